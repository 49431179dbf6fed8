#!/usr/bin/env python3
"""What the daemon's sampler costs ([daemon] sample_seconds, default 30): per round and per month.

Measures, each printed with the machine:
- NVML: `nvml.read(status=True)` (what a round reads), CPU and wall per call; on a machine
  without a GPU, what finding none costs;
- a whole round (gpubook/scheduler/hosts/usage.py: the read, a row per GPU with its booking, the State
  transaction) on a real state database, CPU and wall per round, rows per second; the GPUs are
  the real ones with --nvml, else --gpus made-up ones of NVML's view type (the sampler's reader);
- a pass's accounting call (the bookings it accepted and rejected) with 1,000 bookings;
- the database's growth: bytes per sample row, measured over a simulated day of every GPU at
  the interval, and what that makes per GPU per month;
- with --podman: the login check's cost, `podman logs` of a running container (a round reads
  the log of each running booking not yet seen logged in), CPU (children) and wall per call.

Usage (the podman part as the test user: `gpubook-userbench /work/wt-NAME bench/sampling.py --podman`):
    python3 bench/sampling.py [--gpus 8] [--rounds 300] [--interval 30] [--nvml] [--podman]
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpubook.runtime.engines import ContainerInfo  # noqa: E402
from gpubook.runtime.nvidia import nvml  # noqa: E402
from gpubook.runtime.nvidia.model import Gpu  # noqa: E402
from gpubook.runtime.nvidia.nvml import NvmlView  # noqa: E402
from gpubook.scheduler.hosts.usage import Sampler  # noqa: E402
from gpubook.scheduler.state import BookedRow, Sample, State  # noqa: E402

MONTH_SECONDS = 30 * 24 * 3600


def machine() -> str:
    cores = len(os.sched_getaffinity(0))
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{platform.platform()}, {cores} cores, {memory:.0f} GiB, Python {platform.python_version()}"


def timed(call: Callable[[], object], count: int, *, children: bool = False) -> tuple[float, float]:
    """Median wall and mean CPU seconds (this process, or its children) per call."""
    walls = []
    who = resource.RUSAGE_CHILDREN if children else resource.RUSAGE_SELF
    before = resource.getrusage(who)
    for _ in range(count):
        started = time.perf_counter()
        call()
        walls.append(time.perf_counter() - started)
    after = resource.getrusage(who)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return statistics.median(walls), cpu / count


def made_up(count: int) -> Callable[[], NvmlView]:
    view = NvmlView("550.54.15", tuple(Gpu(index=i, utilisation_percent=37, memory_used_mib=20480,
                                           memory_total_mib=81920) for i in range(count)))
    return lambda: view


def containers(gpus: int, now: datetime) -> list[ContainerInfo]:
    return [ContainerInfo(name=f"gpubook-b{i}", id=str(i), state="running", image="x", booking_id=f"b{i}",
                          user=f"user{i}", gpus=(i,), end=now + timedelta(days=1), spec_hash="x", port=2200 + i,
                          template="debian-ssh") for i in range(gpus)]


def rounds(args: argparse.Namespace, folder: Path) -> None:
    read = nvml.read if args.nvml else None
    view = nvml.read(status=True)
    gpu_count = len(view.gpus) if args.nvml else args.gpus
    if args.nvml and view.driver_version is None:
        print(f"  --nvml: no GPU here ({view.problem}); rounds use {args.gpus} made-up GPUs")
        read, gpu_count = None, args.gpus
    now = datetime.now(UTC)
    running = containers(gpu_count, now)
    with State(folder / "rounds.sqlite") as state:
        state.record_bookings(accepted=[BookedRow(booking_id=c.booking_id, user=c.user, template=c.template,
                                                  host="local", gpus=c.gpus, start=now, end=now + timedelta(days=1))
                                        for c in running], rejected=[], now=now, complete=True)
        sampler = Sampler(state=state, host="local", interval=args.interval, running=lambda: running,
                          logs=lambda name: "", probe_fingerprint="SHA256:none",
                          read=(lambda: nvml.read(status=True)) if read is not None else made_up(gpu_count))
        sampler.watch_logins(running, now=now)  # nobody logged in: each round would read logs; see --podman
        sampler._logged_in |= {c.booking_id for c in running}  # the rounds here measure the GPU part alone
        wall, cpu = timed(lambda: sampler(), args.rounds)
    source = "NVML" if read is not None else "made-up"
    print(f"  a round, {gpu_count} GPUs ({source}), all booked: {wall * 1000:.2f} ms wall (median), "
          f"{cpu * 1000:.2f} ms CPU; {gpu_count / wall:,.0f} rows/s")
    per_hour = 3600 / args.interval
    print(f"  at one round every {args.interval:g} s: {cpu * per_hour:.2f} s CPU per hour "
          f"({cpu / args.interval * 100:.3f} % of one core)")


def growth(args: argparse.Namespace, folder: Path) -> None:
    path = folder / "growth.sqlite"
    start = datetime(2026, 11, 1, tzinfo=UTC)
    per_day = int(86400 / args.interval)
    with State(path) as state:
        state._query("PRAGMA wal_checkpoint(TRUNCATE)")
        empty = path.stat().st_size
        for n in range(per_day):
            at = start + timedelta(seconds=args.interval * n)
            state.record_samples([Sample(at=at, host="local", gpu=g, booking_id=f"20261101-user{g}-abcdef",
                                         utilisation=float((n + g) % 101), memory_used_mib=20480 + n % 1000,
                                         memory_total_mib=81920, seconds=args.interval)
                                  for g in range(args.gpus)])
        state._query("PRAGMA wal_checkpoint(TRUNCATE)")
    rows = per_day * args.gpus
    per_row = (path.stat().st_size - empty) / rows
    month_rows = MONTH_SECONDS / args.interval
    print(f"  database growth: {per_row:.0f} bytes per sample row (table and time index; {rows:,} rows of "
          f"{args.gpus} GPUs); one GPU at {args.interval:g} s: {month_rows:,.0f} rows, "
          f"{per_row * month_rows / 2**20:.1f} MiB per month")


def pass_record(folder: Path, count: int = 1000) -> None:
    """What a pass's accounting call costs: 1,000 accepted bookings written, then one of them moved
    (the upsert leaves the others unwritten; a plan the same as the last is not even sent)."""
    now = datetime(2026, 11, 1, tzinfo=UTC)
    booked = [BookedRow(booking_id=f"b{i}", user=f"user{i % 50}", template="debian-ssh", host="local",
                        gpus=(i % 100,), start=now + timedelta(hours=i), end=now + timedelta(hours=i + 2))
              for i in range(count)]
    with State(folder / "passes.sqlite") as state:
        first, first_cpu = timed(lambda: state.record_bookings(accepted=booked, rejected=[], now=now, complete=True), 1)
        moved = [*booked[:-1], replace(booked[-1], end=booked[-1].end + timedelta(hours=1))]
        again, again_cpu = timed(lambda: state.record_bookings(accepted=moved, rejected=[], now=now, complete=True), 20)
    print(f"  a pass's accounting, {count} bookings: first written {first * 1000:.1f} ms wall, "
          f"{first_cpu * 1000:.1f} ms CPU; one moved {again * 1000:.1f} ms wall, {again_cpu * 1000:.1f} ms CPU "
          "(an unchanged plan: no call)")


def podman_logs(args: argparse.Namespace) -> None:
    from gpubook.runtime.engines import engine_from
    from gpubook.runtime.templates import overlay_image
    from gpubook.runtime.templates.catalog import get_template
    from tests.kits.engine_suite import CACHE_DIR

    engine = engine_from("podman", runtime="runc", storage_driver="overlay")
    image = overlay_image.build_rootfs_image(engine, get_template("debian-ssh"), cache_dir=CACHE_DIR)
    name = f"gpubook-bench-logs-{os.getpid()}"
    import subprocess

    lines = "; ".join(["echo 'sshd[1]: Server listening on 0.0.0.0 port 2200.'"] * 200)
    subprocess.run(["podman", "run", "-d", "--rm", "--name", name, "--network", "none", image, "sh", "-c",
                    f"{lines}; exec sleep 600"], check=True, capture_output=True)
    try:
        time.sleep(1)
        wall, cpu = timed(lambda: engine.logs(name), 20, children=True)
    finally:
        subprocess.run(["podman", "rm", "-f", "-t", "0", name], capture_output=True, check=False)
    print(f"  login check (podman logs of a container with 200 log lines): {wall * 1000:.0f} ms wall (median), "
          f"{cpu * 1000:.0f} ms CPU per booking not yet seen logged in, per round")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=8, help="made-up GPUs (and the growth's GPUs)")
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--interval", type=float, default=30.0, help="[daemon] sample_seconds")
    parser.add_argument("--nvml", action="store_true", help="rounds read the real NVML")
    parser.add_argument("--podman", action="store_true", help="also time podman logs (the login check)")
    args = parser.parse_args()
    print(f"machine: {machine()}")
    wall, cpu = timed(lambda: nvml.read(status=True), 50)
    view = nvml.read(status=True)
    what = f"{len(view.gpus)} GPUs, driver {view.driver_version}" if view.driver_version else f"no GPU: {view.problem}"
    print(f"  nvml.read(status=True) ({what}): {wall * 1000:.2f} ms wall (median), {cpu * 1000:.2f} ms CPU")
    with tempfile.TemporaryDirectory(prefix="gpubook-sampling-") as folder:
        rounds(args, Path(folder))
        growth(args, Path(folder))
        pass_record(Path(folder))
    if args.podman:
        podman_logs(args)


if __name__ == "__main__":
    main()
