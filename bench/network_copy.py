"""Throughput of copying a file into a booking over its SSH port (scp), per network, in one run.

    python bench/network_copy.py                       # 1 GiB, 3 copies per network, as the daemon user
    python bench/network_copy.py --size-mib 256 --copies 1 --network host private

For each network a debian-ssh booking is started as the daemon starts one (its own host key); then
OpenSSH's scp (argv list, the booking's known_hosts line, StrictHostKeyChecking=yes, the booker's
key) copies the same file into it, to /dev/null, so the figure is the SSH path and not the disk.
Copies alternate between the networks so that the machine's load falls on each alike. "private" is
gpubook's default (rootless podman: slirp4netns, rootlesskit port handler), "private-slirp"
slirp4netns's own port handler, "host" the host network.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import paramiko

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.container_start import podman_engine  # noqa: E402
from gpubook.runtime import private  # noqa: E402
from gpubook.runtime.booking import launch, ssh
from gpubook.runtime.data import storage
from gpubook.runtime.engines import Engine, container_name  # noqa: E402
from gpubook.runtime.templates import overlay_image
from gpubook.runtime.templates.catalog import get_template  # noqa: E402
from tests.kits.engine_suite import lane_port  # noqa: E402

MIB = 1 << 20


def start(engine: Engine, network: str, *, folders: storage.DataFolders, booker_key: paramiko.PKey,
          probe_key: paramiko.PKey) -> tuple[str, int, str]:
    """A running booking of network `network`: (container name, port, known_hosts line)."""
    cache = private.default_cache_dir()
    booking_id = f"bench-copy-{network}"
    name = container_name(booking_id)
    engine.stop(name, 0)
    host_key = ssh.booking_host_key(cache, name, owner=engine.host_owner(0, 0), chown=engine.chown)
    spec = launch.booking_spec(
        get_template("debian-ssh"),
        launch.Tenancy(booking_id=booking_id, user="alice", uid=2001, gid=2001,
                        ssh_keys=(f"{booker_key.get_name()} {booker_key.get_base64()} bench",), port=lane_port(),
                        end=datetime.now(UTC) + timedelta(hours=1)),
        launch.HostFiles(probe_key=probe_key, cache_dir=cache, host_key=host_key, folders=folders))
    launch.start_booking(engine, spec, probe_key=probe_key, timeout=60)
    return name, spec.port, ssh.known_hosts_line(host="127.0.0.1", port=spec.port, host_key=host_key.public)


def copy(source: Path, *, port: int, key_file: Path, known_hosts: Path) -> float:
    argv = ["scp", "-q", "-P", str(port), "-i", str(key_file), "-o", "BatchMode=yes",
            "-o", "StrictHostKeyChecking=yes", "-o", f"UserKnownHostsFile={known_hosts}",
            str(source), "alice@127.0.0.1:/dev/null"]
    began = time.monotonic()
    done = subprocess.run(argv, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=600, check=False)
    took = time.monotonic() - began
    # sftp-server cannot set times on /dev/null ("remote fsetstat: Bad message"); the data went through.
    problems = [line for line in done.stderr.splitlines() if "fsetstat" not in line]
    if done.returncode != 0 or problems:
        raise SystemExit(f"scp failed ({done.returncode}): {done.stderr.strip()}")
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--copies", type=int, default=3)
    parser.add_argument("--network", nargs="+", default=["host", "private", "private-slirp"],
                        choices=["host", "private", "private-slirp"])
    args = parser.parse_args()
    cache = private.default_cache_dir()
    engines = {network: podman_engine(network) for network in args.network}
    overlay_image.build_rootfs_image(next(iter(engines.values())), get_template("debian-ssh"), cache_dir=cache)
    probe_key = ssh.load_probe_key(cache / "bench-probe-key")
    booker_key = paramiko.ECDSAKey.generate(bits=256)
    seconds: dict[str, list[float]] = {network: [] for network in engines}
    names: list[tuple[Engine, str]] = []
    with tempfile.TemporaryDirectory(prefix="gpubook-bench-copy-") as work:
        folder = Path(work)
        key_file = folder / "alice_key"
        booker_key.write_private_key_file(str(key_file))
        os.chmod(key_file, 0o600)
        source = folder / "payload"
        with source.open("wb") as file:
            chunk = os.urandom(MIB)  # incompressible, so no compression could flatter a figure
            for _ in range(args.size_mib):
                file.write(chunk)
        (folder / "data").mkdir()
        owner = next(iter(engines.values())).host_owner(2001, 2001)
        folders = storage.prepare(folder / "data", "alice", uid=owner[0], gid=owner[1])
        try:
            targets = {}
            for network, engine in engines.items():
                name, port, line = start(engine, network, folders=folders, booker_key=booker_key,
                                         probe_key=probe_key)
                names.append((engine, name))
                known_hosts = folder / f"known_hosts-{network}"
                known_hosts.write_text(line + "\n")
                targets[network] = (port, known_hosts)
            for _ in range(args.copies):
                for network, (port, known_hosts) in targets.items():
                    seconds[network].append(copy(source, port=port, key_file=key_file, known_hosts=known_hosts))
        finally:
            for engine, name in names:
                engine.stop(name, 0)
                ssh.forget_host_key(cache, name)
    print("machine: Debian 12 VM, 2 cores, 24 GiB")
    rates = {network: args.size_mib / statistics.median(values) for network, values in seconds.items()}
    for network, values in seconds.items():
        print(f"scp {args.size_mib} MiB into a booking, podman {network}: median {statistics.median(values):.2f} s "
              f"({rates[network]:.0f} MiB/s) over {len(values)} copies; each: "
              + ", ".join(f"{value:.2f}" for value in values))
    if "host" in rates:
        for network, rate in rates.items():
            if network != "host":
                print(f"{network} / host throughput: {rate / rates['host']:.2f}")


if __name__ == "__main__":
    main()
