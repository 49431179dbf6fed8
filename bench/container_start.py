"""Start-to-SSH-login and stop times of a debian-ssh booking, podman, udocker or Docker; prints the figures.

    python bench/container_start.py --engine podman            # as the daemon user (rootless)
    python bench/container_start.py --engine podman --network host private private-slirp
    python bench/container_start.py --engine udocker podman --network host private   # as the daemon user
    python bench/container_start.py --engine udocker udocker-spare --network host   # a spare made ahead (issue 42)
    python bench/container_start.py --engine docker --network host   # as root: a private dockerd

Start-to-SSH is from `start_booking` (engine start + entrypoint + sshd) to the first successful
paramiko login of the probe key; stop is `engine.stop(name, grace)` (SIGTERM, sshd exits, removal).
Several networks are measured in one run, their starts interleaved (host, private, host, ...), so
that the machine's load falls on each alike. "private" is gpubook's default (rootless podman:
slirp4netns with the rootlesskit port handler); "private-slirp" is slirp4netns's own port handler.
Several engines (udocker and podman, both the daemon user's) are interleaved the same way, each
with every network it has (udocker: the host's only); each gets the image in its own store first
(udocker: imported from the same mmdebstrap tarball) and its own data folders (their owners differ).
"udocker-spare" is udocker with a spare container of the image made ahead before each start (the
image preparer's `warm`; a booking for now then takes it instead of waiting for `udocker create`); the
making is not timed, the start is.
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

import paramiko

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpubook.runtime import private  # noqa: E402
from gpubook.runtime.booking import launch, ssh
from gpubook.runtime.data import storage
from gpubook.runtime.engines import Engine, EngineOptions, EngineSettings, container_name, engine_from  # noqa: E402
from gpubook.runtime.engines.podman import PodmanEngine  # noqa: E402
from gpubook.runtime.engines.udocker import spare_name
from gpubook.runtime.templates import overlay_image
from gpubook.runtime.templates.catalog import Template, get_template  # noqa: E402
from tests.kits.engine_suite import DOCKER, lane_port, private_dockerd  # noqa: E402


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(fraction * (len(ordered) - 1)))]


class SlirpPortHandlerPodman(PodmanEngine):
    """Rootless podman's private network with slirp4netns's own port handler instead."""

    def private_network_args(self) -> list[str]:
        return ["--network", "slirp4netns:port_handler=slirp4netns,allow_host_loopback=false"]


def podman_engine(network: str) -> Engine:
    if network == "private-slirp":
        settings = EngineSettings(runtime="runc", storage_driver="overlay", network="private")
        return SlirpPortHandlerPodman(settings, EngineOptions())
    return engine_from("podman", runtime="runc", storage_driver="overlay", network=network)


def bench(engines: dict[str, Engine], runs: int) -> dict[str, tuple[list[float], list[float]]]:
    cache = private.default_cache_dir()
    template = get_template("debian-ssh")
    for engine in engines.values():
        overlay_image.build_rootfs_image(engine, template, cache_dir=cache)
    probe_key = ssh.load_probe_key(cache / "bench-probe-key")
    figures: dict[str, tuple[list[float], list[float]]] = {place: ([], []) for place in engines}
    with tempfile.TemporaryDirectory(prefix="gpubook-bench-") as data_root:
        folders = {}
        for place, engine in engines.items():  # each engine's own: the folders' owner is the engine's
            owner = engine.host_owner(2001, 2001)
            (Path(data_root) / place).mkdir()
            folders[place] = storage.prepare(Path(data_root) / place, "alice", uid=owner[0], gid=owner[1],
                                             chown=engine.chown)
        for number in range(runs + 1):  # the first run warms caches and is not counted
            for place, engine in engines.items():
                starts, stops = figures[place]
                if place.endswith("spare"):  # made ahead, as the image preparer does (not timed)
                    engine.warm(overlay_image.run_image(template))  # type: ignore[attr-defined]
                elif place.startswith("udocker"):  # none left by an earlier spare run
                    engine._remove(spare_name(overlay_image.run_image(template)))  # type: ignore[attr-defined]
                started, stopped = one_start(engine, template, folders[place], probe_key,
                                             f"bench-{place.replace(' ', '-')}-{number}")
                if number:
                    starts.append(started)
                    stops.append(stopped)
    return figures


def one_start(engine: Engine, template: Template, folders: storage.DataFolders, probe_key: paramiko.PKey,
              booking_id: str) -> tuple[float, float]:
    """One booking started until the probe logs in, then stopped: (seconds to SSH, seconds to stop)."""
    cache = private.default_cache_dir()
    name = container_name(booking_id)
    host_key = ssh.booking_host_key(cache, name, owner=engine.host_owner(0, 0), chown=engine.chown)
    spec = launch.booking_spec(
        template,
        launch.Tenancy(booking_id=booking_id, user="alice", uid=2001, gid=2001, ssh_keys=(), port=lane_port(),
                        end=datetime.now(UTC) + timedelta(hours=1)),
        launch.HostFiles(probe_key=probe_key, cache_dir=cache, host_key=host_key, folders=folders))
    try:
        ready = launch.start_booking(engine, spec, probe_key=probe_key, timeout=60)
        began = time.monotonic()
        engine.stop(spec.name, 10)
        stopped = time.monotonic() - began
    finally:
        engine.stop(spec.name, 0)
        ssh.forget_host_key(cache, name)
    return ready.seconds, stopped


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", nargs="+", choices=["podman", "udocker", "udocker-spare", "docker"],
                        default=["podman"],
                        help="engines measured in this one run, starts interleaved (docker alone, as root)")
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--docker-host", help="an existing dockerd's address (default: start one)")
    parser.add_argument("--network", nargs="+", default=["private"],
                        choices=["host", "private", "private-slirp"],
                        help="networks measured in this one run, starts interleaved (default: private)")
    args = parser.parse_args()
    if "docker" in args.engine and len(args.engine) > 1:
        parser.error("docker runs as root with its own dockerd: measure it alone")
    if {"udocker", "udocker-spare"} <= set(args.engine):
        parser.error("udocker and udocker-spare share one store (the plain one would take the other's spare): "
                     "measure them one after the other")
    with contextlib.ExitStack() as stack:
        engines: dict[str, Engine] = {}
        for name in args.engine:
            if name == "docker":
                address = args.docker_host or stack.enter_context(private_dockerd())
                engines.update({f"docker {network}": engine_from("docker", binary=DOCKER, global_args=("-H", address),
                                                                 network=network) for network in args.network})
            elif name == "udocker":  # no network namespaces: the host's network only
                engines["udocker host"] = engine_from("udocker", network="host")
            elif name == "udocker-spare":
                engines["udocker host spare"] = engine_from("udocker", network="host")
            else:
                engines.update({f"podman {network}": podman_engine(network) for network in args.network})
        figures = bench(engines, args.runs)
    print(f"machine: Debian 12 VM, 2 cores, 24 GiB; ended {datetime.now(UTC):%Y-%m-%d %H:%M} UTC")
    for place, (starts, stops) in figures.items():
        print(
            f"{place}: start-to-SSH-login over {len(starts)} runs: "
            f"median {statistics.median(starts):.3f} s, p95 {percentile(starts, 0.95):.3f} s, "
            f"min {min(starts):.3f} s, max {max(starts):.3f} s"
        )
        print(
            f"{place}: stop (SIGTERM, exit, remove): median {statistics.median(stops):.3f} s, "
            f"p95 {percentile(stops, 0.95):.3f} s"
        )


if __name__ == "__main__":
    main()
