"""Plain builders shared by the booking and plan tests: a config, events as iCalendar text."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

from gpubook.scheduler.config import Config, parse
from gpubook.scheduler.core.bookings import Booking, BookingReader, Expansion
from gpubook.scheduler.core.topology import ONE_MACHINE, Topology
from gpubook.scheduler.sources import RawObject

CALENDAR = "http://127.0.0.1:5232/lab/devbox1/"
GPU1_CALENDAR = "http://127.0.0.1:5232/lab/devbox1-gpu1/"
TEMPLATES = frozenset({"debian-ssh", "tensorflow-cuda9", "digits-cuda8"})
DATA = Path(__file__).resolve().parents[1] / "data" / "calendars"


def make_config(**defaults: object) -> Config:
    return parse({
        "host": {"name": "devbox1", "timezone": "Europe/Paris"},
        "calendar": [{"url": CALENDAR, "gpus": "all"}, {"url": GPU1_CALENDAR, "gpus": [1]}],
        "defaults": {"template": "debian-ssh", "gpus": 1, "max_hours": 72, "warn_minutes": 15,
                     **defaults},
        "users": {
            "alice": {"uid": 1000, "email": ["alice@lab.example"], "max_gpus": 2},
            "bob": {"uid": 1001, "email": ["bob@lab.example"]},
            "carol": {"uid": 1002, "email": ["carol@lab.example"], "templates": ["debian-*"]},
        },
    }, Path("/etc/gpubook/gpubook.toml"))


def utc(*args: int) -> datetime:
    return datetime(*args, tzinfo=UTC)


def vevent(uid: str, *lines: str) -> str:
    body = "\r\n".join(lines)
    return f"BEGIN:VEVENT\r\nUID:{uid}\r\nDTSTAMP:20261101T120000Z\r\n{body}\r\nEND:VEVENT\r\n"


def vcalendar(*events: str, header: str = "") -> str:
    head = f"{header}\r\n" if header else ""
    return ("BEGIN:VCALENDAR\r\nVERSION:2.0\r\nPRODID:-//gpubook tests//EN\r\n" + head
            + "".join(events) + "END:VCALENDAR\r\n")


def raw(ical: str, name: str = "event", etag: str | None = "1",
        calendar_url: str = CALENDAR) -> RawObject:
    return RawObject(href=f"{calendar_url}{name}.ics", etag=etag, ical=ical,
                     calendar_url=calendar_url)


WINDOW = (datetime(2026, 11, 23, tzinfo=UTC), datetime(2026, 11, 30, tzinfo=UTC))


def read(*objects: RawObject, config: Config | None = None, start: datetime = WINDOW[0],
         end: datetime = WINDOW[1], calendar_url: str = CALENDAR,
         reader: BookingReader | None = None, topology: Topology = ONE_MACHINE) -> Expansion:
    config = config or make_config()
    calendar = next(c for c in config.calendars if c.url == calendar_url)
    return (reader or BookingReader()).read(objects, config=config, calendar=calendar, templates=TEMPLATES,
                                            window_start=start, window_end=end, topology=topology)


def single(*lines: str, uid: str = "u1", **kwargs: object) -> Booking:
    """The one occurrence of one event; the test fails unless there is exactly one."""
    result = read(raw(vcalendar(vevent(uid, *lines))), **kwargs)  # type: ignore[arg-type]
    assert result.problems == (), result.problems
    assert len(result.occurrences) == 1, result.occurrences
    return result.occurrences[0]  # type: ignore[return-value]


def booking(id: str, *, user: str = "alice", template: str = "debian-ssh", gpus: int = 1,
            indices: tuple[int, ...] | None = None, start: int = 10, hours: float = 2,
            created: datetime | None = None, dtstamp: datetime | None = None,
            calendar_url: str = CALENDAR, uid: str | None = None, href: str | None = None) -> Booking:
    """A booking starting `start` hours after midnight UTC on 24 November 2026."""
    begin = utc(2026, 11, 24) + timedelta(hours=start)
    return Booking(id=id, uid=uid or id, user=user, template=template,
                   gpu_count=len(indices) if indices is not None else gpus, gpu_indices=indices,
                   start=begin, end=begin + timedelta(hours=hours), created=created,
                   dtstamp=dtstamp, calendar_url=calendar_url,
                   href=href or f"{calendar_url}{uid or id}.ics", summary="")


FEED = """BEGIN:VCALENDAR
VERSION:2.0
PRODID:-//Google Inc//Google Calendar 70.9054//EN
X-WR-CALNAME:GPU devbox1
X-WR-TIMEZONE:Europe/Berlin
BEGIN:VTIMEZONE
TZID:Europe/Berlin
BEGIN:STANDARD
DTSTART:19701025T030000
RRULE:FREQ=YEARLY;BYMONTH=10;BYDAY=-1SU
TZOFFSETFROM:+0200
TZOFFSETTO:+0100
END:STANDARD
BEGIN:DAYLIGHT
DTSTART:19700329T020000
RRULE:FREQ=YEARLY;BYMONTH=3;BYDAY=-1SU
TZOFFSETFROM:+0100
TZOFFSETTO:+0200
END:DAYLIGHT
END:VTIMEZONE
BEGIN:VTIMEZONE
TZID:America/New_York
BEGIN:STANDARD
DTSTART:19701101T020000
RRULE:FREQ=YEARLY;BYMONTH=11;BYDAY=1SU
TZOFFSETFROM:-0400
TZOFFSETTO:-0500
END:STANDARD
END:VTIMEZONE
BEGIN:VEVENT
UID:weekly@lab
DTSTART;TZID=Europe/Berlin:20261123T090000
DTEND;TZID=Europe/Berlin:20261123T170000
RRULE:FREQ=WEEKLY;COUNT=4
SUMMARY:alice tensorflow-cuda9 gpus=2
END:VEVENT
BEGIN:VEVENT
UID:weekly@lab
RECURRENCE-ID;TZID=Europe/Berlin:20261130T090000
DTSTART;TZID=Europe/Berlin:20261130T120000
DTEND;TZID=Europe/Berlin:20261130T180000
SUMMARY:alice tensorflow-cuda9 gpus=2 (moved)
END:VEVENT
BEGIN:VEVENT
UID:floating@lab
DTSTART:20261124T100000
DTEND:20261124T120000
SUMMARY:bob debian-ssh
END:VEVENT
END:VCALENDAR
""".replace("\n", "\r\n")
