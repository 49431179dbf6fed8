"""E-mail and webhook notices (both off unless `[notify]` enables them).

They consume the notices a pass recorded in its outbox; a delivery that fails is logged with its
cause and never stops a pass: the calendar and the container's own message remain.

Beside the warnings and ends the apply stage queues, the write-back hands each booking's answer
here (`Answers`): accepted, rejected, and running with its ssh line, the same answer the event
shows; a booker on an ICS feed (no write-back) learns it only so. Each answer is told once per
booking: State's ANSWERED note keeps what was told, across passes and restarts. A series'
"accepted" is told once for the whole event (its UID), not once per occurrence; each occurrence's
refusal and each run's ssh line (a new port after a restart too) are told on their own. A booking
already answered in its event before this was noted (an upgrade, or notices enabled later) is
noted without a notice, so that no burst of old answers goes out.
"""

from __future__ import annotations

import json
import logging
import smtplib
import ssl
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from email.message import EmailMessage
from zoneinfo import ZoneInfo

import niquests

from gpubook.runtime.errors import GpubookError
from gpubook.scheduler.core.bookings import Booking, Rejection
from gpubook.scheduler.outbox.settings import NotifyConfig
from gpubook.scheduler.settings import Config, UserConfig
from gpubook.scheduler.sources.block import Outcome, Status, one_line
from gpubook.scheduler.state import State, StateError, notes

log = logging.getLogger(__name__)


class NotifyError(GpubookError):
    """An e-mail or webhook could not be delivered; worth a retry."""

    temporary = True


@dataclass(frozen=True)
class Message:
    """One notice about a booking: what the e-mail says and what the webhook posts."""

    kind: str  # "accepted", "rejected", "running", "warning", "ended"
    booking_id: str
    user: str
    subject: str
    text: str
    fields: Mapping[str, str | int | float | list[int] | None] = field(default_factory=dict)  # port, end, gpus...

    def as_json(self) -> dict[str, object]:
        return {"event": self.kind, "booking": self.booking_id, "user": self.user, "subject": self.subject,
                "text": self.text, **self.fields}


@dataclass(frozen=True)
class MailSettings:
    host: str = "localhost"
    port: int = 25
    sender: str = "gpubook@localhost"
    security: str = "none"  # "none", "starttls" or "tls" (SMTPS)
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    timeout: float = 10.0  # seconds


def send_mail(settings: MailSettings, message: Message, *, to: Sequence[str]) -> None:
    """Send `message` to the booker's addresses; NotifyError when the server cannot take it."""
    if not to:
        return
    mail = EmailMessage()
    mail["From"] = settings.sender
    mail["To"] = ", ".join(to)
    mail["Subject"] = one_line(message.subject)  # a newline in a header would forge headers
    mail["X-Gpubook-Booking"] = one_line(message.booking_id)
    mail.set_content(message.text)
    try:
        if settings.security == "tls":
            server: smtplib.SMTP = smtplib.SMTP_SSL(settings.host, settings.port, timeout=settings.timeout,
                                                    context=ssl.create_default_context())
        else:
            server = smtplib.SMTP(settings.host, settings.port, timeout=settings.timeout)
        with server:
            if settings.security == "starttls":
                server.starttls(context=ssl.create_default_context())
            if settings.username:
                server.login(settings.username, settings.password or "")
            server.send_message(mail)
    except (OSError, smtplib.SMTPException) as failure:
        raise NotifyError(f"booking {message.booking_id}: e-mail to {', '.join(to)} via "
                          f"{settings.host}:{settings.port} failed: {failure}") from None


@dataclass(frozen=True)
class WebhookSettings:
    url: str
    token: str | None = field(default=None, repr=False)  # sent as "Authorization: Bearer <token>"
    timeout: float = 10.0  # seconds


def post_webhook(settings: WebhookSettings, message: Message) -> None:
    """POST the message as one JSON object; NotifyError unless the receiver answers 2xx."""
    headers = {"Content-Type": "application/json", "User-Agent": "gpubook"}
    if settings.token:
        headers["Authorization"] = f"Bearer {settings.token}"
    try:
        answer = niquests.post(settings.url, data=json.dumps(message.as_json()), headers=headers,
                               timeout=settings.timeout, allow_redirects=False)
    except niquests.RequestException as failure:
        raise NotifyError(f"booking {message.booking_id}: webhook {settings.url} failed: {failure}") from None
    if answer.status_code is None or not 200 <= answer.status_code < 300:  # niquests: None without an answer
        raise NotifyError(f"booking {message.booking_id}: webhook {settings.url} answered "
                          f"{answer.status_code} {answer.reason}")


class Notices:
    """The optional e-mail and webhook notices, as `[notify]` configures them (both off by default).

    Called with each notice the daemon gives (warning, ended, …); a delivery that fails is logged
    with its cause and never stops a pass: the calendar and the container's own message remain.
    """

    def __init__(self, settings: NotifyConfig, users: Mapping[str, UserConfig]) -> None:
        self.settings = settings
        self.users = users

    @classmethod
    def from_config(cls, config: Config) -> Notices | None:
        if config.notify.email is None and config.notify.webhook is None:
            return None
        return cls(config.notify, config.users)

    def __call__(self, message: Message) -> None:
        email, webhook = self.settings.email, self.settings.webhook
        if email is not None and message.kind in email.events:
            user = self.users.get(message.user)
            mail = MailSettings(host=email.host, port=email.port, sender=email.sender, security=email.security,
                                username=email.username, password=email.password, timeout=email.timeout_seconds)
            self._deliver("e-mail", message, lambda: send_mail(mail, message, to=user.email if user else ()))
        if webhook is not None and message.kind in webhook.events:
            hook = WebhookSettings(url=webhook.url, token=webhook.token, timeout=webhook.timeout_seconds)
            self._deliver("webhook", message, lambda: post_webhook(hook, message))

    @staticmethod
    def _deliver(channel: str, message: Message, send: Callable[[], None]) -> None:
        try:
            send()
        except NotifyError as error:
            log.warning("booking %s: the %s notice (%s) was not delivered: %s", message.booking_id, channel,
                        message.kind, error)


def deliver_pending(state: State, notices: Callable[[Message], None] | None, *, now: datetime | None = None) -> int:
    """Send the notices a pass recorded in State's outbox; each is tried once, by the one deliverer
    that takes it first (two at once, in threads or processes, never send one twice). Returns how
    many this call took."""
    taken = 0
    for notice in state.pending_notices():
        if not state.notice_delivered(notice.id, at=now):
            continue  # another deliverer took it meanwhile
        taken += 1
        if notices is not None:
            notices(Message(kind=notice.kind, booking_id=notice.booking_id, user=notice.user,
                            subject=notice.subject, text=notice.text, fields=dict(notice.fields)))
    return taken


# -- answers: accepted, rejected, running ------------------------------------------------------

ANSWERS = (Status.ACCEPTED, Status.REJECTED, Status.STANDBY, Status.RUNNING)
_WORDS = {Status.ACCEPTED: "accepted", Status.REJECTED: "refused", Status.STANDBY: "on standby",
          Status.RUNNING: "is running"}  # subject
_SENTENCES = {Status.ACCEPTED: "was accepted", Status.REJECTED: "was refused",
              Status.STANDBY: "waits on standby for its GPUs", Status.RUNNING: "is running"}


def _told(outcome: Outcome) -> str | None:
    """What telling this outcome means, as noted (None: not an answer told by notice)."""
    if outcome.status not in ANSWERS:
        return None
    return f"{outcome.status} {outcome.lines[0]}" if outcome.status == Status.RUNNING and outcome.lines \
        else str(outcome.status)


def _noted_under(item: Booking | Rejection, outcome: Outcome) -> str:
    """A series' acceptance is told once for the event; the rest once per occurrence."""
    return item.uid if outcome.status == Status.ACCEPTED else item.id


def answer_message(item: Booking | Rejection, outcome: Outcome, *, host: str, timezone: str) -> Message | None:
    """The notice of one answer (None: no booker is known to tell)."""
    if item.user is None or outcome.status not in ANSWERS:
        return None
    name = _shortened(one_line(item.summary) or item.id)
    zone = ZoneInfo(timezone)
    when = (f"{item.start.astimezone(zone):%Y-%m-%d %H:%M} to {item.end.astimezone(zone):%Y-%m-%d %H:%M %z}")
    head, *rest = outcome.lines or ("",)
    subject = f'gpubook: "{name}" {_WORDS[outcome.status]} on {host}'
    if outcome.status == Status.RUNNING:
        subject += f": {head}"
    text = "\n".join([f'gpubook on {host}: your booking "{name}" ({when}) {_SENTENCES[outcome.status]}.', "",
                      f"{outcome.status}: {head}", *rest])
    fields: dict[str, str | int | float | list[int] | None] = {
        "status": str(outcome.status), "host": host, "uid": item.uid, "start": item.start.isoformat(),
        "end": item.end.isoformat(), "answer": str(outcome.answer)}
    if outcome.status == Status.RUNNING:
        fields["ssh"] = head
    if outcome.resource is not None and outcome.resource.gpus:
        fields["gpus"] = list(outcome.resource.gpus)
    return Message(kind=str(outcome.status), booking_id=item.id, user=item.user, subject=subject, text=text,
                   fields=fields)


def _shortened(name: str, limit: int = 60) -> str:
    """A title fit for a subject line (Outlook's and Google's UIDs, or a long title, cut)."""
    return name if len(name) <= limit else name[: limit - 1] + "…"


def sends(config: Config, kind: str) -> bool:
    """Whether any notice channel sends `kind` (`events` of [notify.email] or [notify.webhook])."""
    channels = (config.notify.email, config.notify.webhook)
    return any(channel is not None and kind in channel.events for channel in channels)


class Answers:
    """Queues each booking's answer as a notice once (module docstring). Called by the write-back's
    pass and by its lanes (a start's own write-back): one lock makes each answer queued once."""

    def __init__(self, config: Config, state: State) -> None:
        self.config, self.state = config, state
        self._lock = threading.Lock()

    def __call__(self, answered: Sequence[tuple[Booking | Rejection, Outcome]], *, now: datetime) -> None:
        wanted = [(item, outcome, told) for item, outcome in answered if (told := _told(outcome)) is not None]
        if not wanted:
            return
        with self._lock:
            try:
                known = dict(notes.ANSWERED.read(self.state.all_notes()))
                for item, outcome, told in wanted:
                    self._tell(item, outcome, told, known=known, now=now)
            except StateError as error:  # the next pass tells what is left
                log.warning("the answers' notices wait for a later pass: %s", error)

    def _tell(self, item: Booking | Rejection, outcome: Outcome, told: str, *, known: dict[str, frozenset[str]],
              now: datetime) -> None:
        under = _noted_under(item, outcome)
        before = known.get(under)
        if before is not None and told in before:
            return
        # Answered in its event before answers were noted (an upgrade): noted, no burst of old news.
        quiet = before is None and self._in_event_already(item, outcome)
        message = None if quiet or not sends(self.config, str(outcome.status)) else \
            answer_message(item, outcome, host=self.config.host.name, timezone=self.config.host.timezone)
        if message is not None:
            self.state.queue_notice(kind=message.kind, booking_id=message.booking_id, user=message.user,
                                    subject=message.subject, text=message.text, fields=message.fields, at=now)
        known[under] = (before or frozenset()) | {told}
        notes.ANSWERED.write(self.state, under, known[under], at=now)

    def _in_event_already(self, item: Booking | Rejection, outcome: Outcome) -> bool:
        done = self.state.write_back(item.id)
        return done is not None and done.status.split(" ", 1)[0] == outcome.status
