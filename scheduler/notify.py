"""Telling the booker: the outcome written into the calendar event, and optional e-mail and webhook.

Calendar write-back
-------------------
gpubook owns one marked block at the end of the event's DESCRIPTION::

    (the user's own text, never touched)

    --- gpubook ---
    running: ssh -p 2201 alice@devbox1
    until 2026-11-23 17:00 +0100
    --- end gpubook ---

and an ``X-GPUBOOK-STATUS`` property (accepted, rejected, running, ended) for programs. The block
is replaced in place on each update; text above and below it stays byte for byte. A block whose
end marker the user deleted is not recognised and is left alone (a new block is added), so a
half-edited block can never make gpubook eat the user's text.

Writes are conditional (If-Match with the ETag of the version just read). When someone changed
the event in between, the server answers 412; gpubook reads the new version, applies its block
to it and tries again (a bounded number of times), so a concurrent edit is never lost. When the
block and status already say the same, nothing is written: a write-back is idempotent and a
level-triggered reconciler may call it on every pass. Read-only ICS feeds are skipped.

Recurring events — the choice made here
---------------------------------------
A booker who opens one occurrence of a series expects to see *that* occurrence's outcome.

- An occurrence that already has its own component (a RECURRENCE-ID override: the user moved or
  edited that instance) gets the block and status on that component, like a single event.
- Any other occurrence gets an entry in the block of the series' master, named by the
  occurrence's start, with one ``X-GPUBOOK-STATUS;X-GPUBOOK-OCCURRENCE=<start>`` per entry::

      --- gpubook ---
      2026-11-23 09:00 +0100: running: ssh -p 2201 alice@devbox1
        until 2026-11-23 17:00 +0100
      2026-11-30 09:00 +0100: accepted: 1 GPU (0), template debian-ssh
      --- end gpubook ---

  Only the latest ``MAX_OCCURRENCES`` entries are kept. gpubook does not create an override per
  occurrence: an override freezes a copy of the series' properties, so a later edit of the whole
  series (say, a new ``template:`` line) would silently not reach those occurrences — in the
  user's calendar and in gpubook's own reading of it. Every client shows the master's
  description on each occurrence, so the entry with the matching date is where the user looks.
"""

from __future__ import annotations

import json
import logging
import re
import smtplib
import ssl
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, date, datetime
from email.message import EmailMessage
from enum import StrEnum
from typing import Any
from zoneinfo import ZoneInfo

import icalendar
import requests
from caldav.calendarobjectresource import Event as DavEvent
from caldav.collection import Calendar as DavCalendar
from caldav.davclient import DAVClient
from caldav.elements import cdav
from caldav.lib import error as dav_error

from runtime.errors import CalendarError, GpubookError
from scheduler.config import CalendarConfig, Config, NotifyConfig, UserConfig

log = logging.getLogger(__name__)

BEGIN = "--- gpubook ---"
END = "--- end gpubook ---"
STATUS_PROPERTY = "X-GPUBOOK-STATUS"
OCCURRENCE_PARAMETER = "X-GPUBOOK-OCCURRENCE"
MAX_OCCURRENCES = 4  # entries kept in a series' block
_BLOCK = re.compile(rf"^{re.escape(BEGIN)}[ \t]*\r?\n(?P<body>.*?)^{re.escape(END)}[ \t]*(?=\r?$)", re.M | re.S)
_ENTRY = re.compile(r"^(?P<when>\d{4}-\d\d-\d\d(?: \d\d:\d\d [+-]\d{4})?): (?P<status>[a-z]+): (?P<head>.*)$")


class NotifyError(GpubookError):
    """An e-mail or webhook could not be delivered; worth a retry."""

    temporary = True


class Status(StrEnum):
    ACCEPTED = "accepted"
    REJECTED = "rejected"
    RUNNING = "running"
    ENDED = "ended"


# -- what is written ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Outcome:
    """A status and the lines a booker reads; the first line is the headline."""

    status: Status
    lines: tuple[str, ...]

    def with_note(self, note: str) -> Outcome:
        """Add a sentence, e.g. why a moved end was not followed."""
        return replace(self, lines=(*self.lines, _one_line(note)))


def ssh_line(*, port: int, user: str, host: str) -> str:
    return f"ssh -p {port} {user}@{host}"


def _when(moment: datetime, timezone: str) -> str:
    return moment.astimezone(ZoneInfo(timezone)).strftime("%Y-%m-%d %H:%M %z")


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def accepted(*, gpus: Sequence[int], template: str, start: datetime, end: datetime, timezone: str) -> Outcome:
    count = f"{len(gpus)} GPU{'s' if len(gpus) != 1 else ''} ({', '.join(map(str, gpus))})"
    return Outcome(Status.ACCEPTED, (f"{count}, template {template}",
                                     f"from {_when(start, timezone)} to {_when(end, timezone)}"))


def rejected(reason: str) -> Outcome:
    return Outcome(Status.REJECTED, (_one_line(reason),))


def running(*, port: int, user: str, host: str, end: datetime, timezone: str) -> Outcome:
    return Outcome(Status.RUNNING, (ssh_line(port=port, user=user, host=host), f"until {_when(end, timezone)}"))


def ended(*, gpu_hours: float, outputs: str | None, at: datetime, timezone: str) -> Outcome:
    lines = [f"{gpu_hours:.2f} GPU-hours, stopped {_when(at, timezone)}"]
    if outputs:
        lines.append(f"outputs: {outputs}")
    return Outcome(Status.ENDED, tuple(lines))


# -- the block in DESCRIPTION (pure) -----------------------------------------------------------


def find_block(description: str) -> tuple[int, int] | None:
    """(start, end) of gpubook's complete block in `description`, or None."""
    match = _BLOCK.search(description)
    return (match.start(), match.end()) if match else None


def strip_block(description: str) -> str:
    """`description` without gpubook's block: what the booking parser should read, so that a line
    gpubook wrote can never be taken for the user's `key: value` line."""
    span = find_block(description)
    return description if span is None else description[: span[0]] + description[span[1]:]


def replace_block(description: str, block: str) -> str:
    """`description` with gpubook's block replaced in place, or appended after a blank line."""
    span = find_block(description)
    if span is not None:
        return description[: span[0]] + block + description[span[1]:]
    if not description.strip():
        return block
    return description.rstrip("\r\n") + "\n\n" + block


def _render(body: Iterable[str]) -> str:
    return "\n".join([BEGIN, *body, END])


def _single_body(outcome: Outcome) -> list[str]:
    head, *rest = outcome.lines or ("",)
    return [f"{outcome.status}: {head}", *rest]


@dataclass(frozen=True)
class _Entry:
    when: datetime | date
    label: str
    status: str
    lines: tuple[str, ...]


def _sort_key(when: datetime | date) -> datetime:
    if isinstance(when, datetime):
        return when.astimezone(UTC)
    return datetime(when.year, when.month, when.day, tzinfo=UTC)


def _parse_entries(body: str) -> list[_Entry]:
    """Entries of a series' block as gpubook wrote them; foreign lines inside the block are dropped."""
    entries: list[_Entry] = []
    for line in body.splitlines():
        if match := _ENTRY.match(line):
            label = match["when"]
            when = (datetime.strptime(label, "%Y-%m-%d %H:%M %z") if " " in label  # noqa: DTZ007 - %z is in it
                    else date.fromisoformat(label))
            entries.append(_Entry(when, label, match["status"], (match["head"],)))
        elif line.startswith("  ") and entries:
            last = entries[-1]
            entries[-1] = replace(last, lines=(*last.lines, line[2:]))
    return entries


def _series_entries(description: str, occurrence: datetime | date, label: str,
                    outcome: Outcome) -> list[_Entry]:
    span = find_block(description)
    old = _parse_entries(_BLOCK.match(description, span[0])["body"]) if span else []  # type: ignore[index]
    mine = _Entry(occurrence, label, str(outcome.status), outcome.lines or ("",))
    kept = [e for e in old if _sort_key(e.when) != _sort_key(occurrence)] + [mine]
    kept.sort(key=lambda e: _sort_key(e.when))
    return kept[-MAX_OCCURRENCES:]


def _series_body(entries: Sequence[_Entry]) -> list[str]:
    body = []
    for entry in entries:
        head, *rest = entry.lines
        body.append(f"{entry.label}: {entry.status}: {head}")
        body.extend(f"  {line}" for line in rest)
    return body


def _occurrence_value(when: datetime | date) -> str:
    if isinstance(when, datetime):
        return when.astimezone(UTC).strftime("%Y%m%dT%H%M%SZ")
    return when.strftime("%Y%m%d")


def _label(when: datetime | date, timezone: str) -> str:
    if isinstance(when, datetime):
        return _when(when if when.tzinfo else when.replace(tzinfo=ZoneInfo(timezone)), timezone)
    return when.isoformat()


def _status_properties(component: icalendar.cal.Component) -> list[tuple[str, dict[str, str]]]:
    found = component.get(STATUS_PROPERTY)
    values = found if isinstance(found, list) else [] if found is None else [found]
    return [(str(v), {k.upper(): str(p) for k, p in getattr(v, "params", {}).items()}) for v in values]


def _same_occurrence(a: datetime | date, b: datetime | date, timezone: str) -> bool:
    if isinstance(a, datetime) != isinstance(b, datetime):
        return False
    if isinstance(a, datetime) and isinstance(b, datetime):
        zone = ZoneInfo(timezone)  # floating times are read in the host's zone, as bookings do
        return (a if a.tzinfo else a.replace(tzinfo=zone)) == (b if b.tzinfo else b.replace(tzinfo=zone))
    return a == b


def _target(calendar: icalendar.Calendar, uid: str, occurrence: datetime | date | None,
            timezone: str) -> tuple[icalendar.cal.Component, datetime | date | None] | None:
    """The component to write on, and the occurrence to name in it (None: the component is the occurrence)."""
    events = [c for c in calendar.walk("VEVENT") if str(c.get("UID", "")) == uid]
    master = next((e for e in events if "RECURRENCE-ID" not in e), None)
    if occurrence is not None:
        for override in events:
            recurrence_id: Any = override.get("RECURRENCE-ID")
            if recurrence_id is not None and _same_occurrence(recurrence_id.dt, occurrence, timezone):
                return override, None
    if master is None:
        return None
    recurring = "RRULE" in master or "RDATE" in master
    return master, occurrence if recurring and occurrence is not None else None


def apply(calendar: icalendar.Calendar, *, uid: str, occurrence: datetime | date | None, outcome: Outcome,
          timezone: str = "UTC") -> bool | None:
    """Put `outcome` into the event `uid` of `calendar` (in place). True: changed; False: it already
    said this; None: no such event or occurrence in the object."""
    found = _target(calendar, uid, occurrence, timezone)
    if found is None:
        return None
    component, named = found
    old_description = component.get("DESCRIPTION")
    description = str(old_description) if old_description is not None else ""
    if named is None:
        block = _render(_single_body(outcome))
        statuses: list[tuple[str, dict[str, str]]] = [(str(outcome.status), {})]
    else:
        entries = _series_entries(description, named, _label(named, timezone), outcome)
        block = _render(_series_body(entries))
        statuses = [(e.status, {OCCURRENCE_PARAMETER: _occurrence_value(e.when)}) for e in entries]
    new_description = replace_block(description, block)
    if new_description == description and statuses == _status_properties(component):
        return False
    text = icalendar.vText(new_description)
    if old_description is not None:
        text.params.update(getattr(old_description, "params", {}))
    component["DESCRIPTION"] = text
    component.pop(STATUS_PROPERTY, None)
    for value, parameters in statuses:
        component.add(STATUS_PROPERTY, value, parameters=parameters)
    return True


# -- writing it to the server ------------------------------------------------------------------


@dataclass(frozen=True)
class EventRef:
    """Which event (and which occurrence of it) a booking came from."""

    calendar_url: str
    href: str  # the calendar object's URL, as the source reported it
    uid: str
    occurrence: datetime | date | None = None  # the occurrence's RECURRENCE-ID (original start); None: the event


@dataclass(frozen=True)
class WriteResult:
    written: bool
    reason: str  # "written", "unchanged", "read-only feed", "event gone", "no etag"
    etag: str | None = None  # the event's ETag after the write (or as read, when unchanged)
    attempts: int = 0  # PUTs sent


class CalendarWriter:
    """Writes outcomes into one configured calendar. One DAV client per calendar, reused."""

    def __init__(self, calendar: CalendarConfig, *, timezone: str = "UTC", attempts: int = 5,
                 timeout: int = 30, retry_delay: float = 0.2) -> None:
        self.config = calendar
        self.timezone = timezone
        self.attempts = attempts
        self.retry_delay = retry_delay
        self._client: DAVClient | None = None
        self._timeout = timeout

    @property
    def read_only(self) -> bool:
        return self.config.kind != "caldav"

    def _calendar(self) -> DavCalendar:
        if self._client is None:
            self._client = DAVClient(url=self.config.url, username=self.config.username,
                                            password=self.config.password, timeout=self._timeout)
        return self._client.calendar(url=self.config.url)

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    def write(self, ref: EventRef, outcome: Outcome) -> WriteResult:
        """Write `outcome` into the event; re-read and retry when the event changed meanwhile.

        Raises CalendarError when the server cannot be reached or refuses, or when the event kept
        changing for `attempts` tries in a row (the next reconcile pass tries again)."""
        if self.read_only:
            return WriteResult(written=False, reason="read-only feed")
        what = f"event {ref.uid}" + (f" ({_label(ref.occurrence, self.timezone)})" if ref.occurrence else "")
        try:
            for attempt in range(1, self.attempts + 1):
                result = self._try_once(ref, outcome, attempt)
                if result is not None:
                    if result.written:
                        log.info("%s: wrote %s into the calendar", what, outcome.status)
                    return result
                log.info("%s: changed on the server while gpubook wrote %s; reading it again",
                         what, outcome.status)
                time.sleep(self.retry_delay * attempt)
        except dav_error.DAVError as failure:
            raise CalendarError(f"{what}: writing {outcome.status} back failed: "
                                f"{type(failure).__name__} {_reason(failure)}") from None
        except OSError as failure:  # requests' and niquests' (caldav's HTTP library) errors are OSErrors
            raise CalendarError(f"{what}: writing {outcome.status} back failed: {_short(failure)}") from None
        raise CalendarError(f"{what}: changed on the server {self.attempts} times while gpubook wrote "
                            f"{outcome.status}; will try again on the next pass")

    def _try_once(self, ref: EventRef, outcome: Outcome, attempt: int) -> WriteResult | None:
        """One read-modify-write; None when the server said the event changed in between (412)."""
        calendar = self._calendar()
        event = DavEvent(client=self._client, url=ref.href, parent=calendar)
        try:
            event.load(multiget_fallback=False)
        except dav_error.NotFoundError:
            return WriteResult(written=False, reason="event gone", attempts=attempt - 1)
        changed = self._modify(event, ref, outcome)
        if changed is None:
            return WriteResult(written=False, reason="event gone", etag=event.etag, attempts=attempt - 1)
        if not changed:
            return WriteResult(written=False, reason="unchanged", etag=event.etag, attempts=attempt - 1)
        if event.etag and not event.etag.startswith("W/"):
            # Xandikos sends a Schedule-Tag, which an edit of DESCRIPTION or an X- property does not
            # change: If-Schedule-Tag-Match would let a stale write win. Compare the ETag instead.
            event.props.pop(cdav.ScheduleTag.tag, None)
        elif not event.schedule_tag:
            log.warning("event %s: the server gave no strong ETag; not writing back, since an unconditional "
                        "write could undo a user's edit", ref.uid)
            return WriteResult(written=False, reason="no etag", attempts=attempt - 1)
        try:
            # only_this_recurrence=False: PUT the whole object as read, never merge "into a master".
            event.save(increase_seqno=False, only_this_recurrence=False, precondition="etag")
        except (dav_error.ETagMismatchError, dav_error.ScheduleTagMismatchError):
            return None
        return WriteResult(written=True, reason="written", etag=event.etag, attempts=attempt)


    def _modify(self, event: DavEvent, ref: EventRef, outcome: Outcome) -> bool | None:
        """Apply the outcome to the event as read (the step between the GET and the conditional PUT)."""
        with event.edit_icalendar_instance() as ical:
            return apply(ical, uid=ref.uid, occurrence=ref.occurrence, outcome=outcome, timezone=self.timezone)


def _short(failure: Exception) -> str:
    """The cause without urllib3's nesting: "Connection refused" rather than a 300-character repr."""
    text = str(failure)
    for known in ("Connection refused", "timed out", "Name or service not known", "No route to host"):
        if known in text:
            return known
    return text.splitlines()[0][:200] if text else type(failure).__name__


def _reason(failure: dav_error.DAVError) -> str:
    status = getattr(failure, "status", None)
    return f"(HTTP {status})" if status else str(failure).splitlines()[0][:200]


# -- e-mail and webhook (both off unless configured) -------------------------------------------


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
    mail["Subject"] = _one_line(message.subject)  # a newline in a header would forge headers
    mail["X-Gpubook-Booking"] = _one_line(message.booking_id)
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
        answer = requests.post(settings.url, data=json.dumps(message.as_json()), headers=headers,
                               timeout=settings.timeout, allow_redirects=False)
    except requests.RequestException as failure:
        raise NotifyError(f"booking {message.booking_id}: webhook {settings.url} failed: {failure}") from None
    if not 200 <= answer.status_code < 300:
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
