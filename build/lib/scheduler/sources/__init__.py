"""Calendar sources: fetch raw calendar objects, never interpret them.

A source keeps the last state it saw and returns, on every poll, the complete current set of
calendar objects plus whether anything changed, so that a poll where nothing changed costs one
small request and no parsing downstream.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from scheduler.config import CalendarConfig


@dataclass(frozen=True)
class RawObject:
    """One calendar object resource (CalDAV) or one UID's components of a feed, as text."""

    href: str  # absolute URL of the resource; for a feed: feed URL + "#" + UID
    etag: str | None
    ical: str  # a whole VCALENDAR (with its VTIMEZONEs), as the server sent it
    calendar_url: str


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


class Source(Protocol):
    url: str

    def poll(self) -> Snapshot:
        """Fetch what changed since the last poll; raise CalendarError when that is impossible."""
        ...


DEFAULT_TIMEOUT = 30.0  # seconds any one network wait may take


def open_source(calendar: CalendarConfig, *, timeout: float = DEFAULT_TIMEOUT) -> Source:
    """The source for one configured calendar: a CalDAV collection or an ICS feed (`kind`)."""
    if calendar.kind == "ics":
        from scheduler.sources.ics_feed import IcsFeedSource

        return IcsFeedSource(calendar.url, username=calendar.username, password=calendar.password,
                             timeout=timeout)
    from scheduler.sources.caldav_source import CaldavSource

    return CaldavSource(calendar.url, username=calendar.username, password=calendar.password,
                        timeout=timeout)
