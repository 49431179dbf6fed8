"""Issue 9, findings 5, 6 and 10 through the real daemon: real Radicale calendars (and an ICS feed
server that turns into a login page), real rootless podman containers, `gpubook run` as a process.

- A running booking's UID copied into another calendar leaves the running container alone.
- A running booking moved days later ends now and frees its GPU for the next booker.
- One calendar answering with broken data stops and holds nothing in the other calendar.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import caldav

from gpubook.runtime.engines import container_name
from tests.kits import servers
from tests.kits.daemon_kit import (
    DAEMON_MODULE,
    DaemonProcess,
    book,
    child_env,
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


def unfolded(ical: str) -> str:
    """An object's text with its long lines joined again (RFC 5545 folds them at 75 octets)."""
    return re.sub(r"\r?\n[ \t]", "", ical)


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
    assert "already belongs to an event in another calendar" in description(other, "run@test")
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


def test_a_copy_of_a_daily_bookings_uid_in_another_calendar_never_takes_it_days_later(
        tmp_path: Path, radicale_server, engine, keys, cleanup, daemons) -> None:
    """Round 3, H3: bob puts the UID of alice's daily booking into his own calendar. Once the
    occurrences seen before the copy had left the window (days on), each new occurrence was
    first seen by both places in one pass: they tied, both were refused, and alice's running
    occurrence was warned and stopped. The object's own first-seen keeps alice's place first."""
    mine, other = radicale_server.new_calendar(), radicale_server.new_calendar()
    config = write_config(tmp_path, str(mine.url), keys=keys, poll_seconds=1)
    second_calendar(config, str(other.url))
    clock = ToldClock(tmp_path)
    start = clock.soon(0) - timedelta(seconds=1)
    end = start + timedelta(minutes=20)
    book(mine, "daily@test", user="alice", start=start, end=end, gpus="0,", rrule="FREQ=DAILY;COUNT=30")
    # two weeks on, past the window (72 h back, 7 days ahead) of every occurrence seen before the copy
    first, later = (f"daily@test@{start + timedelta(days=n):%Y%m%dT%H%M%SZ}" for n in (0, 14))
    cleanup += [first, later]
    daemon = DaemonProcess(config, env=clock.env()).start()
    daemons.append(daemon)
    wait_for("alice's first occurrence", lambda: running_container(engine, first), timeout=60, daemon=daemon)

    copy = book(other, "daily@test", user="bob", start=start, end=end, gpus="0,", rrule="FREQ=DAILY;COUNT=30")
    wait_for("the copy refused in its event", lambda: "already belongs to" in unfolded(copy.load().data), timeout=30,
             daemon=daemon)
    clock.advance(14 * 86400, daemon)  # every occurrence now in the window is new to both places
    running = wait_for("alice's occurrence two weeks on", lambda: running_container(engine, later), timeout=60,
                       daemon=daemon)
    assert running.gpus == (0,)
    written = unfolded(copy.load().data)
    assert "already belongs to an event in another calendar" in written
    assert str(mine.url) not in written  # never the other calendar's path (L4)
    log = events(tmp_path, later)
    assert not any("more than one place" in m or "warned" in m for m in log), log


def test_a_uid_with_a_newline_is_refused_where_the_calendar_is_read(tmp_path: Path, radicale_server, engine, keys,
                                                                    cleanup, daemons) -> None:
    """Round 3, M1: `UID:lab-42\\nPROMPT_COMMAND=…` (iCalendar unescapes \\n). The start refused it,
    but the plan, the page and `gpubook bookings --json` listed it as accepted until then. Now it is
    refused at reading, with the start's sentence, and never reaches a host."""
    calendar = radicale_server.new_calendar()
    config = write_config(tmp_path, str(calendar.url), keys=keys, poll_seconds=1)
    uid = "lab-42\nPROMPT_COMMAND=touch /tmp/pwned"
    text = event_text(uid, user="alice", start=soon(0) - timedelta(seconds=1), end=soon(600), gpus="0,")
    assert "UID:lab-42\\nPROMPT_COMMAND" in text  # the newline escaped in the file, as a client writes it
    hostile = caldav.Event(calendar.client, url=calendar.url.join("lab-42.ics"), data=text, parent=calendar)
    hostile.save()  # at a name of its own: the UID is no URL
    cleanup.append(uid)
    listed = subprocess.run([sys.executable, "-m", "gpubook.scheduler.commands.cli", "bookings", "--json",
                             "--config", str(config)], capture_output=True, text=True, timeout=120, env=child_env())
    assert listed.returncode == 0, listed.stderr
    plan = json.loads(listed.stdout)
    assert not [a for a in plan["accepted"] if a["uid"].startswith("lab-42")], plan
    assert [r["reason"] for r in plan["rejected"] if r["uid"].startswith("lab-42")] == [
        f"booking id {uid!r} is empty or has control characters"]
    daemon = DaemonProcess(config).start()
    daemons.append(daemon)
    wait_for("the refusal in its event", lambda: "control characters" in unfolded(hostile.load().data),
             timeout=30, daemon=daemon)
    assert running_container(engine, uid) is None
    assert not any(m.startswith("rejected at its start") for m in events(tmp_path, uid))  # refused before
    assert "\nPROMPT_COMMAND" not in daemon.tail() and "lab-42\\nPROMPT_COMMAND" in daemon.tail()  # one line
