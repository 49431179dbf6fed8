"""Free GPUs through the real daemon: a refusal written into the booker's event names the next free
slot, and the daemon's own page serves the availability calendar from its last pass. A real
Radicale calendar, `gpubook run` as a process on rootless podman (the bookings lie days ahead: no
container starts)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import icalendar
import requests

from tests.kits import servers
from tests.kits.daemon_kit import DAEMON_MODULE, DaemonProcess, book, description, wait_for, write_config

pytestmark = DAEMON_MODULE


def test_the_daemon_names_a_free_slot_and_serves_the_busy_times(tmp_path: Path, radicale_server, engine, keys,
                                                                 daemons) -> None:
    calendar = radicale_server.new_calendar()
    config = write_config(tmp_path, str(calendar.url), keys=keys, poll_seconds=1)
    port = servers.free_port()
    config.write_text(config.read_text() + f'\n[web]\nenabled = true\nlisten = "127.0.0.1:{port}"\nauth = "none"\n')
    day = (datetime.now(UTC) + timedelta(days=2)).replace(hour=0, minute=0, second=0, microsecond=0)
    alice, bob = sorted(keys)[:2]
    book(calendar, "first@test", user=alice, start=day + timedelta(hours=10), end=day + timedelta(hours=12),
         gpus="0,1")
    daemon = DaemonProcess(config).start()
    daemons.append(daemon)
    wait_for("the first booking accepted", lambda: "accepted:" in description(calendar, "first@test"), timeout=60,
             daemon=daemon)
    book(calendar, "clash@test", user=bob, start=day + timedelta(hours=11), end=day + timedelta(hours=13), gpus="0,1")
    wait_for("the clash refused", lambda: "rejected:" in description(calendar, "clash@test"), timeout=30,
             daemon=daemon)
    text = " ".join(description(calendar, "clash@test").split())
    assert f"GPUs 0,1 are free {day:%a %d %b} from 12:00 (UTC)" in text, text

    def feed() -> bytes | None:
        try:
            answer = requests.get(f"http://127.0.0.1:{port}/free.ics", timeout=5)
        except requests.ConnectionError:
            return None
        return answer.content if answer.ok and b"BEGIN:VEVENT" in answer.content else None

    body = wait_for("the page's feed", feed, timeout=30, daemon=daemon)
    events = list(icalendar.Calendar.from_ical(body).walk("VEVENT"))
    assert [(e.decoded("dtstart"), e.decoded("dtend"), str(e["summary"])) for e in events] == [
        (day + timedelta(hours=10), day + timedelta(hours=12), "busy: GPU 0,1")]
    assert alice.encode() not in body and b"first@test" not in body
