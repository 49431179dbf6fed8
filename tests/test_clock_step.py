"""The wall clock stepped by ±5 minutes (issue 26), through libfaketime (tests/kits/clock_step.py):
the kit moves a child's wall clock and leaves its monotonic clock alone, podman works under it,
and what the daemon does with a running booking when its clock jumps past the booking's end and back."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from tests.kits.clock_step import SteppedClock
from tests.kits.daemon_kit import (
    DaemonProcess,
    book,
    daemon_test,
    description,
    events,
    running_container,
    soon,
    wait_for,
    write_config,
)

STEP = 300

# Prints the wall clock and the monotonic clock, once per line read.
_READER = ("import datetime, sys, time\n"
           "for _ in sys.stdin:\n"
           "    print(datetime.datetime.now(datetime.UTC).timestamp(), time.monotonic(), flush=True)\n")


def test_a_child_sees_its_wall_clock_step_and_its_monotonic_clock_not(tmp_path: Path) -> None:
    clock = SteppedClock(tmp_path)
    child = subprocess.Popen([sys.executable, "-c", _READER], env={**os.environ, **clock.env()},
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert child.stdin is not None and child.stdout is not None

    def ahead() -> tuple[float, float]:
        """(the child's wall clock - ours, its monotonic clock - ours), read in one round trip."""
        child.stdin.write("\n")  # type: ignore[union-attr]
        child.stdin.flush()  # type: ignore[union-attr]
        before_wall, before_mono = time.time(), time.monotonic()
        wall, mono = map(float, child.stdout.readline().split())  # type: ignore[union-attr]
        return wall - before_wall, mono - before_mono

    try:
        seen = [ahead()]
        for seconds in (STEP, -2 * STEP):
            clock.step(seconds)
            seen.append(ahead())
        clock.reset()
        seen.append(ahead())
    finally:
        child.stdin.close()
        child.wait(timeout=30)
    # Each reading is taken within the round trip (well under the steps' size, under any CPU steal).
    walls = [round(wall / 60) * 60 for wall, _ in seen]
    assert walls == [0, STEP, -STEP, 0], seen
    assert all(abs(mono) < 30 for _, mono in seen), seen


@pytest.mark.podman
@pytest.mark.slow
def test_podman_works_under_a_stepped_clock(tmp_path: Path, engine, image: str) -> None:
    """The daemon's children inherit the environment: podman still runs a container under it (and,
    a Go program reading the clock through the vDSO, stamps it with the real time, not the stepped one)."""
    clock = SteppedClock(tmp_path)
    clock.step(STEP)
    env = {**os.environ, **clock.env()}
    name = f"gpubook-clock-step-{os.getpid()}"
    try:
        ran = subprocess.run(["podman", "--runtime", "runc", "run", "--name", name, image, "echo", "ran"], env=env,
                             capture_output=True, text=True, timeout=120, check=False)
        assert (ran.returncode, ran.stdout) == (0, "ran\n"), ran.stderr
        created = subprocess.run(["podman", "inspect", "--format", "{{.Created.Unix}}", name], env=env,
                                 capture_output=True, text=True, timeout=60, check=True).stdout.strip()
        assert abs(int(created) - time.time()) < 60, created
    finally:
        subprocess.run(["podman", "rm", "-f", name], capture_output=True, timeout=60, check=False)


def test_a_child_under_the_stepped_clock_can_sleep_and_wait(tmp_path: Path) -> None:
    """time.sleep, Event.wait and Popen.wait with a timeout (the daemon's loop, its scheduler, its
    engine calls) work under the clock: without the shim, libfaketime 0.9.10 fails every sleep."""
    clock = SteppedClock(tmp_path)
    clock.step(STEP)
    program = ("import subprocess, threading, time\n"
               "time.sleep(0.01)\n"
               "threading.Event().wait(0.01)\n"
               "child = subprocess.Popen(['sleep', '30'])\n"
               "try:\n    child.wait(timeout=0.01)\nexcept subprocess.TimeoutExpired:\n    child.kill()\n"
               "print('slept')\n")
    ran = subprocess.run([sys.executable, "-c", program], env={**os.environ, **clock.env()}, capture_output=True,
                         text=True, timeout=60, check=False)
    assert (ran.returncode, ran.stdout) == (0, "slept\n"), ran.stderr


@daemon_test
def test_a_step_past_a_running_bookings_end_and_back(tmp_path: Path, radicale, engine, keys, cleanup,
                                                     daemons) -> None:
    """The daemon's clock jumps 5 minutes ahead, past the end of a booking that has 2.5 minutes
    left, and comes back a little later. Seen: the booking is stopped as "ended" at once (the
    daemon cannot tell a step from time passing); the other booking keeps its container; the step
    back is noticed and polling goes on; the stopped booking, whose time has not come to an end, is
    started again (before the fix, a stop "ended" counted as a stop on purpose, core/decide.py
    `_start_actions`: it never ran again and its event said "accepted")."""
    calendar = radicale.new_calendar()
    config = write_config(tmp_path, str(calendar.url), keys=keys, poll_seconds=2)
    short_end, long_end = soon(150), soon(1200)
    book(calendar, "short@test", user="alice", start=soon(0) - timedelta(seconds=1), end=short_end, gpus="0,")
    book(calendar, "long@test", user="bob", start=soon(0) - timedelta(seconds=1), end=long_end, gpus="1,")
    cleanup += ["short@test", "long@test"]
    clock = SteppedClock(tmp_path)
    daemon = DaemonProcess(config, env=clock.env()).start()
    daemons.append(daemon)
    wait_for("short's container", lambda: running_container(engine, "short@test"), timeout=90, daemon=daemon)
    long = wait_for("long's container", lambda: running_container(engine, "long@test"), timeout=90, daemon=daemon)

    clock.step(STEP)
    wait_for("short stopped by the step past its end", lambda: "stopped (ended)" in events(tmp_path, "short@test"),
             timeout=60, daemon=daemon)
    assert running_container(engine, "short@test") is None
    # The main loop compares both clocks every 5 s: two of its rounds see the stepped clock, as on a
    # host whose clock stays stepped a while (a step back within one round would go unseen by it).
    time.sleep(12)
    clock.step(-STEP)
    wait_for("the step back noticed", lambda: any("wall clock stepped back" in line for line in events(tmp_path)),
             timeout=30, daemon=daemon)
    stepped_back = datetime.now(UTC)
    wait_for("a poll after the step back", lambda: _after(_status(tmp_path).get("last_poll"), stepped_back),
             timeout=30, daemon=daemon)
    assert daemon.process is not None and daemon.process.poll() is None, daemon.tail()
    assert running_container(engine, "long@test").id == long.id  # untouched by both steps
    assert datetime.now(UTC) < short_end - timedelta(seconds=30), "too slow to tell: short's time is over"
    # Its time is not over: it starts again (a new container; its outputs were kept), and says so.
    wait_for("short started again", lambda: running_container(engine, "short@test"), timeout=30, daemon=daemon)
    wait_for("short's event saying running", lambda: "running:" in description(calendar, "short@test"),
             timeout=30, daemon=daemon)


@daemon_test
def test_a_step_back_right_after_a_booking_started(tmp_path: Path, radicale, engine, keys, cleanup,
                                                   daemons) -> None:
    """The daemon's clock steps 5 minutes back (and stays there, as a corrected clock does) just
    after a booking started: to the daemon, its start is 5 minutes ahead again. Its container was
    started for that very start, so it goes on: no warning, no stop (before the fix the booker was
    warned that the booking "was moved to a later time" and the container stopped when the notice
    ran out, 20 s here: the running work lost)."""
    calendar = radicale.new_calendar()
    config = write_config(tmp_path, str(calendar.url), keys=keys, poll_seconds=2, notice_seconds=20)
    book(calendar, "fresh@test", user="alice", start=soon(0) - timedelta(seconds=1), end=soon(1200), gpus="0,")
    cleanup.append("fresh@test")
    clock = SteppedClock(tmp_path)
    daemon = DaemonProcess(config, env=clock.env()).start()
    daemons.append(daemon)
    first = wait_for("fresh's container", lambda: running_container(engine, "fresh@test"), timeout=90,
                     daemon=daemon)
    assert daemon.process is not None
    wait_for("the first pass", lambda: _status(tmp_path).get("pid") == daemon.process.pid, timeout=60, daemon=daemon)
    # The main loop reads both clocks every 5 s once the first pass is done: let it take a reading
    # before the step (a step during the first pass goes unseen by it, and polling then pauses for
    # the size of the step, APScheduler's next poll being in wall-clock time).
    time.sleep(6)
    clock.step(-STEP)
    wait_for("the step back noticed", lambda: any("wall clock stepped back" in line for line in events(tmp_path)),
             timeout=30, daemon=daemon)
    # To the daemon its start is 5 minutes ahead again, but its container was started for that very
    # start: the clock went back, the booking did not move. No warning of a move, no stop.
    deadline = time.monotonic() + 45  # past the 20 s notice a move would have given
    while time.monotonic() < deadline:
        assert running_container(engine, "fresh@test") is not None, events(tmp_path, "fresh@test")
        time.sleep(1)
    assert not any("moved to a later time" in line for line in events(tmp_path, "fresh@test"))
    assert running_container(engine, "fresh@test").id == first.id


def _after(stamp: object, moment: datetime) -> bool:
    return isinstance(stamp, str) and datetime.fromisoformat(stamp) >= moment


def _status(folder: Path) -> dict[str, object]:
    path = folder / "state" / "daemon-status.json"
    return json.loads(path.read_text()) if path.exists() else {}
