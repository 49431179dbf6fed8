"""One daemon per state folder and one per account on a host: flocks held for the daemon's life.

`gpubook run` holds an flock on `daemon.lock` in its state folder (two daemons would start, stop
and remove each other's containers) and one of its account on this host (two would fight over the
gpubook-sftp container and the booking ports); a second one exits at once, naming the holder.
"""

from __future__ import annotations

import fcntl
import os
import socket
from pathlib import Path

from gpubook.runtime.errors import GpubookError
from gpubook.runtime.private import private_folder

LOCK_FILE = "daemon.lock"


class AlreadyRunning(GpubookError):
    """Another gpubook daemon holds this state folder."""


def hold_lock(folder: Path) -> int:
    """Take the state folder's daemon lock (kept until this process ends); give its descriptor.
    Raises AlreadyRunning with the holder's pid when another daemon has it."""
    private_folder(folder)
    path = folder / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise AlreadyRunning(f"another gpubook daemon (pid {holder}) already runs on the state folder {folder} "
                             f"(it holds {path}); stop it first") from None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd


def account_lock_path() -> Path:
    """The lock of this account on this host: two daemons of one account, whatever their state
    folders, would fight over the gpubook-sftp container and the booking ports. In the account's
    runtime folder (per host, per uid, a tmpfs), else in its home with the host's name (a home on
    NFS is shared by hosts)."""
    runtime = Path(os.environ.get("XDG_RUNTIME_DIR") or f"/run/user/{os.getuid()}")
    try:
        info = runtime.stat()
        if info.st_uid == os.getuid() and not info.st_mode & 0o022:
            return runtime / "gpubook-daemon.lock"
    except OSError:
        pass
    return private_folder(Path.home() / ".local" / "state") / f"gpubook-daemon-{socket.gethostname()}.lock"


def hold_account_lock(folder: Path, path: Path | None = None) -> int:
    """Take the account's daemon lock besides the state folder's; it names the holder's pid and
    state folder. Raises AlreadyRunning naming both when another daemon of this account has it."""
    path = path or account_lock_path()
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        pid, _, other = os.read(fd, 4096).decode(errors="replace").strip().partition(" ")
        os.close(fd)
        raise AlreadyRunning(f"another gpubook daemon (pid {pid or 'unknown'}, state folder {other or 'unknown'}) "
                             f"already runs as this account on this host (it holds {path}): two would fight over "
                             f"the SFTP service and the booking ports; stop it first") from None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()} {folder}\n".encode())
    return fd
