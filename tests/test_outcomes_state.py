"""What the booker is told is recorded once in State (state/notes.py's outcome notes) and the
write-back reads State and the containers alone: a daemon restarted between a refusal and its
write-back still says why, a hold or a failure stays in the event until its writer clears it, and
the outcome notes outlive a stop's clearing of the booking's history."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

from gpubook.runtime.errors import EngineError
from gpubook.scheduler.apply.passes import Pass
from gpubook.scheduler.sources import block
from gpubook.scheduler.state import State, notes
from tests.kits.booking_kit import vevent
from tests.kits.pass_kit import NOW, Machine, bookings, event, make_config, make_pass

REFUSAL = "the template needs CUDA 8.0, which needs NVIDIA driver 375.26 or newer; this host has 340.108"


def captured(passes: Pass, state: State) -> list[tuple[str, block.Outcome]]:
    """What the calendar lanes of `passes` would write, kept (and recorded as written)."""
    written: list[tuple[str, block.Outcome]] = []

    def send(calendar: object, job: Any) -> None:
        written.append((job.item.id, job.outcome))
        state.write_back_done(job.item.id, status=job.key, etag=None, at=job.now)

    passes.writeback._send = send  # type: ignore[method-assign]
    return written


def cuda8(uid: str) -> str:
    return vevent(uid, f"DTSTART:{NOW:%Y%m%dT%H%M%SZ}", f"DTEND:{NOW + timedelta(hours=2):%Y%m%dT%H%M%SZ}",
                  "SUMMARY:alice digits-cuda8")


def test_a_daemon_restarted_between_a_refusal_and_its_write_back_still_says_why(tmp_path: Path) -> None:
    """The start refuses the booking (its template needs a newer driver), and the daemon stops before
    its write-back. The restarted daemon's first pass starts nothing (its calendars not read yet) and
    writes the event: rejected, with the reason (before: the refusal lived in the dead process's memory,
    and the event said "accepted" with no word of it)."""
    config = make_config(tmp_path)
    machine = Machine()
    machine.driver_version = "340.108"
    occurrences = bookings(config, cuda8("x"))
    with State(tmp_path / "state.sqlite") as state:
        first = make_pass(config, machine, state)
        try:
            first.run(occurrences, now=NOW, write_back=False)  # refused at its start; nothing written yet
        finally:
            first.close()
        assert ("start", "x") not in machine.steps
        restarted = make_pass(config, machine, state)
        written = captured(restarted, state)
        try:
            restarted.run(occurrences, now=NOW + timedelta(seconds=5), may_start=False,
                          stale_reason="the calendars were not read yet", etags={})
            assert restarted.writeback.settle(10)
        finally:
            restarted.close()
        said = [e.message for e in state.events(booking_id="x")]
    ((booking_id, outcome),) = written
    assert booking_id == "x" and outcome.status == block.Status.REJECTED, outcome
    assert outcome.lines == (REFUSAL,), outcome.lines
    assert said.count(f"rejected at its start: {REFUSAL}") == 1, said  # told once, not by each process


def test_a_failed_start_is_told_until_it_runs_and_then_forgotten(tmp_path: Path) -> None:
    """Its failure (and its retry time) is a State note the event shows while it waits, across a new
    Pass; once it starts, the note is gone and the event says "running"."""
    config = make_config(tmp_path)
    machine = Machine()
    machine.failing["x"] = EngineError("podman run: the image is broken")
    occurrences = bookings(config, event("x", NOW - timedelta(minutes=1), NOW + timedelta(hours=1)))
    with State(tmp_path / "state.sqlite") as state:
        first = make_pass(config, machine, state)
        try:
            first.run(occurrences, now=NOW, write_back=False)
        finally:
            first.close()
        failed = notes.read(state).failed["x"]
        assert failed.reason == "podman run: the image is broken" and failed.retry_at is not None
        again = make_pass(config, machine, state)
        written = captured(again, state)
        try:
            again.run(occurrences, now=NOW + timedelta(seconds=1), may_start=False, stale_reason="not read yet",
                      etags={})
            assert again.writeback.settle(10)
            del machine.failing["x"]
            again.run(occurrences, now=NOW + timedelta(minutes=1), etags={})
            assert again.writeback.settle(10)
        finally:
            again.close()
        assert "x" not in notes.read(state).failed
    told, running = (outcome for _, outcome in written)
    assert "could not start yet: podman run: the image is broken" in told.lines, told.lines
    assert running.status == block.Status.RUNNING and not any("could not start" in line for line in running.lines)


def test_a_stop_clears_the_bookings_history_but_not_what_it_was_told(tmp_path: Path) -> None:
    with State(tmp_path / "state.sqlite") as state:
        notes.WARNED.write(state, "x", notes.Warned(NOW, None, NOW), at=NOW)
        notes.POLICY.write(state, "x", "released at 12:10 UTC: nobody logged in", at=NOW)
        notes.clear_history(state, "x")
        found = notes.read(state)
    assert "x" not in found.warned and found.policy == {"x": "released at 12:10 UTC: nobody logged in"}


def test_an_outcome_note_is_written_only_when_it_changes(tmp_path: Path) -> None:
    with State(tmp_path / "state.sqlite") as state:
        assert notes.HELD.put(state, "x", "its GPUs are still in use", at=NOW)
        assert not notes.HELD.put(state, "x", "its GPUs are still in use", at=NOW + timedelta(seconds=1))
        assert notes.NOTE.sync(state, {"x": "pinned", "z": "old"}, {}, at=NOW) == ["x", "z"]
        assert notes.NOTE.sync(state, {"x": "pinned", "y": "moved"}, notes.read(state).note, at=NOW) == ["y"]
        assert state.notes(notes.NOTE.key) == {"x": "pinned", "y": "moved"}  # z no longer wanted: cleared
