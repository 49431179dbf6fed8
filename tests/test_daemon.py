"""The daemon end to end: real Radicale, real rootless podman, `gpubook run` as a real process,
the booker logging in with paramiko. Bookings last seconds; warn_minutes is 0.1 (6 s)."""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from caldav.lib import error as dav_error

from gpubook.runtime.engines import container_name
from gpubook.scheduler.commands import admin
from gpubook.scheduler.state import State
from tests.kits.daemon_kit import (
    DAEMON_MODULE,
    DaemonProcess,
    assert_warned,
    book,
    cli,
    description,
    events,
    run,
    running_container,
    soon,
    try_login,
    wait_for,
    write_config,
)
from tests.kits.told_clock import ToldClock

pytestmark = DAEMON_MODULE


def test_booking_runs_from_start_to_end(tmp_path: Path, radicale, engine, keys, cleanup, daemons) -> None:
    calendar = radicale.new_calendar()
    config = write_config(tmp_path, str(calendar.url), keys=keys, poll_seconds=60)
    start = soon(8)
    end = start + timedelta(seconds=16)  # warned at end - 6 s
    book(calendar, "life@test", user="alice", start=start, end=end)
    cleanup.append("life@test")
    daemon = DaemonProcess(config).start()
    daemons.append(daemon)

    wait_for("the daemon's first pass", lambda: (tmp_path / "state" / "daemon-status.json").exists(),
             timeout=60, daemon=daemon)
    early = running_container(engine, "life@test")
    assert early is None or early.start == start  # not before its start, or armed for it (SSH closed until then)
    accepted = wait_for("accepted in the event", lambda: "accepted:" in description(calendar, "life@test"),
                        timeout=20, daemon=daemon)
    assert accepted

    while datetime.now(UTC) < start:
        time.sleep(0.02)
    info = wait_for("the container", lambda: running_container(engine, "life@test"), timeout=30,
                    interval=0.02, daemon=daemon)
    client = wait_for("SSH login as the booker", lambda: try_login(info.port, "alice", keys["alice"]),
                      timeout=30, interval=0.02, daemon=daemon)
    login_after = (datetime.now(UTC) - start).total_seconds()
    # Long before the next poll (60 s): the start came from the boundary job, not a poll.
    assert login_after < 30, login_after
    print(f"booker logged in {login_after:.2f} s after the start")
    try:
        line = f"running: ssh -p {info.port} alice@127.0.0.1"
        wait_for("the ssh line in the event", lambda: line in description(calendar, "life@test"), timeout=10,
                 daemon=daemon)
        assert run(client, "echo result > /data/output/result.txt")[0] == 0
        assert_warned(client, warn_at=end - timedelta(seconds=6), daemon=daemon)
        warned_at = datetime.now(UTC)
        assert warned_at < end
    finally:
        client.close()

    wait_for("the stop at the end", lambda: engine.inspect(container_name("life@test")) is None,
             timeout=30, daemon=daemon)
    assert datetime.now(UTC) >= end
    assert (tmp_path / "data" / "alice" / "output" / "result.txt").read_text() == "result\n"
    ended = wait_for("ended in the event", lambda: "ended:" in description(calendar, "life@test"), timeout=10,
                     daemon=daemon)
    assert ended
    text = description(calendar, "life@test")
    assert "GPU-hours" in text and "outputs: 127.0.0.1:" in text and "user: alice" in text
    assert daemon.process is not None and daemon.process.poll() is None
    daemon.signal(signal.SIGTERM)
    assert daemon.process.wait(timeout=30) == 0


def test_kill_9_then_restart_adopts_the_same_container(tmp_path: Path, radicale, engine, keys, cleanup,
                                                       daemons) -> None:
    calendar = radicale.new_calendar()
    config = write_config(tmp_path, str(calendar.url), keys=keys, poll_seconds=60)
    book(calendar, "adopt@test", user="alice", start=soon(0) - timedelta(seconds=1),
         end=soon(600))
    cleanup.append("adopt@test")
    daemon = DaemonProcess(config).start()
    daemons.append(daemon)
    first = wait_for("the container", lambda: running_container(engine, "adopt@test"), timeout=60, daemon=daemon)
    status_file = tmp_path / "state" / "daemon-status.json"
    for round_number in range(20):
        daemon.kill()
        daemon = DaemonProcess(config).start()
        daemons.append(daemon)
        pid = daemon.process.pid  # type: ignore[union-attr]
        if round_number % 2:
            # Every other round dies mid-way through its first pass, at a different moment each time.
            time.sleep(0.3 + 0.1 * (round_number % 7))
            continue
        wait_for(f"round {round_number}: a pass of the new daemon",
                 lambda pid=pid: status_file.exists() and json.loads(status_file.read_text())["pid"] == pid,
                 timeout=60, interval=0.05, daemon=daemon)
        mine = [c for c in engine.list() if c.booking_id == "adopt@test"]
        assert [(c.id, c.state) for c in mine] == [(first.id, "running")], round_number
    daemon.kill()
    daemon = DaemonProcess(config).start()
    daemons.append(daemon)
    pid = daemon.process.pid  # type: ignore[union-attr]
    wait_for("a pass of the last daemon", lambda: json.loads(status_file.read_text())["pid"] == pid,
             timeout=60, daemon=daemon)
    mine = [c for c in engine.list() if c.booking_id == "adopt@test"]
    assert [(c.id, c.state) for c in mine] == [(first.id, "running")]
    with State(tmp_path / "state" / "state.sqlite") as state:
        assert len(state.containers(booking_id="adopt@test")) == 1
        assert state.ports() == {"adopt@test": first.port}


def test_calendar_outage(tmp_path: Path, radicale, engine, keys, cleanup, daemons) -> None:
    calendar = radicale.new_calendar()
    # Data older than 0.1 min (6 s) starts nothing.
    config = write_config(tmp_path, str(calendar.url), keys=keys, poll_seconds=1, stale_after_minutes=0.1)
    # The later booking's start is told to the daemon once the calendar is down, so that its data is
    # stale then whatever the load (a start 14 s ahead on the wall clock was once reached with data
    # 5 s old, and rightly started).
    clock = ToldClock(tmp_path)
    book(calendar, "now@test", user="alice", start=clock.soon(0) - timedelta(seconds=1), end=clock.soon(3600),
         gpus="0,")
    later_start = clock.soon(600)
    book(calendar, "later@test", user="bob", start=later_start, end=later_start + timedelta(seconds=600),
         gpus="1,")
    cleanup += ["now@test", "later@test"]
    daemon = DaemonProcess(config, env=clock.env()).start()
    daemons.append(daemon)
    running = wait_for("the running booking", lambda: running_container(engine, "now@test"), timeout=60,
                       daemon=daemon)
    wait_for("a poll that knows the later booking", lambda: "accepted:" in description(calendar, "later@test"),
             timeout=20, daemon=daemon)

    radicale.stop()
    try:
        wait_for("the outage in the log", lambda: any(m.startswith("calendar unreachable") for m in events(tmp_path)),
                 timeout=30, daemon=daemon)
        clock.advance_to(later_start + timedelta(seconds=3), daemon)
        wait_for("the later booking held back", lambda: any("not started: the calendar data is" in m
                                                            for m in events(tmp_path, "later@test")),
                 timeout=30, daemon=daemon)
        assert running_container(engine, "later@test") is None  # stale data starts nothing
        assert running_container(engine, "now@test").id == running.id  # unaffected
        time.sleep(2)  # a few failed polls more: still logged once
        log = events(tmp_path)
        assert len([m for m in log if m.startswith("calendar unreachable")]) == 1, log
        assert "connection refused" in next(m for m in log if m.startswith("calendar unreachable")).lower()
    finally:
        radicale.start()
    later = wait_for("the later booking after the outage", lambda: running_container(engine, "later@test"),
                     timeout=30, daemon=daemon)
    assert later.gpus == (1,)
    assert running_container(engine, "now@test").id == running.id
    log = events(tmp_path)
    assert len([m for m in log if m.startswith("calendar reachable again")]) == 1, log
    assert any("not started: the calendar data is" in m for m in events(tmp_path, "later@test"))


def _started(tmp_path: Path, radicale, engine, keys, cleanup, daemons, booking_id: str):
    """A booking running now under a daemon that polls every 2 s and restarts a dead container
    after 1 s: the calendar, the daemon and the container (its start logged)."""
    calendar = radicale.new_calendar()
    config = write_config(tmp_path, str(calendar.url), keys=keys, poll_seconds=2, restart_backoff_seconds=1)
    book(calendar, booking_id, user="alice", start=soon(0) - timedelta(seconds=1), end=soon(600))
    cleanup.append(booking_id)
    daemon = DaemonProcess(config).start()
    daemons.append(daemon)
    wait_for("the container", lambda: running_container(engine, booking_id), timeout=60, daemon=daemon)
    wait_for("the start in the log", lambda: any(m.startswith("started") for m in events(tmp_path, booking_id)),
             timeout=30, daemon=daemon)
    return calendar, daemon, running_container(engine, booking_id)


def test_container_killed_from_outside_is_restarted(tmp_path: Path, radicale, engine, keys, cleanup,
                                                   daemons) -> None:
    # The death is noticed on the next poll (2 s here); the restart comes after the 1 s back-off.
    calendar, daemon, first = _started(tmp_path, radicale, engine, keys, cleanup, daemons, "dies@test")
    subprocess.run([*engine.global_argv(), "kill", first.name], check=True, capture_output=True)  # type: ignore[attr-defined]
    second = wait_for("a new container", lambda: (c := running_container(engine, "dies@test")) and c.id != first.id
                      and c, timeout=60, daemon=daemon)
    assert second.port == first.port
    client = wait_for("SSH after the restart", lambda: try_login(second.port, "alice", keys["alice"]), timeout=30)
    client.close()
    # The daemon logs the restart once its own SSH probe has answered, which may be just after ours.
    wait_for("the restart in the log",
             lambda: any("restart 1 after it died" in m for m in events(tmp_path, "dies@test")),
             timeout=15, daemon=daemon)
    log = events(tmp_path, "dies@test")
    assert any(m.startswith("died:") for m in log), log
    assert any("restart 1 after it died" in m for m in log), log
    wait_for("the restart in the event", lambda: "after its container died" in description(calendar, "dies@test"),
             timeout=30, daemon=daemon)


def test_a_container_whose_network_namespace_podman_lost_is_started_again(tmp_path: Path, radicale, engine, keys,
                                                                         cleanup, daemons) -> None:
    """CI on 2026-11-27: after podman's pause process ended while a booking's container ran, every
    pass failed ("podman ps: joining network namespace of container …: unknown FS magic") and no
    booking started or stopped for the rest of the run. The state is made as a new pause process
    leaves it (the container's network namespace is no mount in podman's mount namespace); the
    daemon removes that container and starts the booking again, reachable as before."""
    _, daemon, first = _started(tmp_path, radicale, engine, keys, cleanup, daemons, "lost@test")
    podman = engine.global_argv()  # type: ignore[attr-defined]
    tried: list[str] = []  # once failed in a clean-clone run (umount's exit 32, its words not kept): tried again

    def unmounted() -> bool:
        netns = subprocess.run([*podman, "inspect", "--format", "{{.NetworkSettings.SandboxKey}}", first.name],
                               check=True, capture_output=True, text=True).stdout.strip()
        done = subprocess.run([*podman, "unshare", "umount", netns], capture_output=True, text=True)
        tried.append(f"{netns}: {done.returncode} {done.stderr.strip()}")
        return done.returncode == 0

    deadline = time.monotonic() + 30
    while not unmounted():
        assert time.monotonic() < deadline, f"its network namespace stayed mounted: {tried}\n{daemon.tail()}"
        time.sleep(1)
    wait_for("the daemon's removal", lambda: f"container {first.name} lost its network namespace" in daemon.tail(),
             timeout=60, daemon=daemon)
    second = wait_for("a new container", lambda: (c := running_container(engine, "lost@test")) and c.id != first.id
                      and c, timeout=60, daemon=daemon)
    assert second.port == first.port
    client = wait_for("SSH after the restart", lambda: try_login(second.port, "alice", keys["alice"]), timeout=30)
    client.close()
    assert "reconcile pass failed" not in daemon.tail()


def test_back_to_back_bookings_hand_over_one_gpu(tmp_path: Path, radicale, engine, keys, cleanup,
                                                daemons) -> None:
    calendar = radicale.new_calendar()
    config = write_config(tmp_path, str(calendar.url), keys=keys, gpus=1, poll_seconds=60, warn_minutes=0.05)
    clock = ToldClock(tmp_path)  # the handover comes when the first booking runs, told to the daemon
    handover = clock.soon(600)
    book(calendar, "first@test", user="alice", start=clock.soon(0) - timedelta(seconds=1), end=handover, gpus="0,")
    book(calendar, "second@test", user="bob", start=handover, end=handover + timedelta(seconds=600), gpus="0,")
    cleanup += ["first@test", "second@test"]
    daemon = DaemonProcess(config, env=clock.env()).start()
    daemons.append(daemon)
    first = wait_for("the first booking", lambda: running_container(engine, "first@test"), timeout=60,
                     daemon=daemon)
    assert first.gpus == (0,)
    assert running_container(engine, "second@test") is None
    clock.advance_to(handover, daemon)
    second = wait_for("the second booking", lambda: running_container(engine, "second@test"), timeout=60,
                      interval=0.05, daemon=daemon)
    assert second.gpus == (0,)
    left = engine.inspect(first.name)  # never both at once on GPU 0
    assert left is None or not left.running, f"the first booking's container still runs: {left}\n{daemon.tail()}"
    # ...and nothing of it stays (a `podman rm` that failed under load is done again by the next pass)
    wait_for("the first booking's container removed", lambda: engine.inspect(first.name) is None or None,
             timeout=60, daemon=daemon)
    client = wait_for("bob's login", lambda: try_login(second.port, "bob", keys["bob"]), timeout=30)
    client.close()
    wait_for("the second start in the log",
             lambda: any(m.startswith("started") for m in events(tmp_path, "second@test")), timeout=30)
    with State(tmp_path / "state" / "state.sqlite") as state:
        log = [(e.id, e.booking_id, e.message) for e in state.events()]
    stopped = next(i for i, b, m in log if b == "first@test" and m.startswith("stopped"))
    started = next(i for i, b, m in log if b == "second@test" and m.startswith("started"))
    assert stopped < started


def test_user_edit_during_write_back_survives(tmp_path: Path, radicale, engine, keys, cleanup, daemons) -> None:
    calendar = radicale.new_calendar()
    config = write_config(tmp_path, str(calendar.url), keys=keys, poll_seconds=1)
    start = soon(6)
    book(calendar, "edit@test", user="alice", start=start, end=start + timedelta(seconds=600))
    cleanup.append("edit@test")
    daemon = DaemonProcess(config).start()
    daemons.append(daemon)
    # The user keeps editing the event (each edit a read and a conditional write, as clients do)
    # while gpubook writes accepted, then running, into the same event.
    edits = 0
    deadline = time.monotonic() + 25
    while time.monotonic() < deadline and not (edits >= 10 and running_container(engine, "edit@test")):
        event = calendar.event_by_uid("edit@test")
        component = event.icalendar_component
        component["SUMMARY"] = f"alice debian-ssh, edit {edits}"
        component["LOCATION"] = f"room {edits}"
        try:
            event.save(increase_seqno=False, precondition="etag")
            edits += 1
        except (dav_error.ETagMismatchError, dav_error.ScheduleTagMismatchError):
            continue  # a 412: gpubook wrote in between; read again, as a client does
        time.sleep(0.2)
    wait_for("running in the event", lambda: "running: ssh -p" in description(calendar, "edit@test"),
             timeout=20, daemon=daemon)
    component = calendar.event_by_uid("edit@test").icalendar_component
    assert str(component["SUMMARY"]) == f"alice debian-ssh, edit {edits - 1}"
    assert str(component["LOCATION"]) == f"room {edits - 1}"
    assert str(component["X-GPUBOOK-STATUS"]) == "running"
    assert "user: alice" in str(component["DESCRIPTION"])


def test_status_stop_and_log_commands(tmp_path: Path, radicale, engine, keys, cleanup, daemons,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    calendar = radicale.new_calendar()
    config = write_config(tmp_path, str(calendar.url), keys=keys, poll_seconds=1)
    book(calendar, "admin@test", user="alice", start=soon(0) - timedelta(seconds=1), end=soon(600))
    later = soon(300)
    book(calendar, "next@test", user="bob", start=later, end=later + timedelta(seconds=60))
    cleanup += ["admin@test"]
    daemon = DaemonProcess(config).start()
    daemons.append(daemon)
    info = wait_for("the container", lambda: running_container(engine, "admin@test"), timeout=60, daemon=daemon)
    wait_for("a pass that wrote the status file", lambda: (tmp_path / "state" / "daemon-status.json").exists(),
             timeout=30)

    done = cli(config, "status", "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["gpus"]["source"] in ("config", "nvml")
    assert [(r["booking"], r["port"], r["state"]) for r in report["running"]] == [("admin@test", info.port, "running")]
    assert [n["id"] for n in report["next"]] == ["next@test"]
    assert report["last_poll"] and report["outage"] is None
    text = cli(config, "status")
    assert "admin@test" in text.stdout and f"port {info.port}" in text.stdout

    # `gpubook stop` as its command runs it, here in this process: it starts no thread pool and no
    # thread of gpubook's (no Pass, no lanes, no write-back lane: it writes the event itself), beside
    # the running daemon. Its HTTP client's keepalive watchers (urllib3-future starts one per
    # connection pool, the daemon's too) are the library's own.
    started: list[tuple[str, str]] = []
    start_thread = threading.Thread.start

    def counted(thread: threading.Thread) -> None:
        target = getattr(thread, "_target", None)
        started.append((thread.name, getattr(target, "__module__", "") or type(thread).__module__))
        start_thread(thread)

    monkeypatch.setattr(threading.Thread, "start", counted)
    assert admin.stop(str(config), "admin@test") == 0
    monkeypatch.undo()
    ours = [(name, module) for name, module in started
            if module.startswith(("gpubook", "concurrent.futures", "apscheduler")) or name.startswith("gpubook")]
    assert ours == [] and all(module.startswith("urllib3") for _, module in started), started
    assert engine.inspect(info.name) is None
    # `gpubook stop` writes "ended" itself; a pass of the running daemon that began before the stop
    # may write its older view once more, and the next pass puts "ended" back.
    wait_for("the ended note", lambda: "stopped early by an admin" in description(calendar, "admin@test"),
             timeout=15, daemon=daemon)
    assert "ended:" in description(calendar, "admin@test")
    time.sleep(3)  # three polls: the daemon does not start it again
    assert engine.inspect(info.name) is None

    done = cli(config, "log")
    assert done.returncode == 0
    assert "admin@test: stopped (stopped by an admin)" in done.stdout
    assert "admin@test: started on GPU" in done.stdout
    assert cli(config, "stop", "admin@test").returncode == 1  # nothing runs any more


def test_sighup_refuses_a_broken_config_and_keeps_running(tmp_path: Path, radicale, engine, keys,
                                                          daemons) -> None:
    calendar = radicale.new_calendar()
    config = write_config(tmp_path, str(calendar.url), keys=keys, poll_seconds=1)
    daemon = DaemonProcess(config).start()
    daemons.append(daemon)
    wait_for("the first pass", lambda: (tmp_path / "state" / "daemon-status.json").exists(), timeout=60)
    good = config.read_text()
    config.write_text(good.replace("poll_seconds = 1", "poll_seconds = -5"))
    daemon.signal(signal.SIGHUP)
    wait_for("the refusal", lambda: any(m.startswith("reload refused") for m in events(tmp_path)), timeout=20,
             daemon=daemon)
    assert "daemon.poll_seconds: must be greater than 0" in next(
        m for m in events(tmp_path) if m.startswith("reload refused"))
    config.write_text(good)
    daemon.signal(signal.SIGHUP)
    wait_for("the reload", lambda: any("and templates reloaded" in m for m in events(tmp_path)), timeout=20,
             daemon=daemon)
    assert daemon.process is not None and daemon.process.poll() is None


def test_a_second_daemon_on_the_same_state_folder_exits_and_leaves_the_first_ones_container(
        tmp_path: Path, radicale, engine, keys, cleanup, daemons) -> None:
    """issue 9, finding 13: two daemons on one account start, stop and remove each other's
    containers. The second one exits at once, naming the first one's pid; nothing of the first
    one's is touched."""
    calendar = radicale.new_calendar()
    config = write_config(tmp_path, str(calendar.url), keys=keys, poll_seconds=60)
    book(calendar, "one@test", user="alice", start=soon(0) - timedelta(seconds=1), end=soon(600))
    cleanup.append("one@test")
    first = DaemonProcess(config).start()
    daemons.append(first)
    info = wait_for("the first daemon's container", lambda: running_container(engine, "one@test"), timeout=60,
                    daemon=first)
    second = DaemonProcess(config)
    second.log = tmp_path / "second.log"
    second.start()
    daemons.append(second)
    assert second.process is not None and second.process.wait(timeout=60) != 0
    pid = first.process.pid  # type: ignore[union-attr]
    said = second.log.read_text()
    assert f"another gpubook daemon (pid {pid}) already runs on the state folder" in said, said
    assert first.process is not None and first.process.poll() is None
    again = running_container(engine, "one@test")
    assert again is not None and again.id == info.id


def test_a_locked_state_database_fails_steps_not_the_daemon(tmp_path: Path, radicale, engine, keys, cleanup,
                                                            daemons) -> None:
    """issue 9, finding 8: another process holds the state database (BEGIN EXCLUSIVE) during the
    daemon's first passes. Each booking's step fails alone, the daemon keeps running and waking,
    and once the lock is gone both bookings start."""
    import sqlite3

    calendar = radicale.new_calendar()
    config = write_config(tmp_path, str(calendar.url), keys=keys, poll_seconds=5)
    book(calendar, "locked-a@test", user="alice", start=soon(0) - timedelta(seconds=1), end=soon(600), gpus="0,")
    book(calendar, "locked-b@test", user="bob", start=soon(0) - timedelta(seconds=1), end=soon(600), gpus="1,")
    cleanup += ["locked-a@test", "locked-b@test"]
    State(tmp_path / "state" / "state.sqlite").close()  # made and migrated before the lock
    locker = sqlite3.connect(tmp_path / "state" / "state.sqlite", isolation_level=None)
    locker.execute("BEGIN EXCLUSIVE")
    daemon = DaemonProcess(config).start()
    daemons.append(daemon)
    try:
        wait_for("a start failing on the locked database",
                 lambda: "could not be used: database is locked" in daemon.tail(), timeout=120, daemon=daemon)
        assert running_container(engine, "locked-a@test") is None
    finally:
        locker.execute("ROLLBACK")
        locker.close()
    for booking_id in ("locked-a@test", "locked-b@test"):
        wait_for(f"{booking_id} running after the lock", lambda b=booking_id: running_container(engine, b),
                 timeout=120, daemon=daemon)
    assert daemon.process is not None and daemon.process.poll() is None
