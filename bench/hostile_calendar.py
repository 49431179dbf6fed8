"""What hostile events cost a poll, and the plan of 10,000 occurrences: prints figures, asserts nothing.

    PYTHONPATH=. python bench/hostile_calendar.py [OUTPUT_FOLDER]

Issue 9, finding 4: one calendar writer must not stall the daemon. Each hostile event is read
the way the daemon reads it (BookingReader.read over the daemon's window: max_hours back, a week
ahead), twice: the first poll parses and expands it, the second is an unchanged poll (the parse
cache is warm, the expansion runs again). Targets: each hostile event at most 1 s a poll; 10,000
occurrences plan in at most 1 s. With OUTPUT_FOLDER, the figures are also written there as text.
"""

from __future__ import annotations

import os
import platform
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

import icalendar

from gpubook.scheduler.config import parse
from gpubook.scheduler.core.bookings import Booking, BookingReader, Rejection
from gpubook.scheduler.core.plan import plan
from gpubook.scheduler.sources import RawObject

CALENDAR = "http://127.0.0.1:5232/lab/devbox1/"
TEMPLATES = frozenset({"debian-ssh"})
NOW = datetime(2026, 11, 23, 12, tzinfo=UTC)
SIXTY = ",".join(str(n) for n in range(60))
CONFIG = parse({
    "host": {"name": "bench", "timezone": "Europe/Paris"},
    "calendar": [{"url": CALENDAR, "gpus": "all"}],
    "defaults": {"max_hours": 72},
    "users": {f"user{n}": {"uid": 2000 + n} for n in range(20)},
}, Path("bench.toml"))
WINDOW = (NOW - timedelta(hours=72), NOW + timedelta(days=7))


def _object(name: str, *lines: str) -> RawObject:
    body = "\r\n".join(["BEGIN:VCALENDAR", "VERSION:2.0", "PRODID:-//gpubook bench//EN", "BEGIN:VEVENT",
                        f"UID:{name}@bench", "DTSTAMP:20261101T000000Z", "SUMMARY:user1 hostile", *lines,
                        "END:VEVENT", "END:VCALENDAR", ""])
    return RawObject(href=f"{CALENDAR}{name}.ics", etag=f'"{name}"', ical=body, calendar_url=CALENDAR)


def _description(text: str) -> str:
    return "DESCRIPTION:" + icalendar.vText(text).to_ical().decode()


HOSTILE = {
    "80 KB description, a value then a run of blanks": _object(
        "blanks", "DTSTART:20261124T090000Z", "DTEND:20261124T100000Z",
        _description("user: x" + " \t" * 40_000 + "y")),
    "80 KB description of blank lines and begin markers": _object(
        "markers", "DTSTART:20261124T090000Z", "DTEND:20261124T100000Z",
        _description(("--- gpubook ---\n" + " " * 20 + "\n") * 2200)),
    "HOURLY;BYMINUTE=0..59;BYSECOND=0..59 (~864,000 occurrences)": _object(
        "bomb", "DTSTART:20261120T090000Z", "DTEND:20261120T090001Z",
        f"RRULE:FREQ=HOURLY;BYMINUTE={SIXTY};BYSECOND={SIXTY}"),
    "HOURLY;BYMONTH=4;BYMONTHDAY=31;BYMINUTE=0..59 (never happens)": _object(
        "never", "DTSTART:20261101T090000Z", "DTEND:20261101T093000Z",
        f"RRULE:FREQ=HOURLY;BYMONTH=4;BYMONTHDAY=31;BYMINUTE={SIXTY}"),
    "HOURLY since 1970 (a long walk from DTSTART)": _object(
        "old", "DTSTART:19700101T090000Z", "DTEND:19700101T093000Z", "RRULE:FREQ=HOURLY"),
}


def _timed(action: Callable[[], object]) -> tuple[float, object]:
    began = time.perf_counter()
    result = action()
    return time.perf_counter() - began, result


def _read(reader: BookingReader, objects: list[RawObject]) -> tuple[Booking | Rejection, ...]:
    return reader.read(objects, config=CONFIG, calendar=CONFIG.calendars[0], templates=TEMPLATES,
                       window_start=WINDOW[0], window_end=WINDOW[1]).occurrences


def _outcome(occurrences: tuple[Booking | Rejection, ...]) -> str:
    rejected = [o for o in occurrences if isinstance(o, Rejection)]
    if not rejected:
        return f"{len(occurrences)} occurrence(s)"
    return f"{len(occurrences)} occurrence(s), rejected: {rejected[0].reason[:110]}"


def _ordinary(count: int) -> list[RawObject]:
    """`count` one-hour single bookings over the window, one GPU each on a 100-GPU host."""
    objects = []
    for n in range(count):
        start = WINDOW[0] + timedelta(minutes=(n * 37) % (9 * 24 * 60))
        objects.append(_object(f"b{n}", f"DTSTART:{start:%Y%m%dT%H%M%SZ}",
                               f"DTEND:{start + timedelta(hours=1):%Y%m%dT%H%M%SZ}",
                               _description(f"user: user{n % 20}\ngpus: 1")))
    return objects


def main() -> None:
    out: list[str] = []

    def say(line: str) -> None:
        print(line, flush=True)
        out.append(line)

    say(f"machine: {platform.platform()}, {os.cpu_count()} CPUs, Python {platform.python_version()}")
    say(f"window read: {WINDOW[0]:%Y-%m-%d %H:%M} to {WINDOW[1]:%Y-%m-%d %H:%M} UTC (max_hours 72 back, 7 days ahead)")
    say("per-poll reading cost of one hostile event (first poll parses; later polls use the parse cache):")
    for label, hostile in HOSTILE.items():
        reader = BookingReader()
        first, occurrences = _timed(lambda hostile=hostile, reader=reader: _read(reader, [hostile]))
        second, _ = _timed(lambda hostile=hostile, reader=reader: _read(reader, [hostile]))
        say(f"  {label}: first poll {first:6.3f} s, next poll {second:6.3f} s; "
            f"{_outcome(occurrences)}")  # type: ignore[arg-type]
    objects = _ordinary(10_000)
    reader = BookingReader()
    read_time, occurrences = _timed(lambda: _read(reader, objects))
    warm_time, _ = _timed(lambda: _read(reader, objects))
    inventory = range(100)
    plan_time, result = _timed(lambda: plan(occurrences, inventory=inventory, config=CONFIG,  # type: ignore[arg-type]
                                            templates=TEMPLATES, now=NOW))
    say(f"10,000 ordinary one-hour bookings on 100 GPUs: read {read_time:.2f} s (first poll), "
        f"{warm_time:.2f} s (unchanged poll), "
        f"plan {plan_time:.3f} s ({len(result.accepted)} accepted, "  # type: ignore[attr-defined]
        f"{len(result.rejected)} rejected)")  # type: ignore[attr-defined]
    say("targets: each hostile event at most 1 s a poll; 10,000 occurrences plan in at most 1 s")
    if len(sys.argv) > 1:
        folder = Path(sys.argv[1])
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "hostile_calendar.txt").write_text("\n".join(out) + "\n")


if __name__ == "__main__":
    main()
