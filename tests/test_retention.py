"""What the state database forgets ([daemon] keep_days, gpubook/scheduler/state/retention.py): what
bookings that ended before the horizon left behind goes, in one transaction; what runs, is to come or
ended since stays; the event log stays append-only for its last 30 days whatever is asked."""

from __future__ import annotations

import logging
import sqlite3
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from gpubook.runtime.errors import ConfigError
from gpubook.scheduler import config
from gpubook.scheduler.state import State
from gpubook.scheduler.state.usage import BookedRow, RejectedRow, Sample
from tests.kits.daemon_kit import in_process_daemon

NOW = datetime.now(UTC).replace(microsecond=0)
OLD, RECENT = NOW - timedelta(days=500), NOW - timedelta(days=10)


def booking(state: State, name: str, *, start: datetime, end: datetime | None) -> None:
    """One booking's whole trail: accounting, its container's run, write-back, log line, notice,
    a login and a GPU sample; `end` None: still running."""
    stop = end or NOW + timedelta(hours=1)
    state.record_bookings(accepted=[BookedRow(name, "alice", "debian-ssh", "local", (0,), start, stop)], rejected=[],
                          now=start, complete=False)
    state.container_started(name, f"gpubook-{name}", user="alice", gpu_count=1, at=start)
    if end is not None:
        state.container_stopped(f"gpubook-{name}", reason="ended", at=end)
    state.write_back_done(name, status="ended" if end else "running", etag=None, at=end or start)
    state.log_event(f"booking {name}: started", booking_id=name, at=start)
    state.queue_notice(kind="running", booking_id=name, user="alice", subject="s", text="t", fields={}, at=start)
    for notice in state.pending_notices():
        state.notice_delivered(notice.id, at=start)
    state.record_login(name, user="alice", at=start)
    state.record_samples([Sample(start, "local", 0, name, 50.0, 1, 2, 30.0)])


def counts(path: Path) -> dict[str, int]:
    with sqlite3.connect(path) as db:
        return {table: db.execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0]  # noqa: S608 - our own names
                for table in ("containers", "write_backs", "events", "outbox", "usage_bookings", "usage_rejections",
                              "gpu_samples", "logins", "usage_totals")}


def test_prune_forgets_what_ended_before_the_horizon_and_nothing_else(tmp_path: Path) -> None:
    path = tmp_path / "state.sqlite"
    with State(path) as state:
        booking(state, "old", start=OLD, end=OLD + timedelta(hours=2))
        booking(state, "recent", start=RECENT, end=RECENT + timedelta(hours=2))
        booking(state, "running", start=OLD, end=None)  # a booking running since long ago (a reservation)
        state.record_bookings(accepted=[], rejected=[RejectedRow("refused-old", "bob", "GPUs taken", OLD, OLD)],
                              now=OLD, complete=False)
        before = counts(path)
        deleted = state.prune(before=NOW - timedelta(days=400))
        # The running booking keeps its run, write-back, login and accounting; its log line and sample of
        # 500 days ago go (older than the horizon, like every line and sample).
        assert deleted == {"containers": 1, "events": 2, "outbox": 2, "gpu_samples": 2, "usage_rejections": 1,
                           "usage_bookings": 1, "write_backs": 1, "logins": 1, "usage_totals": 1}, deleted
        after = counts(path)
        assert {table: before[table] - after[table] for table in before} == {
            "containers": 1, "write_backs": 1, "events": 2, "outbox": 2, "usage_bookings": 1, "usage_rejections": 1,
            "gpu_samples": 2, "logins": 1, "usage_totals": 1}
        assert set(state.logins()) == {"recent", "running"}
        assert [c.booking_id for c in state.containers(running_only=True)] == ["running"]
        assert state.write_back("running") is not None and state.write_back("old") is None
        assert state.prune(before=NOW - timedelta(days=400)) == {}  # nothing more to forget


def test_the_event_log_stays_append_only_for_30_days(tmp_path: Path) -> None:
    path = tmp_path / "state.sqlite"
    with State(path) as state:
        state.log_event("recent", at=NOW - timedelta(days=29))
        state.log_event("old", at=NOW - timedelta(days=31))
    with sqlite3.connect(path) as db:
        with pytest.raises(sqlite3.IntegrityError, match="append-only for 30 days"):
            db.execute("DELETE FROM events WHERE message = 'recent'")
        with pytest.raises(sqlite3.IntegrityError, match="append-only"):
            db.execute("UPDATE events SET message = 'changed' WHERE message = 'old'")
        assert db.execute("DELETE FROM events WHERE message = 'old'").rowcount == 1


@pytest.mark.parametrize("days", [10, -1])
def test_keep_days_below_the_event_logs_30_is_refused(tmp_path: Path, days: float) -> None:
    path = tmp_path / "gpubook.toml"
    path.write_text(f"[daemon]\nkeep_days = {days}\n[users.alice]\nuid = 2001\n")
    with pytest.raises(ConfigError, match="keep_days.*must be 0 \\(keep everything\\) or at least 30 days"):
        config.load(path)


def test_the_daemon_prunes_a_minute_after_its_start_and_then_daily(tmp_path: Path, caplog) -> None:
    daemon = in_process_daemon(tmp_path)
    try:
        daemon._schedule_watches()
        job = daemon.scheduler.get_job("prune")
        assert job is not None and job.trigger.interval == timedelta(days=1)
        booking(daemon.state, "old", start=OLD, end=OLD + timedelta(hours=2))
        booking(daemon.state, "recent", start=RECENT, end=RECENT + timedelta(hours=2))
        with caplog.at_level(logging.INFO, logger="gpubook.scheduler.daemon"):
            daemon._prune()
        assert set(daemon.state.logins()) == {"recent"}
        said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("state: forgot")]
        assert said == ["state: forgot what ended more than 400 days ago ([daemon] keep_days): 1 containers, "
                        "1 events, 1 outbox, 1 gpu_samples, 1 usage_bookings, 1 write_backs, 1 logins, "
                        "1 usage_totals"], said
    finally:
        daemon.passes.close()
        daemon.state.close()
