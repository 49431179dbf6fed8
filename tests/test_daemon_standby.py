"""Standby with the real daemon, Radicale and rootless podman (issue 40): alice's booking runs on
GPU 3 and nobody logs in; bob's booking for the same GPU and time says `standby: yes`, so it waits
(its event TENTATIVE, "on standby, …") instead of being refused, and a request made after it (bob's
again, without standby) for the same GPU is refused, plain. When alice's booking is released as a
no-show, bob's standby is promoted in the next pass: its event says running, and bob logs in over
SSH; the later request does not overtake it. The promotion is in State and the journal.

The no-show time is told to the daemon (tests/kits/told_clock.py), as in tests/test_daemon_reclaim.py.
"""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path

from gpubook.scheduler.state import State, notes
from tests.kits import fake_gpus
from tests.kits.daemon_kit import (
    DAEMON_MODULE,
    DaemonProcess,
    book,
    description,
    run,
    running_container,
    sampled_config,
    try_login,
    wait_for,
)
from tests.kits.told_clock import ToldClock

pytestmark = DAEMON_MODULE

GPU = 3
NO_SHOW = timedelta(minutes=10)


def _status(calendar, uid: str) -> str:  # type: ignore[no-untyped-def]
    component = calendar.event_by_uid(uid).icalendar_component
    return str(component.get("STATUS", ""))


def test_a_standby_waits_and_runs_when_a_no_show_is_released(tmp_path: Path, radicale, engine, keys, cleanup,
                                                             daemons) -> None:
    calendar = radicale.new_calendar()
    monitor = tmp_path / "gpus.json"
    fake_gpus.write(monitor, [{"utilisation": 0} for _ in range(8)])
    config = sampled_config(tmp_path, str(calendar.url), keys=keys, poll_seconds=1,
                            policy=f"no_show_minutes = {NO_SHOW.total_seconds() / 60:g}\n")
    clock = ToldClock(tmp_path)
    start = clock.soon(8)
    end = start + 2 * NO_SHOW  # never reached: the test ends before
    book(calendar, "gone@test", user="alice", start=start, end=end, gpus=f"{GPU},")
    cleanup.extend(["gone@test", "waits@test", "later@test"])
    daemon = DaemonProcess(config, env={fake_gpus.ENV: str(monitor), **clock.env()}).start()
    daemons.append(daemon)
    # Started, not only armed ahead of its start (the told clock's jump below must come after the
    # start: the armed container's spec waits for the host's time its start was then).
    wait_for("alice's booking running", lambda: "running: ssh -p" in description(calendar, "gone@test"), timeout=60,
             daemon=daemon)

    # bob's standby for the same GPU and time: it waits, tentative, and says so.
    book(calendar, "waits@test", user="bob", start=clock.soon(2), end=end, gpus=f"{GPU},",
         description="standby: yes\n")
    text = wait_for("bob's standby in his event", lambda: "on standby, waiting" in
                    (d := description(calendar, "waits@test")) and d, timeout=60, daemon=daemon)
    assert "on standby, waiting for its GPUs to free up: the GPUs asked for are taken: GPU 3 is booked by alice" \
        in " ".join(text.split()), text
    assert _status(calendar, "waits@test") == "TENTATIVE"
    # A plain request for the same GPU, made after the standby: refused (not on standby), and behind it.
    book(calendar, "later@test", user="bob", start=clock.soon(2), end=end, gpus=f"{GPU},")
    wait_for("the later request's refusal", lambda: "rejected: " in description(calendar, "later@test"), timeout=60,
             daemon=daemon)
    with State(tmp_path / "state" / "state.sqlite") as state:
        assert "waits@test" in notes.read(state).standby

    # alice never logs in: released as a no-show, and bob's standby runs at once.
    clock.advance_to(start + NO_SHOW + timedelta(seconds=5), daemon)
    wait_for("the no-show's container gone", lambda: running_container(engine, "gone@test") is None, timeout=45,
             daemon=daemon)
    gone = time.monotonic()
    promoted = wait_for("bob's container", lambda: running_container(engine, "waits@test"), timeout=60,
                        daemon=daemon)
    assert promoted.gpus == (GPU,)
    bob = wait_for("bob's login", lambda: try_login(promoted.port, "bob", keys["bob"]), timeout=30, daemon=daemon)
    seconds = time.monotonic() - gone
    assert run(bob, "true")[0] == 0
    bob.close()
    print(f"release → standby's SSH login: {seconds:.2f} s")
    wait_for("bob's running event", lambda: "running: ssh -p" in description(calendar, "waits@test"), timeout=60,
             daemon=daemon)
    assert running_container(engine, "later@test") is None  # the later request did not overtake him
    with State(tmp_path / "state" / "state.sqlite") as state:
        read = notes.read(state)
        assert "waits@test" in read.promoted and "waits@test" not in read.standby
        said = [entry.message for entry in state.events(booking_id="waits@test")]
    assert any(line.startswith("promoted from standby (waiting since ") for line in said), said
