"""A booker's data folders under `[storage] data_root`: input (read-only), output, optional home.

`<root>/<user>/input` is bound read-only, `<root>/<user>/output` writable, `<root>/<user>/home` as
the persistent home when enabled. `<root>/<user>` itself belongs to the daemon (root for Docker),
never to the booker: a booker who owned it could swap `output` for a symlink to another booker's
folder between gpubook's check and the engine's bind. Its group is the booker's mapped gid and its
mode 0750: the SFTP service chroots the booker there (sshd wants it root's and not writable by
group or others) and the booker may list it; no host account has that subordinate gid.
The folders inside belong to the host ids
that the engine maps the booker's ids onto (`engine.host_owner`), given to them by the engine's
own `chown` (rootless podman: through `podman unshare`). Names are checked against a strict
pattern and every path, symlinks resolved, must stay under the root.

Whatever a container writes in these folders is on the host: root inside may make setuid or device
files there. `mount_problem` says when `data_root` is not on a nosuid,nodev mount, where the host
ignores both; starting a booking is refused then.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from gpubook.runtime.errors import StorageError
from gpubook.runtime.mounts import Mount, missing_mount_flags
from gpubook.runtime.names import USER_NAME, USER_NAME_RULE

# The same rule as the config's user names (runtime does not import scheduler).
INPUT_TARGET = "/data/input"
USER_FOLDER_MODE = 0o750
OUTPUT_TARGET = "/data/output"

# Gives a folder to host ids (uid, gid) without following a symlink: the engine's own way.
Chown = Callable[[Path, int, int], None]


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


class NoFolders(DataFolders):
    """No data root configured: a booking gets no input, output or home folder."""

    def mounts(self) -> tuple[Mount, ...]:
        return ()


def no_folders(user: str) -> DataFolders:
    return NoFolders(user=user, input=Path("/nonexistent"), output=Path("/nonexistent"), home=None)


def check_user_name(user: str) -> str:
    if not USER_NAME.fullmatch(user):
        raise StorageError(
            f"user name {user!r} is not allowed for data folders ({USER_NAME_RULE})"
        )
    return user


def mount_problem(data_root: Path) -> str | None:
    """None when `data_root` is on a nosuid,nodev mount; else what is wrong, with the fix.

    Root inside a container owns the files it writes there (rootless: as a subordinate id of the
    daemon user; Docker: as host root): without nosuid a setuid copy of a shell made inside runs
    as that owner for anyone with a host login, and without nodev a device node opens the device.
    """
    try:
        missing = missing_mount_flags(data_root)
    except OSError as error:
        return f"data_root {data_root}: {error.strerror}"
    if not missing:
        return None
    return (
        f"data_root {data_root} is on a mount without {','.join(missing)}, so a setuid or device file "
        f"made in a container would work on the host; mount it with nosuid,nodev (e.g. the fstab line "
        f"`{data_root} {data_root} none bind,nosuid,nodev 0 0`, then `mount {data_root}`)"
    )


def mountinfo_problem(mountinfo: str, data_root: Path) -> str | None:
    """None when, in the mount namespace whose /proc/self/mountinfo this is, `data_root` lies on a
    nosuid,nodev mount; else which flags its covering mount lacks there. Rootless podman keeps its
    own mount namespace (its pause process): where / is not a shared mount (hosts without systemd)
    a data_root mounted on the host after that process started is not there at all, and bookings
    would bind the bare folder underneath it. A data_root that is a symbolic link is judged where it
    leads (the same path in both namespaces: they differ in their mounts only), as the kernel does
    when it binds it."""
    best, options = "", ""
    real = os.path.realpath(data_root)
    target = real.rstrip("/") or "/"
    for line in mountinfo.splitlines():
        fields = line.split()
        if len(fields) < 6:
            continue
        point = fields[4].replace("\\040", " ").replace("\\011", "\t")
        if (target == point or target.startswith(point.rstrip("/") + "/")) and len(point) >= len(best):
            best, options = point, fields[5]
    missing = [flag for flag in ("nosuid", "nodev") if flag not in options.split(",")]
    if not best or not missing:
        return None
    shown = str(data_root) if real == str(data_root) else f"{data_root} (that is, {real})"
    return f"{shown} lies on {best} there, mounted without {','.join(missing)}"


def prepare(
    data_root: Path, user: str, *, uid: int, gid: int, home: bool = False, chown: Chown | None = None
) -> DataFolders:
    """Make (or check) the booker's folders and give them back, ready to bind.

    `uid`/`gid` are the host ids the folders should belong to: `engine.host_owner(booker's ids)`;
    `chown` is the engine's way to give them (`engine.chown`). Without it only root gives folders
    away; an unprivileged daemon keeps them.
    """
    check_user_name(user)
    root = _checked_root(data_root)
    give = chown or _chown_as_root
    user_dir = _own_folder(root, root / user, gid=gid, give=give)
    folders = DataFolders(
        user=user,
        input=_booker_folder(root, user_dir / "input", owner=(uid, gid), mode=0o755, give=give),
        output=_booker_folder(root, user_dir / "output", owner=(uid, gid), mode=0o755, give=give),
        home=_booker_folder(root, user_dir / "home", owner=(uid, gid), mode=0o750, give=give)
        if home
        else None,
    )
    return folders


def _chown_as_root(path: Path, uid: int, gid: int) -> None:
    if os.geteuid() == 0:
        os.chown(path, uid, gid, follow_symlinks=False)


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
    if problem := root_mode_problem(data_root):
        raise StorageError(problem)
    return Path(os.path.realpath(data_root))


def root_mode_problem(data_root: Path) -> str | None:
    """None when only its owner may write in `data_root`; else what is wrong, with the fix. Another
    host user who may write there could make `<root>/<user>` (or a symlink by that name) before
    gpubook does, and the booker's folders would be theirs (issue 22, finding 12)."""
    mode = stat.S_IMODE(os.stat(data_root).st_mode)
    if not mode & 0o022:
        return None
    return (f"data_root {data_root} is writable by its group or others (mode {mode:04o}), so another host "
            f"user could plant a booker's folder there before gpubook makes it; chmod go-w {data_root}")


def _own_folder(root: Path, path: Path, *, gid: int, give: Chown) -> Path:
    """`<root>/<user>`: the daemon's, group the booker's, mode 0750, so no booker can rename what
    is inside it and only the booker (through the SFTP service) may list it.

    A folder left by an older gpubook that gave it to the booker is taken back first (as root),
    before anything inside it is looked at.
    """
    resolved, _ = _folder(root, path, mode=0o700)
    info = os.lstat(resolved)
    if info.st_uid != os.geteuid() or info.st_mode & 0o022:
        if os.geteuid() != 0 and info.st_uid != os.geteuid():
            raise StorageError(
                f"{path} belongs to uid {info.st_uid}, not to the daemon's user: a booker could "
                f"swap its folders; chown it to uid {os.geteuid()}"
            )
        os.chown(resolved, os.geteuid(), os.getegid(), follow_symlinks=False)
        _chmod(resolved, 0o700)
        info = os.lstat(resolved)
    if info.st_gid != gid:
        give(resolved, os.geteuid(), gid)
    if info.st_mode & 0o777 != USER_FOLDER_MODE:
        _chmod(resolved, USER_FOLDER_MODE)
    return resolved


def _booker_folder(root: Path, path: Path, *, owner: tuple[int, int], mode: int, give: Chown) -> Path:
    resolved, created = _folder(root, path, mode=mode)
    info = os.lstat(resolved)
    if created:
        _chmod(resolved, mode)  # whatever the umask took away
    if (info.st_uid, info.st_gid) != owner:
        give(resolved, *owner)
    return resolved


def _chmod(path: Path, mode: int) -> None:
    """chmod a folder, never through a symlink (Linux has no lchmod)."""
    handle = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        os.fchmod(handle, mode)
    finally:
        os.close(handle)


def _folder(root: Path, path: Path, *, mode: int) -> tuple[Path, bool]:
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
    return resolved, created
