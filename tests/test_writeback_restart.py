"""The event of a booking that runs again after its container died says so next to its new ssh
line (on a Slurm cluster: its node failed and it runs on another)."""

from __future__ import annotations

import threading
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from gpubook.runtime.engines import ContainerInfo, container_name
from gpubook.scheduler.hosts import Started, StartRequest
from gpubook.scheduler.outbox.writeback import Remarks, WriteBack
from gpubook.scheduler.sources import block
from gpubook.scheduler.state import ContainerRecord, State, notes
from tests.kits.pass_kit import HOLD, NOW, Machine, bookings, event, make_config, make_pass, running


def test_a_run_after_a_death_says_so_next_to_its_ssh_line(tmp_path: Path) -> None:
    with State(tmp_path / "state.sqlite") as state:
        _check(tmp_path, state)


def _check(tmp_path: Path, state: State) -> None:
    config = make_config(tmp_path)
    (booking,) = bookings(config, event("x", NOW - timedelta(hours=1), NOW + timedelta(hours=1)))
    plan = make_pass(config, Machine(), state).plan([booking], [], now=NOW)
    died = ContainerRecord(id=1, booking_id="x", name=container_name("x"), user="alice", gpu_count=1,
                           started_at=NOW - timedelta(hours=1), stopped_at=NOW - timedelta(minutes=3),
                           exit_reason="died: the container vanished", restarts=0)
    again = replace(died, id=2, started_at=NOW - timedelta(minutes=2), stopped_at=None, exit_reason=None, restarts=1)
    info = running("x", (0,), end=NOW + timedelta(hours=1))
    remarks = Remarks(refused={}, failures={}, notes={}, images={})
    outcome = WriteBack(config, state).outcome(plan.accepted[0], info, [died, again], remarks=remarks, now=NOW)
    assert outcome is not None and outcome.lines[0] == "ssh -p 2200 alice@devbox1"
    assert outcome.lines[-1] == ("started again at 11:58:00 UTC after its container died "
                                 "(died: the container vanished)")
    first = WriteBack(config, state).outcome(plan.accepted[0], info, [again], remarks=remarks, now=NOW)
    assert first is not None and not any("started again" in line for line in first.lines)


class ListedBeforeRecorded(Machine):
    """A host whose started container is listed as running before its start returns (as on a
    Slurm node, where the step reports SSH before the start's next look; or podman, which lists
    a container before its sshd answers): a pass meanwhile sees it, its start not yet recorded."""

    def __init__(self) -> None:
        super().__init__()
        self.listed = threading.Event()
        self.answer = threading.Event()

    def start(self, request: StartRequest) -> Started:
        info = running(request.booking_id, request.gpus, end=request.end, port=request.port)
        self.containers[info.name] = info
        self.listed.set()
        self.answer.wait(HOLD)
        return Started(info=info, seconds_to_ssh=0.0)


def test_a_pass_during_a_restart_leaves_its_event_to_the_start(tmp_path: Path) -> None:
    """A pass that reads the world while a restart is at work sees its new container but only the
    dead run's record: it says nothing for that booking (its start's own write-back does, with the
    "started again" line), so the event never shows the new ssh line without it."""
    config = make_config(tmp_path)
    with State(tmp_path / "state.sqlite") as state:
        name = container_name("x")
        state.container_started("x", name, user="alice", gpu_count=1, at=NOW - timedelta(hours=1))
        state.container_stopped(name, reason="died: the container vanished", at=NOW - timedelta(minutes=5))
        occurrences = bookings(config, event("x", NOW - timedelta(hours=1), NOW + timedelta(hours=1)))
        machine = ListedBeforeRecorded()
        passes = make_pass(config, machine, state)
        passes.patience = 0.0  # the pass leaves the held start to finish alone, as a slow one is
        written: list[tuple[str, block.Outcome]] = []

        def send(calendar: object, job: Any) -> None:  # what the calendar lane would write, kept
            written.append((job.item.id, job.outcome))
            state.write_back_done(job.item.id, status=job.key, etag=None, at=job.now)

        passes.writeback._send = send  # type: ignore[method-assign]
        try:
            passes.run(occurrences, now=NOW, etags={})  # the restart, held at its SSH
            assert machine.listed.wait(HOLD)
            passes.run(occurrences, now=NOW + timedelta(seconds=2), etags={})  # a poll's pass meanwhile
            machine.answer.set()
            for future in list(passes.busy.values()):
                future.result(HOLD)
            assert passes.writeback.settle(HOLD)
        finally:
            machine.answer.set()
            passes.close()
    running_lines = [outcome.lines for booking_id, outcome in written if outcome.status == "running"]
    assert running_lines, written
    for lines in running_lines:  # every write of its new ssh line says why it runs again
        assert any("after its container died (died: the container vanished)" in line for line in lines), lines


class RecordedWhileListed(Machine):
    """A host whose start is held until a pass lists the containers: the start then returns (and is
    recorded) between that listing and the pass's read of State's records."""

    def __init__(self) -> None:
        super().__init__()
        self.answer = threading.Event()
        self.between: threading.Event | None = None  # set: the next listing lets the start finish first
        self.finished: list[Any] = []  # the start's lane, waited for inside the listing

    def start(self, request: StartRequest) -> Started:
        self.answer.wait(HOLD)
        return super().start(request)

    def list(self) -> list[ContainerInfo]:
        listed = super().list()
        if self.between is not None:
            self.between, between = None, self.between
            self.answer.set()
            for future in self.finished:
                future.result(HOLD)
            between.set()
        return listed


def test_a_start_recorded_while_a_pass_reads_is_not_taken_for_a_death(tmp_path: Path) -> None:
    """A start that is recorded after a pass listed the containers but before it read State has an
    open record and no container in that pass's world: the pass leaves the booking alone (it was
    at work when the pass began) instead of clearing the new container as vanished."""
    config = make_config(tmp_path)
    with State(tmp_path / "state.sqlite") as state:
        occurrences = bookings(config, event("x", NOW - timedelta(minutes=1), NOW + timedelta(hours=1)))
        machine = RecordedWhileListed()
        passes = make_pass(config, machine, state)
        passes.patience = 0.0  # the pass leaves the held start to finish alone, as a slow one is
        try:
            passes.run(occurrences, now=NOW, etags={}, write_back=False)  # the start, held at its SSH
            machine.finished = list(passes.busy.values())
            machine.between = threading.Event()
            passes.run(occurrences, now=NOW + timedelta(seconds=2), etags={}, write_back=False)
            assert machine.between is None  # the second pass's listing let the start finish
            for future in list(passes.busy.values()):
                future.result(HOLD)
        finally:
            machine.answer.set()
            passes.close()
        assert container_name("x") in machine.containers  # still running
        assert [r.exit_reason for r in state.containers(booking_id="x")] == [None]  # no death recorded


@pytest.mark.parametrize("newer", [True, False], ids=["newer", "same"])
def test_a_pass_during_a_woken_read_still_writes_its_newer_outcome(tmp_path: Path, newer: bool) -> None:
    """A held booking's start ends in `Preparing` and wakes its write-back, whose deliverer reads
    State at once: before the pass has noted the image's newer line. The pass then writes its own
    outcome, with that line, while the read is still at work: it is written after the read's, not
    dropped as the same outcome (CI of 2026-11-30: the event kept "0 of 15 MB" until the image was
    ready, test_daemon_images). The same outcome is written once."""

    config = make_config(tmp_path)
    with State(tmp_path / "state.sqlite") as state:
        occurrences = bookings(config, event("x", NOW - timedelta(seconds=1), NOW + timedelta(hours=1)))
        plan = make_pass(config, Machine(), state).plan(occurrences, [], now=NOW)
        notes.IMAGE.write(state, "x", "preparing image lab: 0 of 15 MB", at=NOW)
        writeback = WriteBack(config, state)
        written: list[block.Outcome] = []
        read, go = threading.Event(), threading.Event()
        recorded = writeback._recorded

        def held_read(*args: Any, **kwargs: Any) -> block.Outcome | None:  # the deliverer's read, held
            outcome = recorded(*args, **kwargs)
            read.set()
            go.wait(HOLD)
            return outcome

        def send(calendar: object, job: Any) -> None:
            written.append(job.outcome)
            state.write_back_done(job.item.id, status=job.key, etag=None, at=job.now)

        writeback._recorded = held_read  # type: ignore[method-assign]
        writeback._send = send  # type: ignore[method-assign]
        try:
            writeback.wake(plan.accepted[0], containers=[], etag=None, now=NOW)
            assert read.wait(HOLD)  # it has read the old line
            if newer:
                notes.IMAGE.write(state, "x", "preparing image lab: 11 of 15 MB, ready about 12:01", at=NOW)
            writeback.write(plan, containers=[], now=NOW, etags={})
            go.set()
            assert writeback.settle(HOLD)
        finally:
            go.set()
            writeback.close()
    line = "preparing image lab: 11 of 15 MB, ready about 12:01" if newer else "preparing image lab: 0 of 15 MB"
    assert [line in outcome.lines for outcome in written] == ([False, True] if newer else [True]), written
