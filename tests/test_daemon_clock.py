"""A backward step of the wall clock (NTP, `date -s`) must not stall the polls for the size of the
step (finding 15 of issue 9). The clocks are injected: the daemon's main loop hands its
`_watch_clock` both readings every few seconds, as the test does here."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

from gpubook.scheduler.clock import ClockWatch
from tests.kits.daemon_kit import in_process_daemon, wait_for

T0 = datetime(2026, 11, 23, 12, tzinfo=UTC)


def test_clock_watch_sees_a_step_back_and_nothing_else() -> None:
    watch = ClockWatch(tolerance=1.0)
    assert watch.stepped_back(wall=T0, monotonic=100.0) is None  # the first reading
    assert watch.stepped_back(wall=T0 + timedelta(seconds=5), monotonic=105.0) is None
    assert watch.stepped_back(wall=T0 + timedelta(seconds=9.6), monotonic=110.0) is None  # 0.4 s slewed
    assert watch.stepped_back(wall=T0 + timedelta(hours=3), monotonic=115.0) is None  # a step forward
    assert watch.forward == timedelta(hours=3, seconds=-14.6)  # told apart (3 h less the 9.6 s read before, 5 s passed)
    assert watch.stepped_back(wall=T0 + timedelta(hours=2), monotonic=120.0) == timedelta(hours=1, seconds=5)
    assert watch.stepped_back(wall=T0 + timedelta(hours=2, seconds=5), monotonic=125.0) is None


def test_a_poll_happens_soon_after_the_wall_clock_steps_back_an_hour(tmp_path: Path) -> None:
    daemon = in_process_daemon(tmp_path, poll_seconds=60)
    daemon.scheduler.start()
    try:
        now = datetime.now(UTC)
        # Five seconds before the step the clock read an hour later than now, and the last poll had
        # just run: APScheduler's next poll, a minute after it by the old clock, is an hour away.
        daemon._schedule_polls(first=now + timedelta(hours=1, seconds=55))
        daemon._watch_clock(wall=now + timedelta(hours=1, seconds=-5), monotonic=1000.0)
        assert daemon.calendar.last_poll is None
        daemon._watch_clock(wall=now, monotonic=1005.0)
        polled = wait_for("a poll after the clock stepped back", lambda: daemon.calendar.last_poll, timeout=30)
        assert polled >= now
        job = daemon.scheduler.get_job("poll")
        assert job is not None and job.next_run_time <= datetime.now(UTC) + timedelta(seconds=60)
        events = [event.message for event in daemon.state.events()]
        assert "the wall clock stepped back by 60 min; polling now and every 60 s from here" in events
    finally:
        daemon.scheduler.shutdown(wait=True)
        daemon.passes.close()
        daemon.state.close()
