"""Processes on GPUs outside the bookings' containers, with real processes: a "container" here is a
real PID namespace (unshare, run as root), a host process is a real `sleep`; only NVML's list is
given by the test (an NvmlView). The podman and daemon side is tests/test_daemon_foreign.py."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from gpubook.runtime.engines import ContainerInfo
from gpubook.runtime.nvidia import processes
from gpubook.runtime.nvidia.model import Gpu, GpuProcess
from gpubook.runtime.nvidia.nvml import NvmlView
from gpubook.scheduler.hosts.foreign import ForeignWatch
from gpubook.scheduler.outbox import foreign
from gpubook.scheduler.outbox.status import GpuSummary, HostStatus, Status
from gpubook.scheduler.state import State

NOW = datetime(2026, 11, 23, 14, 5, tzinfo=UTC)
needs_root = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                                reason="a PID namespace of its own needs root and unshare")


def _child_of(pid: int) -> int:
    for _ in range(100):
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        if children:
            return int(children[0])
        time.sleep(0.05)
    raise AssertionError(f"pid {pid} has no child")


@pytest.fixture
def namespace() -> Iterator[tuple[ContainerInfo, int]]:
    """A booking's "container": a real PID namespace; (its info, a second process in it)."""
    outer = subprocess.Popen(["unshare", "--pid", "--fork", "sh", "-c", "sleep 300 & sleep 300"])
    init = 0
    try:
        init = _child_of(outer.pid)  # the namespace's pid 1 (sh)
        inner = _child_of(init)
        info = ContainerInfo(name="gpubook-own", id="a" * 64, state="running", image="i", booking_id="own@test",
                             user="alice", gpus=(0,), end=None, spec_hash="", port=2201, template="t", pid=init)
        yield info, inner
    finally:
        if init:
            os.kill(init, signal.SIGKILL)  # its namespace's processes go with it
        outer.kill()
        outer.wait()


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    process = subprocess.Popen(["sleep", "300"])
    yield process
    process.kill()
    process.wait()


def view(*gpus: list[int]) -> NvmlView:
    return NvmlView("550.54", tuple(Gpu(index=i, uuid=f"GPU-{i}", name="Fake",
                                        processes=tuple(GpuProcess(pid=p, name=None, used_memory_mib=1) for p in pids))
                                    for i, pids in enumerate(gpus)))


@needs_root
def test_a_process_in_the_namespace_is_the_containers_and_a_host_process_none(namespace, sleeper) -> None:
    info, inner = namespace
    attribution = processes.Attribution([info])
    assert attribution.container_of(inner) == "gpubook-own"
    host = attribution.process(sleeper.pid)
    assert host.container is None and host.command == "sleep" and host.user == "root" and host.started > 0


def test_a_cgroup_named_after_a_container_counts_only_outside_other_users_delegations(tmp_path: Path) -> None:
    """Hostile: anyone may make a cgroup named libpod-ID.scope under their own user@UID.service; where
    namespaces cannot be read (Docker), such a process must not pass for the container's."""
    ident = "c" * 64
    info = ContainerInfo(name="gpubook-b", id=ident, state="running", image="i", booking_id="b@test", user="bob",
                         gpus=(0,), end=None, spec_hash="", port=2201, template="t", pid=0)  # its namespace unread
    proc = tmp_path / "proc"
    (proc / "self" / "ns").mkdir(parents=True)
    (proc / "self" / "ns" / "pid").symlink_to("pid:[1]")
    for pid, path in ((10, f"/user.slice/user-1002.slice/user@1002.service/app.slice/libpod-{ident}.scope"),
                      (11, f"/user.slice/user-1001.slice/user@1001.service/user.slice/libpod-{ident}.scope/container"),
                      (12, f"/system.slice/docker-{ident}.scope"), (13, "/user.slice/user-1002.slice/session-3.scope")):
        (proc / str(pid)).mkdir()
        (proc / str(pid) / "cgroup").write_text(f"0::{path}\n")
    attribution = processes.Attribution([info], own_uid=1001, proc=proc)
    assert [attribution.container_of(pid) for pid in (10, 11, 12, 13, 14)] == [None, "gpubook-b", "gpubook-b",
                                                                               None, None]


@needs_root
def test_a_host_process_on_a_booked_gpu_is_reported_and_the_bookings_own_never(tmp_path: Path, namespace,
                                                                               sleeper) -> None:
    info, inner = namespace
    changes: list[int] = []
    with State(tmp_path / "state.sqlite") as state:
        readings = [view([info.pid, inner, sleeper.pid], [os.getpid()])]
        watch = ForeignWatch(state=state, host="local", running=lambda: [info], read=lambda: readings[-1],
                             on_change=lambda: changes.append(1))
        first = watch(now=NOW)
        assert {(r.gpu, r.pid, r.booking_id) for r in first.changed} == {(0, sleeper.pid, "own@test"),
                                                                         (1, os.getpid(), None)}
        assert changes == [1]
        assert watch(now=NOW + timedelta(seconds=30)).changed == () and changes == [1]  # seen again: no news
        rows = state.foreign()
        assert rows[0].last_seen == NOW + timedelta(seconds=30) and rows[0].first_seen == NOW
        lines = foreign.event_lines(state.foreign(current=False, booking_ids=["own@test"]), timezone="UTC")
        assert lines == {"own@test": [f"foreign: GPU 0 is also used by pid {sleeper.pid} (sleep, root) since 14:05; "
                                      "not this booking's"]}
        assert [n.kind for n in state.pending_notices()] == ["foreign"]
        assert any(f"pid {sleeper.pid} (sleep, root) uses the GPU outside the booking's container" in e.message
                   for e in state.events(booking_id="own@test"))
        readings.append(view([info.pid, inner], []))
        ended = watch(now=NOW + timedelta(seconds=60))
        assert {r.pid for r in ended.changed} == {sleeper.pid, os.getpid()} and changes == [1, 1]
        assert state.foreign() == []
        assert foreign.event_lines(state.foreign(current=False, booking_ids=["own@test"]), timezone="UTC") == {
            "own@test": [f"foreign: GPU 0 was also used by pid {sleeper.pid} (sleep, root) from 14:05 to 14:06; "
                         "not this booking's"]}


@needs_root
def test_stop_mode_stops_the_outside_process_after_the_grace_and_never_the_bookings_own(tmp_path: Path, namespace,
                                                                                       sleeper) -> None:
    info, inner = namespace
    with State(tmp_path / "state.sqlite") as state:
        watch = ForeignWatch(state=state, host="local", running=lambda: [info], mode="stop",
                             grace=timedelta(minutes=2), read=lambda: view([info.pid, inner, sleeper.pid]))
        watch(now=NOW)
        assert state.foreign()[0].action == "due 2026-11-23T14:07:00+00:00"
        watch(now=NOW + timedelta(minutes=1))
        assert sleeper.poll() is None  # within the grace: still there
        watch(now=NOW + timedelta(minutes=2))
        assert sleeper.wait(timeout=10) == -signal.SIGTERM
        assert state.foreign()[0].action == "stopped 2026-11-23T14:07:00+00:00"
        for _ in range(3):
            watch(now=NOW + timedelta(minutes=10))
        os.kill(inner, 0)  # the booking's own process: never reported, never signalled
        os.kill(info.pid, 0)
        assert all(row.pid == sleeper.pid for row in state.foreign(current=False, booking_ids=["own@test"]))


@needs_root
def test_stop_mode_kills_a_process_that_ignores_sigterm(tmp_path: Path, namespace, monkeypatch) -> None:
    from gpubook.scheduler.hosts import foreign as watch_module

    monkeypatch.setattr(watch_module, "KILL_AFTER", 0.5)
    stubborn = subprocess.Popen(["sh", "-c", "trap '' TERM; while :; do sleep 0.1; done"])
    info, _ = namespace
    try:
        with State(tmp_path / "state.sqlite") as state:
            watch = ForeignWatch(state=state, host="local", running=lambda: [info], mode="stop",
                                 grace=timedelta(0), read=lambda: view([stubborn.pid]))
            time.sleep(0.2)  # its trap set
            watch(now=NOW)
            watch(now=NOW)
            assert stubborn.wait(timeout=10) == -signal.SIGKILL
    finally:
        stubborn.kill()
        stubborn.wait()


def test_status_and_metrics_show_the_sightings() -> None:
    from gpubook.scheduler.outbox import metrics

    item = {"host": "local", "gpu": 0, "pid": 4242, "user": "carol", "command": "python3", "booking": "b@test",
            "container": None, "since": NOW.isoformat(), "action": "cannot: not hers"}
    report = Status(hosts=(HostStatus(name="local", gpus=GpuSummary(source="nvml", count=2)),), foreign=(item,))
    again = Status.from_json(report.to_json())
    assert again.foreign == (item,)
    assert "  GPU 0 (booking b@test): pid 4242 (python3, carol) since 14:05; gpubook cannot stop it: not hers" in \
        again.render("UTC")
    family = metrics._foreign_family(again, host_name="gpu1")
    assert {(s.labels["host"], s.labels["gpu"], s.value) for s in family.samples} == {
        ("gpu1", "0", 1), ("gpu1", "1", 0)}


@needs_root
def test_a_pid_reused_since_the_sighting_is_never_signalled(tmp_path: Path, namespace, sleeper) -> None:
    """Hostile to a stop by pid alone: the row's start time no longer matches the process now on that pid."""
    info, _ = namespace
    with State(tmp_path / "state.sqlite") as state:
        watch = ForeignWatch(state=state, host="local", running=lambda: [info], mode="stop", grace=timedelta(0),
                             read=lambda: view([sleeper.pid]))
        row = watch.sightings(view([sleeper.pid]), now=NOW)[0]
        action = watch.stop(replace(row, started=row.started - 1), now=NOW)
        assert action == "spared: its pid now names another process"
        time.sleep(0.2)
        assert sleeper.poll() is None


@needs_root
def test_a_container_without_a_pid_in_the_passs_view_is_asked_of_the_engine(tmp_path: Path, namespace) -> None:
    """A container opened from its armed state comes without a pid until the next listing: its own
    process must still not be foreign (the engine's inspect says where it runs)."""
    info, inner = namespace
    asked: list[str] = []

    def inspect(name: str) -> ContainerInfo:
        asked.append(name)
        return info

    with State(tmp_path / "state.sqlite") as state:
        watch = ForeignWatch(state=state, host="local", running=lambda: [replace(info, pid=0, id="")],
                             read=lambda: view([inner]), inspect=inspect)
        assert watch(now=NOW).seen == 0
        assert watch(now=NOW).seen == 0
        assert asked == ["gpubook-own"]  # once, then remembered


@needs_root
def test_a_process_still_there_when_its_gpus_booking_changes_is_news_for_the_new_booking(tmp_path: Path, namespace,
                                                                                          sleeper) -> None:
    info, _ = namespace
    running: list[ContainerInfo] = []
    with State(tmp_path / "state.sqlite") as state:
        watch = ForeignWatch(state=state, host="local", running=lambda: running, mode="stop",
                             grace=timedelta(minutes=1), read=lambda: view([sleeper.pid]))
        assert [r.booking_id for r in watch(now=NOW).changed] == [None]  # an unbooked GPU: reported, never stopped
        assert state.foreign()[0].action == ""
        running.append(info)
        assert [r.booking_id for r in watch(now=NOW + timedelta(minutes=1)).changed] == ["own@test"]
        assert state.foreign()[0].action == "due 2026-11-23T14:07:00+00:00"
        assert [n.booking_id for n in state.pending_notices()] == ["own@test"]


@needs_root
def test_short_lived_processes_of_one_user_on_a_gpu_are_one_row_and_one_notice_per_window(tmp_path: Path,
                                                                                          namespace) -> None:
    """Hostile (issue 22, finding 14): a host user's short-lived GPU processes, a new one at every
    sample (a cron job, a retry loop). Before, each made a new row, an event line and an e-mail.
    Now the user's processes on that GPU are one row and one notice while they keep coming within
    the window; a process beside a live one gets its own row (it may have to be stopped), quietly."""
    info, inner = namespace
    changes: list[int] = []
    current: list[int] = []
    with State(tmp_path / "state.sqlite") as state:
        watch = ForeignWatch(state=state, host="local", running=lambda: [info], read=lambda: view([info.pid, *current]),
                             on_change=lambda: changes.append(1), window=timedelta(minutes=10))
        pids = []
        for sample in range(6):  # every 30 s another process of root's, gone by the next sample
            process = subprocess.Popen(["sleep", "300"])
            pids.append(process.pid)
            current[:] = [process.pid] + ([os.getpid()] if sample == 3 else [])  # once, two at a time
            try:
                watch(now=NOW + timedelta(seconds=30 * sample))
            finally:
                process.kill()
                process.wait()
            current.clear()
        watch(now=NOW + timedelta(seconds=180))  # none now
        rows = state.foreign(current=False, booking_ids=["own@test"])
        assert len(rows) == 2 and sorted(r.repeats for r in rows) == [1, 5]  # the group's row and the one beside
        kept = next(r for r in rows if r.repeats == 5)
        assert (kept.pid, kept.first_seen, kept.gone_at) == (pids[-1], NOW, NOW + timedelta(seconds=180))
        assert foreign.event_line(kept, timezone="UTC") == (
            f"foreign: GPU 0 was also used by pid {pids[-1]} (sleep, root) and 5 earlier processes of root from "
            "14:05 to 14:08; not this booking's")
        assert [n.kind for n in state.pending_notices()] == ["foreign"]  # one e-mail, not six
        warnings = [e.message for e in state.events(booking_id="own@test") if "uses the GPU" in e.message]
        assert len(warnings) == 1 and changes == [1], warnings
        # Quiet for longer than the window: the next process is news again.
        later = subprocess.Popen(["sleep", "300"])
        try:
            current[:] = [later.pid]
            assert [r.pid for r in watch(now=NOW + timedelta(minutes=20)).changed] == [later.pid]
        finally:
            later.kill()
            later.wait()
        assert len(state.pending_notices()) == 2


@needs_root
def test_a_repeat_of_a_stopped_process_is_stopped_after_its_own_grace(tmp_path: Path, namespace) -> None:
    """Stop mode with repeats: the row a new process takes over keeps its group's stop time unless
    that stop was done (then the new process gets its own grace); either way it is stopped."""
    info, _ = namespace
    current: list[int] = []
    with State(tmp_path / "state.sqlite") as state:
        watch = ForeignWatch(state=state, host="local", running=lambda: [info], mode="stop", grace=timedelta(minutes=1),
                             read=lambda: view([info.pid, *current]), window=timedelta(minutes=10))
        first = subprocess.Popen(["sleep", "300"])
        current[:] = [first.pid]
        watch(now=NOW)
        watch(now=NOW + timedelta(minutes=1))
        assert first.wait(timeout=10) == -signal.SIGTERM
        second = subprocess.Popen(["sleep", "300"])
        try:
            current[:] = [second.pid]
            watch(now=NOW + timedelta(minutes=2))
            (row,) = state.foreign()
            assert (row.pid, row.repeats, row.action) == (second.pid, 1, "due 2026-11-23T14:08:00+00:00")
            watch(now=NOW + timedelta(minutes=3))
            assert second.wait(timeout=10) == -signal.SIGTERM
        finally:
            second.kill()
            second.wait()
