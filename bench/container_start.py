"""Start-to-SSH-login and stop times of a debian-ssh booking, podman or Docker; prints the figures.

    python bench/container_start.py --engine podman            # as the daemon user (rootless)
    python bench/container_start.py --engine docker            # as root: starts a private dockerd

Start-to-SSH is from `start_booking` (engine start + entrypoint + sshd) to the first successful
paramiko login of the probe key; stop is `engine.stop(name, grace)` (SIGTERM, sshd exits, removal).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runtime import ssh, storage  # noqa: E402
from runtime.engines import Engine, engine_from  # noqa: E402
from runtime.templates import get_template  # noqa: E402
from tests.engine_suite import DOCKER, free_port, private_dockerd  # noqa: E402


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(fraction * (len(ordered) - 1)))]


def bench(engine: Engine, runs: int) -> tuple[list[float], list[float]]:
    cache = ssh.default_cache_dir()
    template = get_template("debian-ssh")
    ssh.build_rootfs_image(engine, template, cache_dir=cache)
    probe_key = ssh.load_probe_key(cache / "bench-probe-key")
    starts, stops = [], []
    with tempfile.TemporaryDirectory(prefix="gpubook-bench-") as data_root:
        owner = engine.host_owner(2001, 2001)
        folders = storage.prepare(Path(data_root), "alice", uid=owner[0], gid=owner[1])
        for number in range(runs + 1):  # the first run warms caches and is not counted
            spec = ssh.booking_spec(
                template,
                booking_id=f"bench-{number}",
                user="alice",
                uid=2001,
                gid=2001,
                ssh_keys=[],
                probe_key=probe_key,
                port=free_port(),
                end=datetime.now(UTC) + timedelta(hours=1),
                folders=folders,
                cache_dir=cache,
            )
            try:
                ready = ssh.start_booking(engine, spec, probe_key=probe_key, timeout=60)
                began = time.monotonic()
                engine.stop(spec.name, 10)
                stopped = time.monotonic() - began
            finally:
                engine.stop(spec.name, 0)
            if number:
                starts.append(ready.seconds)
                stops.append(stopped)
    return starts, stops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=["podman", "docker"], default="podman")
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--docker-host", help="an existing dockerd's address (default: start one)")
    args = parser.parse_args()
    with contextlib.ExitStack() as stack:
        if args.engine == "podman":
            engine = engine_from("podman", runtime="runc", storage_driver="overlay")
        else:
            address = args.docker_host or stack.enter_context(private_dockerd())
            engine = engine_from("docker", binary=DOCKER, global_args=("-H", address))
        starts, stops = bench(engine, args.runs)
    print(
        f"{args.engine}: start-to-SSH-login over {len(starts)} runs: "
        f"median {statistics.median(starts):.3f} s, p95 {percentile(starts, 0.95):.3f} s, "
        f"min {min(starts):.3f} s, max {max(starts):.3f} s"
    )
    print(
        f"{args.engine}: stop (SIGTERM, exit, remove): median {statistics.median(stops):.3f} s, "
        f"p95 {percentile(stops, 0.95):.3f} s"
    )


if __name__ == "__main__":
    main()
