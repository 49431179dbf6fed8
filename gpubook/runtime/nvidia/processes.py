"""Whose is a process on a GPU: which of gpubook's containers it runs in (if any), its owner, its command.

NVML lists each GPU's processes by host PID; this tells a booking's own processes from anyone
else's. What decides, strongest first:

- The PID namespace: `/proc/PID/ns/pid` against the namespace of each container's first process.
  A namespace's inode is unique while it lives and nobody can join a rootless container's without
  being the daemon's user (it owns the container's user namespace, so the kernel lets it read its
  containers' processes' namespaces). A process in the host's namespace is in none of them; so is a
  process of another container run by someone else.
- Where namespaces cannot be read (a container engine running as root, e.g. Docker: its
  containers' processes are root's), `/proc/PID/cgroup` naming the container's full id. Any user
  may make cgroups under their own delegated `user@UID.service` and name them after a container
  id, so a path through another user's `user@UID.service` never counts.
- A process the daemon may not inspect at all belongs to none of its containers.

Ancestry is not used: a `podman exec` process is no descendant of the container's first process,
and a parent is no proof of the namespace it put its child in.
"""

from __future__ import annotations

import functools
import os
import pwd
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from gpubook.runtime.engines import ContainerInfo

PROC = Path("/proc")
SUBUID = Path("/etc/subuid")
_USER_SERVICE = re.compile(r"^user@(\d+)\.service$")


@dataclass(frozen=True)
class HostProcess:
    """One process as the host sees it."""

    pid: int
    started: int  # its start in clock ticks after boot (/proc/PID/stat): a reused PID is another process; 0: unknown
    uid: int | None  # its real uid; None: gone or unreadable
    user: str  # "carol"; "uid 100998 (gpubook's subordinate uid)"; "uid 4242"; "unknown"
    command: str  # /proc/PID/comm, or what NVML called it
    container: str | None  # the gpubook container it runs in; None: none of them


def pid_namespace(pid: int, *, proc: Path = PROC) -> str | None:
    """"pid:[4026531836]", or None where the process is gone or its namespace may not be read."""
    try:
        return os.readlink(proc / str(pid) / "ns" / "pid")
    except OSError:
        return None


def start_ticks(pid: int, *, proc: Path = PROC) -> int:
    """The process's start (field 22 of /proc/PID/stat, after the command in parentheses); 0: unknown."""
    try:
        text = (proc / str(pid) / "stat").read_text()
        return int(text[text.rindex(")") + 2:].split()[19])
    except (OSError, ValueError, IndexError):
        return 0


def real_uid(pid: int, *, proc: Path = PROC) -> int | None:
    try:
        for line in (proc / str(pid) / "status").read_text().splitlines():
            if line.startswith("Uid:"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def user_name(uid: int | None, *, subuid: Path = SUBUID) -> str:
    """The account's name; a subordinate uid (a rootless container's user) says whose range it is in."""
    return "unknown" if uid is None else _user_name(uid, subuid)


@functools.lru_cache(maxsize=1024)  # NSS and /etc/subuid cost ~0.2 ms a look; a round asks for few uids, often
def _user_name(uid: int, subuid: Path) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        pass
    for owner, first, count in _subordinate_ranges(subuid):
        if first <= uid < first + count:
            return f"uid {uid} ({owner}'s subordinate uid: a rootless container's user)"
    return f"uid {uid}"


def _subordinate_ranges(path: Path) -> list[tuple[str, int, int]]:
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return []
    ranges = []
    for line in lines:
        parts = line.strip().split(":")
        if len(parts) == 3 and parts[1].isdigit() and parts[2].isdigit():
            owner = parts[0]
            if owner.isdigit():
                owner = user_name(int(owner), subuid=Path("/nonexistent"))
            ranges.append((owner, int(parts[1]), int(parts[2])))
    return ranges


def command_of(pid: int, *, fallback: str | None = None, proc: Path = PROC) -> str:
    try:
        return (proc / str(pid) / "comm").read_text().strip() or fallback or "?"
    except OSError:
        return fallback or "?"


class Attribution:
    """Which of `containers` each host PID runs in, read once per sampling round."""

    def __init__(self, containers: Iterable[ContainerInfo], *, own_uid: int | None = None, proc: Path = PROC,
                 subuid: Path = SUBUID) -> None:
        self.proc, self.subuid = proc, subuid
        self.own_uid = os.getuid() if own_uid is None else own_uid
        running = [info for info in containers if info.running]
        self._by_namespace: dict[str, str] = {}
        self._unread: list[ContainerInfo] = []  # containers whose namespace could not be read
        for info in running:
            namespace = pid_namespace(info.pid, proc=proc) if info.pid > 0 else None
            # Never the daemon's own namespace: a container sharing it (--pid=host) proves nothing.
            if namespace is not None and namespace != os.readlink(proc / "self" / "ns" / "pid"):
                self._by_namespace[namespace] = info.name
            else:
                self._unread.append(info)

    def process(self, pid: int, *, name: str | None = None) -> HostProcess:
        uid = real_uid(pid, proc=self.proc)
        return HostProcess(pid=pid, started=start_ticks(pid, proc=self.proc), uid=uid,
                           user=user_name(uid, subuid=self.subuid), command=command_of(pid, fallback=name,
                                                                                        proc=self.proc),
                           container=self.container_of(pid))

    def container_of(self, pid: int) -> str | None:
        namespace = pid_namespace(pid, proc=self.proc)
        if namespace is not None and namespace in self._by_namespace:
            return self._by_namespace[namespace]
        return self._by_cgroup(pid) if self._unread else None

    def _by_cgroup(self, pid: int) -> str | None:
        try:
            text = (self.proc / str(pid) / "cgroup").read_text()
        except OSError:
            return None  # not ours to inspect: in none of our containers
        for line in text.splitlines():
            segments = line.split(":", 2)[-1].split("/")
            if any((m := _USER_SERVICE.match(s)) and int(m[1]) != self.own_uid for s in segments):
                continue  # another user's delegated cgroups: they name them as they like
            for info in self._unread:
                if len(info.id) >= 32 and any(_names_id(segment, info.id) for segment in segments):
                    return info.name
        return None


def _names_id(segment: str, container_id: str) -> bool:
    """libpod-ID.scope, docker-ID.scope (systemd), libpod-ID, ID (cgroupfs)."""
    for prefix in ("libpod-", "docker-", ""):
        for suffix in (".scope", ""):
            if segment == f"{prefix}{container_id}{suffix}":
                return True
    return False


def attribute(pids: Sequence[int], containers: Iterable[ContainerInfo]) -> dict[int, str | None]:
    """pid → the gpubook container it runs in (None: none), for a one-off look."""
    attribution = Attribution(containers)
    return {pid: attribution.container_of(pid) for pid in pids}
