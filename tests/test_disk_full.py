"""The state folder's disk full (issue 26): a write then fails with StateUnavailable, one clear
sentence, and takes nothing with it; once there is space again the next write works and the
database passes its integrity check. The disk is a small tmpfs (tests/kits/disk_full.py)."""

from __future__ import annotations

import errno
import sqlite3
from pathlib import Path

import pytest

from gpubook.scheduler.state import State, StateUnavailable
from tests.kits.disk_full import FILLER, fill, full_folder, unfill


def _integrity(path: Path) -> str:
    db = sqlite3.connect(path)
    try:
        return str(db.execute("PRAGMA integrity_check").fetchone()[0])
    finally:
        db.close()


def test_fill_leaves_no_room_for_a_new_block_and_unfill_gives_it_back() -> None:
    with full_folder() as folder:
        assert fill(folder) > 1 << 20
        with pytest.raises(OSError) as raised:
            (folder / "new").write_bytes(b"x" * 4096)
        assert raised.value.errno == errno.ENOSPC
        unfill(folder)
        assert not (folder / FILLER).exists()
        (folder / "new").write_bytes(b"x" * (1 << 20))


def test_a_state_write_on_a_full_disk_fails_cleanly_and_the_next_one_after_space_works() -> None:
    with full_folder() as folder:
        path = folder / "state" / "state.sqlite"
        with State(path) as state:
            state.log_event("before the disk filled", booking_id="b1")
            state.container_started("b1", "gpubook-b1", user="alice", gpu_count=1)
            fill(folder)
            full = r"state database .* could not be used: database or disk is full"
            with pytest.raises(StateUnavailable, match=full):
                state.log_event("while the disk is full " + "x" * 2000, booking_id="b1")
            with pytest.raises(StateUnavailable, match="disk is full"):
                state.container_stopped("gpubook-b1", reason="ended")
            # What was committed before is still read, whole, while the disk stays full.
            assert [e.message for e in state.events()] == ["before the disk filled"]
            assert [c.stopped_at for c in state.containers()] == [None]
            assert _integrity(path) == "ok"
            unfill(folder)
            state.log_event("after the space came back", booking_id="b1")
            assert state.container_stopped("gpubook-b1", reason="ended") is not None
        assert _integrity(path) == "ok"
        with State(path) as reopened:  # a restart reads it all back: nothing half-written, nothing lost
            assert [e.message for e in reopened.events()] == ["before the disk filled", "after the space came back"]
            assert [c.exit_reason for c in reopened.containers()] == ["ended"]


def test_a_restart_while_the_disk_is_full_is_refused_in_one_sentence_and_works_once_there_is_space() -> None:
    """Closed cleanly, the database has no -wal or -shm file left; opening it makes them, which a
    full disk refuses: SQLite's "disk I/O error", named as the full disk it is, not a traceback."""
    with full_folder() as folder:
        path = folder / "state" / "state.sqlite"
        with State(path) as state:
            state.log_event("first run")
        fill(folder)
        with pytest.raises(StateUnavailable, match=r"state database .* cannot be opened: .*its disk has less than"):
            State(path)
        assert not list(path.parent.glob("*.corrupt-*"))  # not set aside as damaged
        unfill(folder)
        with State(path) as state:
            state.log_event("second run, space again")
            assert [e.message for e in state.events()] == ["first run", "second run, space again"]
        assert _integrity(path) == "ok"
