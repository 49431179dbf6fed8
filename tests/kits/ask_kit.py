"""Asking the daemon (`gpubook free`, `bookings`, `mine`): a real `gpubook run` on an engine that
starts nothing (daemon_kit.IdleEngine, named in its config by dotted path: no podman), a real
Radicale calendar, and the commands run as a researcher runs them: no config, no secret."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import paramiko

from tests.kits.daemon_kit import ROOT, write_config

IDLE_ENGINE = "tests.kits.daemon_kit:IdleEngine"


def idle_config(folder: Path, calendar_url: str, *, keys: dict[str, paramiko.PKey],
                accounts: Mapping[str, str], poll_seconds: float = 1) -> Path:
    """write_config's daemon on the idle engine; `accounts`: gpubook user → `[users.NAME] account`."""
    path = write_config(folder, calendar_url, keys=keys, poll_seconds=poll_seconds)
    text = path.read_text().replace('name = "podman"\nruntime = "runc"\nstorage_driver = "overlay"',
                                    f'name = "{IDLE_ENGINE}"')
    for user, login in accounts.items():
        text = text.replace(f"[users.{user}]\n", f'[users.{user}]\naccount = "{login}"\n')
    path.write_text(text)
    return path


def researcher_env(home: Path, **extra: str) -> dict[str, str]:
    """An environment with no config anywhere (no $GPUBOOK_CONFIG, an empty HOME), gpubook from the tree."""
    home.mkdir(parents=True, exist_ok=True)
    return {"HOME": str(home), "PATH": "/usr/local/bin:/usr/bin:/bin", "PYTHONPATH": str(ROOT),
            "PYTHONDONTWRITEBYTECODE": "1", "LANG": "C.UTF-8", **extra}


def gpubook(*args: str, env: Mapping[str, str], prefix: Sequence[str] = (), timeout: float = 60
            ) -> subprocess.CompletedProcess[str]:
    """`gpubook ARGS` in a child process with exactly `env` (`prefix`: runuser ... env -i, as root)."""
    argv = [*prefix, sys.executable, "-m", "gpubook.scheduler.commands.cli", *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd="/",
                          env=None if prefix else dict(env))


def as_account(login: str, env: Mapping[str, str]) -> list[str]:
    """The prefix that runs a command as `login` with only `env` (runuser, then env -i)."""
    return ["runuser", "-u", login, "--", "env", "-i", *(f"{key}={value}" for key, value in env.items())]


def raw_ask(uid: int, payload: bytes, *, timeout: float = 10) -> bytes:
    """Send `payload` as it is to the daemon of `uid` and read its answer to the end (b"": the
    daemon cut the connection off)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
        connection.settimeout(timeout)
        connection.connect(f"\0gpubook-ask-{uid}")
        connection.sendall(payload)
        data = b""
        try:
            while chunk := connection.recv(65536):
                data += chunk
        except ConnectionResetError:
            return b""
    return data


def login() -> str:
    import pwd

    return pwd.getpwuid(os.getuid()).pw_name
