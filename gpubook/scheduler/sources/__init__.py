"""Calendar sources: fetch raw calendar objects, never interpret them.

A source keeps the last state it saw and returns, on every poll, the complete current set of
calendar objects plus whether anything changed, so that a poll where nothing changed costs one
small request and no parsing downstream.

The API the rest of gpubook uses (nothing else of this package is needed outside it):

- `open_source(calendar, *, timeout=30.0) -> Source` for one configured `[[calendar]]`; the
  calendar's `kind` picks the class from `REGISTRY` (or names one as `package.module:Class`).
- `Source.poll() -> Snapshot`: every object the calendar holds now, and whether that changed;
  raises `CalendarError` (temporary) or `CalendarDataError` (permanent), from `.errors`.
- `Source.checks_cheaply`: whether a `poll()` now costs one small request when nothing changed (a
  CalDAV sync-token or ctag; not an ICS feed, nor a CalDAV server listing every ETag). The daemon's
  change check (`[daemon] check_seconds`) polls only such sources between its full polls.
- `Source.preflight() -> str`: the check `gpubook doctor` makes (one poll); says what it found.
- `Source.open_writer(*, timezone) -> Writer | None`: the write-back capability, a new `Writer`
  the caller closes; None where the source is read-only (ICS feeds). Callers ask for it instead
  of checking a kind. `open_writer(calendar, *, timezone)` does the same from the config alone.
- `Writer.write(EventRef, Outcome) -> WriteResult` and `Writer.close()`; the `Outcome` and the
  block it becomes in the event are `scheduler.sources.block`'s.

Adding a source is one module with a `BaseSource` subclass and one `register` line; the
module is imported only when a calendar uses it, so loading the config stays light.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import closing
from dataclasses import dataclass, field
from datetime import date, datetime
from typing import TYPE_CHECKING, ClassVar, Protocol

from gpubook.runtime.plugins import Registry
from gpubook.scheduler.sources.errors import CalendarDataError

if TYPE_CHECKING:
    from gpubook.scheduler.settings import CalendarConfig
    from gpubook.scheduler.sources.block import Outcome

DEFAULT_TIMEOUT = 30.0  # seconds any one network wait may take



@dataclass(frozen=True)
class RawObject:
    """One calendar object resource (CalDAV) or one UID's components of a feed, as text."""

    href: str  # absolute URL of the resource; for a feed: feed URL + "#" + UID
    etag: str | None
    ical: str  # a whole VCALENDAR (with its VTIMEZONEs), as the server sent it
    calendar_url: str
    refused: str = ""  # why it was not downloaded (too large: `ical` is empty); "": read it


@dataclass(frozen=True)
class PollStats:
    requests: int = 0
    bytes_received: int = 0
    bytes_sent: int = 0
    method: str = ""  # "sync-token", "etag", "time-range", "ics-304", "ics-full", ...


@dataclass(frozen=True)
class Snapshot:
    """What a calendar holds now. `objects` is keyed by href and always complete."""

    calendar_url: str
    objects: Mapping[str, RawObject]
    changed: bool
    stats: PollStats = field(default_factory=PollStats)


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
    reason: str  # "written", "unchanged", "event gone", "no etag"
    etag: str | None = None  # the event's ETag after the write (or as read, when unchanged)
    attempts: int = 0  # PUTs sent


class Writer(Protocol):
    """A source's write capability: outcomes written into the booker's events."""

    def write(self, ref: EventRef, outcome: Outcome) -> WriteResult:
        """Write the outcome into the event; raise CalendarError when that failed (retry later)."""
        ...

    def close(self) -> None: ...


class Source(Protocol):
    url: str

    @property
    def checks_cheaply(self) -> bool:
        """A poll costs one small request when nothing changed: worth doing every few seconds."""
        ...

    def poll(self) -> Snapshot:
        """Fetch what changed since the last poll; raise CalendarError when that is impossible."""
        ...

    def preflight(self) -> str:
        """A check for `gpubook doctor`: what the calendar holds, or a CalendarError."""
        ...

    def open_writer(self, *, timezone: str) -> Writer | None:
        """A new writer into this calendar; None when the source is read-only."""
        ...

    def close(self) -> None: ...


class BaseSource:
    """What the sources share: construction from a `[[calendar]]`, the preflight, no writer.

    `calendar_keys` are the `[[calendar]]` keys a kind reads besides url, gpus and kind.
    """

    calendar_keys: ClassVar[tuple[str, ...]] = ("username", "password_file")
    url: str

    @property
    def checks_cheaply(self) -> bool:
        # A kind that cannot tell cheaply is read every poll_seconds only (an ICS feed: polling a
        # provider's feed every few seconds is rude, and each poll may download it whole).
        return False

    def __init__(self, url: str, *, username: str | None = None, password: str | None = None,
                 timeout: float = DEFAULT_TIMEOUT) -> None:
        # The constructor every kind takes (from_config calls it); each kind defines its own.
        raise NotImplementedError

    @classmethod
    def from_config(cls, calendar: CalendarConfig, *, timeout: float = DEFAULT_TIMEOUT) -> BaseSource:
        return cls(calendar.url, username=calendar.username, password=calendar.password, timeout=timeout)

    def poll(self) -> Snapshot:
        raise NotImplementedError

    def preflight(self) -> str:
        # One real poll: cheap for a calendar gpubook can use, and it finds every fault a poll would.
        return f"{len(self.poll().objects)} object(s)"

    def open_writer(self, *, timezone: str) -> Writer | None:
        return None

    def close(self) -> None:
        pass


# kind -> "module:Class"; a config `kind` may also be such a path itself (Radicale's loader).
REGISTRY: Registry[type[BaseSource]] = Registry("calendar source", error=CalendarDataError, base=BaseSource)
register = REGISTRY.register  # `[[calendar]] kind = "<kind>"` means this source class (or "module:Class")

register("caldav", "gpubook.scheduler.sources.caldav_source:CaldavSource")
register("ics", "gpubook.scheduler.sources.ics_feed:IcsFeedSource")


def source_class(kind: str) -> type[BaseSource]:
    """The class for a calendar `kind`: a registered name or a `package.module:Class` path; raises
    CalendarDataError saying what is wrong (the config reports `REGISTRY.problem(kind)`)."""
    return REGISTRY.load(kind)


def https_url(url: str) -> str:
    """webcal:// is how calendar apps link a feed; it is plain https."""
    return "https://" + url.removeprefix("webcal://") if url.startswith("webcal://") else url


def implied_kind(url: str) -> str:
    """The kind a calendar URL implies when the config names none: a .ics URL is a feed."""
    return "ics" if url.split("?", 1)[0].lower().endswith(".ics") else "caldav"


def open_source(calendar: CalendarConfig, *, timeout: float = DEFAULT_TIMEOUT) -> Source:
    """The source for one configured calendar, of the class its `kind` names."""
    return source_class(calendar.kind).from_config(calendar, timeout=timeout)


def open_writer(calendar: CalendarConfig, *, timezone: str, timeout: float = DEFAULT_TIMEOUT) -> Writer | None:
    """The calendar's writer (its source's capability), or None for a read-only one."""
    with closing(open_source(calendar, timeout=timeout)) as source:
        return source.open_writer(timezone=timezone)
