"""The Slurm backend's pure parts: scontrol's listings read, the reservation diff, its argv."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from gpubook.runtime.errors import ConfigError
from gpubook.scheduler import daemon
from gpubook.scheduler.config import parse as parse_config
from gpubook.scheduler.hosts.slurm import SlurmCluster, parse, sync
from tests.kits.slurm_jobs_kit import NOW, accepted, booking

PREFIX = "gpubook-"

NODE_LINES = (
    "NodeName=node1 Arch=x86_64 CoresPerSocket=1  CPUAlloc=0 CPUEfctv=2 CPUTot=2 CPULoad=0.58 "
    "AvailableFeatures=(null) ActiveFeatures=(null) Gres=gpu:a100:4(S:0-1) NodeAddr=10.126.1.2 NodeHostName=node1 "
    "Version=22.05.8 OS=Linux 6.18.44-fc-v595 #1 SMP PREEMPT_DYNAMIC @0  RealMemory=1000 AllocMem=0 FreeMem=22426 "
    "Sockets=2 Boards=1 State=IDLE ThreadsPerCore=1 TmpDisk=0 Weight=1 Owner=N/A MCS_label=N/A Partitions=gpu,all\n"
    "NodeName=node2 Arch=x86_64 Gres=gpu:a100:4,gpu:v100:2 OS=Linux 6.1 #1 SMP State=IDLE+DRAIN "
    "Partitions=gpu Reason=gres/gpu count reported lower than configured (0 < 4) [slurm@2026-11-22T23:56:00]\n"
    "NodeName=login1 Gres=(null) State=MIXED Partitions=login\n"
    "NodeName=node3 Gres=gpu:8 State=DOWN* Partitions=gpu\n"
)
RESERVATION_LINES = (
    "ReservationName=gpubook-b1-0123456789 StartTime=2026-11-23T09:00:00 EndTime=2026-11-23T10:00:00 "
    "Duration=01:00:00 Nodes=node[1-2,07] NodeCnt=3 CoreCnt=2 Features=(null) PartitionName=(null) "
    "Flags=OVERLAP,SPEC_NODES TRES=cpu=2 Users=gpubook Groups=(null) Accounts=(null) Licenses=(null) "
    "State=INACTIVE BurstBuffer=(null) Watts=n/a MaxStartDelay=(null)\n"
)


def test_nodes_are_read_with_their_gpus_partitions_and_whether_they_take_work() -> None:
    nodes = {n.name: n for n in parse.nodes(NODE_LINES)}
    assert nodes["node1"].gpus == 4 and nodes["node1"].gpu_types == ("a100",)
    assert nodes["node1"].partitions == ("gpu", "all") and nodes["node1"].usable
    assert nodes["node2"].gpus == 6 and nodes["node2"].gpu_types == ("a100", "v100")
    assert not nodes["node2"].usable  # drained
    assert nodes["login1"].gpus == 0
    assert not nodes["node3"].usable  # not responding (the *)


def test_reservations_are_read_with_expanded_nodes_and_utc_times() -> None:
    (found,) = parse.reservations(RESERVATION_LINES)
    assert found.nodes == ("node07", "node1", "node2")
    assert found.start == datetime(2026, 11, 23, 9, tzinfo=UTC)
    assert found.users == ("gpubook",) and "OVERLAP" in found.flags


def test_hostlists_expand_ranges_padding_and_plain_names() -> None:
    assert parse.expand_hostlist("gpu[01-03,10],login1,rack[1-2]n[1-2]") == [
        "gpu01", "gpu02", "gpu03", "gpu10", "login1", "rack1n1", "rack1n2", "rack2n1", "rack2n2"]
    assert parse.expand_hostlist("(null)") == []


def test_a_new_booking_is_created_and_a_second_sync_changes_nothing() -> None:
    want = sync.wanted([accepted(booking())], prefix=PREFIX, users=["gpubook"])
    (change,) = sync.diff(want, [], prefix=PREFIX, now=NOW)
    assert change.kind == "create"
    assert change.argv == ("create", "reservation", f"ReservationName={want[0].name}",
                           "StartTime=2026-11-23T09:00:00", "EndTime=2026-11-23T10:00:00", "Nodes=node1",
                           "Users=gpubook", "Flags=OVERLAP")
    held = parse.Reservation(name=want[0].name, nodes=("node1",), start=want[0].start, end=want[0].end,
                             users=("gpubook",), flags=("OVERLAP", "SPEC_NODES"), state="INACTIVE")
    assert sync.diff(want, [held], prefix=PREFIX, now=NOW) == []


def test_an_edit_updates_only_what_moved_and_a_cancel_deletes() -> None:
    first = sync.wanted([accepted(booking())], prefix=PREFIX, users=["gpubook"])[0]
    held = parse.Reservation(name=first.name, nodes=("node1",), start=first.start, end=first.end,
                             users=("gpubook",), flags=(), state="INACTIVE")
    moved = sync.wanted([accepted(booking(hours=3), host="node2")], prefix=PREFIX, users=["gpubook"])
    (change,) = sync.diff(moved, [held], prefix=PREFIX, now=NOW)
    assert change.argv == ("update", f"ReservationName={first.name}", "EndTime=2026-11-23T12:00:00", "Nodes=node2")
    (gone,) = sync.diff([], [held], prefix=PREFIX, now=NOW)
    assert gone.argv == ("delete", f"ReservationName={first.name}")


def test_reservations_without_the_prefix_are_never_touched() -> None:
    theirs = parse.Reservation(name="maintenance", nodes=("node1",), start=NOW, end=NOW + timedelta(hours=1),
                               users=("root",), flags=("MAINT",), state="ACTIVE")
    assert sync.diff([], [theirs], prefix=PREFIX, now=NOW) == []


def test_an_active_reservation_keeps_its_start() -> None:
    started = booking(start=NOW - timedelta(minutes=10))
    want = sync.wanted([accepted(started)], prefix=PREFIX, users=["gpubook"])
    (create,) = sync.diff(want, [], prefix=PREFIX, now=NOW)
    assert "StartTime=now" in create.argv  # Slurm takes no start in the past
    held = parse.Reservation(name=want[0].name, nodes=("node1",), start=NOW, end=want[0].end,
                             users=("gpubook",), flags=(), state="ACTIVE")
    assert sync.diff(want, [held], prefix=PREFIX, now=NOW + timedelta(seconds=30)) == []


def test_hostile_booking_ids_become_one_plain_reservation_name() -> None:
    """A UID is free calendar text: it must not add keys (Users=, Flags=, Nodes=) to the command."""
    hostile = "x Users=root Flags=MAINT,IGNORE_JOBS Nodes=ALL\tReservationName=other"
    want = sync.wanted([accepted(booking(hostile))], prefix=PREFIX, users=["gpubook"])
    (change,) = sync.diff(want, [], prefix=PREFIX, now=NOW)
    name = want[0].name
    assert re.fullmatch(r"gpubook-[A-Za-z0-9_.-]+", name) and "=" not in name and " " not in name
    assert [a.split("=")[0] for a in change.argv[2:]] == ["ReservationName", "StartTime", "EndTime", "Nodes",
                                                          "Users", "Flags"]
    assert sync.reservation_name(hostile, prefix=PREFIX) != sync.reservation_name(hostile + " ", prefix=PREFIX)


BASE = {"calendar": [{"url": "http://127.0.0.1:5232/lab/", "gpus": "all"}]}


def test_the_backend_section_is_read_and_checked(tmp_path: Path) -> None:
    config = parse_config({**BASE, "backend": {"kind": "slurm", "partition": "gpu", "reservation_prefix": "lab1-"}},
                   tmp_path / "gpubook.toml")
    cluster = SlurmCluster.from_config(config.backend)
    assert (cluster.prefix, cluster.partition) == ("lab1-", "gpu")
    assert parse_config(BASE, tmp_path / "gpubook.toml").backend.kind == "local"
    with pytest.raises(ConfigError) as raised:
        parse_config({**BASE, "backend": {"kind": "pbs", "reservation_prefix": "a b"}}, tmp_path / "gpubook.toml")
    assert "backend.kind" in str(raised.value) and "backend.reservation_prefix" in str(raised.value)


def test_the_daemon_refuses_a_slurm_backend_without_shared_storage_in_one_sentence(tmp_path: Path) -> None:
    config = parse_config({**BASE, "backend": {"kind": "slurm"}}, tmp_path / "gpubook.toml")
    with pytest.raises(ConfigError, match="backend.shared_dir: not set; the Slurm backend needs a folder that "
                                          "every node and the daemon see at the same path"):
        daemon._runnable(config)
    daemon._runnable(parse_config({**BASE, "backend": {"kind": "slurm", "shared_dir": str(tmp_path)}},
                                  tmp_path / "gpubook.toml"))
    daemon._runnable(parse_config(BASE, tmp_path / "gpubook.toml"))


def test_a_silent_node_is_told_from_a_down_one() -> None:
    def node(state: str) -> parse.Node:
        return parse.Node(name="n", gpus=4, gpu_types=(), partitions=("gpu",), state=state)

    assert [node(s).silent for s in ("IDLE*", "MIXED*", "UNKNOWN*", "IDLE", "DOWN*", "IDLE+DRAIN*", "FAIL*")] == [
        True, True, True, False, False, False, False]
    assert not node("IDLE*").usable


def test_a_cancelled_bookings_reservation_stays_while_its_job_runs() -> None:
    held = [parse.Reservation(name="gpubook-gone-1", nodes=("node1",), start=NOW, end=NOW + timedelta(hours=1),
                        users=("gpubook",), flags=("OVERLAP",), state="ACTIVE")]
    assert sync.diff([], held, prefix="gpubook-", now=NOW, keep={"gpubook-gone-1"}) == []
    assert [c.kind for c in sync.diff([], held, prefix="gpubook-", now=NOW)] == ["delete"]
