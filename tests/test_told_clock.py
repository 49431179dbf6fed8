"""The daemon's clock is one seam (gpubook/scheduler/clock.py): a test tells it the time
(tests/kits/told_clock.py), and the daemon's passes, boundary jobs, warnings and ends follow it,
while containers and SSH stay real."""

from __future__ import annotations

import signal
from datetime import UTC, datetime, timedelta
from pathlib import Path

from gpubook.runtime.engines import container_name
from gpubook.scheduler import clock as clock_module
from gpubook.scheduler.clock import Clock
from tests.kits.daemon_kit import (
    DaemonProcess,
    book,
    daemon_test,
    description,
    in_process_daemon,
    run,
    running_container,
    try_login,
    wait_for,
    write_config,
)
from tests.kits.told_clock import ToldClock


def test_a_told_clock_is_the_hosts_plus_the_offset_in_its_file(tmp_path: Path) -> None:
    told = tmp_path / "offset"
    clock = Clock(told)
    assert abs((clock.now() - datetime.now(UTC)).total_seconds()) < 5  # no file yet: the host's clock
    told.write_text("3600.5\n")
    assert abs((clock.now() - datetime.now(UTC)).total_seconds() - 3600.5) < 5
    moment = datetime(2026, 11, 28, 12, tzinfo=UTC)
    assert clock.real(moment) == moment - timedelta(seconds=3600.5)
    told.write_text("not a number")
    assert clock.offset() == timedelta(seconds=3600.5)  # a half-written file: the last offset stands
    assert Clock(None).offset() == timedelta(0)


@daemon_test
def test_a_bookings_warning_and_end_come_when_the_daemons_clock_is_told(tmp_path: Path, radicale, engine, keys,
                                                                        cleanup, daemons) -> None:
    """A booking of 20 minutes, ended in seconds: the warning and the stop follow the told clock, the
    booker's output is kept, the event says ended, and the host's clock is nowhere near the booked end.
    (20 minutes: under the 30 after which the calendar's data would count as stale.)"""
    calendar = radicale.new_calendar()
    config = write_config(tmp_path, str(calendar.url), keys=keys, poll_seconds=60)
    clock = ToldClock(tmp_path)
    start = clock.soon(0) - timedelta(seconds=1)
    end = start + timedelta(minutes=20)
    book(calendar, "told@test", user="alice", start=start, end=end)
    cleanup.append("told@test")
    daemon = DaemonProcess(config, env=clock.env()).start()
    daemons.append(daemon)

    info = wait_for("the container", lambda: running_container(engine, "told@test"), timeout=60, daemon=daemon)
    client = wait_for("SSH login as the booker", lambda: try_login(info.port, "alice", keys["alice"]),
                      timeout=30, daemon=daemon)
    try:
        assert run(client, "echo kept > /data/output/result.txt")[0] == 0
        shell = client.invoke_shell(term="xterm")
        shell.settimeout(1.0)
        clock.advance_to(end - timedelta(seconds=4), daemon)  # inside warn_minutes (6 s)
        seen = b""

        def warned() -> bool:
            nonlocal seen
            try:
                seen += shell.recv(4096)
            except TimeoutError:
                pass
            return b"this booking ends at" in seen

        wait_for("the warning on the booker's terminal", warned, timeout=30, daemon=daemon)
    finally:
        client.close()
    assert engine.inspect(container_name("told@test")) is not None  # warned, not stopped yet

    clock.advance_to(end + timedelta(seconds=1), daemon)
    wait_for("the stop at the told end", lambda: engine.inspect(container_name("told@test")) is None,
             timeout=30, daemon=daemon)
    assert datetime.now(UTC) < end - timedelta(minutes=15)  # the host's clock never got there
    assert (tmp_path / "data" / "alice" / "output" / "result.txt").read_text() == "kept\n"
    wait_for("ended in the event", lambda: "ended:" in description(calendar, "told@test"), timeout=30,
             daemon=daemon)
    daemon.signal(signal.SIGTERM)
    assert daemon.process is not None and daemon.process.wait(timeout=30) == 0


def test_the_boundary_job_is_set_on_the_hosts_clock_for_the_told_moment(tmp_path: Path, monkeypatch) -> None:
    """APScheduler keeps its jobs on the host's clock: a wake-up at 13:00 on a clock told an hour ahead
    is a job at 12:00 on the host's; the event log's lines carry the told time."""
    told = tmp_path / "offset"
    told.write_text("3600")
    monkeypatch.setattr(clock_module, "CLOCK", Clock(told))
    daemon = in_process_daemon(tmp_path, poll_seconds=60)
    daemon.scheduler.start()
    try:
        moment = datetime.now(UTC).replace(microsecond=0) + timedelta(hours=1, minutes=10)
        daemon._wake_at(moment)
        job = daemon.scheduler.get_job("boundary")
        assert job is not None and job.next_run_time == moment - timedelta(hours=1)
        daemon._event("a line", level="info")
        logged = [event.at for event in daemon.state.events() if event.message == "a line"]
        assert logged and logged[0] > datetime.now(UTC) + timedelta(minutes=59)
    finally:
        daemon.scheduler.shutdown(wait=True)
        daemon.passes.close()
        daemon.state.close()
