"""A booking's start to SSH through the daemon: `[backend] kind = "slurm"` against the local backend.

    sudo PYTHONPATH=. python bench/slurm_daemon_start.py [ROUNDS]

Needs root (tests/kits/slurm_kit.py makes the tests' real Slurm 22.05 cluster: slurmctld, two slurmd of
4 GPUs in their own network namespaces), the account gpubook-test with rootless podman and the
debian-ssh test image (built once, as in tests/test_slurm_jobs.py), and the nosuid,nodev test
data mount (tests/kits/safe_data.py). Prints figures; asserts nothing beyond sanity.

Two real daemons (`gpubook run` as gpubook-test, tests/daemon_kit.DaemonProcess) run at the same
time for the whole run, each on its own Radicale calendar: one with the Slurm backend (the config of
tests/test_daemon_slurm.py), one with the local backend (tests/daemon_kit.write_config; its
data_root a folder of the test mount given to the account). Each round books the same booking
(debian-ssh, 1 GPU, start = now + 20 s) first on the Slurm daemon, then, once that one is cancelled
and its container gone, on the local one: never two bookings at once. From the booking's DTSTART,
this script measures
  (a) the running line in the event (`running: ssh -p PORT alice@HOST`, the event fetched every
      0.05 s; an armed local booking's event already gives `ssh from the start: ...` before it), and
  (b) the first paramiko login as alice + `id -un` (tried every 0.05 s) at that port on the node's
      address, the port read as early as it is known (the daemon's state database, read-only, or
      the ssh line, whichever comes first; both must agree).
The local daemon arms the container ahead of the start (its sshd answers at the start and the
start only opens it); the Slurm daemon submits the job at the start (sbatch, scheduling, srun,
the container started on the node): the figures differ mostly by that.
"""

from __future__ import annotations

import os
import platform
import pwd
import re
import sqlite3
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import caldav
import paramiko

from gpubook.runtime.engines import container_name
from tests.kits import daemon_kit, safe_data, servers, slurm_kit
from tests.kits.engine_suite import new_key
from tests.kits.slurm_jobs_kit import REPO, jobs, login, reservations, run
from tests.kits.slurm_jobs_kit import write_config as slurm_config
from tests.kits.slurm_kit import podman_as

MACHINE = "Debian 12 VM, 2 cores, 24 GiB, rootless podman runc/overlay, Slurm 22.05 in network namespaces"
POLL = 0.05
SSH_LINE = re.compile(r"running: ssh -p (\d+) alice@([\w.]+)")  # node1 (Slurm) or 127.0.0.1 (local)
AHEAD = "ssh from the start: ssh -p"  # an armed booking's line, written before its start
LEAD = 20  # seconds between the booking and its start: planned, reserved (Slurm), armed (local)


@dataclass(frozen=True)
class Side:
    """One daemon and how to reach what it starts."""

    name: str
    daemon: daemon_kit.DaemonProcess
    calendar: caldav.Calendar
    state: Path
    address: Callable[[str], str]  # the host of an ssh line -> the address to log in at
    idle: Callable[[], bool]  # nothing of a cancelled booking left (job, reservation)


def given(folder: Path, user: str) -> Path:
    account = pwd.getpwnam(user)
    folder.mkdir(exist_ok=True)
    os.chown(folder, account.pw_uid, account.pw_gid)
    return folder


def state_port(path: Path, booking_id: str) -> int | None:
    """The booking's port in the daemon's state database, opened read-only (the daemon owns it)."""
    if not path.exists():
        return None
    try:
        with sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=1) as db:
            row = db.execute("SELECT port FROM ports WHERE booking_id = ?", (booking_id,)).fetchone()
    except sqlite3.Error:
        return None
    return int(row[0]) if row else None


def logs_in(address: str, port: int, key: paramiko.PKey) -> bool:
    try:
        with login(address, port, key) as client:
            return run(client, "id -un").split() == ["alice"]
    except (OSError, paramiko.SSHException, EOFError):
        return False


def measure(side: Side, booking_id: str, key: paramiko.PKey, user: str) -> tuple[float, float, bool]:
    """Seconds from DTSTART to (a) the running ssh line in the event and (b) the first login, and
    whether the event gave an ssh line 2 s before the start (armed); then the booking is cancelled."""
    start = (datetime.now(UTC) + timedelta(seconds=LEAD + 1)).replace(microsecond=0)
    daemon_kit.book(side.calendar, booking_id, user="alice", start=start, end=start + timedelta(hours=1))
    line: dict[str, tuple[float, str, int]] = {}
    deadline = start + timedelta(seconds=180)

    def watch_event() -> None:
        while datetime.now(UTC) < deadline:
            found = SSH_LINE.search(daemon_kit.description(side.calendar, booking_id))
            if found:
                line["seen"] = ((datetime.now(UTC) - start).total_seconds(), found.group(2), int(found.group(1)))
                return
            time.sleep(POLL)

    while datetime.now(UTC) < start - timedelta(seconds=2):
        time.sleep(0.1)
    early = side.address("")  # the node its reservation holds (Slurm), read once before the start
    ahead = AHEAD in daemon_kit.description(side.calendar, booking_id)
    if not early:
        print(f"  {side.name} {booking_id}: no reservation 2 s before its start", flush=True)
    while datetime.now(UTC) < start:
        time.sleep(0.005)
    watcher = threading.Thread(target=watch_event, daemon=True)
    watcher.start()
    port, address, login_at = None, None, None
    while login_at is None and datetime.now(UTC) < deadline:
        if port is None:
            port = state_port(side.state, booking_id)
        if "seen" in line:
            _, host, port_in_line = line["seen"]
            assert port in (None, port_in_line), f"{booking_id}: state says port {port}, the event {port_in_line}"
            port, address = port_in_line, side.address(host)
        elif port is not None and early:
            address = early
        if port is not None and address is not None and logs_in(address, port, key):
            login_at = (datetime.now(UTC) - start).total_seconds()
            break
        time.sleep(POLL)
    watcher.join(timeout=max(0.0, (deadline - datetime.now(UTC)).total_seconds()))
    if login_at is None or "seen" not in line:
        raise SystemExit(f"{side.name} {booking_id}: no ssh line or login within 180 s\n{side.daemon.tail()}")
    side.calendar.event_by_uid(booking_id).delete()
    names = [container_name(booking_id), *(container_name(f"{booking_id}@{n}") for n in ("node1", "node2"))]
    daemon_kit.wait_for(f"{booking_id}'s container gone", lambda: all(podman_as(
        user, "container", "exists", name) == 1 for name in names), timeout=90, interval=0.5, daemon=side.daemon)
    daemon_kit.wait_for(f"{booking_id}'s job and reservation gone", side.idle, timeout=60, interval=0.5,
                        daemon=side.daemon)
    return line["seen"][0], login_at, ahead


def slurm_side(cluster: slurm_kit.Cluster, radicale: servers.CalendarServer, key: paramiko.PKey) -> Side:
    folder = given(cluster.root / "daemon", cluster.user)
    given(folder / "shared", cluster.user)
    calendar = radicale.new_calendar()
    daemon = daemon_kit.DaemonProcess(slurm_config(folder, cluster, str(calendar.url), key), user=cluster.user,
                                      tree=REPO).start()
    address = {n.name: n.address for n in cluster.nodes}

    def node(host: str) -> str:
        if host:
            return address[host]
        held = list(reservations(cluster).values())  # before the ssh line: the node the plan reserved
        return address[held[0].nodes[0]] if len(held) == 1 else ""

    return Side("slurm", daemon, calendar, folder / "state" / "state.sqlite", node,
                lambda: not jobs(cluster) and not reservations(cluster))


def local_side(root: Path, user: str, radicale: servers.CalendarServer, key: paramiko.PKey) -> Side:
    folder = given(root / "local", user)
    data = given(Path(tempfile.mkdtemp(prefix="bench-", dir=safe_data.MOUNT)), user)
    (folder / "data").symlink_to(data)
    calendar = radicale.new_calendar()
    config = daemon_kit.write_config(folder, str(calendar.url), keys={"alice": key}, poll_seconds=2)
    config.chmod(0o644)
    daemon = daemon_kit.DaemonProcess(config, user=user, tree=REPO).start()
    return Side("local", daemon, calendar, folder / "state" / "state.sqlite", lambda host: "127.0.0.1",
                lambda: True)


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    key = new_key()
    figures: dict[str, list[tuple[float, float, bool]]] = {"slurm": [], "local": []}
    ids = [f"bench-{kind}{n}@gpubook" for n in range(rounds) for kind in figures]
    print(f"machine: {MACHINE}; {platform.platform()}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}")
    print("both daemons run at the same time for the whole run (each its own calendar); each round books on "
          "the Slurm daemon, then on the local one, one after the other (never two bookings at once)")
    print("the local daemon arms the container ahead of the start (its SSH answers at the start); the Slurm "
          "daemon submits the job at the start (sbatch, scheduling, srun, the container started on the node)",
          flush=True)
    with slurm_kit.running() as cluster, servers.running(servers.radicale) as radicale:
        sides: list[Side] = []
        data_link = cluster.root / "local" / "data"
        try:
            sides = [slurm_side(cluster, radicale, key), local_side(cluster.root, cluster.user, radicale, key)]
            time.sleep(5)  # both daemons through their first pass
            for index in range(rounds):
                for side in sides:
                    figures[side.name].append(measure(side, f"bench-{side.name}{index}@gpubook", key,
                                                      cluster.user))
                print(f"round {index + 1}: " + "; ".join(
                    f"{name}: running ssh line {a:.2f} s, login + id -un {b:.2f} s"
                    + (" (an ssh line in the event before the start)" if ahead else "")
                    for name, (a, b, ahead) in ((n, f[-1]) for n, f in figures.items())), flush=True)
        finally:
            for side in sides:
                side.daemon.stop()
            for booking_id in ids:  # a Slurm step's container is named with its node
                for name in (booking_id, f"{booking_id}@node1", f"{booking_id}@node2"):
                    podman_as(cluster.user, "rm", "--force", "--time=0", container_name(name))
            if data_link.is_symlink():
                safe_data.remove(data_link.resolve())
    for name, pairs in figures.items():
        print(f"median ({rounds} rounds), {name}: DTSTART to the running ssh line "
              f"{statistics.median(a for a, _, _ in pairs):.2f} s, "
              f"to login + id -un {statistics.median(b for _, b, _ in pairs):.2f} s")
    print(f"load at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
