"""Which resource limits this host can enforce for the daemon's containers, and the limits a booking gets.

Rootless podman (and the runc it starts) can only set limits in a cgroup its account may write:
- cgroups v1: never (podman drops every limit with a warning);
- cgroups v2 with a user systemd manager that delegates the controllers: `--cgroup-manager systemd`
  (each container a scope under user@UID.service);
- cgroups v2 without systemd: `--cgroup-manager cgroupfs` with `--cgroup-parent` in a subtree the
  account owns. Podman (libpod/container_internal_linux.go, getOCICgroupPath) gives a rootless
  cgroupfs container no cgroup at all unless a cgroup parent is set; with one it asks runc for
  PARENT/libpod-ID, which runc creates, enabling the parent's controllers on the way
  (libcontainer/cgroups/fs2/create.go), and puts conmon in PARENT/conmon.

The delegated subtree (`make_delegated_subtree`, run once per boot as root by `gpubook setup`):
/sys/fs/cgroup/gpubook, owned by the account with its cgroup.procs, cgroup.subtree_control and
cgroup.threads, the controllers enabled in its subtree_control; the daemon runs in its leaf
gpubook/daemon (a cgroup with controllers enabled for its children may hold no process itself,
the kernel's "no internal processes" rule) and the containers go under gpubook/bookings. A process
may move another between two cgroups only with write access to their common ancestor's
cgroup.procs, so root must start the daemon in gpubook/daemon: the account cannot leave the
cgroup it was started in for one outside its own subtree.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from gpubook.runtime.errors import GpubookError

ROOT = Path("/sys/fs/cgroup")
SUBTREE = "gpubook"  # /sys/fs/cgroup/gpubook: the delegated subtree that `gpubook setup` makes
DAEMON_LEAF = "daemon"  # the daemon's own cgroup in it
BOOKINGS = "bookings"  # where podman puts the containers (--cgroup-parent)
REQUIRED = ("memory", "pids")  # what a booking's limits need
WANTED = ("cpu",)  # delegated where the host has it, for CPU weights and quotas
DELEGATED_FILES = ("cgroup.procs", "cgroup.subtree_control", "cgroup.threads")
GIB = 1 << 30
MIB = 1 << 20
RESERVE_MIN = 4 * GIB  # memory kept for the host (the daemon, sshd, the page cache) at the least
RESERVE_SHARE = 0.10  # ... or this share of it, whichever is more
# Where systemd runs: every user manager gets these controllers to hand on (`gpubook setup` writes it,
# then `systemctl daemon-reload`; a running user manager takes it at its next start).
SYSTEMD_DROPIN = Path("/etc/systemd/system/user@.service.d/delegate.conf")
SYSTEMD_DROPIN_TEXT = "[Service]\nDelegate=cpu cpuset io memory pids\n"


class DelegationError(GpubookError):
    """The delegated subtree cannot be made on this host."""


@dataclass(frozen=True)
class Placement:
    """Where rootless podman puts containers here, and whether their limits hold."""

    manager: str  # podman's --cgroup-manager: "systemd" or "cgroupfs"
    parent: str | None  # --cgroup-parent (a cgroup path such as "/gpubook/bookings"); None: podman's own
    enforced: bool  # memory and pids limits hold
    how: str  # a sentence: why they hold, or why not


# -- reading the host -----------------------------------------------------------------------


def cgroup_version(mounts: Path = Path("/proc/self/mounts")) -> int:
    """2 where /sys/fs/cgroup is the unified hierarchy, else 1 (v1 or hybrid)."""
    for line in mounts.read_text().splitlines():
        fields = line.split()
        if len(fields) > 2 and fields[1] == str(ROOT):
            return 2 if fields[2] == "cgroup2" else 1
    return 1


def own_cgroup(proc: Path = Path("/proc/self/cgroup")) -> str:
    """This process's cgroup v2 path ("/gpubook/daemon"); "" where it has none (pure v1)."""
    for line in proc.read_text().splitlines():
        if line.startswith("0::"):
            return line[3:].strip()
    return ""


def _words(path: Path) -> set[str]:
    try:
        return set(path.read_text().split())
    except OSError:
        return set()


def controllers(folder: Path) -> set[str]:
    """The controllers a cgroup may use (its parent enabled them for it)."""
    return _words(folder / "cgroup.controllers")


def enabled(folder: Path) -> set[str]:
    """The controllers a cgroup enables for its children."""
    return _words(folder / "cgroup.subtree_control")


def mem_total(meminfo: Path = Path("/proc/meminfo")) -> int:
    """The host's memory in bytes (MemTotal)."""
    match = re.search(r"^MemTotal:\s+(\d+) kB", meminfo.read_text(), re.MULTILINE)
    if match is None:
        raise GpubookError(f"{meminfo} has no MemTotal line")
    return int(match.group(1)) * 1024


def host_gpu_count(proc: Path = Path("/proc/driver/nvidia/gpus")) -> int:
    """The NVIDIA GPUs the driver shows (one folder each); 0 without a driver."""
    try:
        return sum(1 for entry in proc.iterdir() if entry.is_dir())
    except OSError:
        return 0


# -- the default memory limit ---------------------------------------------------------------


def reserve(total: int) -> int:
    """Memory kept for the host: max(4 GiB, 10 %), but never more than half of a small host."""
    return min(max(RESERVE_MIN, int(total * RESERVE_SHARE)), total // 2)


def memory_share(total: int, *, booked: int, host_gpus: int) -> int:
    """A booking's memory where neither its template nor [engine] memory names one: the host's
    memory less the reserve, shared by GPUs (bytes, whole MiB). A booking without GPUs, or a host
    where the driver shows none, counts as one GPU of one."""
    gpus = max(booked, 1)
    pool = total - reserve(total)
    return pool * gpus // max(host_gpus, gpus) // MIB * MIB


def size_text(size: int) -> str:
    """Bytes as the engines' --memory takes them ("11468m")."""
    return f"{size // MIB}m"


# -- where containers go ----------------------------------------------------------------------


def user_bus(env: Mapping[str, str]) -> str | None:
    """The user systemd manager's bus socket, where one answers: DBUS_SESSION_BUS_ADDRESS's
    unix:path=, else $XDG_RUNTIME_DIR/bus; None where neither is a socket."""
    candidates = []
    address = env.get("DBUS_SESSION_BUS_ADDRESS", "")
    for part in address.split(";"):
        match = re.match(r"unix:path=([^,]+)", part)
        if match:
            candidates.append(match.group(1))
    if env.get("XDG_RUNTIME_DIR"):
        candidates.append(f"{env['XDG_RUNTIME_DIR']}/bus")
    for candidate in candidates:
        try:
            if Path(candidate).is_socket():
                return candidate
        except OSError:
            continue
    return None


def systemd_problem(uid: int, env: Mapping[str, str], *, root: Path = ROOT) -> str | None:
    """None where podman's systemd manager can set limits for this account, else why not."""
    if user_bus(env) is None:
        return "no user systemd manager answers (no $XDG_RUNTIME_DIR/bus)"
    service = root / "user.slice" / f"user-{uid}.slice" / f"user@{uid}.service"
    missing = [name for name in REQUIRED if name not in controllers(service)]
    if missing:
        return (f"systemd delegates no {', '.join(missing)} to user@{uid}.service "
                f"({service}/cgroup.controllers)")
    return None


def delegation_problem(uid: int | None = None, *, root: Path = ROOT, own: str | None = None) -> str | None:
    """None where this process runs in a leaf of a cgroup subtree its account owns with the
    memory and pids controllers enabled (cgroupfs limits hold), else the sentence saying why not."""
    uid = os.geteuid() if uid is None else uid
    own = own_cgroup() if own is None else own
    if not (root / "cgroup.controllers").exists():
        return f"{root} is not a cgroup v2 hierarchy"
    subtree = PurePosixPath(own or "/").parent
    if own in ("", "/") or subtree == PurePosixPath("/"):
        return (f"this process's cgroup {own or '/'} is not inside a subtree its account owns "
                f"(start the daemon in {root / SUBTREE / DAEMON_LEAF}, see docs/guides/limits.md)")
    folder = root / str(subtree).lstrip("/")
    for path in (folder, *(folder / name for name in DELEGATED_FILES[:2])):
        try:
            owner = path.stat().st_uid
        except OSError as error:
            return f"cannot read {path}: {error.strerror}"
        if owner != uid:
            return f"{path} belongs to uid {owner}, not to this account (uid {uid})"
    missing = [name for name in REQUIRED if name not in enabled(folder)]
    if missing:
        absent = [name for name in missing if name not in controllers(folder)]
        where = folder.parent if absent else folder
        return f"{', '.join(absent or missing)} missing from {where}/cgroup.subtree_control"
    return None


def bookings_parent(own: str | None = None) -> str:
    """The cgroup path (for --cgroup-parent) the containers go under: beside the daemon's leaf."""
    own = own_cgroup() if own is None else own
    return str(PurePosixPath(own).parent / BOOKINGS)


def placement(*, euid: int, env: Mapping[str, str], root: Path = ROOT, version: int | None = None,
              own: str | None = None) -> Placement:
    """Podman's cgroup manager here, and whether rootless limits hold (see the module docstring)."""
    version = cgroup_version() if version is None else version
    if euid == 0:
        return Placement("cgroupfs", None, True, "rootful podman sets them in its own cgroups")
    if version != 2:
        return Placement("cgroupfs", None, False, "this host has cgroups v1, where rootless podman ignores "
                         "every resource limit (--memory, --pids-limit)")
    systemd = systemd_problem(euid, env, root=root)
    if systemd is None:
        return Placement("systemd", None, True, "the user systemd manager delegates memory and pids")
    delegation = delegation_problem(euid, root=root, own=own)
    if delegation is None:
        parent = bookings_parent(own)
        return Placement("cgroupfs", parent, True, f"containers go under the delegated cgroup {parent}")
    # Not run in the subtree (doctor or status from an admin's shell, a daemon started by hand): the
    # subtree `gpubook setup` made still takes the containers, and its limits are what they get.
    leaf = f"/{SUBTREE}/{DAEMON_LEAF}"
    if own != leaf and (root / SUBTREE / DAEMON_LEAF).is_dir() \
            and delegation_problem(euid, root=root, own=leaf) is None:
        parent = bookings_parent(leaf)
        return Placement("cgroupfs", parent, True, f"containers go under the delegated cgroup {parent} (of "
                         f"{root / SUBTREE}, which this account owns; this process runs outside it)")
    return Placement("cgroupfs", None, False, f"cgroups v2 but nothing delegated to this account: {systemd}; "
                     f"and {delegation}; rootless podman then sets no limits")


def prepare_bookings(parent: str, *, root: Path = ROOT) -> None:
    """Make the cgroup the containers go under and enable the controllers for them (runc would
    too, but silently leaves out one it cannot enable: here that is a clear error)."""
    folder = root / parent.lstrip("/")
    try:
        folder.mkdir(exist_ok=True)
    except OSError as error:
        raise DelegationError(f"cannot make {folder}: {error.strerror}") from None
    wanted = [name for name in (*REQUIRED, *WANTED) if name in controllers(folder)]
    missing = [name for name in REQUIRED if name not in controllers(folder)]
    if missing:
        raise DelegationError(f"{folder} cannot use {', '.join(missing)} (not in its cgroup.controllers)")
    _enable(folder, wanted)


def _enable(folder: Path, names: Sequence[str]) -> None:
    absent = [name for name in names if name not in enabled(folder)]
    if not absent:
        return
    try:
        (folder / "cgroup.subtree_control").write_text(" ".join(f"+{name}" for name in absent))
    except OSError as error:
        raise DelegationError(f"cannot enable {', '.join(absent)} in {folder}/cgroup.subtree_control: "
                              f"{error.strerror} (a cgroup with processes of its own cannot give "
                              f"controllers to children)") from None


# -- making the delegated subtree (root) ------------------------------------------------------


def delegation_commands(user: str, *, name: str = SUBTREE, root: Path = ROOT) -> list[str]:
    """The shell commands `make_delegated_subtree` is equal to (docs, `gpubook setup --dry-run`)."""
    top, leaf = root / name, root / name / DAEMON_LEAF
    controls = " ".join(f"+{c}" for c in (*REQUIRED, *WANTED))
    files = " ".join(f"{top}/{f}" for f in DELEGATED_FILES)
    leaf_files = " ".join(f"{leaf}/{f}" for f in DELEGATED_FILES)
    return [
        f"echo '{controls}' > {root}/cgroup.subtree_control",
        f"mkdir -p {leaf}",
        f"echo '{controls}' > {top}/cgroup.subtree_control",
        f"chown {user}: {top} {files}",
        f"chown {user}: {leaf} {leaf_files}",
    ]


def make_delegated_subtree(uid: int, gid: int, *, name: str = SUBTREE, root: Path = ROOT) -> list[str]:
    """As root: /sys/fs/cgroup/NAME for the account uid:gid, controllers enabled, its leaf
    NAME/daemon made; idempotent. Returns what it did, one sentence a step. cgroupfs is not
    persistent: run it again after each boot, before the daemon starts."""
    if not (root / "cgroup.controllers").exists():
        raise DelegationError(f"{root} is not a cgroup v2 hierarchy (this host has cgroups v1): boot with "
                              "systemd.unified_cgroup_hierarchy=1 to enforce rootless limits")
    missing = [c for c in REQUIRED if c not in controllers(root)]
    if missing:
        raise DelegationError(f"this kernel's cgroup v2 has no {', '.join(missing)} controller")
    wanted = [c for c in (*REQUIRED, *WANTED) if c in controllers(root)]
    top, leaf = root / name, root / name / DAEMON_LEAF
    done = []
    if set(wanted) - enabled(root):
        _enable(root, wanted)
        done.append(f"enabled {' '.join(wanted)} in {root}/cgroup.subtree_control")
    for folder in (top, leaf):
        if not folder.is_dir():
            folder.mkdir()
            done.append(f"made {folder}")
    if set(wanted) - enabled(top):
        _enable(top, wanted)
        done.append(f"enabled {' '.join(wanted)} in {top}/cgroup.subtree_control")
    for folder in (top, leaf):
        for path in (folder, *(folder / f for f in DELEGATED_FILES)):
            if path.stat().st_uid != uid or path.stat().st_gid != gid:
                os.chown(path, uid, gid)
                done.append(f"gave {path} to {uid}:{gid}")
    return done


def enter(pid: int, *, name: str = SUBTREE, root: Path = ROOT) -> None:
    """As root: move process `pid` (the daemon's launcher, before it drops to the account) into
    the subtree's daemon leaf."""
    (root / name / DAEMON_LEAF / "cgroup.procs").write_text(str(pid))
