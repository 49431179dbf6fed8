"""Issue 9, findings 5, 6 and 10 through the real daemon: real Radicale calendars (and an ICS feed
server that turns into a login page), real rootless podman containers, `gpubook run` as a process.

- A running booking's UID copied into another calendar leaves the running container alone.
- A running booking moved days later ends now and frees its GPU for the next booker.
- One calendar answering with broken data stops and holds nothing in the other calendar.
"""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path

from gpubook.runtime.engines import container_name
from tests.kits import servers
from tests.kits.daemon_kit import (
    DAEMON_MODULE,
    DaemonProcess,
    book,
    description,
    edit,
    event_text,
    events,
    running_container,
    soon,
    wait_for,
    write_config,
)
from tests.kits.told_clock import ToldClock

pytestmark = DAEMON_MODULE


def second_calendar(config: Path, url: str) -> None:
    """A second `[[calendar]]` (TOML adds it to the same array wherever it is written)."""
    config.write_text(config.read_text() + f'\n[[calendar]]\nurl = "{url}"\n')


def test_a_copied_uid_leaves_the_running_booking_alone(tmp_path: Path, radicale_server, engine, keys, cleanup,
                                                        daemons) -> None:
    """Hostile (finding 5): bob copies the UID of alice's running booking into another calendar.
    Before, both events were refused and alice's container was warned and stopped."""
    mine, other = radicale_server.new_calendar(), radicale_server.new_calendar()
    config = write_config(tmp_path, str(mine.url), keys=keys, poll_seconds=1)
    second_calendar(config, str(other.url))
    book(mine, "run@test", user="alice", start=soon(0) - timedelta(seconds=1), end=soon(600), gpus="0,")
    cleanup.append("run@test")
    daemon = DaemonProcess(config).start()
    daemons.append(daemon)
    running = wait_for("alice's container", lambda: running_container(engine, "run@test"), timeout=60,
                       daemon=daemon)

    book(other, "run@test", user="bob", start=soon(0) - timedelta(seconds=1), end=soon(2), gpus="0,")
    wait_for("the copy refused in its event", lambda: "rejected" in description(other, "run@test"), timeout=30,
             daemon=daemon)
    time.sleep(3 + 3)  # longer than the notice (3 s) plus a poll: a stop would have come by now
    still = running_container(engine, "run@test")
    assert still is not None and still.id == running.id, daemon.tail()
    assert "already belongs to the event" in description(other, "run@test")
    assert "running:" in description(mine, "run@test")
    assert not any("warned" in m or "stopped" in m for m in events(tmp_path, "run@test")), events(tmp_path, "run@test")


def test_a_running_booking_moved_days_later_stops_and_frees_its_gpu(tmp_path: Path, radicale_server, engine, keys,
                                                                    cleanup, daemons) -> None:
    """Hostile (finding 6): alice moves her running booking to the same hours six days later. Before,
    her container kept running (for six days) and bob's next booking on that GPU was held."""
    calendar = radicale_server.new_calendar()
    config = write_config(tmp_path, str(calendar.url), keys=keys, poll_seconds=1, notice_seconds=3)
    clock = ToldClock(tmp_path)  # bob's start comes when alice's old occurrence is gone, told to the daemon
    start, end = clock.soon(0) - timedelta(seconds=1), clock.soon(300)
    book(calendar, "moved@test", user="alice", start=start, end=end, gpus="0,")
    bob_start = end + timedelta(seconds=2)
    book(calendar, "next@test", user="bob", start=bob_start, end=bob_start + timedelta(seconds=600), gpus="0,")
    cleanup += ["moved@test", "next@test"]
    daemon = DaemonProcess(config, env=clock.env()).start()
    daemons.append(daemon)
    wait_for("alice's container", lambda: running_container(engine, "moved@test"), timeout=60, daemon=daemon)
    wait_for("bob's booking accepted", lambda: "accepted:" in description(calendar, "next@test"), timeout=30,
             daemon=daemon)

    later = timedelta(days=6)
    moved = event_text("moved@test", user="alice", start=start + later, end=end + later, gpus="0,")
    wait_for("the event moved (retried while gpubook writes back)", lambda: edit(calendar, "moved@test", moved),
             timeout=20, daemon=daemon)
    wait_for("alice's old occurrence stopped", lambda: engine.inspect(container_name("moved@test")) is None,
             timeout=20, daemon=daemon)
    assert clock.now() < end  # it ended after the notice, not at (or long after) its old end
    assert any("moved to a later time" in m for m in events(tmp_path, "moved@test")), events(tmp_path, "moved@test")
    clock.advance_to(bob_start, daemon)
    bob = wait_for("bob's container on GPU 0", lambda: running_container(engine, "next@test"), timeout=60,
                   daemon=daemon)
    assert bob.gpus == (0,)
    assert running_container(engine, "moved@test") is None
    assert not any("still used by" in m for m in events(tmp_path, "next@test")), events(tmp_path, "next@test")


def test_one_broken_calendar_stops_and_holds_nothing_in_the_others(tmp_path: Path, radicale_server, engine, keys,
                                                                   cleanup, daemons) -> None:
    """Hostile (finding 10): a second calendar (an ICS feed) starts answering with a login page.
    Before, that CalendarDataError discarded every calendar's poll: after `stale_after_minutes`
    nothing started anywhere. Now only the feed's bookings are affected, and its running booking
    is not stopped because of the read error."""
    calendar = radicale_server.new_calendar()
    feed = servers.FeedServer().start()
    try:
        config = write_config(tmp_path, str(calendar.url), keys=keys, gpus=3, poll_seconds=1,
                              stale_after_minutes=0.1)
        second_calendar(config, f"{feed.base_url}/lab.ics")
        bob = event_text("feed@test", user="bob", start=soon(0) - timedelta(seconds=1), end=soon(600), gpus="1,")
        feed.replies["/lab.ics"] = servers.Reply(body=bob.encode(), headers={"Content-Type": "text/calendar"})
        book(calendar, "now@test", user="alice", start=soon(0) - timedelta(seconds=1), end=soon(600), gpus="0,")
        later_start = soon(20)
        book(calendar, "later@test", user="alice", start=later_start, end=later_start + timedelta(seconds=600),
             gpus="2,")
        cleanup += ["now@test", "later@test", "feed@test"]
        daemon = DaemonProcess(config).start()
        daemons.append(daemon)
        alice = wait_for("alice's container", lambda: running_container(engine, "now@test"), timeout=60,
                         daemon=daemon)
        fed = wait_for("the feed's booking", lambda: running_container(engine, "feed@test"), timeout=60,
                       daemon=daemon)

        feed.replies["/lab.ics"] = servers.Reply(body=b"<!DOCTYPE html><html>Please log in</html>",
                                                 headers={"Content-Type": "text/html"})
        later = wait_for("the other calendar's later booking, started on time",
                         lambda: running_container(engine, "later@test"), timeout=60, daemon=daemon)
        assert later.gpus == (2,)
        time.sleep(2)
        assert running_container(engine, "now@test").id == alice.id
        assert running_container(engine, "feed@test").id == fed.id  # a read error stops nothing
        messages = events(tmp_path)
        broken = [m for m in messages if m.startswith(f"calendar {feed.base_url}/lab.ics cannot be read")]
        assert len(broken) == 1 and "HTML" in broken[0], messages
        assert not any(m.startswith("calendar unreachable") for m in messages), messages
    finally:
        feed.stop()
