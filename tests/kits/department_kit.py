"""A department's GPU servers in numbers, for bench/department.py: real `gpubook run` daemons, each with
its own calendar, state, page and account lock (the lab kit's way), on `AnsweringEngine`.

`AnsweringEngine` is a fake for what cannot run here twenty times over (twenty hosts' containers): its
containers are SSH servers in the daemon's own process (paramiko), each on the booking's port with the
booking's own host key (read from the folder the spec binds) and letting in only the keys the spec gives
(the booker's and the daemon's probe key). So a daemon's start is the whole of it: port, host key,
probe login, write-back; nothing but the container is left out. Each start and each login is appended,
with its wall time, to the JSON-lines file $GPUBOOK_BENCH_STARTS, which the bench reads."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from pathlib import Path

import paramiko

from gpubook.runtime.booking.launch import HOST_KEY_TARGET
from gpubook.runtime.booking.ssh import HOST_KEY_FILE
from gpubook.runtime.engines import ContainerInfo, ContainerSpec
from gpubook.runtime.engines.spec import info_from_labels
from tests.kits.daemon_kit import IdleEngine

STARTS_ENV = "GPUBOOK_BENCH_STARTS"  # the JSON-lines file each start and login is appended to


def _record(kind: str, booking: str) -> None:
    path = os.environ.get(STARTS_ENV)
    if path:
        line = json.dumps({"kind": kind, "booking": booking, "at": time.time()}) + "\n"
        with open(path, "a") as out:  # one write of one line: appends from threads never interleave
            out.write(line)


class _Server(paramiko.ServerInterface):
    def __init__(self, user: str, keys: set[str], booking: str) -> None:
        self.user, self.keys, self.booking = user, keys, booking

    def get_allowed_auths(self, username: str) -> str:
        return "publickey"

    def check_auth_publickey(self, username: str, key: paramiko.PKey) -> int:
        if username == self.user and key.get_base64() in self.keys:
            _record("login", self.booking)
            return paramiko.AUTH_SUCCESSFUL
        return paramiko.AUTH_FAILED


class _Container:
    """One booking's SSH server: a listening socket and a thread that serves each connection's handshake."""

    def __init__(self, spec: ContainerSpec, host_key: paramiko.PKey, keys: set[str]) -> None:
        self.listener = socket.create_server(("127.0.0.1", spec.port), reuse_port=False)
        self.listener.settimeout(0.5)
        self.closed = threading.Event()
        self.server = _Server(spec.user, keys, spec.booking_id)
        self.host_key = host_key
        self.thread = threading.Thread(target=self._serve, name=f"fake sshd {spec.port}", daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.closed.is_set():
            try:
                connection, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            transport = paramiko.Transport(connection)
            transport.add_server_key(self.host_key)
            try:
                transport.start_server(server=self.server)  # the client's auth and close run in its thread
            except (paramiko.SSHException, EOFError, OSError):
                transport.close()

    def close(self) -> None:
        self.closed.set()
        self.listener.close()
        self.thread.join(timeout=5)


class AnsweringEngine(IdleEngine):
    """Containers that are SSH servers in this process (see the module's docstring)."""

    name = "answering"

    def __init__(self, *args: object) -> None:
        self._lock = threading.Lock()
        self._running: dict[str, tuple[ContainerInfo, _Container]] = {}

    def list(self) -> list[ContainerInfo]:
        with self._lock:
            return [info for info, _ in self._running.values()]

    def inspect(self, name: str) -> ContainerInfo | None:
        with self._lock:
            found = self._running.get(name)
        return found[0] if found else None

    def start(self, spec: ContainerSpec) -> ContainerInfo:
        with self._lock:
            if spec.name in self._running:
                return self._running[spec.name][0]
        _record("start", spec.booking_id)
        folder = next(Path(m.source) for m in spec.mounts if m.target == HOST_KEY_TARGET)
        host_key = paramiko.Ed25519Key.from_private_key_file(str(folder / HOST_KEY_FILE))
        keys = {words[at + 1] for line in dict(spec.env).get("GPUBOOK_KEYS", "").splitlines()
                for words in [line.split()] for at, word in enumerate(words[:-1])
                if word.startswith(("ssh-", "ecdsa-", "sk-"))}  # an authorized_keys line's key, options or not
        container = _Container(spec, host_key, keys)
        info = info_from_labels(name=spec.name, id=f"answering-{spec.port}", state="running", image=spec.image,
                                labels=spec.labels())
        with self._lock:
            self._running[spec.name] = (info, container)
        return info

    def stop(self, name: str, grace: float) -> None:
        with self._lock:
            found = self._running.pop(name, None)
        if found is not None:
            found[1].close()

    def image_exists(self, image: str) -> bool:
        return True
