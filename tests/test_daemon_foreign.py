"""Processes on a booked GPU outside its booking's container, with the real daemon, Radicale and
rootless podman; NVML's process list comes from tests/kits/fake_gpus.py, the PIDs are real: a `sleep` the
booker starts in their container over SSH (a subordinate uid's process), a `sleep` this test starts
on the host, and the host's pid 1 (root's: the daemon may not signal it).

With a poll of 60 s, the event and the status file showing the outside process within seconds is
the sampler asking for a pass itself. In "stop" mode the outside process is stopped after the
grace; pid 1 is reported as not stoppable; the booker's own process is never reported nor signalled."""

from __future__ import annotations

import json
import os
import subprocess
from datetime import timedelta
from pathlib import Path

import pytest

from tests.kits import daemon_kit, fake_gpus
from tests.kits.daemon_kit import (
    DAEMON_MODULE,
    DaemonProcess,
    book,
    description,
    running_container,
    sampled_config,
    soon,
    try_login,
    wait_for,
)

pytestmark = [
    *DAEMON_MODULE,
    pytest.mark.skipif(os.geteuid() == 0, reason="the daemon runs as an unprivileged user (pid 1 is not its own)"),
]
GPU = 6  # a GPU no other daemon test books


def _pids_running(*argv: str) -> list[int]:
    wanted = "\0".join(argv).encode() + b"\0"
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if (entry / "cmdline").read_bytes() == wanted:
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def test_a_process_outside_the_booking_is_reported_and_stopped_and_its_own_never(tmp_path: Path, radicale, engine,
                                                                                 keys, cleanup, daemons) -> None:
    calendar = radicale.new_calendar()
    gpus = tmp_path / "gpus.json"
    fake_gpus.write(gpus, [{"utilisation": 0} for _ in range(8)])
    config = sampled_config(tmp_path, str(calendar.url), keys=keys, poll_seconds=60,
                            policy='foreign_processes = "stop"\nforeign_grace_minutes = 0.1\n')
    start = soon(6)
    book(calendar, "foreign@test", user="alice", start=start, end=start + timedelta(minutes=3), gpus=f"{GPU},")
    cleanup.append("foreign@test")
    daemon = DaemonProcess(config, env={fake_gpus.ENV: str(gpus)}).start()
    daemons.append(daemon)
    info = wait_for("alice's container", lambda: running_container(engine, "foreign@test"), timeout=60,
                    daemon=daemon)
    client = wait_for("alice's login", lambda: try_login(info.port, "alice", keys["alice"]), timeout=30,
                      daemon=daemon)
    client.exec_command("nohup sleep 4123 >/dev/null 2>&1 &")
    (own,) = wait_for("alice's sleep", lambda: _pids_running("sleep", "4123") or None, timeout=10)
    outside = subprocess.Popen(["sleep", "4124"])

    def event_saying(*parts: str) -> str | None:
        text = description(calendar, "foreign@test")
        return text if all(part in text for part in parts) else None

    try:
        fake_gpus.write(gpus, [{"utilisation": 0, "processes": [{"pid": p} for p in (info.pid, own, outside.pid, 1)]}
                               if i == GPU else {"utilisation": 0} for i in range(8)])
        line = f"foreign: GPU {GPU} is also used by pid {outside.pid} (sleep, "
        text = wait_for("the outside process in the event", lambda: event_saying(line), timeout=20, daemon=daemon)
        assert "gpubook stops it at" in text
        status = json.loads((tmp_path / "state" / "daemon-status.json").read_text())
        assert {item["pid"] for item in status["foreign"]} == {outside.pid, 1}
        assert outside.wait(timeout=30) < 0  # stopped after the grace (SIGTERM)
        text = wait_for("the stop in the event", timeout=20, daemon=daemon,
                        check=lambda: event_saying("gpubook stopped it at", "gpubook cannot stop it"))
        assert "pid 1 (" in text and "may not signal a process of root" in text
        assert f"pid {own} " not in text and f"pid {info.pid} " not in text  # the booking's own: never reported
        assert Path(f"/proc/{own}").exists()  # ... nor signalled
        listed = daemon_kit.cli(config, "status")
        assert f"GPU {GPU} (booking foreign@test): pid 1 (" in listed.stdout
        assert daemon.log.read_text().count("pid 1 (") >= 1
    finally:
        client.close()
        outside.kill()
        outside.wait()
