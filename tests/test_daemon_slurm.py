"""The daemon with `[backend] kind = "slurm"` on a real Slurm 22.05 cluster (tests/kits/slurm_kit.py: two
slurmd nodes of 4 GPUs in their own network namespaces, slurmctld as the unprivileged account the
daemon runs as), real Radicale and rootless podman on the nodes: bookings become reservations on
the nodes the plan chose, their jobs start at their start, bookers log in on their nodes, a
two-node booking's containers reach each other, the booker's data folders on the shared storage are
bound (input read-only, output written through), an edit moves a reservation, a cancel deletes it,
a kill -9 of the daemon adopts jobs and reservations, and a stopped slurmctld is said, not
mistaken for dead bookings."""

from __future__ import annotations

import json
import os
import pwd
import re
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import caldav
import pytest

from gpubook.runtime.engines import container_name
from gpubook.scheduler.core import free
from gpubook.scheduler.hosts.slurm import parse
from tests.kits import safe_data, slurm_kit
from tests.kits.daemon_kit import DaemonProcess, book, cli, description, wait_for
from tests.kits.engine_suite import new_key
from tests.kits.slurm_jobs_kit import REPO, jobs, login, reservations, run, write_config
from tests.kits.slurm_kit import podman_as

pytestmark = [pytest.mark.slurm, pytest.mark.podman, pytest.mark.daemon,
              pytest.mark.skipif(slurm_kit.available() is not None, reason=str(slurm_kit.available()))]
SSH_LINE = re.compile(r"ssh -p (\d+) alice@(node\d)")


@pytest.fixture
def daemon_dir(cluster: slurm_kit.Cluster) -> Path:
    """The daemon's folder, its account's (the test runs as root, the daemon as the Slurm user)."""
    account = pwd.getpwnam(cluster.user)
    folder = cluster.root / "daemon"
    for path in (folder, folder / "shared"):
        path.mkdir()
        os.chown(path, account.pw_uid, account.pw_gid)
    return folder


@pytest.fixture
def data_root(cluster: slurm_kit.Cluster) -> Iterator[Path]:
    """The bookers' data folders on "shared storage" (the nodes here share this machine's disk),
    on the tests' nosuid,nodev mount, given to the daemon's account."""
    account = pwd.getpwnam(cluster.user)
    with safe_data.data_root() as folder:
        os.chown(folder, account.pw_uid, account.pw_gid)
        yield folder


def nodes_of(held: parse.Reservation | None) -> tuple[str, ...]:
    return held.nodes if held is not None else ()


def test_bookings_run_on_the_cluster_through_slurm(cluster: slurm_kit.Cluster, daemon_dir: Path, radicale,
                                                   data_root: Path, account_image: None) -> None:
    calendar: caldav.Calendar = radicale.new_calendar()
    key = new_key()
    config = write_config(daemon_dir, cluster, str(calendar.url), key, data_root)
    address = {n.name: n.address for n in cluster.nodes}
    daemon = DaemonProcess(config, user=cluster.user, tree=REPO).start()
    leftover = [container_name(f"{b}@test@{n}") for b in ("one", "pair") for n in address]
    try:
        now = datetime.now(UTC).replace(microsecond=0)
        start, end = now + timedelta(seconds=25), now + timedelta(hours=1)
        book(calendar, "one@test", user="alice", start=start, end=end, gpus="1")
        book(calendar, "pair@test", user="alice", start=start, end=end, gpus="6", description="nodes: 2\n")
        book(calendar, "later@test", user="alice", start=now + timedelta(hours=2), end=now + timedelta(hours=3))
        # Before the start: each booking's reservation on the nodes the plan chose (node1 first).
        held = wait_for("three reservations", lambda: (r := reservations(cluster)) and len(r) == 3 and r,
                        timeout=60, daemon=daemon)
        by_booking = {name.split("-")[1]: r for name, r in held.items()}
        assert {k: v.nodes for k, v in by_booking.items()} == {
            "one": ("node1",), "pair": ("node1", "node2"), "later": ("node1",)}, held
        assert jobs(cluster) == {}  # nothing runs before its start
        # A whole node asked for while no node has 4 GPUs free: refused, with the next slots that fit; and
        # `gpubook free` (asked of the daemon) shows that very time, on that node, to the minute: one plan.
        book(calendar, "solo@test", user="alice", start=start, end=end, gpus="4")
        reason = wait_for("solo's refusal with its offer", lambda: (t := description(calendar, "solo@test"))
                          and "4 GPUs on node" in t and t, timeout=60, daemon=daemon)
        asked = cli(config, "free", "--gpus", "4", "--hours", "1", "--json", user=cluster.user, tree=REPO)
        assert asked.returncode == 0, asked.stderr
        after = [s for s in json.loads(asked.stdout)["slots"] if datetime.fromisoformat(s["start"]) >= start]
        assert after and datetime.fromisoformat(after[0]["start"]) == end, (asked.stdout, reason)
        first = free.Slot(start=end, end=datetime.fromisoformat(after[0]["end"]) if after[0]["end"] else None,
                          placement=tuple((host, tuple(gpus)) for host, gpus in after[0]["placement"]))
        offered = free.describe([first], zone=UTC, now=datetime.now(UTC), one_host=False)
        assert offered.removesuffix(" (UTC)") in " ".join(reason.split()), (offered, reason)
        # At the start: the jobs run, the events give each node's ssh line.
        one = wait_for("one's ssh line", lambda: SSH_LINE.search(description(calendar, "one@test")),
                       timeout=90, daemon=daemon)
        assert one.group(2) == "node1"
        pair_text = wait_for("pair's ssh lines", lambda: (t := description(calendar, "pair@test"))
                             and "also on node2" in t and t, timeout=90, daemon=daemon)
        first = SSH_LINE.search(pair_text)
        assert first is not None and first.group(2) == "node1"
        assert f"also on node2: ssh -p {first.group(1)} alice@node2" in pair_text
        assert "hostfile: /etc/gpubook/hostfile" in pair_text
        with login(address["node1"], int(one.group(1)), key) as client:
            assert run(client, "id -un").split() == ["alice"]
            # The booker's folders on the shared storage: output written through, input read-only.
            assert run(client, "echo trained > /data/output/model.txt && echo ok") == "ok\n"
            assert run(client, "touch /data/input/x 2>&1 || echo refused").endswith("refused\n")
        assert (data_root / "alice" / "output" / "model.txt").read_text() == "trained\n"
        assert not (data_root / "alice" / "input" / "x").exists()
        with login(address["node1"], int(first.group(1)), key) as client:
            hostfile = run(client, "cat /etc/gpubook/hostfile").splitlines()
            assert hostfile == [f"{address['node1']} slots=3", f"{address['node2']} slots=3"]
            reach = f"bash -c 'exec 3<>/dev/tcp/{address['node2']}/{first.group(1)}; head -c 7 <&3'"
            assert run(client, reach) == "SSH-2.0"  # node1's container reaches node2's at the hostfile's address
        running = jobs(cluster)
        assert len(running) == 2
        # `gpubook status` (as the daemon's account) lists each node and what runs there.
        shown = wait_for("both bookings in gpubook status", lambda: (out := cli(
            config, "status", user=cluster.user, tree=REPO).stdout) and "pair@test" in out and out,
            timeout=30, daemon=daemon)
        node1_part = shown[shown.index("Host node1"):shown.index("Host node2")]
        assert "one@test" in node1_part and "pair@test" in node1_part, shown
        # An edit moves a reservation; kill -9 of the daemon: the new one adopts jobs and reservations.
        daemon.kill()
        later = calendar.event_by_uid("later@test")
        for name, moment in (("DTSTART", now + timedelta(hours=4)), ("DTEND", now + timedelta(hours=5))):
            later.icalendar_component.pop(name)
            later.icalendar_component.add(name, moment)
        later.save()
        daemon = DaemonProcess(config, user=cluster.user, tree=REPO).start()
        moved = wait_for("the moved reservation", lambda: any(
            r.start == now + timedelta(hours=4) for r in reservations(cluster).values()), timeout=60, daemon=daemon)
        assert moved and len(reservations(cluster)) == 3
        assert jobs(cluster) == running  # the same jobs: nothing started twice
        with login(address["node1"], int(one.group(1)), key) as client:
            assert run(client, "id -un").split() == ["alice"]
        # slurmctld stopped: said, and nothing is mistaken for dead; back: the bookings go on.
        cluster.stop_slurmctld()
        wait_for("the controller's outage in the log", lambda: "the Slurm controller does not answer" in daemon.tail(),
                 timeout=60, daemon=daemon)
        cluster.start_slurmctld()
        wait_for("a pass after the outage", lambda: jobs(cluster) == running, timeout=60, daemon=daemon)
        # A cancel (the event deleted) deletes the reservation and ends the job; the container goes.
        calendar.event_by_uid("later@test").delete()
        calendar.event_by_uid("one@test").delete()
        wait_for("one's job and both reservations gone", lambda: len(jobs(cluster)) == 1
                 and len(reservations(cluster)) == 1, timeout=60, daemon=daemon)
        wait_for("one's container removed", lambda: podman_as(cluster.user, "container", "exists",
                                                             container_name("one@test@node1")) == 1, timeout=30)
        # An admin's `gpubook stop` (as the daemon's account) ends the two-node booking's job on both nodes.
        stopped = cli(config, "stop", "pair@test", user=cluster.user, tree=REPO)
        assert stopped.returncode == 0, stopped.stderr
        wait_for("pair's job gone", lambda: jobs(cluster) == {}, timeout=60, daemon=daemon)
        wait_for("the stop in the event", lambda: "stopped early by an admin" in description(calendar, "pair@test"),
                 timeout=30, daemon=daemon)
        assert "died" not in daemon.tail()
        # The warnings before the stops reached the containers (through a step of each booking's job).
        assert "warned: gpubook: this booking was removed from the calendar" in daemon.tail()
        assert [line for line in daemon.log.read_text().splitlines() if "inside the container failed" in line] == []
    finally:
        daemon.stop()
        for name in leftover:
            podman_as(cluster.user, "rm", "--force", "--time=0", name)


def test_a_failed_node_ends_its_job_the_booking_starts_again_on_another_and_ends_at_its_end(
        cluster: slurm_kit.Cluster, daemon_dir: Path, radicale, data_root: Path,
        account_image: None) -> None:
    calendar: caldav.Calendar = radicale.new_calendar()
    key = new_key()
    config = write_config(daemon_dir, cluster, str(calendar.url), key, data_root)
    address = {n.name: n.address for n in cluster.nodes}
    daemon = DaemonProcess(config, user=cluster.user, tree=REPO).start()
    try:
        now = datetime.now(UTC).replace(microsecond=0)
        end = now + timedelta(seconds=100)  # short: its end is seen too
        book(calendar, "moved@test", user="alice", start=now + timedelta(seconds=15), end=end, gpus="2")
        first = wait_for("the ssh line", lambda: SSH_LINE.search(description(calendar, "moved@test")),
                         timeout=90, daemon=daemon)
        assert first.group(2) == "node1"
        (job,) = jobs(cluster).values()
        # Slurm takes node1 out (as on a node failure: DOWN ends its jobs; drained, it stays out): the job
        # ends; gpubook sees the booking die, the plan moves it to node2 (its reservation too) and it
        # starts again there.
        cluster.scontrol("update", "NodeName=node1", "State=DOWN", "Reason=failed")
        cluster.scontrol("update", "NodeName=node1", "State=DRAIN", "Reason=failed")  # not back on its own
        again = wait_for("the ssh line on node2", lambda: (m := SSH_LINE.search(description(calendar, "moved@test")))
                         and m.group(2) == "node2" and m, timeout=120, daemon=daemon)
        assert nodes_of(next(iter(reservations(cluster).values()))) == ("node2",)
        assert "after its container died" in description(calendar, "moved@test")  # the event says why
        assert list(jobs(cluster).values()) != [job]  # a new job: the old one ended with its node
        with login(address["node2"], int(again.group(1)), key) as client:
            assert run(client, "id -un").split() == ["alice"]
        assert "died" in daemon.tail()
        # At the booking's end: warned, the job ends, the container goes, the event says "ended".
        wait_for("the end in the event", lambda: "GPU-hours, stopped" in description(calendar, "moved@test"),
                 timeout=(end - datetime.now(UTC)).total_seconds() + 60, daemon=daemon)
        assert datetime.now(UTC) >= end
        wait_for("the job gone", lambda: jobs(cluster) == {}, timeout=30, daemon=daemon)
        wait_for("its container removed (the step stops it as the job completes)", lambda: podman_as(
            cluster.user, "container", "exists", container_name("moved@test@node2")) == 1, timeout=30, daemon=daemon)
        assert "warned: gpubook: this booking ends at" in daemon.log.read_text()
    finally:
        daemon.stop()
        for node in ("node1", "node2"):  # node1's: its step was ended with its node, not always its container
            podman_as(cluster.user, "rm", "--force", "--time=0", container_name(f"moved@test@{node}"))
