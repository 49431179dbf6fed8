"""The daemon under a burst of signals: thousands of SIGUSR1 (each a "look now", as tests and benches
tell its clock) and SIGHUPs, then SIGTERM. Its handlers once set threading Events in the signal handler:
a signal that came while the main thread held an Event's lock blocked the handler for good and each
later one stacked another on it until "RecursionError: maximum recursion depth exceeded" ended the
daemon (found by bench/soak.py). Now the signals travel through a wakeup fd to a thread."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import paramiko

from tests.kits.daemon_kit import DaemonProcess, daemon_test, wait_for, write_config


@daemon_test
def test_a_burst_of_signals_neither_stops_nor_hangs_the_daemon(tmp_path: Path) -> None:
    config = write_config(tmp_path, "http://127.0.0.1:9/cal/", keys={"alice": paramiko.ECDSAKey.generate(bits=256)},
                          poll_seconds=60)
    daemon = DaemonProcess(config).start()
    assert daemon.process is not None
    try:
        wait_for("the first pass", lambda: (tmp_path / "state" / "daemon-status.json").is_file(), timeout=120,
                 daemon=daemon)
        for number in range(3000):
            os.kill(daemon.process.pid, signal.SIGHUP if number % 500 == 0 else signal.SIGUSR1)
            if number % 50 == 0:
                time.sleep(0.01)  # the main loop wakes between the bursts, holding its wait's lock at times
        time.sleep(2)
        assert daemon.process.poll() is None, daemon.tail()
        # Still answering signals: a stop comes at once and cleanly.
        os.kill(daemon.process.pid, signal.SIGTERM)
        assert daemon.process.wait(timeout=60) == 0, daemon.tail()
        assert "RecursionError" not in daemon.tail() and "Traceback" not in daemon.tail(), daemon.tail()
    finally:
        daemon.kill()
