"""Book for right now, end to end: the real daemon on default [daemon] check_seconds, rootless podman,
and a booking saved on Radicale and on Xandikos with its start already past, as a booker does when
they sit down to work. poll_seconds is an hour: the booker gets in only because the change check
found the booking (without it, the next poll would come an hour later)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import caldav

from gpubook.scheduler.state import State
from tests.kits.daemon_kit import DAEMON_MODULE, DaemonProcess, book, events, try_login, wait_for, write_config

pytestmark = DAEMON_MODULE


def test_a_booking_saved_for_now_is_started_by_the_check(tmp_path: Path, new_calendar: caldav.Calendar, engine,
                                                          keys, cleanup, daemons) -> None:
    config = write_config(tmp_path, str(new_calendar.url), keys=keys, poll_seconds=3600, gpus=8)
    assert "check_seconds" not in config.read_text()  # the default's
    daemon = DaemonProcess(config).start()
    daemons.append(daemon)
    wait_for("the daemon's first pass", (tmp_path / "state" / "daemon-status.json").exists, timeout=60,
             daemon=daemon)
    start = (datetime.now(UTC) - timedelta(minutes=2)).replace(microsecond=0)
    cleanup.append("now@test")
    book(new_calendar, "now@test", user="alice", start=start, end=start + timedelta(minutes=20),
         gpus="6,")  # a GPU no other test's container holds (they share this podman)
    with State(tmp_path / "state" / "state.sqlite") as state:
        port = wait_for("the booking's port", lambda: state.ports().get("now@test"), timeout=120, daemon=daemon)
    client = wait_for("the booker's login", lambda: try_login(port, "alice", keys["alice"]), timeout=120,
                      interval=0.05, daemon=daemon)
    client.close()
    said = wait_for("the start in the event log", lambda: [m for m in events(tmp_path, "now@test")
                                                           if m.startswith("started")], timeout=60, daemon=daemon)
    # Nothing held it: the image it needs is here (the start does not wait for its preparation,
    # queued by the same pass), and the pass that found it started it.
    assert not [m for m in events(tmp_path, "now@test") if "preparing" in m], events(tmp_path, "now@test")
    assert len(said) == 1, said
