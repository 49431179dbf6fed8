"""What the lab tests share: a lab of real daemons (`gpubook run` processes), each with its own
calendar on Radicale, its own state and its own page on a loopback port, telling each other apart
by [host] name. Their engine is `LabEngine`, a fake for what cannot run here in numbers: it lists
the running containers a JSON file names (a booking that is running, with its SSH port) and
starts nothing; every other part of the daemon (calendar, plan, state, page, metrics) is real."""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import bcrypt
import requests

from gpubook.runtime.engines import ContainerInfo, container_name
from tests.kits.daemon_kit import DaemonProcess, IdleEngine, wait_for

CONTAINERS_ENV = "GPUBOOK_TEST_LAB_CONTAINERS"  # the JSON file LabEngine lists its containers from
SECRET = "lab-secret-0123456789abcdef"
PASSWORDS = {"alice": "alice-pw-1", "bob": "bob-pw-2"}


class LabEngine(IdleEngine):
    """Lists the running containers in $GPUBOOK_TEST_LAB_CONTAINERS; stops and starts nothing."""

    name = "lab"

    def list(self) -> list[ContainerInfo]:
        path = os.environ.get(CONTAINERS_ENV)
        if not path or not Path(path).exists():
            return []
        return [ContainerInfo(name=container_name(item["booking"]), id=item["booking"], state="running",
                              image="debian-ssh", booking_id=item["booking"], user=item["user"],
                              gpus=tuple(item["gpus"]), port=item["port"], end=datetime.fromisoformat(item["end"]),
                              spec_hash="lab", template="debian-ssh", start=datetime.fromisoformat(item["start"]))
                for item in json.loads(Path(path).read_text())]

    def inspect(self, name: str) -> ContainerInfo | None:
        return next((info for info in self.list() if info.name == name), None)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def htpasswd(folder: Path, users: dict[str, str] = PASSWORDS) -> Path:
    path = folder / "htpasswd"
    path.write_text("".join(f"{user}:{bcrypt.hashpw(password.encode(), bcrypt.gensalt(5)).decode()}\n"
                            for user, password in users.items()))
    path.chmod(0o600)
    return path


@dataclass
class Server:
    """One daemon of the lab: its [host] name, its page's base URL, its folder and process."""

    name: str
    url: str
    folder: Path
    daemon: DaemonProcess

    def get(self, path: str, *, user: str | None = None, timeout: float = 30,
            params: dict[str, str] | None = None) -> requests.Response:
        auth = (user, PASSWORDS[user]) if user else None
        return requests.get(self.url + path, auth=auth, timeout=timeout, params=params)


def write_config(folder: Path, *, name: str, calendar_url: str, port: int, lab: Sequence[str] = (),
                 auth: str = "basic", secret: str | None = SECRET, gpus: int = 2) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    web = ['[web]', 'enabled = true', f'listen = "127.0.0.1:{port}"', f'auth = "{auth}"',
           f'lab = {json.dumps(list(lab))}']
    if auth == "basic":
        web.append(f'htpasswd_file = "{htpasswd(folder)}"')
    if secret is not None:
        (folder / "lab-secret").write_text(secret + "\n")
        (folder / "lab-secret").chmod(0o600)
        web.append(f'lab_secret_file = "{folder / "lab-secret"}"')
    lines = ['[host]', f'name = "{name}"', 'timezone = "UTC"', '',
             '[[calendar]]', f'url = "{calendar_url}"', 'username = "test"', '',
             '[gpus]', f'count = {gpus}', '',
             '[engine]', f'name = "{LabEngine.__module__}:{LabEngine.__name__}"', '',
             '[daemon]', 'poll_seconds = 2', f'state_dir = "{folder / "state"}"', '',
             '[users.alice]', 'uid = 2001', '', '[users.bob]', 'uid = 2002', '', *web, '']
    path = folder / "gpubook.toml"
    path.write_text("\n".join(lines))
    return path


def running(folder: Path, *items: dict[str, object]) -> Path:
    """The containers `LabEngine` lists for the daemon in `folder` (booking, user, gpus, port, start, end)."""
    path = folder / "containers.json"
    path.write_text(json.dumps(list(items)))
    return path


@contextmanager
def serving(folder: Path, config: Path, *, name: str, port: int) -> Iterator[Server]:
    """`gpubook run` on `config`, until its page answers and has a status; stopped after."""
    runtime = folder / "run"  # the account's daemon lock is here: a lab of one account's daemons, one per folder
    runtime.mkdir(mode=0o700, exist_ok=True)
    daemon = DaemonProcess(config, env={CONTAINERS_ENV: str(folder / "containers.json"),
                                        "XDG_RUNTIME_DIR": str(runtime)}).start()
    server = Server(name=name, url=f"http://127.0.0.1:{port}", folder=folder, daemon=daemon)
    try:
        wait_for(f"{name}'s page with a status", lambda: _has_status(server), timeout=60, interval=0.3,
                 daemon=daemon)
        yield server
    finally:
        daemon.stop()


def _has_status(server: Server) -> bool:
    try:
        answer = server.get("/api/status", user="alice", timeout=5)
    except requests.RequestException:
        return False
    return answer.status_code == 200 and bool(answer.json().get("last_poll"))
