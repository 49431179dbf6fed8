"""Containers podman no longer knows while their processes run on.

podman 4.3 starts a container's monitor, conmon, before it records the container in its store: a
`podman run` killed in between (the daemon killed with it, the host's OOM killer, a wrapper's
timeout) leaves conmon and the booker's command running, with the booking's GPUs and its published
port (conmon holds the port forwarder's exit pipe), while podman lists nothing of that name. Its
booking cannot start again (the port is taken) and nothing would ever stop it. A `stop` killed
midway and then `rm --force` leave the same (`CliEngine._remove_leftover`).

`monitors()` finds the conmon processes of this account; `end()` ends one with its container's
command. The podman engine ends those of a booking's container name that its store does not list,
before that booking's start and after a start that failed (tests/test_faulty_engine.py).
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")


@dataclass(frozen=True)
class Monitor:
    pid: int  # conmon's; the container's command (runc's child) is this process's child
    id: str  # the container id podman gave it
    name: str
    bundle: str  # -b: the container's folder under its store's graph root

    def in_store(self, graph_root: Path) -> bool:
        return Path(self.bundle).is_relative_to(graph_root)


def monitors(*, uid: int | None = None, proc: Path = PROC) -> list[Monitor]:
    """The conmon processes of the account `uid` (this process's by default), from their argv."""
    uid = os.getuid() if uid is None else uid
    found = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if entry.stat().st_uid != uid:
                continue
            argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:  # ended meanwhile
            continue
        if argv and Path(argv[0]).name == "conmon":
            values = _values(argv, ("-c", "-n", "-b"))
            if values is not None:
                found.append(Monitor(int(entry.name), *values))
    return found


def _values(argv: list[str], flags: tuple[str, ...]) -> tuple[str, ...] | None:
    values = []
    for flag in flags:
        try:
            values.append(argv[argv.index(flag) + 1])
        except (ValueError, IndexError):
            return None
    return tuple(values)


def end(monitor: Monitor, *, proc: Path = PROC) -> None:
    """SIGKILL the container's command (its pid namespace's init: the namespace goes with it) and
    then its conmon; the port forwarder exits once conmon is gone."""
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == monitor.pid:  # its parent pid
            _kill(int(entry.name))
    _kill(monitor.pid)


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
