"""Hostile tests for bookings' networks and SSH trust, on real rootless podman, sshd and paramiko.

- A booker who takes a booking's port between gpubook's port check and the container's sshd (with
  an SSH server that lets anyone in) must not get the readiness probe's login: the start fails with
  a sentence and nothing runs, so gpubook never writes `running` pointing at that server.
- A service inside one booking's container is reachable from no other booking and holds no host port.
- The `known_hosts` line the daemon writes into the event lets the booker connect with
  RejectPolicy: the first login needs no trust on first use.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import paramiko
import pytest

from gpubook.runtime.booking import ssh
from gpubook.runtime.engines import ContainerSpec, Engine, EngineOptions, EngineSettings
from gpubook.runtime.engines.podman import PodmanEngine
from gpubook.runtime.errors import EngineError
from gpubook.runtime.templates.catalog import get_template
from gpubook.scheduler.commands.embedded import free_port
from gpubook.scheduler.hosts import Booker, StartRequest
from gpubook.scheduler.hosts.local import LocalHost
from tests.kits import engine_suite, servers
from tests.kits.daemon_kit import DaemonProcess, book, description, running_container, soon, wait_for, write_config
from tests.kits.engine_suite import BOOKER, CACHE_DIR, Bookings, connect, new_key, run

pytestmark = [
    pytest.mark.podman,
    pytest.mark.skipif(shutil.which("podman") is None, reason="podman is not installed"),
]
PODMAN = engine_suite.PODMAN


@pytest.fixture(scope="session")
def engine_args() -> dict:
    args = dict(PODMAN)  # gpubook's default network
    if os.geteuid() == 0:  # rootful (finding 13 of issue 22): root's store keeps the driver it was made with
        args.pop("storage_driver")
    return args


# --- a squatter ------------------------------------------------------------------------------------


class _AnyoneIn(paramiko.ServerInterface):
    """The squatter's SSH server: every public key is welcome, every command "succeeds"."""

    def __init__(self, logins: list[str]) -> None:
        self.logins = logins

    def get_allowed_auths(self, username: str) -> str:
        return "publickey"

    def check_auth_publickey(self, username: str, key: paramiko.PKey) -> int:
        self.logins.append(username)
        return paramiko.AUTH_SUCCESSFUL

    def check_channel_request(self, kind: str, chanid: int) -> int:
        return paramiko.OPEN_SUCCEEDED

    def check_channel_exec_request(self, channel: paramiko.Channel, command: bytes) -> bool:
        channel.send_exit_status(0)
        return True


class Squatter:
    """A booker's own SSH server on a port of the host, with its own host key."""

    def __init__(self, port: int) -> None:
        self.logins: list[str] = []
        self.key = paramiko.ECDSAKey.generate(bits=256)
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("0.0.0.0", port))  # noqa: S104 - as a booker on the host network would
        self.sock.listen()
        self.sock.settimeout(0.2)
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.done.is_set():
            try:
                client, _ = self.sock.accept()
            except OSError:
                continue
            transport = paramiko.Transport(client)
            transport.add_server_key(self.key)
            try:
                transport.start_server(server=_AnyoneIn(self.logins))
            except (paramiko.SSHException, EOFError, OSError):
                transport.close()

    def close(self) -> None:
        self.done.set()
        self.thread.join(timeout=5)
        self.sock.close()


class SquattedPodman(PodmanEngine):
    """The real engine, with a booker taking the port right after gpubook found it free."""

    squatters: list[Squatter]

    def _check_port_free(self, spec: ContainerSpec) -> None:
        super()._check_port_free(spec)
        self.squatters.append(Squatter(spec.port))


def _squatted_host(network: str | None) -> tuple[LocalHost, SquattedPodman]:
    settings = EngineSettings(**PODMAN) if network is None else EngineSettings(**PODMAN, network=network)
    engine = SquattedPodman(settings, EngineOptions())
    engine.squatters = []
    host = LocalHost(engine=engine, gpus=(), driver_version=None,
                     probe_key=ssh.load_probe_key(CACHE_DIR / "test-probe-key"), cache_dir=CACHE_DIR)
    return host, engine


def _request(port: int) -> StartRequest:
    booker = Booker(BOOKER, 2001, 2001, (engine_suite.key_line(new_key()),))
    return StartRequest(booking_id=f"squat-{port}@test", booker=booker,
                        template=get_template("debian-ssh"), gpus=(), port=port,
                        end=datetime.now(UTC) + timedelta(hours=1))


@pytest.mark.parametrize("network", [None, "host"], ids=["default-network", "host-network"])
def test_a_squatter_on_the_port_never_gets_the_probe_or_the_booker(network: str | None, image: str) -> None:
    """Default network: the published port cannot be had, so the start fails. Host network (an
    admin's choice): the container's sshd cannot bind, the probe meets the squatter's server and
    refuses its host key before logging in. Either way: an error, no container, no login."""
    host, engine = _squatted_host(network)
    request = _request(free_port())
    name = engine_suite.container_name(request.booking_id)
    try:
        with pytest.raises(EngineError) as failed:
            host.start(request)
        assert engine.inspect(name) is None, "a failed start leaves no container"
        assert engine.squatters[0].logins == [], "the probe logged in to the squatter's server"
        if network == "host":
            assert "showed host key" in str(failed.value)
            assert "another program holds the port" in str(failed.value)
        else:  # the published port is the host's, and the squatter has it
            assert "address already in use" in str(failed.value)
    finally:
        for squatter in engine.squatters:
            squatter.close()
        engine.stop(name, 0)
        ssh.forget_host_key(CACHE_DIR, name)


# --- services stay in their booking ----------------------------------------------------------------


def _host_addresses() -> list[str]:
    done = subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True, check=False)
    return [field.split("/")[0] for line in done.stdout.splitlines() for field in line.split()[3:4]]


def _connect_command(address: str, port: int) -> str:
    return f"python3 -c 'import socket; socket.create_connection((\"{address}\", {port}), 2)'"


def _wait_listening(client: paramiko.SSHClient, port: int) -> None:
    probe = _connect_command("127.0.0.1", port)
    for _ in range(100):
        if run(client, probe)[0] == 0:
            return
        time.sleep(0.1)
    raise AssertionError(f"the service in booking X never listened on {port}")


def test_a_service_in_one_booking_is_out_of_reach_of_another(bookings: Bookings) -> None:
    service_port = free_port()
    x = bookings.start(command=("python3", "-m", "http.server", str(service_port)))
    y = bookings.start()
    # Rootful podman: X's own address on its network too (issue 22, finding 13: one shared bridge).
    addresses = ["127.0.0.1", "10.0.2.2", *_host_addresses(), *_container_addresses(bookings.engine, x.spec.name)]
    with connect(x.spec.port, BOOKER, x.key) as client:
        _wait_listening(client, service_port)
    with connect(y.spec.port, BOOKER, y.key) as client:
        reached = [address for address in addresses if run(client, _connect_command(address, service_port))[0] == 0]
    assert reached == [], f"booking Y reached booking X's service at {reached}"
    with socket.socket() as on_host:
        on_host.bind(("0.0.0.0", service_port))  # noqa: S104 - the host port is still free
    # The booking's SSH port is published, and on the host only that one.
    connect(x.spec.port, BOOKER, x.key).close()


def _container_addresses(engine: Engine, name: str) -> list[str]:
    raw = engine._inspect_raw([name])[0]  # type: ignore[attr-defined]  # noqa: SLF001
    networks = (raw.get("NetworkSettings") or {}).get("Networks") or {}
    return [value["IPAddress"] for value in networks.values() if value.get("IPAddress")]


# --- known_hosts in the event ------------------------------------------------------------------------


@pytest.mark.daemon
def test_the_events_known_hosts_line_lets_the_booker_in_with_reject_policy(
        tmp_path: Path, radicale: servers.CalendarServer, engine: Engine, image: str) -> None:
    keys = {"alice": paramiko.ECDSAKey.generate(bits=256)}
    calendar = radicale.new_calendar()
    config = write_config(tmp_path, str(calendar.url), keys=keys, poll_seconds=2)
    start = soon(3)
    book(calendar, "pinned@test", user="alice", start=start, end=start + timedelta(minutes=2))
    daemon = DaemonProcess(config).start()
    try:
        text = wait_for("running in the event", lambda: (lambda d: d if "running:" in d else None)(
            description(calendar, "pinned@test")), timeout=60, daemon=daemon)
        found = re.search(r"known_hosts: (\[127\.0\.0\.1\]:\d+ ssh-ed25519 \S+)", text)
        assert found, f"no known_hosts line in the event:\n{text}"
        known_hosts = tmp_path / "known_hosts"
        known_hosts.write_text(found.group(1) + "\n")
        info = running_container(engine, "pinned@test")
        assert info is not None and info.host_key == found.group(1).split(" ", 1)[1]
        client = paramiko.SSHClient()
        client.load_host_keys(str(known_hosts))
        client.set_missing_host_key_policy(paramiko.RejectPolicy())
        client.connect("127.0.0.1", port=info.port, username="alice", pkey=keys["alice"],
                       look_for_keys=False, allow_agent=False, timeout=10)
        with client:
            assert run(client, "id -un")[1].strip() == "alice"
    finally:
        daemon.stop()
        engine.stop(engine_suite.container_name("pinned@test"), 0)
