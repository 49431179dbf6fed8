"""How long free GPU time takes for a busy lab: prints figures, asserts nothing.

    PYTHONPATH=. python bench/free_slots.py [BOOKINGS] [GPUS]

Builds BOOKINGS bookings (default 1,000) over a week on a host with GPUS GPUs (default 8), about a
third of them clashing, then times: the plan with its refusals naming free slots and without
(the slots' cost in the plan), the busy blocks and lanes from the plan, the next slots for a few
requests, and the availability feed (outbox/free_feed.py) built from the plan's blocks.
"""

from __future__ import annotations

import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

from gpubook.scheduler.config import parse
from gpubook.scheduler.core import free
from gpubook.scheduler.core import plan as plan_module
from gpubook.scheduler.core.bookings import Booking
from gpubook.scheduler.core.plan import LOCAL

CALENDAR = "http://127.0.0.1:5232/lab/devbox1/"
NOW = datetime(2026, 11, 23, 8, tzinfo=UTC)


def bookings(count: int, gpus: int, rng: random.Random) -> list[Booking]:
    made = []
    for number in range(count):
        start = NOW + timedelta(minutes=30 * rng.randrange(7 * 48))
        indices = tuple(sorted(rng.sample(range(gpus), 2))) if rng.random() < 0.3 else None
        made.append(Booking(id=f"b{number}", uid=f"b{number}", user=f"user{number % 20}", template="debian-ssh",
                            gpu_count=len(indices) if indices else rng.choice([1, 1, 2, 4]), gpu_indices=indices,
                            start=start, end=start + timedelta(hours=rng.choice([1, 2, 4, 8])), created=None,
                            dtstamp=None, calendar_url=CALENDAR, href=f"{CALENDAR}b{number}.ics"))
    return made


def busy_lab(count: int, gpus: int, clashes: int) -> list[Booking]:
    """`count` one-GPU bookings back to back over the week (every GPU full), and `clashes` more that
    name a GPU already booked: what a busy lab's refusals cost."""
    per_gpu = -(-count // gpus)
    length = timedelta(days=7) / per_gpu
    made = []
    for number in range(count + clashes):
        slot = number if number < count else (number - count) * 7
        start = NOW + (slot // gpus) * length
        made.append(Booking(id=f"b{number}", uid=f"b{number}", user=f"user{number % 20}", template="debian-ssh",
                            gpu_count=1, gpu_indices=(slot % gpus,), start=start, end=start + length,
                            created=None, dtstamp=None, calendar_url=CALENDAR, href=f"{CALENDAR}b{number}.ics"))
    return made


def timed(what: Callable[[], object], *, runs: int = 5) -> tuple[float, object]:
    times, result = [], None
    for _ in range(runs):
        began = time.perf_counter()
        result = what()
        times.append(time.perf_counter() - began)
    return statistics.median(times), result


def main() -> None:
    count = int(sys.argv[1]) if len(sys.argv) > 1 else 1000
    gpus = int(sys.argv[2]) if len(sys.argv) > 2 else 8
    config = parse({"host": {"name": "bench", "timezone": "Europe/Paris"},
                    "calendar": [{"url": CALENDAR, "gpus": "all"}],
                    "users": {f"user{n}": {"uid": 3000 + n} for n in range(20)}}, Path("/etc/gpubook/gpubook.toml"))
    items = bookings(count, gpus, random.Random(7))

    def planned() -> plan_module.Plan:  # reads `items` when called
        return plan_module.plan(items, inventory=tuple(range(gpus)), config=config, templates={"debian-ssh"},
                                now=NOW)

    def compare() -> tuple[float, float, object]:
        with_slots, result = timed(planned)
        searches = plan_module._Offers.SEARCHES
        plan_module._Offers.SEARCHES = 0  # no refusal names a slot: the plan as it was
        without, _ = timed(planned)
        plan_module._Offers.SEARCHES = searches
        return with_slots, without, result

    print(f"machine: {platform.node()}, {os.cpu_count()} cores, Python {platform.python_version()}; "
          f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC")
    lab = busy_lab(count, gpus, 50)
    items, kept = lab, items
    with_slots, without, found = compare()
    assert isinstance(found, plan_module.Plan)
    print(f"a busy lab, {count} bookings back to back on {gpus} GPUs and 50 clashing: {len(found.accepted)} "
          f"accepted, {len(found.rejected)} refused; plan with the refusals' free slots: {with_slots * 1e3:.1f} ms, "
          f"without: {without * 1e3:.1f} ms (median of 5)")
    items = kept
    with_slots, without, result = compare()
    assert isinstance(result, plan_module.Plan)
    named = sum(1 for r in result.rejected if " free " in r.reason.split("; ", 1)[-1])
    lanes_time, lanes = timed(lambda: free.lanes(free.blocks(result.accepted)))
    horizon = NOW + timedelta(days=7)
    requests = [free.Request(among={LOCAL: tuple(range(gpus))}, count=n, duration=timedelta(hours=h))
                for n in (1, 2, 4, gpus) for h in (1, 8)]
    slots_time, _ = timed(lambda: [free.next_slots(lanes, r, after=NOW, horizon=horizon)  # type: ignore[arg-type]
                                   for r in requests])
    print(f"random requests, {count} bookings on {gpus} GPUs: {len(result.accepted)} accepted, "
          f"{len(result.rejected)} refused ({named} of them naming free slots)")
    print(f"plan with the refusals' free slots: {with_slots * 1e3:.1f} ms; without: {without * 1e3:.1f} ms "
          f"(median of 5)")
    print(f"busy blocks and lanes from the plan: {lanes_time * 1e3:.2f} ms")
    print(f"next free slots for {len(requests)} requests (1..{gpus} GPUs, 1 h and 8 h): {slots_time * 1e3:.2f} ms "
          f"({slots_time / len(requests) * 1e3:.3f} ms each)")
    try:
        from gpubook.scheduler.outbox import free_feed
    except ImportError:
        return
    feed_time, feed = timed(lambda: free_feed.feed(free.blocks(found.accepted), host_name="bench", viewer=None,
                                                   now=NOW))
    print(f"availability feed (icalendar) of the busy lab's {len(found.accepted)} bookings: {feed_time * 1e3:.1f} ms, "
          f"{len(feed) / 1e3:.0f} kB")  # type: ignore[arg-type]


if __name__ == "__main__":
    main()
