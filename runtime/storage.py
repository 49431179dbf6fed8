"""A booker's data folders under `[storage] data_root`: input (read-only), output, optional home.

`<root>/<user>/input` is bound read-only, `<root>/<user>/output` writable, `<root>/<user>/home` as
the persistent home when enabled. Folders are made on first use and belong to the booker: as root
they are chown'ed to the booker's uid/gid; rootless they belong to the daemon user, which the
container's user namespace shows as the booker (keep-id), so whatever the booker writes lands
under the daemon's uid on the host. Names are checked against a strict pattern and every path,
symlinks resolved, must stay under the root.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

from runtime.errors import StorageError
from runtime.mounts import Mount
from runtime.names import USER_NAME, USER_NAME_RULE

# The same rule as the config's user names (runtime does not import scheduler).
INPUT_TARGET = "/data/input"
OUTPUT_TARGET = "/data/output"


@dataclass(frozen=True)
class DataFolders:
    user: str
    input: Path
    output: Path
    home: Path | None

    def mounts(self) -> tuple[Mount, ...]:
        mounts = [
            Mount(self.input, INPUT_TARGET, read_only=True),
            Mount(self.output, OUTPUT_TARGET, read_only=False),
        ]
        if self.home is not None:
            mounts.append(Mount(self.home, f"/home/{self.user}", read_only=False))
        return tuple(mounts)


def check_user_name(user: str) -> str:
    if not USER_NAME.fullmatch(user):
        raise StorageError(
            f"user name {user!r} is not allowed for data folders ({USER_NAME_RULE})"
        )
    return user


def prepare(data_root: Path, user: str, *, uid: int, gid: int, home: bool = False) -> DataFolders:
    """Make (or check) the booker's folders and give them back, ready to bind.

    `uid`/`gid` are the host ids the folders should belong to: `engine.host_owner(booker's ids)`.
    Only root can give them away; an unprivileged daemon keeps them (rootless: that is right).
    """
    check_user_name(user)
    root = _checked_root(data_root)
    user_dir = _folder(root, root / user, uid=uid, gid=gid, mode=0o750)
    folders = DataFolders(
        user=user,
        input=_folder(root, user_dir / "input", uid=uid, gid=gid, mode=0o750),
        output=_folder(root, user_dir / "output", uid=uid, gid=gid, mode=0o750),
        home=_folder(root, user_dir / "home", uid=uid, gid=gid, mode=0o750) if home else None,
    )
    return folders


def _checked_root(data_root: Path) -> Path:
    try:
        info = os.stat(data_root)
    except FileNotFoundError:
        raise StorageError(
            f"data_root {data_root} does not exist; create it or fix [storage] data_root"
        ) from None
    except OSError as error:
        raise StorageError(f"data_root {data_root}: {error.strerror}") from None
    if not stat.S_ISDIR(info.st_mode):
        raise StorageError(f"data_root {data_root} is not a folder")
    if not os.access(data_root, os.W_OK | os.X_OK):
        raise StorageError(
            f"data_root {data_root} is not writable by this user (uid {os.geteuid()})"
        )
    return Path(os.path.realpath(data_root))


def _folder(root: Path, path: Path, *, uid: int, gid: int, mode: int) -> Path:
    """Make `path` if missing; refuse symlinks and anything that resolves outside `root`."""
    try:
        os.mkdir(path, mode)
        created = True
    except FileExistsError:
        created = False
    except OSError as error:
        raise StorageError(f"cannot create {path}: {error.strerror}") from None
    info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        raise StorageError(
            f"{path} is not a plain folder (a symlink or a file); refusing to bind it"
        )
    resolved = Path(os.path.realpath(path))
    if not resolved.is_relative_to(root) or resolved == root:
        raise StorageError(f"{path} resolves to {resolved}, outside data_root {root}")
    if created and os.geteuid() == 0:
        os.chown(path, uid, gid)
    return resolved
