"""E-mail and webhook notices (both off unless `[notify]` enables them).

They consume the notices a pass recorded in its outbox; a delivery that fails is logged with its
cause and never stops a pass: the calendar and the container's own message remain.
"""

from __future__ import annotations

import json
import logging
import smtplib
import ssl
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from email.message import EmailMessage

import niquests

from gpubook.runtime.errors import GpubookError
from gpubook.scheduler.outbox.settings import NotifyConfig
from gpubook.scheduler.settings import Config, UserConfig
from gpubook.scheduler.sources.block import one_line
from gpubook.scheduler.state import State

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
    """Send the notices a pass recorded in State's outbox; each is tried once. Returns how many."""
    pending = state.pending_notices()
    for notice in pending:
        if notices is not None:
            notices(Message(kind=notice.kind, booking_id=notice.booking_id, user=notice.user,
                            subject=notice.subject, text=notice.text, fields=dict(notice.fields)))
        state.notice_delivered(notice.id, at=now)
    return len(pending)
