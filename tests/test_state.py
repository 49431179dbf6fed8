"""gpubook.scheduler.state against a real SQLite file: ports, containers, accounting, log, recovery."""

from __future__ import annotations

import logging
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import textwrap
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from gpubook.scheduler.state import MIGRATIONS, State, StateError, StateUnavailable, port_is_free, schema

T0 = datetime(2026, 11, 21, 9, 0, tzinfo=UTC)
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def db(tmp_path: Path) -> State:
    with State(tmp_path / "state.sqlite") as opened:
        yield opened


def _free_block(size: int) -> int:
    """The first port of `size` consecutive ports that are free on this host right now."""
    for start in range(20000, 60000, size):
        if all(port_is_free(p) for p in range(start, start + size)):
            return start
    pytest.skip("no block of free ports found")


def test_new_database_has_current_schema_wal_and_foreign_keys(tmp_path: Path, caplog) -> None:
    path = tmp_path / "sub" / "state.sqlite"
    with caplog.at_level(logging.INFO, logger="gpubook.scheduler.state"), State(path) as db:
        assert db.schema_version == len(MIGRATIONS)
        mode = db._query("PRAGMA journal_mode")[0][0]
        assert mode == "wal"
        assert db._query("PRAGMA foreign_keys")[0][0] == 1
    # A first start is normal: said (once each), never a warning (issue 41).
    assert "does not exist" in caplog.text and f"schema made at version {len(MIGRATIONS)}" in caplog.text
    assert sum("schema" in r.getMessage() for r in caplog.records) == 1
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    # Opening again migrates nothing and says nothing.
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="gpubook.scheduler.state"), State(path) as db:
        assert db.schema_version == len(MIGRATIONS)
    assert caplog.text == ""


def test_port_is_lowest_free_stable_and_released(db: State, tmp_path: Path) -> None:
    low = _free_block(4)
    first = db.port_for("b1", port_min=low, port_max=low + 3)
    second = db.port_for("b2", port_min=low, port_max=low + 3)
    assert (first, second) == (low, low + 1)
    assert db.port_for("b1", port_min=low, port_max=low + 3) == low  # stable per booking
    db.release_port("b1")
    assert db.port_for("b3", port_min=low, port_max=low + 3) == low  # lowest free again
    assert db.ports() == {"b3": low, "b2": low + 1}
    # Survives reopening.
    with State(db.path) as again:
        assert again.port_for("b2", port_min=low, port_max=low + 3) == low + 1


def test_port_taken_on_the_host_is_skipped(db: State) -> None:
    low = _free_block(3)
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", low))
        squatter.listen()
        assert not port_is_free(low)
        assert db.port_for("b1", port_min=low, port_max=low + 2) == low + 1


def test_no_port_left_is_a_clear_error(db: State) -> None:
    low = _free_block(2)
    db.port_for("b1", port_min=low, port_max=low + 1)
    db.port_for("b2", port_min=low, port_max=low + 1)
    with pytest.raises(StateError, match=rf"booking b3: no free SSH port left in {low}-{low + 1}"):
        db.port_for("b3", port_min=low, port_max=low + 1)
    assert "b3" not in db.ports()


def test_adopted_port_wins_over_a_stale_record(db: State) -> None:
    low = _free_block(2)
    db.port_for("old", port_min=low, port_max=low + 1)
    db.adopt_port("running", low)
    assert db.ports() == {"running": low}
    assert db.port_for("running", port_min=low, port_max=low + 1) == low


def test_container_records_restarts_and_gpu_hours(db: State) -> None:
    first = db.container_started("b1", "gpubook-b1", user="alice", gpu_count=2, at=T0)
    assert first.restarts == 0 and first.stopped_at is None
    # Adopting the same running container records nothing new.
    assert db.container_started("b1", "gpubook-b1", user="alice", gpu_count=2, at=T0 + timedelta(hours=5)) == first
    stopped = db.container_stopped("gpubook-b1", reason="died: exit 137", at=T0 + timedelta(hours=1))
    assert stopped is not None and stopped.exit_reason == "died: exit 137"
    assert db.container_stopped("gpubook-b1", reason="again", at=T0 + timedelta(hours=2)) is None
    second = db.container_started("b1", "gpubook-b1", user="alice", gpu_count=2, at=T0 + timedelta(hours=1.5))
    assert second.restarts == 1 and db.restarts("b1") == 1
    db.container_started("b2", "gpubook-b2", user="bob", gpu_count=1, at=T0)
    db.container_stopped("gpubook-b2", reason="ended", at=T0 + timedelta(hours=3))
    db.container_started("b3", "gpubook-b3", user="alice", gpu_count=1, at=T0 + timedelta(hours=2))

    now = T0 + timedelta(hours=2.5)
    by_booking = db.gpu_hours_by_booking(now=now)
    assert by_booking == pytest.approx({"b1": 2 * 1 + 2 * 1.0, "b2": 3.0, "b3": 0.5})
    assert db.gpu_hours_by_user(now=now) == pytest.approx({"alice": 4.5, "bob": 3.0})
    assert [r.name for r in db.containers(running_only=True)] == ["gpubook-b1", "gpubook-b3"]
    assert len(db.containers(booking_id="b1")) == 2


def test_write_backs_are_upserted(db: State) -> None:
    assert db.write_back("b1") is None
    db.write_back_done("b1", status="accepted", etag='"1"', at=T0)
    db.write_back_done("b1", status="running", etag='"2"', at=T0 + timedelta(minutes=1))
    record = db.write_back("b1")
    assert record is not None
    assert (record.status, record.etag, record.written_at) == ("running", '"2"', T0 + timedelta(minutes=1))


def test_event_log_is_append_only_and_ordered(db: State) -> None:
    first = db.log_event("poll: calendar unreachable", level="warning", at=T0)
    db.log_event("started", booking_id="b1", at=T0 + timedelta(seconds=1))
    db.log_event("stopped", booking_id="b1", at=T0 + timedelta(seconds=2))
    assert [e.message for e in db.events()] == ["poll: calendar unreachable", "started", "stopped"]
    assert [e.message for e in db.events(after_id=first)] == ["started", "stopped"]
    assert [e.message for e in db.events(booking_id="b1", limit=1)] == ["started"]
    with pytest.raises(ValueError, match="level must be one of"):
        db.log_event("x", level="fatal")
    raw = sqlite3.connect(db.path)
    with pytest.raises(sqlite3.DatabaseError, match="append-only"):
        raw.execute("DELETE FROM events")
    with pytest.raises(sqlite3.DatabaseError, match="append-only"):
        raw.execute("UPDATE events SET message = 'rewritten'")
    raw.close()


def test_naive_datetime_is_refused(db: State) -> None:
    with pytest.raises(ValueError, match="naive"):
        db.log_event("x", at=datetime(2026, 1, 1))


def test_corrupt_database_is_set_aside_and_recreated(tmp_path: Path, caplog) -> None:
    path = tmp_path / "state.sqlite"
    path.write_bytes(b"this is not a database, it is garbage " * 200)
    with caplog.at_level(logging.WARNING, logger="gpubook.scheduler.state"), State(path) as db:
        assert db.schema_version == len(MIGRATIONS)
        db.log_event("alive")
        assert [e.message for e in db.events()] == ["alive"]
    assert "unreadable" in caplog.text
    aside = list(tmp_path.glob("state.sqlite.corrupt-*"))
    assert len(aside) == 1 and aside[0].read_bytes().startswith(b"this is not a database")


def test_database_with_damaged_pages_is_recreated(tmp_path: Path) -> None:
    path = tmp_path / "state.sqlite"
    with State(path) as db:
        for number in range(300):
            db.log_event(f"event {number} " + "x" * 200)
    data = bytearray(path.read_bytes())
    assert len(data) > 8192
    data[4096:8192] = b"\xff" * 4096  # smash the second page, keep the header
    path.write_bytes(bytes(data))
    with State(path) as db:
        assert db.events() == []  # a fresh database; the damaged one was moved aside
    assert list(tmp_path.glob("state.sqlite.corrupt-*"))


def test_newer_schema_is_refused_not_destroyed(tmp_path: Path) -> None:
    path = tmp_path / "state.sqlite"
    with State(path):
        pass
    raw = sqlite3.connect(path)
    raw.execute(f"PRAGMA user_version = {len(MIGRATIONS) + 1}")
    raw.close()
    with pytest.raises(StateError, match="newer than this gpubook knows"):
        State(path)
    assert path.exists() and not list(tmp_path.glob("*.corrupt-*"))


def test_failed_migration_leaves_the_version_unchanged(tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / "state.sqlite"
    with State(path):
        pass
    monkeypatch.setattr(schema, "MIGRATIONS",
                        MIGRATIONS + ("CREATE TABLE extra (x INTEGER); INSERT INTO nowhere VALUES (1);",))
    with pytest.raises(StateUnavailable, match="cannot be opened: no such table: nowhere"):
        State(path)
    raw = sqlite3.connect(path)
    assert raw.execute("PRAGMA user_version").fetchone()[0] == len(MIGRATIONS)
    assert raw.execute("SELECT count(*) FROM sqlite_master WHERE name = 'extra'").fetchone()[0] == 0
    raw.close()


WRITER = textwrap.dedent("""
    import sys
    from gpubook.scheduler.state import State
    db = State(sys.argv[1])
    number = 0
    while True:
        db.log_event(f"event {number}", booking_id="b1")
        db.container_started("b1", f"c{number}", user="alice", gpu_count=1)
        print(number, flush=True)  # only after both commits
        number += 1
""")


def test_survives_kill_9_while_writing(tmp_path: Path) -> None:
    path = tmp_path / "state.sqlite"
    child = subprocess.Popen([sys.executable, "-c", WRITER, str(path)], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert child.stdout is not None
    last = -1
    try:
        for line in child.stdout:
            last = int(line)
            if last >= 300:
                break
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
        child.stdout.close()
    assert child.returncode == -signal.SIGKILL
    assert last >= 300, "the writer stopped before it was killed"
    assert Path(str(path) + "-wal").exists()  # killed with a live WAL: nothing was checkpointed cleanly
    with State(path) as db:
        assert db._query("PRAGMA integrity_check")[0][0] == "ok"
        messages = [e.message for e in db.events()]
        # Every acknowledged commit is there, in order, with nothing invented.
        assert len(messages) >= last + 1
        assert messages == [f"event {n}" for n in range(len(messages))]
        assert len(db.containers()) >= last + 1
    assert not list(tmp_path.glob("*.corrupt-*"))


def test_record_stop_keeps_a_run_already_closed_and_records_a_lost_one(db: State) -> None:
    """The handlers' record_stop: a run `gpubook stop` already closed stays closed with its reason (a
    pass that finds the leftover must not add a death, which would be restarted); a container State
    never saw (a lost database) gets a record, so that its restarts stay bounded."""
    from gpubook.scheduler.apply.handlers import record_stop

    db.container_started("b1", "gpubook-b1", user="alice", gpu_count=1, at=T0)
    admin = record_stop(db, name="gpubook-b1", booking_id="b1", reason="stopped by an admin",
                        now=T0 + timedelta(minutes=5))
    leftover = record_stop(db, name="gpubook-b1", booking_id="b1", reason="died: the container was exited",
                           now=T0 + timedelta(minutes=6))
    assert leftover == admin and leftover.exit_reason == "stopped by an admin"
    assert [r.exit_reason for r in db.containers(booking_id="b1")] == ["stopped by an admin"]
    lost = record_stop(db, name="gpubook-b2", booking_id="b2", reason="died: the container vanished",
                       now=T0 + timedelta(minutes=7))
    assert lost.exit_reason == "died: the container vanished" and lost.stopped_at is not None


def test_first_seen_is_recorded_once_kept_and_forgotten_long_after(tmp_path: Path) -> None:
    """Who keeps a UID several objects hold: the time gpubook first saw each occurrence in each object."""
    one, two = ("cal", "a.ics", "a"), ("cal", "b.ics", "b")
    t0 = datetime(2026, 11, 1, tzinfo=UTC)
    with State(tmp_path / "state.sqlite") as db:
        assert db.first_seen([one], now=t0) == {one: t0}
        later = t0 + timedelta(days=1)
        assert db.first_seen([one, two], now=later) == {one: t0, two: later}  # a's time is kept
        much_later = t0 + timedelta(days=40)
        # b is gone from the reading and was first seen long ago: forgotten; a is still read: kept.
        assert db.first_seen([one], now=much_later, forget_before=much_later - timedelta(days=30)) == {one: t0}
        assert db.first_seen([two], now=much_later) == {two: much_later}
    with State(tmp_path / "state.sqlite") as db:  # persisted
        assert db.first_seen([one], now=datetime(2027, 1, 1, tzinfo=UTC)) == {one: t0}


def test_a_restart_after_a_death_gets_the_port_the_booking_had(tmp_path: Path) -> None:
    """CI runs saw a container killed from outside come back on the next port: its died container's
    port forwarder still held the port, and lets go of it only once the engine removed that
    container, which the engine's start does (and then waits for the port: CliEngine.start). So the
    restart is given its port busy or not, held in State (the pass that saw the death frees it only
    at its end) or remembered since; a start that fails on it gives it back, and the next gets a free one."""
    busy: set[int] = set()

    def probe(port: int) -> bool:
        return port not in busy and port_is_free(port)

    low = _free_block(3)
    with State(tmp_path / "probe.sqlite", port_probe=probe) as db:
        db.port_for("other", port_min=low, port_max=low + 2)
        assert db.port_for("dies", port_min=low, port_max=low + 2) == low + 1
        db.release_port("other")
        busy.add(low + 1)  # the died container's forwarder
        assert db.port_for("dies", port_min=low, port_max=low + 2) == low + 1  # still held in State
        assert db.release_ports_except(set()) == ["dies"]  # the pass frees it ...
        assert db.port_for("dies", port_min=low, port_max=low + 2) == low + 1  # ... and it is remembered
        assert db.port_for("new", port_min=low, port_max=low + 2) == low  # a new booking: a free one
        db.release_port("dies")  # that start failed: the port still busy after the engine's wait
        assert db.port_for("dies", port_min=low, port_max=low + 2) == low + 2  # the lowest free one


def test_priority_is_earned_by_acceptance_at_a_slot_and_lost_by_a_move_or_a_refusal(tmp_path: Path) -> None:
    """Issue 22, finding 1: a refused occurrence holds no acceptance, a move starts its row afresh,
    an accepted one keeps its first acceptance (and rank) while it asks for the same slot."""
    mine, other = ("cal", "a.ics", "a"), ("cal", "b.ics", "b")
    t0 = datetime(2026, 11, 1, tzinfo=UTC)
    t1, t2, t3 = (t0 + timedelta(minutes=n) for n in (1, 2, 3))
    with State(tmp_path / "state.sqlite") as db:
        rows = db.slots_asked({mine: "10-12 gpus 0,1", other: "20-21 gpus 0,1"}, now=t0)
        assert rows[other].seen_at == t0 and rows[other].accepted_at is None
        db.slots_decided([(mine, 0, (("local", (0, 1)),))], [other], now=t0)  # b refused (parked)
        rows = db.slots_asked({mine: "10-12 gpus 0,1", other: "20-21 gpus 0,1"}, now=t1)
        assert (rows[mine].accepted_at, rows[mine].rank, rows[mine].placement) == (t0, 0, (("local", (0, 1)),))
        assert rows[other].accepted_at is None and rows[other].seen_at == t0  # refused: no priority
        # b moves onto a's slot: a new request, seen now, never accepted.
        rows = db.slots_asked({mine: "10-12 gpus 0,1", other: "10-12 gpus 0,1"}, now=t2)
        assert (rows[other].seen_at, rows[other].accepted_at) == (t2, None)
        db.slots_decided([(mine, 3, (("local", (0, 1)),)), (other, 4, ())], [], now=t2)
        rows = db.slots_asked({mine: "10-12 gpus 0,1", other: "10-12 gpus 0,1"}, now=t3)
        assert (rows[mine].accepted_at, rows[mine].rank) == (t0, 0)  # its first acceptance and rank kept
        assert (rows[other].accepted_at, rows[other].rank) == (t2, 4)
        db.slots_decided([], [mine], now=t3)  # refused once: the acceptance is gone
        assert db.slots_asked({mine: "10-12 gpus 0,1"}, now=t3)[mine].accepted_at is None
        much_later = t0 + timedelta(days=40)
        assert db.slots_asked({}, now=much_later, forget_before=much_later - timedelta(days=30)) == {}
        assert db.slots_asked({other: "10-12 gpus 0,1"}, now=much_later)[other].seen_at == much_later  # forgotten
