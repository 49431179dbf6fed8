"""What `gpubook setup` reads of a host (`Facts`) and the actions it takes there.

Facts are read in one place so that the steps in setup.py stay pure: a test gives them the facts of
a host it describes and reads the plan, the same plan `--dry-run` prints. Actions are argv lists run
as root or as the daemon's account (`runuser`, with a clean environment) and whole files written by
root; each prints as the shell command an admin would type (docs/guides/install.md shows the same).
"""

from __future__ import annotations

import errno
import os
import pwd
import shlex
import stat
import subprocess
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from gpubook.runtime.errors import GpubookError

FSTAB = Path("/etc/fstab")
SUBID_FILES = (Path("/etc/subuid"), Path("/etc/subgid"))
TUN = Path("/dev/net/tun")
UDEV_RULE = Path("/etc/udev/rules.d/60-gpubook-tun.rules")
DELEGATE_CONF = Path("/etc/systemd/system/user@.service.d/delegate.conf")
LINGER_DIR = Path("/var/lib/systemd/linger")
CGROUP_ROOT = Path("/sys/fs/cgroup")
SUBTREE_LEAF = "gpubook/daemon"  # gpubook.runtime.cgroups' SUBTREE/DAEMON_LEAF: where the daemon is started
ACCOUNT_PATH = "/usr/local/bin:/usr/bin:/bin"
COMMAND_SECONDS = 1800  # the image build (mmdebstrap) is the longest: minutes on a slow mirror


READ_LIMIT = 1024 * 1024  # bytes of any one file setup reads (/etc/subuid of a large lab fits)


class SetupError(GpubookError):
    """`gpubook setup` cannot go on: its input is wrong or a step failed (nothing after it ran)."""


@dataclass(frozen=True)
class Account:
    name: str
    uid: int
    gid: int
    home: Path


@dataclass(frozen=True)
class DataRoot:
    exists: bool
    owner: int | None  # uid
    nosuid_nodev: bool  # statvfs: the mount it lies on has both


@dataclass(frozen=True)
class Facts:
    """Everything a step decides on. `None` where it could not be read (no account yet, not root)."""

    account: Account | None
    subids: tuple[str, str]  # the texts of /etc/subuid, /etc/subgid
    systemd: bool  # systemd runs as PID 1 (/run/systemd/system, as sd_booted(3) tests)
    lingering: bool
    udev: bool  # udevd runs (/run/udev/control)
    data_root: DataRoot
    fstab: str
    tun_mode: int | None  # /dev/net/tun's permission bits; None: no such device
    udev_rule: bool
    delegate_conf: str | None
    cgroup_v2: bool  # /sys/fs/cgroup is a cgroup v2 hierarchy
    subtree_owner: int | None  # uid owning the delegated subtree's daemon leaf (/sys/fs/cgroup/gpubook/daemon)
    runtime_dir: bool  # /run/user/UID exists
    storage_conf: str | None  # the account's ~/.config/containers/storage.conf
    stores: tuple[str, ...]  # drivers of the account's existing podman store (vfs, overlay)
    config: bool  # the account's ~/.config/gpubook/gpubook.toml exists
    unit: str | None  # the account's ~/.config/systemd/user/gpubook.service
    unit_enabled: bool  # enabled and active in the account's user manager
    mmdebstrap: bool
    image: bool | None  # the default template's image is in the account's store; None: not looked at


def read_text(path: Path, *, limit: int = READ_LIMIT) -> str | None:
    """A file setup reads (as root, some in the account's home): None when it is not there. Opened
    without following a final link and without waiting (a FIFO made there hung setup), read only if
    a regular file, at most `limit` bytes (a link to /dev/zero ate root's memory: round 3, L6)."""
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except PermissionError:  # --dry-run as an ordinary user: the account's files are its own
        return None
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise SetupError(f"{path} is a symbolic link: setup reads and writes only the file itself; "
                             "remove the link and run setup again") from None
        raise SetupError(f"{path} cannot be read: {error.strerror}") from None
    with os.fdopen(descriptor, "rb") as opened:
        if not stat.S_ISREG(os.fstat(opened.fileno()).st_mode):
            raise SetupError(f"{path} is not a regular file (a FIFO, a device or a folder): remove it and run "
                             "setup again")
        data = opened.read(limit + 1)
    if len(data) > limit:
        raise SetupError(f"{path} is larger than {limit // 1024} KiB: not a file setup wrote; look at it")
    return data.decode(errors="replace")


def data_root_problem(path: Path, *, owners: frozenset[int] = frozenset({0})) -> str | None:
    """Why setup must not chown and mount `path` (None: it may). setup runs as root and is run
    again after reboots; whoever can replace `path`, or a folder above it, by a link (to /etc)
    would get that target chowned to the account and mounted (round 3, M5). So: no component is
    a link, and every folder above it is root's and writable by nobody else, save a sticky one
    (/tmp) whose entry below is there already and root's. `owners`: who may own the folders above."""
    parts = [*reversed(path.parents), path]
    for index, part in enumerate(parts):
        try:
            info = os.lstat(part)
        except FileNotFoundError:
            above = parts[index - 1]
            mode = os.lstat(above).st_mode
            if mode & stat.S_ISVTX and mode & 0o002:
                return (f"--data-root {path}: {part} is not there yet in {above}, where any account may make it "
                        f"first (as a link): make {part} as root first, or choose another place")
            return None  # setup makes the rest, in folders only root can write
        if stat.S_ISLNK(info.st_mode):
            return (f"--data-root {path}: {part} is a symbolic link; give the real path (setup would chown and "
                    "mount what the link points to)")
        if part == path:
            return None
        if not stat.S_ISDIR(info.st_mode):
            return f"--data-root {path}: {part} is not a folder"
        child = parts[index + 1]
        shared = info.st_mode & 0o022
        if info.st_uid not in owners or (shared and not (info.st_mode & stat.S_ISVTX and _root_entry(child, owners))):
            who = f"owned by uid {info.st_uid}" if info.st_uid not in owners else "writable by others"
            return (f"--data-root {path}: the folder {part} above it is {who}: whoever controls it could "
                    f"replace {child} by a link (to /etc, say) before setup chowns and mounts it; choose a "
                    "place whose folders above are root's and writable by root alone")
    return None


def _root_entry(path: Path, owners: frozenset[int]) -> bool:
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return False
    return info.st_uid in owners and not stat.S_ISLNK(info.st_mode)


def account(name: str) -> Account | None:
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        return None
    return Account(name, entry.pw_uid, entry.pw_gid, Path(entry.pw_dir))


def account_home(name: str) -> Path:
    """The account's home, or where useradd will make it (/etc/default/useradd's HOME, else /home)."""
    found = account(name)
    if found is not None:
        return found.home
    base = "/home"
    for line in (read_text(Path("/etc/default/useradd")) or "").splitlines():
        if line.startswith("HOME="):
            base = line.partition("=")[2].strip() or base
    return Path(base) / name


def _data_root(path: Path) -> DataRoot:
    try:
        stat_result, flags = path.stat(), os.statvfs(path).f_flag
    except OSError:
        return DataRoot(exists=False, owner=None, nosuid_nodev=False)
    both = bool(flags & os.ST_NOSUID and flags & os.ST_NODEV)
    return DataRoot(exists=True, owner=stat_result.st_uid, nosuid_nodev=both)


def _stores(home: Path) -> tuple[str, ...]:
    store = home / ".local/share/containers/storage"
    return tuple(driver for driver in ("vfs", "overlay") if (store / f"{driver}-images").is_dir())


def _tun_mode() -> int | None:
    try:
        return TUN.stat().st_mode & 0o777
    except OSError:
        return None


def _which(program: str) -> bool:
    return any((Path(folder) / program).is_file() for folder in ACCOUNT_PATH.split(":") + ["/usr/sbin", "/sbin"])


def read_facts(name: str, data_root: Path, *, image: str | None = None) -> Facts:
    """The host as it is now. `image`: also ask the account's podman whether it holds this image."""
    found = account(name)
    home = account_home(name)
    systemd = Path("/run/systemd/system").is_dir()
    return Facts(
        account=found,
        subids=tuple(read_text(path) or "" for path in SUBID_FILES),  # type: ignore[arg-type]
        systemd=systemd, lingering=(LINGER_DIR / name).exists(), udev=Path("/run/udev/control").exists(),
        data_root=_data_root(data_root), fstab=read_text(FSTAB) or "", tun_mode=_tun_mode(),
        udev_rule=UDEV_RULE.exists(), delegate_conf=read_text(DELEGATE_CONF),
        cgroup_v2=(CGROUP_ROOT / "cgroup.controllers").exists(), subtree_owner=_owner(CGROUP_ROOT / SUBTREE_LEAF),
        runtime_dir=found is not None and Path(f"/run/user/{found.uid}").is_dir(),
        storage_conf=read_text(home / ".config/containers/storage.conf"), stores=_stores(home),
        config=(home / ".config/gpubook/gpubook.toml").exists(),
        unit=read_text(home / ".config/systemd/user/gpubook.service"),
        unit_enabled=systemd and found is not None and _unit_enabled(name),
        mmdebstrap=_which("mmdebstrap"),
        image=_has_image(found, image) if image and found is not None and os.geteuid() == 0 else None,
    )


def _owner(path: Path) -> int | None:
    try:
        return path.stat().st_uid
    except OSError:
        return None


def _unit_enabled(name: str) -> bool:
    def answer(verb: str) -> str:
        result = subprocess.run(["systemctl", "--user", "-M", f"{name}@", verb, "gpubook"],
                                capture_output=True, text=True, timeout=60, check=False)
        return result.stdout.strip()

    return answer("is-enabled") == "enabled" and answer("is-active") == "active"


def _has_image(found: Account, image: str) -> bool:
    result = subprocess.run(as_account(found.name, ("podman", "image", "exists", image), uid=found.uid,
                                       home=found.home), capture_output=True, timeout=120, check=False,
                            cwd=found.home)
    return result.returncode == 0


def storage_driver(text: str | None) -> str | None:
    if text is None:
        return None
    try:
        return str(tomllib.loads(text).get("storage", {}).get("driver", "")) or None
    except tomllib.TOMLDecodeError:
        return None


def as_account(name: str, argv: tuple[str, ...], *, uid: int | None, home: Path) -> tuple[str, ...]:
    """argv run as the account with a clean environment: no root's XDG_RUNTIME_DIR or PYTHONPATH."""
    runtime = f"/run/user/{uid}" if uid is not None else "/run/user/$(id -u " + name + ")"
    return ("runuser", "-u", name, "--", "env", "-i", f"HOME={home}", f"USER={name}", f"LOGNAME={name}",
            f"PATH={ACCOUNT_PATH}", f"XDG_RUNTIME_DIR={runtime}", "LANG=C.UTF-8", *argv)


def shell_line(argv: tuple[str, ...]) -> str:
    """argv as a shell line; an account's uid not known yet stays a `$(id -u NAME)` the shell expands."""
    return " ".join(f'"{arg}"' if "$(id -u " in arg else shlex.quote(arg) for arg in argv)


@dataclass(frozen=True)
class Run:
    argv: tuple[str, ...]
    stdin: str | None = None  # fed to the command (a file's content for `install /dev/stdin`)
    shown_stdin: str | None = None  # what the input is, when the shell line does not show it whole

    def shell(self) -> str:
        line = shell_line(self.argv)
        if self.stdin is None:
            return line
        if self.shown_stdin:
            return f"{line} > /dev/null  # its input: {self.shown_stdin}"
        return f"{line} > /dev/null <<< {shlex.quote(self.stdin)}"


@dataclass(frozen=True)
class Write:
    """A whole file written by root (mode 0644): /etc files only."""

    path: Path
    text: str

    def shell(self) -> str:
        return f"printf %s {shlex.quote(self.text)} > {self.path}"


@dataclass(frozen=True)
class AppendLine:
    path: Path
    line: str

    def shell(self) -> str:
        return f"echo {shlex.quote(self.line)} >> {self.path}"


@dataclass(frozen=True)
class Call:
    """A function of gpubook's own, run in setup's process (as root); `shown`: the shell lines it
    is equal to."""

    function: Callable[[], object]
    shown: tuple[str, ...]

    def shell(self) -> str:
        return "\n  $ ".join(self.shown)


Action = Run | Write | AppendLine | Call


def perform(action: Action, *, cwd: Path | None = None) -> str:
    """Do one action; its output. A failure raises SetupError naming the command and its last line."""
    if isinstance(action, Write):
        action.path.parent.mkdir(parents=True, exist_ok=True)
        action.path.write_text(action.text)
        action.path.chmod(0o644)
        return ""
    if isinstance(action, Call):
        try:
            done = action.function()
        except GpubookError as error:  # the host cannot (cgroups v1): said, and the set-up goes on
            return f"not done: {error}"
        return "; ".join(done) if isinstance(done, list) else str(done or "")
    if isinstance(action, AppendLine):
        text = read_text(action.path) or ""
        with action.path.open("a") as stream:
            stream.write(("" if not text or text.endswith("\n") else "\n") + action.line + "\n")
        return ""
    try:
        result = subprocess.run(action.argv, input=action.stdin, capture_output=True, text=True,
                                timeout=COMMAND_SECONDS, check=False, cwd=cwd if cwd and cwd.is_dir() else "/")
    except (OSError, subprocess.TimeoutExpired) as error:
        raise SetupError(f"`{action.shell()}` could not run: {error}") from None
    if result.returncode != 0:
        last = (result.stderr.strip() or result.stdout.strip() or "no output").splitlines()[-1]
        raise SetupError(f"`{action.shell()}` failed (exit {result.returncode}): {last}")
    return result.stdout
