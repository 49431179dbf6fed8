"""How long expanding and planning take for a busy calendar: prints figures, asserts nothing.

    PYTHONPATH=. python bench/plan_scale.py [EVENTS] [GPUS]

Builds EVENTS calendar objects (default 1,000; one booking each, as a CalDAV server holds them:
80 % single bookings, 20 % daily series) for a host with GPUS GPUs (default 100), then times:
the first expansion (every object parsed), a second one (parse cache warm, as on a poll where
nothing changed), and the plan (the median of PLANS runs). Each timed step begins with a full garbage
collection, as timeit's measures do without one: a collection owed by the step before (the parse
cache holds a hundred thousand objects, one full collection costs ~80 ms here) is not charged to the
next; the collections a step itself causes stay in its time.
"""

from __future__ import annotations

import gc
import os
import platform
import random
import resource
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

from gpubook.scheduler.config import parse
from gpubook.scheduler.core.bookings import BookingReader, Rejection
from gpubook.scheduler.core.plan import plan
from gpubook.scheduler.sources import RawObject

CALENDAR = "http://127.0.0.1:5232/lab/devbox1/"
TEMPLATES = frozenset({"debian-ssh", "tensorflow-cuda9", "digits-cuda8"})
WINDOW_START = datetime(2026, 11, 23, tzinfo=UTC)
WINDOW_END = WINDOW_START + timedelta(days=7)
PLANS = 5


def event(number: int, rng: random.Random, gpus: int) -> str:
    start = WINDOW_START + timedelta(minutes=30 * rng.randrange(7 * 48))
    end = start + timedelta(hours=rng.choice([1, 2, 4, 8, 24]))
    user = f"user{rng.randrange(20)}"
    if rng.random() < 0.3:
        request = "gpus: " + ",".join(str(g) for g in sorted(rng.sample(range(gpus), 2)))
    else:
        request = f"gpus: {rng.choice([1, 1, 2, 4])}"
    lines = [
        "BEGIN:VCALENDAR", "VERSION:2.0", "PRODID:-//gpubook bench//EN", "BEGIN:VEVENT",
        f"UID:bench-{number}@gpubook", "DTSTAMP:20261101T000000Z",
        f"CREATED:20261101T{number // 3600 % 24:02d}{number // 60 % 60:02d}{number % 60:02d}Z",
        f"DTSTART:{start:%Y%m%dT%H%M%SZ}", f"DTEND:{end:%Y%m%dT%H%M%SZ}",
        f"SUMMARY:{user} run {number}",
        f"DESCRIPTION:template: {rng.choice(sorted(TEMPLATES))}\\n{request}",
    ]
    if number % 5 == 0:
        lines.append("RRULE:FREQ=DAILY;COUNT=30")
    lines += ["END:VEVENT", "END:VCALENDAR", ""]
    return "\r\n".join(lines)


def main() -> None:
    events = int(sys.argv[1]) if len(sys.argv) > 1 else 1000
    gpus = int(sys.argv[2]) if len(sys.argv) > 2 else 100
    config = parse({
        "host": {"name": "bench", "timezone": "Europe/Paris"},
        "calendar": [{"url": CALENDAR, "gpus": "all"}],
        "users": {f"user{n}": {"uid": 2000 + n} for n in range(20)},
    }, Path("bench.toml"))
    rng = random.Random(42)
    objects = [RawObject(href=f"{CALENDAR}{n}.ics", etag=f'"{n}"', ical=event(n, rng, gpus),
                         calendar_url=CALENDAR) for n in range(events)]
    reader = BookingReader()

    def expand() -> tuple[float, float, tuple]:
        gc.collect()
        wall, cpu = time.perf_counter(), time.process_time()
        result = reader.read(objects, config=config, calendar=config.calendars[0],
                             templates=TEMPLATES, window_start=WINDOW_START, window_end=WINDOW_END)
        return time.perf_counter() - wall, time.process_time() - cpu, result.occurrences

    cold_wall, cold_cpu, occurrences = expand()
    warm_wall, warm_cpu, _ = expand()
    timings = []
    for _ in range(PLANS):
        gc.collect()
        wall, cpu = time.perf_counter(), time.process_time()
        result = plan(occurrences, inventory=range(gpus), config=config, templates=TEMPLATES,
                      now=WINDOW_START)
        timings.append((time.process_time() - cpu, time.perf_counter() - wall))
    plan_cpu, plan_wall = sorted(timings)[PLANS // 2]
    refused_early = sum(isinstance(o, Rejection) for o in occurrences)

    print(f"machine: {platform.platform()}, {os.cpu_count()} CPUs, "
          f"Python {platform.python_version()}")
    print(f"{events} calendar objects -> {len(occurrences)} occurrences in a 7-day window "
          f"({refused_early} refused while reading); {gpus} GPUs")
    print(f"expand, first read (parse everything): {cold_wall * 1000:8.1f} ms wall "
          f"{cold_cpu * 1000:8.1f} ms CPU")
    print(f"expand, unchanged (parse cache warm):  {warm_wall * 1000:8.1f} ms wall "
          f"{warm_cpu * 1000:8.1f} ms CPU")
    print(f"plan (median of {PLANS}):                  {plan_wall * 1000:8.1f} ms wall "
          f"{plan_cpu * 1000:8.1f} ms CPU")
    print(f"plan result: {len(result.accepted)} accepted, {len(result.rejected)} rejected")
    print(f"peak RSS: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")


if __name__ == "__main__":
    main()
