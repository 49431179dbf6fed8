"""Start-to-SSH-login and stop times of a debian-ssh booking, podman or Docker; prints the figures.

    python bench/container_start.py --engine podman            # as the daemon user (rootless)
    python bench/container_start.py --engine docker            # as root: starts a private dockerd

Start-to-SSH is from `start_booking` (engine start + entrypoint + sshd) to the first successful
paramiko login of the probe key; stop is `engine.stop(name, grace)` (SIGTERM, sshd exits, removal).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runtime import ssh, storage  # noqa: E402
from runtime.engines import Engine, engine_from  # noqa: E402
from runtime.templates import get_template  # noqa: E402


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(fraction * (len(ordered) - 1)))]


def free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


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


def start_dockerd() -> tuple[subprocess.Popen[bytes], str, Path]:
    home = Path(tempfile.mkdtemp(prefix="gpubook-dockerd-", dir="/tmp"))
    address = f"unix://{home}/docker.sock"
    daemon = subprocess.Popen(
        [
            "/usr/sbin/dockerd",
            "--iptables=false",
            "--bridge=none",
            "--host",
            address,
            "--data-root",
            str(home / "data"),
            "--exec-root",
            str(home / "exec"),
            "--pidfile",
            str(home / "dockerd.pid"),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    for _ in range(600):
        check = ["/usr/bin/docker", "-H", address, "info"]
        if subprocess.run(check, capture_output=True, check=False).returncode == 0:
            return daemon, address, home
        time.sleep(0.1)
    daemon.terminate()
    raise SystemExit("dockerd did not start")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=["podman", "docker"], default="podman")
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--docker-host", help="an existing dockerd's address (default: start one)")
    args = parser.parse_args()
    daemon = None
    if args.engine == "podman":
        engine = engine_from("podman", runtime="runc", storage_driver="overlay")
    else:
        address = args.docker_host
        if address is None:
            daemon, address, home = start_dockerd()
        engine = engine_from("docker", binary="/usr/bin/docker", global_args=("-H", address))
    try:
        starts, stops = bench(engine, args.runs)
    finally:
        if daemon is not None:
            daemon.terminate()
            daemon.wait(timeout=60)
            shutil.rmtree(home, ignore_errors=True)
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
