"""The event of a booking that runs again after its container died says so next to its new ssh
line (on a Slurm cluster: its node failed and it runs on another)."""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta
from pathlib import Path

from gpubook.runtime.engines import container_name
from gpubook.scheduler.outbox.writeback import Remarks, WriteBack
from gpubook.scheduler.state import ContainerRecord, State
from tests.kits.pass_kit import NOW, Machine, bookings, event, make_config, make_pass, running


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
