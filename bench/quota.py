"""What the quotas cost the plan: the same busy calendar planned with every quota off and with all
three on (prints figures, asserts nothing).

    PYTHONPATH=. python bench/quota.py [EVENTS] [GPUS]

The calendar of bench/plan_scale.py (EVENTS objects, default 1,000: 80 % single bookings, 20 % daily
series; 20 users), read over the window the daemon reads when a week quota is set (two weeks and
the longest booking back, a week ahead), on GPUS GPUs (default 100). Planned with no quota, then
with `week_gpu_hours = 40`, `max_days_ahead = 7`, `max_future_bookings = 20`: wall and CPU time
(best of 5) and how many bookings each quota refused.
"""

from __future__ import annotations

import os
import platform
import random
import sys
import time
from collections import Counter
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from plan_scale import CALENDAR, TEMPLATES, WINDOW_START, event  # noqa: E402

from gpubook.scheduler.config import Config, parse  # noqa: E402
from gpubook.scheduler.core import policy  # noqa: E402
from gpubook.scheduler.core.bookings import BookingReader  # noqa: E402
from gpubook.scheduler.core.plan import plan, seen_key  # noqa: E402
from gpubook.scheduler.sources import RawObject  # noqa: E402

NOW = WINDOW_START + timedelta(days=3)


def config(policy_table: dict[str, Any]) -> Config:
    return parse({
        "host": {"name": "bench", "timezone": "Europe/Paris"},
        "calendar": [{"url": CALENDAR, "gpus": "all"}],
        "users": {f"user{n}": {"uid": 2000 + n} for n in range(20)},
        "policy": policy_table,
    }, Path("bench.toml"))


def best(runs: int, work: Any) -> tuple[float, float, Any]:
    timings = []
    for _ in range(runs):
        wall, cpu = time.perf_counter(), time.process_time()
        result = work()
        timings.append((time.perf_counter() - wall, time.process_time() - cpu))
    return (*min(timings), result)


def main() -> None:
    events = int(sys.argv[1]) if len(sys.argv) > 1 else 1000
    gpus = int(sys.argv[2]) if len(sys.argv) > 2 else 100
    off = config({})
    on = config({"week_gpu_hours": 40, "max_days_ahead": 7, "max_future_bookings": 20})
    rng = random.Random(42)
    objects = [RawObject(href=f"{CALENDAR}{n}.ics", etag=f'"{n}"', ical=event(n, rng, gpus),
                         calendar_url=CALENDAR) for n in range(events)]
    window_start = NOW - policy.reach_back(on)
    occurrences = BookingReader().read(objects, config=on, calendar=on.calendars[0], templates=TEMPLATES,
                                       window_start=window_start, window_end=NOW + policy.reach_ahead(on)).occurrences
    # First seen: in creation order, a day before each starts (so max_days_ahead refuses some).
    first_seen = {seen_key(o): o.start - timedelta(days=1 + (n % 9)) for n, o in enumerate(occurrences)}
    print(f"machine: {platform.platform()}, {os.cpu_count()} CPUs, Python {platform.python_version()}")
    print(f"{events} calendar objects -> {len(occurrences)} occurrences read from {window_start:%Y-%m-%d} "
          f"to {NOW + policy.reach_ahead(on):%Y-%m-%d}; {gpus} GPUs; 20 users")
    for name, cfg in (("no quota", off), ("3 quotas", on)):
        wall, cpu, result = best(5, lambda cfg=cfg: plan(occurrences, inventory=range(gpus), config=cfg,
                                                          templates=TEMPLATES, now=NOW, first_seen=first_seen))
        kinds = Counter("week" if "GPU-hours in the week" in r.reason else "ahead" if "days ahead" in r.reason
                        else "future" if "have not started" in r.reason else "other" for r in result.rejected)
        print(f"plan, {name:8s}: {wall * 1000:7.1f} ms wall {cpu * 1000:7.1f} ms CPU (best of 5); "
              f"{len(result.accepted)} accepted, rejected: {dict(sorted(kinds.items()))}")


if __name__ == "__main__":
    main()
