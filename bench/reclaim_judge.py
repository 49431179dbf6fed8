#!/usr/bin/env python3
"""What judging no-shows and idle GPUs adds to a pass (gpubook/scheduler/apply/reclaim.py: `judge_running`):
State's logins and each running booking's first, last and last busy GPU sample, read from the
index (booking, GPU, time), then the pure judge. Printed with the machine.

The database holds `--hours` of samples every `--interval` s for `--gpus` GPUs, each GPU booked by
one running booking for all that time; half the bookings are busy to the last sample, half have
been idle for the last `--idle-hours` (the worst case for the last-busy look, which walks back over
the idle stretch).

Usage: python3 bench/reclaim_judge.py [--gpus 8] [--hours 72] [--interval 10] [--idle-hours 24] [--passes 50]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpubook.runtime.engines import ContainerInfo  # noqa: E402
from gpubook.scheduler.apply.reclaim import judge_running  # noqa: E402
from gpubook.scheduler.config import parse  # noqa: E402
from gpubook.scheduler.core.bookings import Booking  # noqa: E402
from gpubook.scheduler.core.plan import Accepted, Plan  # noqa: E402
from gpubook.scheduler.state import Sample, State  # noqa: E402


def machine() -> str:
    cores = len(os.sched_getaffinity(0))
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{platform.platform()}, {cores} cores, {memory:.0f} GiB, Python {platform.python_version()}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--hours", type=float, default=72)
    parser.add_argument("--interval", type=float, default=10)
    parser.add_argument("--idle-hours", type=float, default=24)
    parser.add_argument("--passes", type=int, default=50)
    args = parser.parse_args()
    now = datetime(2026, 11, 24, 12, tzinfo=UTC)
    start = now - timedelta(hours=args.hours)
    users = {"alice": {"uid": 1000}}
    config = parse({"host": {"name": "bench", "timezone": "UTC"}, "calendar": [{"url": "http://cal/x/"}],
                    "defaults": {"max_hours": args.hours + 1}, "users": users,
                    "policy": {"no_show_minutes": 30, "idle_minutes": 60}}, Path("/etc/gpubook/bench.toml"))
    with tempfile.TemporaryDirectory() as folder, State(Path(folder) / "state.sqlite") as state:
        bookings, running = [], {}
        for gpu in range(args.gpus):
            booking_id = f"b{gpu}"
            bookings.append(Accepted(Booking(id=booking_id, uid=booking_id, user="alice", template="t", gpu_count=1,
                                             gpu_indices=(gpu,), start=start, end=now + timedelta(hours=1),
                                             created=None, dtstamp=None, calendar_url="http://cal/x/", href="h"),
                                     (gpu,), now))
            running[booking_id] = ContainerInfo(name=booking_id, id="c", state="running", image="i",
                                                booking_id=booking_id, user="alice", gpus=(gpu,), end=None,
                                                spec_hash="h", port=None, template="t")
            state.container_started(booking_id, booking_id, user="alice", gpu_count=1, at=start)
        rounds = int(args.hours * 3600 / args.interval)
        idle_from = now - timedelta(hours=args.idle_hours)
        batch = []
        for number in range(rounds):
            at = start + timedelta(seconds=number * args.interval)
            for gpu in range(args.gpus):
                busy = gpu % 2 == 0 or at < idle_from
                batch.append(Sample(at=at, host="local", gpu=gpu, booking_id=f"b{gpu}", utilisation=90 if busy else 1,
                                    memory_used_mib=0, memory_total_mib=1, seconds=args.interval))
            if len(batch) >= 20000:
                state.record_samples(batch)
                batch = []
        state.record_samples(batch)
        records = {r.booking_id: [r] for r in state.containers()}
        plan = Plan(accepted=tuple(bookings), rejected=(), next_wakeup=None)
        times, cpu = [], []
        for _ in range(args.passes):
            wall, used = time.perf_counter(), time.process_time()
            verdicts = judge_running(config, state, plan=plan, running=running, records=records, now=now)
            times.append(time.perf_counter() - wall)
            cpu.append(time.process_time() - used)
        idle = sum(1 for v in verdicts.values() if v.idle is not None)
    print(f"machine: {machine()}")
    print(f"samples: {rounds * args.gpus} rows ({args.gpus} GPUs, {args.hours:g} h every {args.interval:g} s); "
          f"{args.gpus} running bookings, {idle} idle for the last {args.idle_hours:g} h")
    print(f"judge_running per pass: wall median {statistics.median(times) * 1000:.2f} ms, "
          f"max {max(times) * 1000:.2f} ms; CPU median {statistics.median(cpu) * 1000:.2f} ms")


if __name__ == "__main__":
    main()
