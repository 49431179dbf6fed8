"""The answer end to end: `gpubook run` as a real process on real Radicale and rootless podman; the
booker's event carries the host's attendee and STATUS as one booking runs (its booker logs in) and
another is refused."""

from __future__ import annotations

import signal
from datetime import timedelta
from pathlib import Path

import caldav

from tests.kits.daemon_kit import (
    DAEMON_MODULE,
    DaemonProcess,
    book,
    description,
    running_container,
    soon,
    try_login,
    wait_for,
    write_config,
)

pytestmark = DAEMON_MODULE

HOST = "127.0.0.1"  # daemon_kit's [host] name
ATTENDEE = f"urn:x-gpubook:host:{HOST}"


def _answer(calendar: caldav.Calendar, uid: str) -> tuple[str, str, str]:
    """(PARTSTAT of the host's attendee, its CN, the event's STATUS); empty before any answer."""
    component = calendar.event_by_uid(uid).icalendar_component
    found = component.get("ATTENDEE")
    attendees = found if isinstance(found, list) else [] if found is None else [found]
    ours = [a for a in attendees if str(a).lower() == ATTENDEE]
    if not ours:
        return "", "", ""
    return str(ours[0].params["PARTSTAT"]), str(ours[0].params["CN"]), str(component.get("STATUS", ""))


def test_the_running_daemon_answers_in_the_event(tmp_path: Path, radicale, engine, keys, cleanup,  # type: ignore[no-untyped-def]
                                                 daemons) -> None:
    calendar = radicale.new_calendar()
    config = write_config(tmp_path, str(calendar.url), keys=keys, poll_seconds=60)
    start = soon(0)
    book(calendar, "run@test", user="alice", start=start, end=start + timedelta(minutes=2), gpus="0,")
    book(calendar, "big@test", user="bob", start=start, end=start + timedelta(minutes=2), gpus="5")
    cleanup.append("run@test")
    daemon = DaemonProcess(config).start()
    daemons.append(daemon)

    info = wait_for("the container", lambda: running_container(engine, "run@test"), timeout=60, daemon=daemon)
    client = wait_for("SSH login as the booker", lambda: try_login(info.port, "alice", keys["alice"]),
                      timeout=30, daemon=daemon)
    client.close()
    wait_for("the ssh line in the event", lambda: "running: ssh -p" in description(calendar, "run@test"),
             timeout=20, daemon=daemon)
    assert _answer(calendar, "run@test") == ("ACCEPTED", f"{HOST} GPU 0", "CONFIRMED")
    wait_for("the refusal in the event", lambda: _answer(calendar, "big@test")[0], timeout=20, daemon=daemon)
    assert _answer(calendar, "big@test") == ("DECLINED", f"{HOST} GPUs", "TENTATIVE")
    daemon.signal(signal.SIGTERM)
    assert daemon.process is not None and daemon.process.wait(timeout=30) == 0
