"""Armed containers with the real daemon, Radicale and rootless podman: a booking's container runs
ahead of its start, its SSH refuses everyone until the start (hostile: the booker's own key), a
daemon killed meanwhile leaves it to the next one, which starts it (probe, record, the ssh line);
a booking deleted while armed loses its container and port at once."""

from __future__ import annotations

import tempfile
import time
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path

import paramiko
import pytest
from caldav.lib import error as dav_error

from gpubook.runtime.engines import SpecTaken
from gpubook.runtime.templates.catalog import get_template
from gpubook.scheduler.apply.ahead import LEAD
from gpubook.scheduler.hosts import Booker, StartRequest
from gpubook.scheduler.hosts.local import LocalHost
from gpubook.scheduler.state import State
from tests.kits import safe_data
from tests.kits.daemon_kit import (
    DAEMON_MODULE,
    DaemonProcess,
    book,
    description,
    event_text,
    events,
    key_line,
    running_container,
    soon,
    try_login,
    wait_for,
    write_config,
)
from tests.kits.engine_suite import lane_port
from tests.kits.told_clock import ToldClock

pytestmark = DAEMON_MODULE


def test_an_armed_booking_lets_nobody_in_before_its_start(tmp_path: Path, radicale, engine, keys, cleanup,
                                                          daemons) -> None:
    calendar = radicale.new_calendar()
    config = write_config(tmp_path, str(calendar.url), keys=keys, poll_seconds=60, gpus=8)
    config.write_text(config.read_text() + "[policy]\nremind_minutes = 10\n")  # the daemon's alarm, too
    # Further ahead than the daemon arms (LEAD): it arms at the start minus LEAD, or at its first pass if
    # that comes later, so the time left to try logins before the start no longer hangs on how fast a
    # loaded machine starts the daemon (18 s ahead was once too late in a clean-clone run).
    start = soon(LEAD.total_seconds() + 10)
    book(calendar, "armed@test", user="alice", start=start, end=start + timedelta(seconds=600),
         gpus="7,")  # a GPU no other test's container holds (they share this podman)
    cleanup.append("armed@test")
    daemon = DaemonProcess(config).start()
    daemons.append(daemon)
    armed = wait_for("the container run ahead of its start", lambda: running_container(engine, "armed@test"),
                     timeout=LEAD.total_seconds() + 40, interval=0.05, daemon=daemon)
    assert armed.start == start and armed.port is not None
    # The port is fixed once armed: the event gives the ssh line before the start (the booker can
    # have their terminal ready), and says it answers from the start.
    ahead = f"ssh from the start: ssh -p {armed.port} alice@127.0.0.1"
    wait_for("the ssh line in the event before the start", lambda: ahead in description(calendar, "armed@test"),
             timeout=10, interval=0.1, daemon=daemon)
    assert datetime.now(UTC) < start - timedelta(seconds=3), "the event said it too late to test the start"
    alarms = calendar.event_by_uid("armed@test").icalendar_component.walk("VALARM")
    assert [(str(a.get("X-GPUBOOK-ALARM")), a.decoded("TRIGGER")) for a in alarms] == [("1", -timedelta(minutes=10))]
    assert f"ssh -p {armed.port} alice@127.0.0.1" in str(alarms[0].get("DESCRIPTION"))  # its port, once armed
    daemon.kill()  # killed while armed: the next daemon must still start it at its start, and only then
    attempts = 0
    while datetime.now(UTC) < start - timedelta(seconds=1.5):
        assert try_login(armed.port, "alice", keys["alice"], timeout=1) is None, "logged in before the start"
        attempts += 1
        time.sleep(0.2)
    assert attempts > 0, "armed too late to try a login before the start"
    assert "running:" not in description(calendar, "armed@test")
    daemon = DaemonProcess(config).start()
    daemons.append(daemon)
    client = wait_for("the booker's login after the start", lambda: try_login(armed.port, "alice", keys["alice"]),
                      timeout=30, interval=0.05, daemon=daemon)
    assert datetime.now(UTC) >= start
    client.close()
    line = f"running: ssh -p {armed.port} alice@127.0.0.1"
    wait_for("the ssh line in the event", lambda: line in description(calendar, "armed@test"), timeout=30,
             daemon=daemon)
    same = running_container(engine, "armed@test")
    assert same is not None and same.id == armed.id  # the armed container itself, not a second run
    said = events(tmp_path, "armed@test")
    assert any(m.startswith("started") and "SSH answered" in m for m in said), said
    assert not any(m.startswith("adopted") for m in said), said
    with State(tmp_path / "state" / "state.sqlite") as state:
        assert state.notes("armed") == {}
        assert state.ports() == {"armed@test": armed.port}


def test_a_booking_deleted_while_armed_loses_its_container_and_port(tmp_path: Path, radicale, engine, keys,
                                                                     cleanup, daemons) -> None:
    calendar = radicale.new_calendar()
    config = write_config(tmp_path, str(calendar.url), keys=keys, poll_seconds=1, gpus=8)
    start = soon(40)
    book(calendar, "gone@test", user="bob", start=start, end=start + timedelta(seconds=600), gpus="6,")
    cleanup.append("gone@test")
    daemon = DaemonProcess(config).start()
    daemons.append(daemon)
    armed = wait_for("the container run ahead of its start", lambda: running_container(engine, "gone@test"),
                     timeout=40, interval=0.05, daemon=daemon)
    calendar.event_by_uid("gone@test").delete()
    wait_for("the armed container removed", lambda: engine.inspect(armed.name) is None, timeout=20, daemon=daemon)
    assert datetime.now(UTC) < start

    # The handler's steps after the removal, in its order: the port given back, the armed note
    # cleared, the event line. Waited for as a whole: the test once read the state between the first
    # two (CI, 2026-11-26).
    def handled() -> bool | None:
        said = any("removed its container run ahead of its start" in m for m in events(tmp_path, "gone@test"))
        with State(tmp_path / "state" / "state.sqlite") as state:
            return (said and "gone@test" not in state.ports() and "gone@test" not in state.notes("armed")) or None

    wait_for("the armed booking's port, note and line handled", handled, timeout=20, daemon=daemon)
    with State(tmp_path / "state" / "state.sqlite") as state:
        assert state.containers(booking_id="gone@test") == []  # never started: no run, no notice
        assert state.ports() == {} and state.notes("armed") == {}


def test_an_armed_booking_given_to_another_user_never_opens_for_the_old_one(tmp_path: Path, radicale, engine, keys,
                                                                            cleanup, daemons) -> None:
    """Hostile (issue 22, finding 17): alice's booking is armed, then its event names bob. The armed
    container (alice's account and keys) is removed before the start, and bob's starts at the start.
    Before, alice's armed container stayed and opened at the start, for alice, until its start
    replaced it a few seconds later."""
    calendar = radicale.new_calendar()
    config = write_config(tmp_path, str(calendar.url), keys=keys, poll_seconds=1, gpus=8)
    start = soon(30)
    end = start + timedelta(seconds=600)
    book(calendar, "rebook@test", user="alice", start=start, end=end, gpus="5,")
    cleanup.append("rebook@test")
    daemon = DaemonProcess(config).start()
    daemons.append(daemon)
    armed = wait_for("alice's container run ahead of its start", lambda: running_container(engine, "rebook@test"),
                     timeout=25, interval=0.05, daemon=daemon)
    assert armed.user == "alice" and armed.start == start

    def edited() -> bool:
        event = calendar.event_by_uid("rebook@test")
        event.data = event_text("rebook@test", user="bob", start=start, end=end, gpus="5,")
        try:
            event.save()
        except dav_error.ETagMismatchError:
            return False  # gpubook wrote back in between: read it again
        return True

    wait_for("the event given to bob", edited, timeout=10, daemon=daemon)
    before_start = (start - datetime.now(UTC)).total_seconds() - 1
    assert before_start > 2, "the edit came too late to test the disarm before the start"
    wait_for("alice's armed container removed before the start",
             lambda: (now := engine.inspect(armed.name)) is None or now.id != armed.id,
             timeout=before_start, interval=0.05, daemon=daemon)
    assert datetime.now(UTC) < start
    # The disarm handler logs its line after the stop, the port's release and the note's clearing.
    wait_for("the disarm's line in the event log",
             lambda: any("user or SSH keys changed" in m for m in events(tmp_path, "rebook@test")),
             timeout=10, daemon=daemon)
    bobs = wait_for("bob's container after the start", lambda: (c := running_container(engine, "rebook@test"))
                    and c.user == "bob" and c.port and c, timeout=60, interval=0.1, daemon=daemon)
    client = wait_for("bob's login", lambda: try_login(bobs.port, "bob", keys["bob"]), timeout=30, daemon=daemon)
    client.close()
    assert try_login(bobs.port, "alice", keys["alice"]) is None


def test_an_armed_container_with_another_spec_at_the_start_is_run_again_at_once(tmp_path: Path, radicale, engine,
                                                                                  keys, cleanup, daemons) -> None:
    """Its spec changed between the arm and the start (here the daemon's told clock jumped, which moves
    the start's real moment in GPUBOOK_NOT_BEFORE; a template edited in between does the same): the start
    replaced it at once. It once failed with "already runs with another spec; stop it first; retry in 5
    min", a start 5 minutes late (found by bench/soak.py)."""
    calendar = radicale.new_calendar()
    config = write_config(tmp_path, str(calendar.url), keys=keys, poll_seconds=60, gpus=8)
    clock = ToldClock(tmp_path)
    start = clock.soon(LEAD.total_seconds() + 30)
    book(calendar, "respec@test", user="alice", start=start, end=start + timedelta(seconds=600), gpus="5,")
    cleanup.append("respec@test")
    daemon = DaemonProcess(config, env=clock.env()).start()
    daemons.append(daemon)
    armed = wait_for("the container run ahead of its start", lambda: running_container(engine, "respec@test"),
                     timeout=LEAD.total_seconds() + 60, interval=0.05, daemon=daemon)
    clock.advance_to(start, daemon)  # the start is now, in the daemon's time: its spec's real moment moved
    client = wait_for("the booker's login at the start", lambda: try_login(armed.port, "alice", keys["alice"]),
                      timeout=60, interval=0.1, daemon=daemon)
    client.close()
    again = running_container(engine, "respec@test")
    assert again is not None and again.id != armed.id  # run again, on the port it had
    # The booker may log in before the daemon's own probe has returned and its start is logged: wait for it.
    wait_for("the start in the event log", lambda: any(m.startswith("started") and "SSH answered" in m
                                                       for m in events(tmp_path, "respec@test")),
             timeout=60, interval=0.1, daemon=daemon)
    said = events(tmp_path, "respec@test")
    assert not any("another spec" in m for m in said), said


def test_a_start_replaces_its_own_container_run_ahead_for_a_later_start(tmp_path: Path, engine, keys,
                                                                         cleanup) -> None:
    """A booking armed for a later start and moved to start now: when its start comes before the pass has
    removed the container run ahead for the old start (their lanes run side by side), the start met it
    and failed with "already runs with another spec", retried 5 minutes later (found by bench/soak.py).
    That container's start is still to come, so its SSH is shut and nobody is in it: the start replaces
    it. One whose start has come (its SSH may be open) is never replaced."""
    data = Path(tempfile.mkdtemp(prefix="taken-", dir=safe_data.MOUNT))
    host = LocalHost(engine=engine, gpus=tuple(range(8)), driver_version=None,
                     probe_key=paramiko.ECDSAKey.generate(bits=256), cache_dir=tmp_path / "cache", data_root=data)
    later = datetime.now(UTC).replace(microsecond=0) + timedelta(minutes=10)
    request = StartRequest(booking_id="taken@test", booker=Booker("alice", 2001, 2001, (key_line(keys["alice"]),)),
                           template=get_template("debian-ssh"), gpus=(3,), port=lane_port(),
                           end=later + timedelta(hours=1), start=later)
    cleanup.append("taken@test")
    armed = host.arm(request)
    now = datetime.now(UTC).replace(microsecond=0)
    started = host.start(replace(request, start=now))
    assert started.info.id != armed.id
    client = wait_for("the booker's login", lambda: try_login(request.port, "alice", keys["alice"]), timeout=30)
    client.close()
    with pytest.raises(SpecTaken):  # open since `now`: another spec never takes it away
        host.start(replace(request, start=now - timedelta(minutes=1)))
    assert running_container(engine, "taken@test").id == started.info.id
