#!/usr/bin/env python3
"""What telling foreign processes apart costs, per sampling round ([daemon] sample_seconds).

The layout: --gpus GPUs, each booked by a "container" (a real PID namespace of its own, made with
`unshare --user --map-root-user --pid --fork`, so it runs as any user) holding half of the GPU's
--per-gpu processes; the other half are plain host processes (`sleep`): foreign. Only NVML's list
is made up (an NvmlView naming those real PIDs); the /proc reads are the real ones.

Printed with the machine, CPU and wall per round (median wall, mean CPU):
- attribution alone: gpubook/runtime/nvidia/processes.py's Attribution built for the round's containers
  and each listed PID looked at (namespace, owner, command, start time);
- a whole round of gpubook/scheduler/hosts/foreign.py's ForeignWatch on a real state database, with every
  sighting already known (the steady state: last-seen times moved on, nothing to tell).

Usage: python3 bench/foreign.py [--gpus 8] [--per-gpu 10] [--rounds 200]
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpubook.runtime.engines import ContainerInfo  # noqa: E402
from gpubook.runtime.nvidia.model import Gpu, GpuProcess  # noqa: E402
from gpubook.runtime.nvidia.nvml import NvmlView  # noqa: E402
from gpubook.runtime.nvidia.processes import Attribution  # noqa: E402
from gpubook.scheduler.hosts.foreign import ForeignWatch  # noqa: E402
from gpubook.scheduler.state import State  # noqa: E402


def machine() -> str:
    cores = len(os.sched_getaffinity(0))
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return (f"{platform.platform()}, {cores} cores, {memory:.0f} GiB, Python {platform.python_version()}, "
            f"uid {os.getuid()}")


def timed(call: Callable[[], object], count: int) -> tuple[float, float]:
    walls = []
    before = resource.getrusage(resource.RUSAGE_SELF)
    for _ in range(count):
        started = time.perf_counter()
        call()
        walls.append(time.perf_counter() - started)
    after = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime) / count
    return statistics.median(walls), cpu


def children(pid: int, count: int) -> list[int]:
    for _ in range(200):
        found = [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
        if len(found) >= count:
            return found
        time.sleep(0.05)
    raise SystemExit(f"pid {pid} did not start its {count} children")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--per-gpu", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=200)
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)  # each first sighting is a warning; 80 of them say nothing here
    own, outside = args.per_gpu // 2, args.per_gpu - args.per_gpu // 2
    started: list[subprocess.Popen[bytes]] = []
    try:
        containers, listed = [], []
        for gpu in range(args.gpus):
            script = " ".join(["sleep 600 &"] * own) + " wait"
            outer = subprocess.Popen(["unshare", "--user", "--map-root-user", "--pid", "--fork", "sh", "-c", script])
            started.append(outer)
            (init,) = children(outer.pid, 1)
            inner = children(init, own)
            containers.append(ContainerInfo(name=f"gpubook-b{gpu}", id=f"{gpu:064x}", state="running", image="i",
                                            booking_id=f"b{gpu}@bench", user="alice", gpus=(gpu,), end=None,
                                            spec_hash="", port=None, template="t", pid=init))
            hosts = [subprocess.Popen(["sleep", "600"]) for _ in range(outside)]
            started += hosts
            listed.append([*inner, *(p.pid for p in hosts)])
        view = NvmlView("550.54", tuple(Gpu(index=i, uuid=f"GPU-{i}", name="bench", processes=tuple(
            GpuProcess(pid=p, name=None, used_memory_mib=1) for p in pids)) for i, pids in enumerate(listed)))

        def attribute() -> None:
            attribution = Attribution(containers)
            for pids in listed:
                for pid in pids:
                    attribution.process(pid)

        with tempfile.TemporaryDirectory() as folder, State(Path(folder) / "state.sqlite") as state:
            watch = ForeignWatch(state=state, host="bench", running=lambda: containers, read=lambda: view)
            first = watch()
            assert first.seen == args.gpus * outside, first.seen  # the containers' own are never foreign
            attribution_wall, attribution_cpu = timed(attribute, args.rounds)
            round_wall, round_cpu = timed(watch, args.rounds)
        print(f"machine: {machine()}")
        print(f"layout: {args.gpus} GPUs x {args.per_gpu} processes ({own} in the GPU's booking container, "
              f"{outside} foreign on the host), {args.rounds} rounds")
        print(f"attribution alone: {attribution_wall * 1e3:.2f} ms wall (median), {attribution_cpu * 1e3:.2f} ms CPU "
              f"per round; {attribution_cpu / (args.gpus * args.per_gpu) * 1e6:.0f} us CPU per process")
        print(f"whole round (State, steady): {round_wall * 1e3:.2f} ms wall (median), {round_cpu * 1e3:.2f} ms CPU "
              f"per round; at the default 30 s interval: {round_cpu / 30 * 100:.3f} % of one core")
    finally:
        for process in started:
            process.kill()
            process.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
