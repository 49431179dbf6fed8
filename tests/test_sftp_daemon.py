"""The SFTP data service through the real daemon (`gpubook run`), real Radicale, rootless podman and
OpenSSH's `sftp` client: what a booker does, from docs/guides/booking.md alone — upload a dataset before the
booking, use it read-only inside, download the results after the end — and what an admin relies
on: the service started again when killed, a user removed by SIGHUP, the service kept across a
daemon restart, `gpubook status` showing each user's space."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import paramiko
import pytest

from gpubook.runtime.data import sftp
from gpubook.runtime.engines import Engine, container_name
from gpubook.scheduler.commands.embedded import free_port
from tests.kits import sftp_kit
from tests.kits.daemon_kit import (
    DaemonProcess,
    book,
    cli,
    description,
    run,
    running_container,
    soon,
    try_login,
    wait_for,
    write_config,
)

pytestmark = [
    pytest.mark.podman, pytest.mark.caldav, pytest.mark.slow, pytest.mark.daemon,
    pytest.mark.skipif(shutil.which("sftp") is None, reason="OpenSSH's sftp client is not installed"),
]


@pytest.fixture
def service(engine: Engine) -> Iterator[str]:
    """The daemon's SFTP container, removed after the test."""
    yield sftp.SERVICE_NAME
    engine.stop(sftp.SERVICE_NAME, 0)


class Client:
    """OpenSSH's sftp as a booker runs it, trusting only the service's host key."""

    def __init__(self, folder: Path, *, port: int, keys: dict[str, paramiko.PKey]) -> None:
        self.folder, self.port = folder, port
        self.key_files = sftp_kit.key_files(folder, keys)
        self.known_hosts = folder / "known_hosts"

    def trust(self, state: Path) -> None:
        public = (state / "sftp" / "etc" / "host_key.pub").read_text().strip()
        self.known_hosts.write_text(f"[127.0.0.1]:{self.port} {public}\n")

    def batch(self, user: str, commands: str) -> subprocess.CompletedProcess[str]:
        return sftp_kit.sftp_batch(user, commands, port=self.port, key_file=self.key_files[user],
                                   known_hosts=self.known_hosts)

    def answers(self, user: str) -> bool:
        return self.batch(user, "ls\n").returncode == 0


def with_sftp(config: Path, port: int) -> None:
    config.write_text(config.read_text() + f'\n[sftp]\nenabled = true\nport = {port}\nlisten = "127.0.0.1"\n'
                      'check_seconds = 1\n')




def test_upload_before_the_booking_use_it_inside_download_after(
        tmp_path: Path, radicale, engine: Engine, keys, service: str) -> None:
    calendar = radicale.new_calendar()
    config = write_config(tmp_path, str(calendar.url), keys=keys, poll_seconds=2)  # it sees the booking made later
    port = free_port()
    with_sftp(config, port)
    daemon = DaemonProcess(config).start()
    client = Client(tmp_path, port=port, keys=keys)
    try:
        wait_for("the SFTP service", lambda: (tmp_path / "state" / "sftp" / "etc" / "host_key.pub").exists()
                 and (engine.inspect_service(service) or None), timeout=60, daemon=daemon)
        client.trust(tmp_path / "state")
        wait_for("the service answers", lambda: client.answers("alice"), timeout=30, daemon=daemon)

        # Before any booking: the dataset goes up.
        (tmp_path / "dataset.csv").write_text("x,y\n1,2\n")
        done = client.batch("alice", f"put {tmp_path / 'dataset.csv'} input/dataset.csv\n")
        assert done.returncode == 0, done.stderr

        start = soon(10)
        end = start + timedelta(seconds=20)
        book(calendar, "sftp@test", user="alice", start=start, end=end)
        upload_line = f"input: sftp -P {port} alice@127.0.0.1"
        wait_for("the upload line in the accepted event", lambda: upload_line in description(calendar, "sftp@test"),
                 timeout=30, daemon=daemon)
        # The service's host key comes with it: the booker's known_hosts from the event alone.
        public = (tmp_path / "state" / "sftp" / "etc" / "host_key.pub").read_text().strip()
        known = f"sftp known_hosts: [127.0.0.1]:{port} {public}"
        assert known in description(calendar, "sftp@test")
        client.known_hosts.write_text(known.removeprefix("sftp known_hosts: ") + "\n")

        info = wait_for("the booking's container", lambda: running_container(engine, "sftp@test"), timeout=40,
                        daemon=daemon)
        booking = wait_for("SSH into the booking", lambda: try_login(info.port, "alice", keys["alice"]),
                           timeout=30, daemon=daemon)
        with booking:
            assert run(booking, "cat /data/input/dataset.csv") == (0, "x,y\n1,2\n")
            assert run(booking, "touch /data/input/new")[0] != 0  # read-only inside
            assert run(booking, "echo trained > /data/output/model.txt")[0] == 0
        wait_for("the end of the booking", lambda: engine.inspect(container_name("sftp@test")) is None,
                 timeout=40, daemon=daemon)
        assert datetime.now(UTC) >= end - timedelta(seconds=1)

        done = client.batch("alice", f"get output/model.txt {tmp_path / 'model.txt'}\n")
        assert done.returncode == 0, done.stderr
        assert (tmp_path / "model.txt").read_text() == "trained\n"
        done = client.batch("alice", "rm output/model.txt\n")  # theirs to delete
        assert done.returncode == 0, done.stderr
        download_line = f"outputs: sftp -P {port} alice@127.0.0.1"
        wait_for("the download line in the ended event", lambda: download_line in description(calendar, "sftp@test"),
                 timeout=20, daemon=daemon)
        assert known in description(calendar, "sftp@test")

        status = cli(config, "status", "--json")
        assert status.returncode == 0, status.stderr
        report = json.loads(status.stdout)["sftp"]
        assert report["running"] and report["port"] == port and "alice" in report["usage"]
        assert "SFTP: running on 127.0.0.1:" in cli(config, "status").stdout
    finally:
        daemon.stop()
        engine.stop(container_name("sftp@test"), 0)


def test_the_daemon_restarts_a_killed_service_removes_users_on_sighup_and_keeps_it_across_restarts(
        tmp_path: Path, radicale, engine: Engine, keys, service: str) -> None:
    calendar = radicale.new_calendar()
    config = write_config(tmp_path, str(calendar.url), keys=keys, poll_seconds=60)
    port = free_port()
    with_sftp(config, port)
    daemon = DaemonProcess(config).start()
    client = Client(tmp_path, port=port, keys=keys)
    try:
        first = wait_for("the SFTP service", lambda: (tmp_path / "state" / "sftp" / "etc" / "host_key.pub").exists()
                         and engine.inspect_service(service), timeout=60, daemon=daemon)
        client.trust(tmp_path / "state")
        wait_for("the service answers", lambda: client.answers("bob"), timeout=30, daemon=daemon)

        subprocess.run(["podman", "kill", service], capture_output=True, check=False)
        again = wait_for("the service started again", lambda: (info := engine.inspect_service(service))
                         and info.running and info.id != first.id and info, timeout=30, daemon=daemon)
        wait_for("the service answers again", lambda: client.answers("alice"), timeout=30, daemon=daemon)

        text = config.read_text()
        cut = text.index("[users.bob]")
        config.write_text(text[:cut] + text[text.index("\n\n", cut) + 2:])
        daemon.signal(signal.SIGHUP)
        wait_for("bob refused after the reload", lambda: not client.answers("bob"), timeout=30, daemon=daemon)
        assert client.answers("alice")

        assert daemon.stop() == 0
        time.sleep(1)
        kept = engine.inspect_service(service)
        assert kept is not None and kept.running and kept.id == again.id  # the service outlives the daemon
        assert client.answers("alice")
        daemon = DaemonProcess(config).start()
        time.sleep(3)  # a few watch rounds of the new daemon
        adopted = engine.inspect_service(service)
        assert adopted is not None and adopted.id == again.id, "a new daemon must keep the running service"
        assert client.answers("alice") and not client.answers("bob")
    finally:
        daemon.stop()
