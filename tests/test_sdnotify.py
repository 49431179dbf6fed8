"""gpubook.scheduler.sdnotify against real AF_UNIX datagram sockets (a path and the abstract namespace)."""

from __future__ import annotations

import os
import socket
import uuid
from pathlib import Path

import pytest

from gpubook.scheduler.sdnotify import Notifier


def _receive(sock: socket.socket) -> dict[str, str]:
    payload = sock.recv(4096).decode()
    return dict(line.split("=", 1) for line in payload.split("\n"))


@pytest.fixture
def path_socket(tmp_path: Path):
    address = str(tmp_path / "notify")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(address)
        sock.settimeout(5)
        yield address, sock


def test_ready_status_and_watchdog_over_a_path_socket(path_socket) -> None:
    address, sock = path_socket
    notifier = Notifier.from_environment({"NOTIFY_SOCKET": address})
    assert notifier.enabled
    assert notifier.ready(status="2 running, next start 09:00")
    assert _receive(sock) == {"READY": "1", "STATUS": "2 running, next start 09:00"}
    assert notifier.watchdog()
    assert _receive(sock) == {"WATCHDOG": "1"}
    assert notifier.status("polling")
    assert _receive(sock) == {"STATUS": "polling"}
    assert notifier.stopping()
    assert _receive(sock) == {"STOPPING": "1"}


def test_abstract_namespace_socket() -> None:
    name = f"gpubook-test-{uuid.uuid4().hex}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        sock.settimeout(5)
        notifier = Notifier.from_environment({"NOTIFY_SOCKET": "@" + name})
        assert notifier.reloading()
        assert _receive(sock) == {"RELOADING": "1"}


def test_a_newline_cannot_forge_another_field(path_socket) -> None:
    address, sock = path_socket
    Notifier(address).status("calendar down\nREADY=1")
    assert _receive(sock) == {"STATUS": "calendar down READY=1"}


def test_without_systemd_everything_is_a_quiet_no_op() -> None:
    notifier = Notifier.from_environment({})
    assert not notifier.enabled
    assert notifier.ready() is False and notifier.watchdog() is False
    assert notifier.watchdog_interval is None


def test_a_vanished_socket_is_reported_not_raised(tmp_path: Path, caplog) -> None:
    notifier = Notifier(str(tmp_path / "gone"))
    assert notifier.watchdog() is False
    assert "sd_notify" in caplog.text


def test_watchdog_interval_is_half_of_watchdog_usec_for_this_process_only() -> None:
    mine = Notifier.from_environment({"NOTIFY_SOCKET": "/x", "WATCHDOG_USEC": "30000000",
                                      "WATCHDOG_PID": str(os.getpid())})
    assert mine.watchdog_interval == 15.0
    unset_pid = Notifier.from_environment({"NOTIFY_SOCKET": "/x", "WATCHDOG_USEC": "4000000"})
    assert unset_pid.watchdog_interval == 2.0
    other = Notifier.from_environment({"NOTIFY_SOCKET": "/x", "WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "1"})
    assert other.watchdog_interval is None


@pytest.mark.slow  # a second or more: out of the fast lane
def test_a_long_first_pass_extends_systemds_start_timeout_before_ready(tmp_path: Path, path_socket) -> None:
    """The daemon's first pass may outlast systemd's start timeout (90 s by default): while it runs,
    the daemon sends EXTEND_TIMEOUT_USEC; READY=1 follows the pass. The first poll here is held
    until the stand-in for systemd has seen what the daemon says meanwhile."""
    import signal
    import threading

    from gpubook.scheduler.daemon import Daemon
    from tests.kits.daemon_kit import in_process_daemon

    address, sock = path_socket
    held = threading.Event()

    class SlowFirstPoll(Daemon):
        def poll(self) -> None:
            held.wait(60)
            super().poll()

    daemon = in_process_daemon(tmp_path, notifier=Notifier(address), kind=SlowFirstPoll)
    received: list[dict[str, str]] = []

    def systemd() -> None:
        try:
            received.append(_receive(sock))  # sent while the first poll is held
            held.set()
            while "READY" not in received[-1]:
                received.append(_receive(sock))
        finally:
            held.set()
            daemon._stop.set()
            daemon._woken.set()

    handlers = {number: signal.getsignal(number) for number in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    manager = threading.Thread(target=systemd)
    manager.start()
    try:
        assert daemon.run() == 0
    finally:
        manager.join()
        for number, handler in handlers.items():
            signal.signal(number, handler)
    assert received, "nothing was sent while the first pass ran"
    assert int(received[0]["EXTEND_TIMEOUT_USEC"]) >= 10_000_000, received[0]
    # READY=1 alone: the STATUS= line a pass sends (its status line) stays systemd's; tests/test_systemd_boot.py
    # sees it under a real systemd.
    assert received[-1] == {"READY": "1"}
