"""Issue 22, finding 1 through the real daemon: priority is earned by acceptance, never by being seen.

A real Radicale calendar, `gpubook run` as a process on rootless podman (the bookings lie days ahead:
no container starts). Bob plays the hostile writer of the lab's shared calendar.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import caldav

from tests.kits.daemon_kit import (
    DAEMON_MODULE,
    DaemonProcess,
    book,
    description,
    edit,
    event_text,
    wait_for,
    write_config,
)

pytestmark = DAEMON_MODULE


def status(calendar: caldav.Calendar, uid: str) -> str:
    """The outcome gpubook wrote into the event ("accepted", "rejected" or "" before its first pass)."""
    text = description(calendar, uid)
    return next((word for word in ("accepted", "rejected") if f"{word}:" in text), "")


def test_a_parked_event_moved_onto_an_accepted_booking_does_not_evict_it(tmp_path: Path, radicale_server, engine,
                                                                          keys, daemons) -> None:
    """Hostile (finding 1): bob saves an event that is refused (an unknown template) long before;
    alice then books 10-12 on GPUs 0,1 and is accepted; bob moves his parked event onto that slot
    with a valid template. Before, bob's event took the slot at the next poll (it was first seen
    earlier) and alice's said rejected; now bob's move is a new request, behind alice's booking."""
    calendar = radicale_server.new_calendar()
    config = write_config(tmp_path, str(calendar.url), keys=keys, poll_seconds=1)
    day = (datetime.now(UTC) + timedelta(days=2)).replace(hour=0, minute=0, second=0, microsecond=0)
    book(calendar, "parked@test", user="bob", start=day + timedelta(hours=20), end=day + timedelta(hours=21),
         gpus="0,1", description="template: no-such-template\n")
    daemon = DaemonProcess(config).start()
    daemons.append(daemon)
    wait_for("bob's parked event refused", lambda: status(calendar, "parked@test") == "rejected", timeout=60,
             daemon=daemon)
    assert "no-such-template" in description(calendar, "parked@test")

    ten, noon = day + timedelta(hours=10), day + timedelta(hours=12)
    book(calendar, "alice@test", user="alice", start=ten, end=noon, gpus="0,1")
    wait_for("alice's booking accepted", lambda: status(calendar, "alice@test") == "accepted", timeout=30,
             daemon=daemon)

    moved = event_text("parked@test", user="bob", start=ten, end=noon, gpus="0,1")
    wait_for("bob's event moved (retried while gpubook writes back)", lambda: edit(calendar, "parked@test", moved),
             timeout=20, daemon=daemon)
    wait_for("bob's moved event decided", lambda: "no-such-template" not in description(calendar, "parked@test")
             and status(calendar, "parked@test"), timeout=30, daemon=daemon)
    time.sleep(3)  # a few more polls: an eviction would show by now
    assert status(calendar, "parked@test") == "rejected", description(calendar, "parked@test")
    assert "booked by alice" in description(calendar, "parked@test"), description(calendar, "parked@test")
    assert status(calendar, "alice@test") == "accepted", description(calendar, "alice@test")


def test_an_accepted_booking_moved_onto_another_competes_as_new(tmp_path: Path, radicale_server, engine, keys,
                                                                 daemons) -> None:
    """Hostile (finding 1, the second route): bob's booking, accepted before alice's at another time,
    is moved onto alice's accepted slot. Its old acceptance buys nothing there: alice keeps it."""
    calendar = radicale_server.new_calendar()
    config = write_config(tmp_path, str(calendar.url), keys=keys, poll_seconds=1)
    day = (datetime.now(UTC) + timedelta(days=2)).replace(hour=0, minute=0, second=0, microsecond=0)
    book(calendar, "early@test", user="bob", start=day + timedelta(hours=20), end=day + timedelta(hours=22),
         gpus="0,1")
    daemon = DaemonProcess(config).start()
    daemons.append(daemon)
    wait_for("bob's booking accepted", lambda: status(calendar, "early@test") == "accepted", timeout=60,
             daemon=daemon)
    ten, noon = day + timedelta(hours=10), day + timedelta(hours=12)
    book(calendar, "alice@test", user="alice", start=ten, end=noon, gpus="0,1")
    wait_for("alice's booking accepted", lambda: status(calendar, "alice@test") == "accepted", timeout=30,
             daemon=daemon)

    moved = event_text("early@test", user="bob", start=ten, end=noon, gpus="0,1")
    wait_for("bob's event moved", lambda: edit(calendar, "early@test", moved), timeout=20, daemon=daemon)
    wait_for("bob's moved booking refused", lambda: status(calendar, "early@test") == "rejected", timeout=30,
             daemon=daemon)
    time.sleep(3)
    assert status(calendar, "early@test") == "rejected", description(calendar, "early@test")
    assert status(calendar, "alice@test") == "accepted", description(calendar, "alice@test")
