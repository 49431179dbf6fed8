"""The state folder's disk full (issue 26): a write then fails with StateUnavailable, one clear
sentence, and takes nothing with it; once there is space again the next write works and the
database passes its integrity check. The disk is a small tmpfs (tests/kits/disk_full.py)."""

from __future__ import annotations

import errno
import json
import sqlite3
import time
from datetime import timedelta
from pathlib import Path

import pytest

from gpubook.scheduler.outbox import status_file
from gpubook.scheduler.outbox.status import GpuSummary, HostStatus, Status
from gpubook.scheduler.state import State, StateUnavailable
from tests.kits.daemon_kit import (
    DaemonProcess,
    book,
    daemon_test,
    description,
    running_container,
    soon,
    wait_for,
    write_config,
)
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


def test_the_status_file_on_a_full_disk_is_a_warning_and_leaves_no_half_written_file(caplog) -> None:  # type: ignore[no-untyped-def]
    report = Status(hosts=(HostStatus(name="local", gpus=GpuSummary(source="config", count=1)),))
    with full_folder() as folder:
        assert status_file.write(report, folder)
        before = (folder / status_file.STATUS_FILE).read_bytes()
        fill(folder)
        # Big enough to need a new block: the disk refuses it.
        big = Status(hosts=report.hosts, problems=tuple("x" * 100 for _ in range(100)))
        assert not status_file.write(big, folder)
        assert sorted(p.name for p in folder.iterdir()) == sorted([FILLER, status_file.STATUS_FILE])
        assert (folder / status_file.STATUS_FILE).read_bytes() == before  # the last one whole, not half of the new
        assert "was not written this pass: No space left on device" in caplog.text
        unfill(folder)
        assert status_file.write(big, folder)


@daemon_test
def test_the_daemon_with_its_state_folder_on_a_full_disk(tmp_path: Path, radicale, engine, keys, cleanup,
                                                        daemons) -> None:
    """A running booking keeps running while the disk is full; a booking due meanwhile fails to
    start (its port cannot be recorded) and starts once there is space; the daemon neither dies
    nor loses a record; a restart (after a kill -9) while the disk is full adopts the running
    containers; the status file is skipped with a warning meanwhile, never a traceback."""
    calendar = radicale.new_calendar()
    with full_folder() as full:
        config = write_config(tmp_path, str(calendar.url), keys=keys, poll_seconds=2)
        config.write_text(config.read_text().replace(f'state_dir = "{tmp_path / "state"}"',
                                                     f'state_dir = "{full / "state"}"'))
        book(calendar, "first@test", user="alice", start=soon(0) - timedelta(seconds=1), end=soon(900), gpus="0,")
        cleanup += ["first@test", "second@test"]
        daemon = DaemonProcess(config).start()
        daemons.append(daemon)
        first = wait_for("first's container", lambda: running_container(engine, "first@test"), timeout=90,
                         daemon=daemon)
        wait_for("first written back", lambda: "running:" in description(calendar, "first@test"), timeout=60,
                 daemon=daemon)
        fill(full)
        book(calendar, "second@test", user="bob", start=soon(0) - timedelta(seconds=1), end=soon(900), gpus="1,")
        wait_for("a start of second refused for the full disk", lambda: "second@test: start failed" in _log(daemon),
                 timeout=60, daemon=daemon)
        time.sleep(6)  # a few passes more (every 2 s) with the disk full: the daemon stays up
        assert running_container(engine, "second@test") is None  # its port could not be recorded
        assert "second@test: start failed: the state database" in _log(daemon)
        assert daemon.process is not None and daemon.process.poll() is None, daemon.tail()
        assert running_container(engine, "first@test").id == first.id
        unfill(full)
        second = wait_for("second's container once there is space", lambda: running_container(engine, "second@test"),
                          timeout=60, daemon=daemon)
        wait_for("second written back", lambda: "running:" in description(calendar, "second@test"), timeout=60,
                 daemon=daemon)
        daemon.kill()
        # A restart while the disk is full: the database opens (its -wal and -shm files are there
        # after a kill -9), the running containers are adopted, only the writes wait for space.
        fill(full)
        seen = len(_log(daemon))  # the daemons share one log file
        again = DaemonProcess(config).start()
        daemons.append(again)
        wait_for("the restarted daemon's pass", lambda: "not written this pass" in _log(again)[seen:], timeout=60,
                 daemon=again)
        assert again.process is not None and again.process.poll() is None, again.tail()
        assert {b: running_container(engine, b).id for b in ("first@test", "second@test")} == {
            "first@test": first.id, "second@test": second.id}
        unfill(full)
        wait_for("a status file from the restarted daemon", lambda: _status(full).get("pid") == again.process.pid,
                 timeout=60, daemon=again)
        assert again.stop() == 0
        assert "Traceback" not in _log(again), _log(again)
        path = full / "state" / "state.sqlite"
        assert _integrity(path) == "ok"
        with State(path) as state:
            assert sorted((c.booking_id, c.name, c.stopped_at) for c in state.containers()) == [
                ("first@test", first.name, None), ("second@test", second.name, None)]
            assert state.ports() == {"first@test": first.port, "second@test": second.port}


def _log(daemon: DaemonProcess) -> str:
    return daemon.log.read_text(errors="replace")


def _status(folder: Path) -> dict[str, object]:
    path = folder / "state" / "daemon-status.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
