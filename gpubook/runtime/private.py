"""Folders and files only their owner may read: the state folder, its database and status file,
the probe key.

Modes are set explicitly, never left to the umask: a daemon started with umask 000 (or 002 on a
host with shared groups) must not leave the probe key or the booking history readable or
writable by the bookers who log in to the same host. A folder that others can already write to is
refused rather than fixed: files may have been planted in it (a symlink named like the database).
Someone else's folder (root running `gpubook status` on the daemon's state) is used as it is.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
from pathlib import Path

from gpubook.runtime.errors import GpubookError

log = logging.getLogger(__name__)


class UnsafePath(GpubookError):
    """A private folder or file that others may write to, or a key that others may read."""


def default_cache_dir() -> Path:
    """The account's own cache (~/.cache/gpubook, or under XDG_CACHE_HOME): probe keys, host keys, root
    file systems of templates."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "gpubook"


def private_folder(path: Path, *, own: bool = False) -> Path:
    """Make `path` (mode 0700) or check it: ours and readable by others → set to 0700; writable by
    others → UnsafePath with the fix in one sentence; someone else's → UnsafePath with `own`."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = path.stat()
    mode = stat.S_IMODE(info.st_mode)
    if own and info.st_uid != os.geteuid():
        raise UnsafePath(f"the folder {path} belongs to uid {info.st_uid}, not to this daemon's uid {os.geteuid()}: "
                         f"what is in it is not the daemon's to trust; remove it (it is made again) or chown it")
    if mode & 0o022:
        owner = "" if info.st_uid == os.geteuid() else f"owned by uid {info.st_uid}, "
        raise UnsafePath(f"the folder {path} is {owner}writable by its group or others (mode {mode:04o}): anyone "
                         f"could have planted files in it; check what is in it, then chmod 700 {path}")
    if info.st_uid == os.geteuid() and mode & 0o077:
        os.chmod(path, 0o700)
        log.warning("the folder %s was readable by others (mode %04o); its mode is now 0700", path, mode)
    return path


def private_file(path: Path, *, create: bool = True) -> Path:
    """Make `path` an empty file of mode 0600 if missing (`create`), or set an existing one of ours
    to 0600; a symlink there is refused (O_NOFOLLOW), not followed."""
    if not create and not os.path.lexists(path):
        return path
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as error:
        if path.is_symlink():
            raise UnsafePath(f"{path} is a symbolic link (to {os.readlink(path)}), not a file of its own; "
                             f"remove it") from None
        raise UnsafePath(f"{path} cannot be opened: {error.strerror}") from None
    try:
        info = os.fstat(fd)
        if info.st_uid == os.geteuid() and stat.S_IMODE(info.st_mode) != 0o600:
            os.fchmod(fd, 0o600)
    finally:
        os.close(fd)
    return path


def write_private(path: Path, data: bytes) -> None:
    """Write `path` (mode 0600) through a fresh temporary file beside it, then rename: the temporary
    name is made with O_EXCL|O_NOFOLLOW, so a symlink or file planted there is never written through."""
    partial = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}")  # threads share the pid
    partial.unlink(missing_ok=True)
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(data)
        partial.replace(path)
    except BaseException:
        partial.unlink(missing_ok=True)  # a full disk's half-written file would stay, under another pid's name
        raise


def check_private_key(path: Path) -> None:
    """A private key others can read, or that belongs to someone else, is refused: ssh(1) refuses
    such a key for the same reason."""
    info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode):
        raise UnsafePath(f"the key {path} is a symbolic link; put the key file itself there (mode 0600)")
    if info.st_uid != os.geteuid():
        raise UnsafePath(f"the key {path} belongs to uid {info.st_uid}, not to this daemon's uid {os.geteuid()}; "
                         f"remove it (a new one is made) or chown it")
    mode = stat.S_IMODE(info.st_mode)
    if mode & 0o077:
        raise UnsafePath(f"the key {path} is readable or writable by others (mode {mode:04o}); "
                         f"chmod 600 {path}, or remove it if others may have read it (a new one is made)")
