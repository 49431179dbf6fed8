"""What /metrics costs: one scrape with 1,000 bookings in the status, and one observation. Prints them.

    PYTHONPATH=. python bench/metrics.py [--bookings 1000] [--rounds 200]

The status holds `--bookings` running bookings (every fourth armed) on one host, the counts of a
1,000-booking plan and 20 image preparations; GPU-hours for 50 users come from a State subclass
with fixed figures (State's own accounting query is H-usage's to measure), and 8 GPUs from a fixed
NVML view (NVML's own read is cached 2 s and is not part of this figure). Measured: the registry's
text exposition (generate_latest: what the WSGI app does per scrape), wall and this process's CPU
time; the same over HTTP (wsgiref on loopback, requests as the client; the client's own parse not
timed); and one histogram observation as the start handler makes it.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from wsgiref.simple_server import WSGIRequestHandler, make_server

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import requests  # noqa: E402
from prometheus_client import generate_latest  # noqa: E402

from gpubook.runtime.nvidia.model import Gpu  # noqa: E402
from gpubook.runtime.nvidia.nvml import NvmlView  # noqa: E402
from gpubook.scheduler.outbox import metrics  # noqa: E402
from gpubook.scheduler.outbox.status import GpuSummary, HostStatus, RunningBooking, Status  # noqa: E402
from gpubook.scheduler.state import State  # noqa: E402

USERS = [f"user{n}" for n in range(50)]


class UsageState(State):
    def gpu_hours_booked_by_user(self) -> dict[str, float]:
        return {user: 10.0 * n for n, user in enumerate(USERS)}

    def gpu_hours_used_by_user(self) -> dict[str, float]:
        return {user: 4.0 * n for n, user in enumerate(USERS)}


def machine() -> str:
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{platform.platform()}, {os.cpu_count()} cores, {memory:.0f} GiB, Python {platform.python_version()}"


def status(count: int) -> Status:
    running = tuple(RunningBooking(booking=f"b{n}@lab", user=USERS[n % 50], gpus=(n % 8,),
                                   state="armed: SSH opens at 10:00:00 UTC" if n % 4 == 0 else "running",
                                   port=20000 + n, end="2026-11-23T10:00:00+00:00", container=f"gpubook-b{n}")
                    for n in range(count))
    return Status(hosts=(HostStatus(name="local", gpus=GpuSummary(source="nvml", count=8), running=running),),
                  last_poll="2026-11-22T10:00:00+00:00", last_poll_ok="2026-11-22T10:00:00+00:00",
                  counts={"now": count, "upcoming": 1000, "rejected": 100},
                  images={"preparations": [{"state": "ready"}] * 20, "free_bytes": 10**11})


def gpus() -> NvmlView:
    return NvmlView("580.65.06", gpus=tuple(Gpu(index=n, uuid=f"GPU-{n:04d}", memory_total_mib=81920,
                                                memory_used_mib=1024 * n, utilisation_percent=10 * n)
                                            for n in range(8)))


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base class's name
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bookings", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=200)
    args = parser.parse_args()
    print(f"machine: {machine()}")
    report = status(args.bookings)
    with tempfile.TemporaryDirectory(prefix="gpubook-bench-") as folder:
        usage = UsageState(Path(folder) / "state.sqlite")
        made = metrics.Metrics(status=lambda: report, usage=usage, users=lambda: USERS, gpus=gpus)
        for seconds in (0.3, 0.5, 1.2, 2.0, 40.0):
            made.started(seconds_to_ssh=seconds)
            made.polled(seconds=seconds / 10)
            made.passed(seconds=seconds / 10)
        size = len(generate_latest(made.registry))
        walls, cpus = [], []
        for _ in range(args.rounds):
            wall, cpu = time.perf_counter(), time.process_time()
            generate_latest(made.registry)
            walls.append(time.perf_counter() - wall)
            cpus.append(time.process_time() - cpu)
        server = make_server("127.0.0.1", 0, metrics.wsgi_app(made), handler_class=_Quiet)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        url = f"http://127.0.0.1:{server.server_port}/metrics"
        http = []
        with requests.Session() as session:
            for _ in range(args.rounds):
                began = time.perf_counter()
                session.get(url, timeout=10).raise_for_status()
                http.append(time.perf_counter() - began)
        server.shutdown()
        server.server_close()
        observations = 100_000
        began = time.perf_counter()
        for _ in range(observations):
            made.started(seconds_to_ssh=0.5)
        observe = (time.perf_counter() - began) / observations
        usage.close()
    ms = 1000.0
    print(f"scrape with {args.bookings} bookings in the status ({size} bytes of text): generate_latest median "
          f"{ms * statistics.median(walls):.2f} ms wall, {ms * statistics.median(cpus):.2f} ms CPU, max "
          f"{ms * max(walls):.2f} ms ({args.rounds} rounds); over HTTP (wsgiref, loopback) median "
          f"{ms * statistics.median(http):.2f} ms, max {ms * max(http):.2f} ms")
    print(f"one observation (start-to-SSH histogram, through the guard): {1e6 * observe:.2f} µs")


if __name__ == "__main__":
    main()
