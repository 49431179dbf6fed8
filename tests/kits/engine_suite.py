"""The behaviour every engine must show, run against real engines (podman and Docker modules).

A test module gives `engine_args` (how tests/plugins/engines.py makes `engine`, with the debian-ssh
image in it, and `bookings`) and `expected_owner(uid)` (the host uid that files written by booker
`uid` get), then subclasses `EngineBehaviour`. Containers are removed even when a test fails.
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import stat
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from pathlib import Path

import paramiko
import pytest

from gpubook.runtime import private
from gpubook.runtime.booking import launch, ssh
from gpubook.runtime.data import storage
from gpubook.runtime.engines import ContainerSpec, Engine, EngineOptions, container_name, engine_from, udocker
from gpubook.runtime.engines.cli_engine import EXEC_OUTPUT_LIMIT
from gpubook.runtime.errors import EngineError, StorageError
from gpubook.runtime.templates.catalog import Template
from gpubook.scheduler.commands.embedded import end_process

BOOKER = "alice"
BOOKER_UID = 2001
BOOKER_GID = 2001
CACHE_DIR = private.default_cache_dir()
# The engine arguments of the podman suites: rootless podman as these machines run it.
PODMAN = {"name": "podman", "runtime": "runc", "storage_driver": "overlay"}
DOCKERD = "/usr/sbin/dockerd"
DOCKER = "/usr/bin/docker"  # Debian's client, matching Debian's dockerd

# The template's command: on SIGTERM it notes that, works one more second, then notes it finished.
# A stop that honours the grace period lets it finish; a stop without one kills it before.
GRACEFUL_COMMAND = (
    "/bin/sh",
    "-c",
    "trap 'echo term > /data/output/term-marker; sleep 1;"
    " echo finished >> /data/output/term-marker;"
    " exit 0' TERM; touch /data/output/trap-set; while :; do sleep 0.1; done",
)


BRIDGE_ADDRESS = "172.31.250.1/24"  # the bridge of `private_dockerd(bridge=True)`, a rarely used range


@contextmanager
def private_dockerd(*, bridge: bool = False) -> Iterator[str]:
    """Debian's dockerd on a private socket, its data under a temporary folder; gives its address.
    Stopped and removed afterwards. Host network only (`--iptables=false --bridge=none`) unless
    `bridge`: then its docker0 bridge (no iptables rules: docker-proxy forwards published ports),
    deleted afterwards, so gpubook's private network runs under Docker too."""
    # Short path: containerd's socket under exec-root must fit in 108 bytes.
    home = Path(tempfile.mkdtemp(prefix="gpubook-dockerd-", dir="/tmp"))
    address = f"unix://{home / 'docker.sock'}"
    log_path = home / "dockerd.log"
    with log_path.open("wb") as log:
        daemon = subprocess.Popen(
            [DOCKERD, "--iptables=false", f"--bip={BRIDGE_ADDRESS}" if bridge else "--bridge=none", "--host", address,
             "--data-root", str(home / "data"), "--exec-root", str(home / "exec"),
             "--pidfile", str(home / "dockerd.pid")],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )
    try:
        _wait_for_dockerd(address, daemon, log_path)
        yield address
    finally:
        end_process(daemon, timeout=30)
        # dockerd leaves its default network namespace mounted under exec-root; rmtree cannot
        # remove a mount point.
        netns = home / "exec" / "netns" / "default"
        if netns.exists():
            subprocess.run(["umount", str(netns)], capture_output=True, check=False)
        shutil.rmtree(home, ignore_errors=True)
        if bridge:  # dockerd leaves its bridge behind
            subprocess.run(["ip", "link", "delete", "docker0"], capture_output=True, check=False)


def lane_port() -> int:
    """A booking's port from this lane's block, below the kernel's ephemeral range: a port bound by
    `free_port()` and let go could be any outgoing connection's before the container publishes it
    (a clean-clone run: Docker's proxy found its port 53857 in use)."""
    from tests.kits.daemon_kit import port_range

    return port_range(1)[0]


def _wait_for_dockerd(address: str, daemon: subprocess.Popen[bytes], log_path: Path) -> None:
    for _ in range(600):
        if daemon.poll() is not None:
            raise RuntimeError(f"dockerd exited: {log_path.read_text()[-2000:]}")
        done = subprocess.run([DOCKER, "-H", address, "info"], capture_output=True, check=False)
        if done.returncode == 0:
            return
        time.sleep(0.1)
    raise RuntimeError(f"dockerd did not answer within 60 s: {log_path.read_text()[-2000:]}")


def new_key() -> paramiko.PKey:
    return paramiko.ECDSAKey.generate(bits=256)


def key_line(key: paramiko.PKey) -> str:
    return f"{key.get_name()} {key.get_base64()} test"


def connect(port: int, user: str, key: paramiko.PKey) -> paramiko.SSHClient:
    client = paramiko.SSHClient()
    client.set_missing_host_key_policy(paramiko.AutoAddPolicy())  # noqa: S507 - fresh test host key
    client.connect(
        "127.0.0.1",
        port=port,
        username=user,
        pkey=key,
        look_for_keys=False,
        allow_agent=False,
        timeout=10,
    )
    return client


def run(client: paramiko.SSHClient, command: str) -> tuple[int, str, str]:
    _, stdout, stderr = client.exec_command(command, timeout=30)
    status = stdout.channel.recv_exit_status()
    return status, stdout.read().decode(), stderr.read().decode()


@dataclass
class Booking:
    spec: ContainerSpec
    folders: storage.DataFolders
    key: paramiko.PKey
    ready: launch.Ready


class Bookings:
    """Starts bookings for tests and removes every one of them afterwards, pass or fail."""

    def __init__(self, engine: Engine, data_root: Path, template: Template) -> None:
        self.engine = engine
        self.data_root = data_root
        self.template = template
        self.probe_key = ssh.load_probe_key(CACHE_DIR / "test-probe-key")
        self.names: list[str] = []

    def spec(
        self,
        *,
        key: paramiko.PKey,
        command: tuple[str, ...] = (),
        user: str = BOOKER,
        uid: int = BOOKER_UID,
        port: int | None = None,
    ) -> tuple[ContainerSpec, storage.DataFolders]:
        owner_uid, owner_gid = self.engine.host_owner(uid, uid)
        folders = storage.prepare(self.data_root, user, uid=owner_uid, gid=owner_gid, chown=self.engine.chown)
        template = replace(self.template, command=command)
        booking_id = f"test-{secrets.token_hex(4)}@gpubook"
        host_key = ssh.booking_host_key(CACHE_DIR, container_name(booking_id),
                                        owner=self.engine.host_owner(0, 0), chown=self.engine.chown)
        spec = launch.booking_spec(
            template,
            launch.Tenancy(booking_id=booking_id, user=user, uid=uid, gid=uid, ssh_keys=(key_line(key),),
                            port=port or lane_port(), end=datetime.now(UTC) + timedelta(hours=1), gpus=(0, 1)),
            launch.HostFiles(probe_key=self.probe_key, cache_dir=CACHE_DIR, host_key=host_key, folders=folders),
        )
        self.names.append(spec.name)
        return spec, folders

    def start(self, *, command: tuple[str, ...] = ()) -> Booking:
        key = new_key()
        spec, folders = self.spec(key=key, command=command)
        ready = launch.start_booking(self.engine, spec, probe_key=self.probe_key, timeout=60)
        return Booking(spec=spec, folders=folders, key=key, ready=ready)

    def cleanup(self) -> None:
        for name in self.names:
            try:
                self.engine.stop(name, 0)
            except EngineError:
                pass
            ssh.forget_host_key(CACHE_DIR, name)


class EngineBehaviour:
    """Subclassed by each engine's test module (which adds the marker)."""

    # Root inside, reached with sudo. udocker has one id, the booker's: no root, and sudo must fail.
    root_inside = True

    def sudo(self, client: paramiko.SSHClient) -> bool:
        """Whether sudo works inside, checked against what the engine promises."""
        works = run(client, "sudo -n true")[0] == 0
        assert works == self.root_inside, f"sudo {'fails' if self.root_inside else 'works'} inside"
        return works

    def test_booker_logs_in_with_sudo_and_bound_folders(
        self, bookings: Bookings, expected_owner
    ) -> None:
        booking = bookings.start()
        _put(booking.folders.input / "dataset.txt", "numbers\n")
        with connect(booking.spec.port, BOOKER, booking.key) as client:
            assert run(client, "id -un; id -u; id -g")[1].split() == [
                BOOKER,
                str(BOOKER_UID),
                str(BOOKER_GID),
            ]
            if self.sudo(client):
                assert run(client, "sudo -n id -u")[1].strip() == "0"
            assert run(client, "cat /data/input/dataset.txt")[1] == "numbers\n"
            status, _, error = run(client, "touch /data/input/new-file")
            assert status != 0 and "Read-only file system" in error
            if self.root_inside:
                status, _, error = run(client, "sudo -n touch /data/input/new-file")
                assert status != 0 and "Read-only file system" in error
            assert (
                run(
                    client,
                    "echo result > /data/output/result.txt; stat -c %u /data/output/result.txt",
                )[1]
                == f"{BOOKER_UID}\n"
            )
        bookings.engine.stop(booking.spec.name, 5)
        assert bookings.engine.inspect(booking.spec.name) is None
        written = booking.folders.output / "result.txt"
        assert written.read_text() == "result\n"
        assert written.stat().st_uid == expected_owner(BOOKER_UID)
        assert not (booking.folders.input / "new-file").exists()

    def test_only_the_bookers_key_opens_it(self, bookings: Bookings) -> None:
        booking = bookings.start()
        port = booking.spec.port
        with pytest.raises(paramiko.AuthenticationException):
            connect(port, BOOKER, new_key()).close()  # another booker's key
        with pytest.raises(paramiko.AuthenticationException):
            connect(port, "root", booking.key).close()  # root login is off, even with the key
        transport = paramiko.Transport(("127.0.0.1", port))
        try:
            transport.start_client(timeout=10)
            with pytest.raises(paramiko.BadAuthenticationType) as refused:
                transport.auth_password(BOOKER, "any password")
            assert refused.value.allowed_types == ["publickey"]
        finally:
            transport.close()
        # The daemon's probe key logs in, but may run nothing but `true`.
        with connect(port, BOOKER, bookings.probe_key) as client:
            assert run(client, "echo escaped > /data/output/probe; echo out")[1] == ""
        assert not (booking.folders.output / "probe").exists()

    def test_stop_gives_the_grace_period(self, bookings: Bookings) -> None:
        booking = bookings.start(command=GRACEFUL_COMMAND)
        marker = booking.folders.output / "term-marker"
        _wait_for_trap(booking.folders)
        bookings.engine.stop(booking.spec.name, 20)
        assert marker.read_text() == "term\nfinished\n"

    def test_stop_without_grace_kills(self, bookings: Bookings) -> None:
        booking = bookings.start(command=GRACEFUL_COMMAND)
        marker = booking.folders.output / "term-marker"
        _wait_for_trap(booking.folders)
        bookings.engine.stop(booking.spec.name, 0)
        assert not marker.exists() or "finished" not in marker.read_text()

    def test_list_finds_it_by_labels_and_second_start_is_a_no_op(
        self, bookings: Bookings, engine_args: dict
    ) -> None:
        booking = bookings.start()
        fresh = engine_from(**engine_args)  # no state shared with the engine that started it
        found = [info for info in fresh.list() if info.booking_id == booking.spec.booking_id]
        assert len(found) == 1
        info = found[0]
        assert (info.name, info.user, info.gpus, info.port, info.template, info.spec_hash) == (
            booking.spec.name,
            BOOKER,
            (0, 1),
            booking.spec.port,
            "debian-ssh",
            booking.spec.spec_hash,
        )
        assert info.end == booking.spec.end and info.running
        again = fresh.start(booking.spec)
        assert again.id == info.id
        assert [i.id for i in fresh.list() if i.booking_id == booking.spec.booking_id] == [info.id]
        changed = replace(booking.spec, memory="1g")
        with pytest.raises(EngineError, match="another spec"):
            fresh.start(changed)

    def test_isolation(self, bookings: Bookings) -> None:
        """No host PID or IPC namespace; MKNOD, NET_RAW and SYS_ADMIN gone even for root inside."""
        booking = bookings.start()
        with connect(booking.spec.port, BOOKER, booking.key) as client:
            namespaces = run(client, "readlink /proc/self/ns/pid /proc/self/ns/ipc")[1].split()
            sudo = "sudo -n " if self.sudo(client) else ""
            # Root's bounding set; the booker's effective set where there is no root (a new user
            # namespace's bounding set is full, over nothing that namespace owns).
            field = "CapBnd" if self.root_inside else "CapEff"
            bounding = run(client, f"{sudo}grep {field} /proc/self/status")[1].split()[1]
            status, _, _ = run(client, f"{sudo}mknod /tmp/node c 1 3")
        assert namespaces[0] != os.readlink("/proc/self/ns/pid")
        assert namespaces[1] != os.readlink("/proc/self/ns/ipc")
        capabilities = int(bounding, 16)
        for number in (27, 13, 21):  # CAP_MKNOD, CAP_NET_RAW, CAP_SYS_ADMIN
            assert not capabilities & (1 << number)
        assert status != 0

    def test_a_setuid_file_made_inside_gives_nothing_on_the_host(self, bookings: Bookings) -> None:
        """Root and the booker inside make setuid copies of `id` in /data/output. On the host
        neither may belong to the daemon's user (whose uid runs every container and reads the
        calendar password), and neither may run as its owner: data_root is nosuid."""
        booking = bookings.start()
        with connect(booking.spec.port, BOOKER, booking.key) as client:
            made = "cp /usr/bin/id /data/output/mine && chmod 4755 /data/output/mine"
            if self.sudo(client):
                made += " && sudo -n cp /usr/bin/id /data/output/roots && sudo -n chmod 4755 /data/output/roots"
            assert run(client, made)[0] == 0
        for name in ("mine", "roots") if self.root_inside else ("mine",):
            path = booking.folders.output / name
            info = path.stat()
            assert info.st_mode & stat.S_ISUID, f"{name} lost its setuid bit: the attack was not staged"
            if bookings.engine.name == "podman":  # Docker maps nothing: root inside is host root
                assert info.st_uid not in (os.getuid(), 0), f"{name} belongs to uid {info.st_uid}"
            assert "euid=" not in run_as_someone_else(path), f"{name} ran as its owner"

    def test_missing_image_is_a_clear_error_and_leaves_nothing(self, bookings: Bookings) -> None:
        spec, _ = bookings.spec(key=new_key())
        spec = replace(spec, image="localhost/gpubook/no-such-image:1")
        with pytest.raises(EngineError, match="no-such-image.* is not present"):
            bookings.engine.start(spec)
        assert bookings.engine.inspect(spec.name) is None

    def test_port_taken_is_a_clear_error_and_leaves_nothing(self, bookings: Bookings) -> None:
        with socket.socket() as holder:
            holder.bind(("0.0.0.0", 0))  # noqa: S104 - the engine checks every address, as sshd binds
            holder.listen()
            port = holder.getsockname()[1]
            spec, _ = bookings.spec(key=new_key(), port=port)
            with pytest.raises(EngineError, match=f"port {port} is already in use"):
                bookings.engine.start(spec)
        assert bookings.engine.inspect(spec.name) is None

    def test_bad_user_name_starts_nothing(self, bookings: Bookings) -> None:
        before = {info.name for info in bookings.engine.list()}
        with pytest.raises(StorageError, match="not allowed"):
            bookings.spec(key=new_key(), user="../../etc")
        assert list(bookings.data_root.iterdir()) == []
        assert {info.name for info in bookings.engine.list()} == before


    def test_a_failed_run_never_removes_a_container_it_did_not_create(self, bookings: Bookings) -> None:
        """issue 9, finding 13: a second daemon (or any caller) whose `run` fails because the name is
        in use must not remove the container by that name: it is someone else's, and running."""
        booking = bookings.start()
        engine = bookings.engine

        class Racing(type(engine)):  # type: ignore[misc]
            """Saw no container by that name, as a second daemon racing the first one does."""

            def inspect(self, name: str) -> None:  # type: ignore[override]
                return None

        racer = Racing(engine.settings, EngineOptions(global_args=engine.global_args))
        with pytest.raises(EngineError):
            racer.start(replace(booking.spec, port=lane_port()))
        after = engine.inspect(booking.spec.name)
        assert after is not None and after.running and after.id == booking.ready.info.id

    def test_exec_is_bounded_in_time_and_output(self, bookings: Bookings) -> None:
        """What runs inside belongs to the booker: it may never return, or write without end."""
        booking = bookings.start()
        with pytest.raises(EngineError, match="no answer within"):
            bookings.engine.exec(booking.spec.name, ["sleep", "600"], timeout=1)
        flood = bookings.engine.exec(booking.spec.name, ["sh", "-c", "yes | head -c 5000000"], timeout=60)
        assert flood.returncode == 0
        assert len(flood.stdout) == EXEC_OUTPUT_LIMIT
def _put(path: Path, text: str) -> None:
    """Write a file into a booker's folder, as its owner would (rootless: a subordinate id, which
    only podman's namespace can act as)."""
    if os.geteuid() == 0:
        path.write_text(text)
        return
    subprocess.run(["podman", "unshare", "tee", str(path)], input=text, text=True, capture_output=True,
                   check=True)


def run_as_someone_else(path: Path) -> str:
    """`path` (a copy of id) run by a user other than its owner: as the daemon's user when that is
    not root, else as nobody, through an open descriptor (nobody cannot walk data_root)."""
    handle = os.open(path, os.O_PATH)
    try:
        kwargs: dict = {"user": 65534, "group": 65534, "extra_groups": []} if os.geteuid() == 0 else {}
        done = subprocess.run([f"/proc/self/fd/{handle}"], pass_fds=(handle,), capture_output=True,
                              text=True, check=True, **kwargs)
    finally:
        os.close(handle)
    assert done.stdout.startswith("uid="), done.stdout
    return done.stdout


def _wait_for_trap(folders: storage.DataFolders) -> None:
    """Wait until the template's command has set its SIGTERM trap (it then touches a file)."""
    for _ in range(600):
        if (folders.output / "trap-set").exists():
            return
        time.sleep(0.05)
    raise AssertionError("the template's command never started")


def owner_for_podman(uid: int) -> int:
    """Rootless: the daemon user's subordinate id base+uid; rootful: the booker's mapped uid."""
    if os.geteuid() == 0:
        return uid + 1_000_000_000
    uid_map = subprocess.run(["podman", "unshare", "cat", "/proc/self/uid_map"], capture_output=True,
                             text=True, check=True).stdout
    base = next(int(f[1]) for f in (line.split() for line in uid_map.splitlines()) if f[0] == "1")
    return base + uid


def finished_spare(engine: udocker.UdockerEngine, image: str) -> Path | None:
    """The folder of udocker's spare container of `image`, once made whole (its spare file written)."""
    link = engine.top / "containers" / udocker.spare_name(image)
    if not link.is_symlink():
        return None
    folder = udocker._linked(link)
    return folder if (folder / udocker.SPARE_FILE).is_file() else None
