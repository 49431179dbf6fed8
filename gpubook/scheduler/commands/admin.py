"""`gpubook run`, `status`, `stop` and `log`: the daemon in the foreground, and what an admin asks of it.

status, stop and log never talk to a running daemon: they read the engine's containers (the truth
for what runs), the State database and the status file the daemon rewrites after each pass.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING
from zoneinfo import ZoneInfo

from gpubook import logsafe
from gpubook.runtime.engines import container_name, make_engine
from gpubook.runtime.errors import GpubookError
from gpubook.runtime.nvidia import gpus as gpu_inventory
from gpubook.scheduler import config as config_module
from gpubook.scheduler.core.plan import LOCAL
from gpubook.scheduler.hosts import backend as backends
from gpubook.scheduler.locks import LOCK_FILE
from gpubook.scheduler.outbox.status import GpuSummary, HostStatus, Status, engine_line, setup_findings
from gpubook.scheduler.outbox.status_file import STATUS_FILE
from gpubook.scheduler.sources.errors import printable
from gpubook.scheduler.state import LogEntry, State, port_range_problem
from gpubook.scheduler.state.folder import state_dir

if TYPE_CHECKING:
    from gpubook.scheduler.wiring import Stopping

log = logging.getLogger(__name__)

EXIT_NOT_RUNNING = 3  # as `systemctl status` says of a unit that is not active
PROC_LOCKS = Path("/proc/locks")


def run(config_path: str) -> int:
    """The daemon in the foreground; logs go to stderr (journald adds the time under systemd)."""
    root = logging.getLogger()
    # The daemon's log: each line with its time, or with its priority under journald (logsafe.configure).
    logsafe.configure(min(root.level or logging.INFO, logging.INFO), times=True)
    root.setLevel(min(root.level or logging.INFO, logging.INFO))
    logging.getLogger("apscheduler").setLevel(logging.ERROR)  # "skipped: already running" is expected
    from gpubook.scheduler.daemon import Daemon  # status, stop and log need none of it (each a process of its own)

    return Daemon(config_module.load(config_path, directory="read"), exclusive=True).run()


def daemon_pid(folder: Path, *, locks: Path = PROC_LOCKS) -> int | None:
    """The pid of the daemon holding the state folder's lock (`gpubook run`), or None when no
    process holds it. Read from the kernel's lock table, so that asking never takes the lock
    (a daemon starting at that instant would find it taken and refuse to run)."""
    path = folder / LOCK_FILE
    try:
        found = path.stat()
    except FileNotFoundError:
        return None
    except PermissionError:
        raise GpubookError(f"cannot read {path}: permission denied (run this as the daemon's user)") from None
    try:
        table = locks.read_text()
    except OSError:  # no /proc here: ask the lock itself, briefly
        return _pid_by_flock(path)
    device = f"{os.major(found.st_dev):02x}:{os.minor(found.st_dev):02x}:{found.st_ino}"
    for line in table.splitlines():
        fields = line.split()
        if "FLOCK" in fields and device in fields and "->" not in fields:  # "->": a waiter, not the holder
            holder = fields[fields.index(device) - 1]
            return int(holder) if holder.isdigit() else 0
    return None


def _pid_by_flock(path: Path) -> int | None:
    import fcntl

    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        text = os.read(fd, 32).decode(errors="replace").strip()
        return int(text) if text.isdigit() else 0
    finally:
        os.close(fd)
    return None


def _not_running(folder: Path, report: Status, *, written: float | None) -> str:
    when = report.updated or (datetime.fromtimestamp(written, UTC).isoformat() if written else None)
    last = f"last status written at {when}" if when else "no status written yet"
    return f"no gpubook daemon is running for {folder} ({last})"


def status(config_path: str, *, as_json: bool = False) -> int:
    """What runs and what comes; exit 3 (and a first line saying so) when no daemon holds the state
    folder, since the last status shown is then as old as that daemon's last pass."""
    config = config_module.load(config_path)
    folder = state_dir(config)
    pid = daemon_pid(folder)
    engine = make_engine(config.engine)
    # Another account's engine (root's podman, say) holds none of the daemon's containers: its listing
    # and its limits would be that account's. The daemon's account owns the state folder.
    owner = _owner(folder)
    elsewhere = owner is not None and owner != os.geteuid()
    live = None if elsewhere else backends.listed_here(config, engine)  # None: as the daemon's last pass listed them
    status_path = folder / STATUS_FILE
    if status_path.is_file():
        report = Status.from_json(json.loads(status_path.read_text()))
    else:  # the daemon has not run a pass yet: this host's GPUs, nothing planned
        summary = GpuSummary.of(gpu_inventory.inventory(static_count=config.gpu_count))
        report = Status(hosts=(HostStatus(name=LOCAL, gpus=summary),))
    ports: dict[str, int] = {}
    problems: list[LogEntry] = []
    if (folder / "state.sqlite").is_file():  # a read-only command never makes the daemon's database
        with State(folder / "state.sqlite") as state:
            ports = state.ports()
            problems = [e for e in state.events(limit=None) if e.level in ("warning", "error")][-5:]
    if live is not None:  # else as the daemon's last pass listed them
        report = report.with_containers(live, ports=ports)
    held = set(ports.values()) | ({config.sftp.port} if config.sftp.enabled else set())
    if live is not None and (taken := port_range_problem(config.ssh.port_min, config.ssh.port_max, held=held)):
        report = replace(report, problems=(*report.problems, taken))
    shown_engine = engine_line(engine) if not elsewhere else (
        f"{config.engine.name} of {_login(owner)}, the daemon's account (this command runs as {_login(os.geteuid())}: "
        "the containers are as the daemon's last pass listed them; run it as the daemon's account to list them now)")
    report = replace(report, findings=setup_findings(config.engine), engine=shown_engine, recent_warnings=tuple(
        printable(f"{e.at.isoformat()} {e.booking_id or '-'}: {e.message}") for e in problems))
    # An engine may enforce everything; another account's limits are not the daemon's.
    limits = None if elsewhere else getattr(engine, "limits_problem", lambda: None)()
    if limits is not None:
        report = replace(report, problems=(*report.problems, f"resource limits: {limits}"))
    written = status_path.stat().st_mtime if status_path.is_file() else None
    warning = None if pid is not None else _not_running(folder, report, written=written)
    if as_json:
        json.dump({**report.to_json(), "daemon": {"running": pid is not None, "pid": pid or None,
                                                  "state_dir": str(folder)}}, sys.stdout, indent=2)
        print()
    else:
        print("\n".join(([warning] if warning else []) + report.render(config.host.timezone)))
    return 0 if pid is not None else EXIT_NOT_RUNNING


def _owner(folder: Path) -> int | None:
    """The uid that owns the state folder (the daemon's account); None: no folder yet."""
    try:
        return folder.stat().st_uid
    except OSError:
        return None


def _login(uid: int | None) -> str:
    import pwd

    try:
        return pwd.getpwuid(uid if uid is not None else -1).pw_name
    except (KeyError, OverflowError):
        return f"uid {uid}"


def stop(config_path: str, booking: str) -> int:
    """Stop a booking's container now; it is not started again; the event says "ended". Built
    through the wiring's `for_stop`: beside a running daemon, nothing of a daemon is made."""
    from gpubook.scheduler import wiring

    parts = wiring.for_stop(config_module.load(config_path))
    try:
        return _stop(parts, booking, now=datetime.now(UTC))
    finally:
        parts.close()


def _stop(parts: Stopping, booking: str, *, now: datetime) -> int:
    if problem := parts.refresh_hosts():  # the backend's hosts, read as a pass reads them
        raise GpubookError(problem)
    matches = [c for c in parts.containers() if booking in (c.booking_id, c.name)]
    if not matches:
        raise GpubookError(f"no running container for booking {booking!r} (see gpubook status)")
    info = matches[0]
    parts.stop_now(info.booking_id, now=now)
    print(f"stopped {container_name(info.booking_id)} (booking {info.booking_id})")
    try:
        reading = parts.calendars.read(now=now)
        parts.refresh_hosts()  # the container gone: its host read again (a cluster's job cancelled)
        plan = parts.plan([o for o in reading.occurrences if o.id == info.booking_id], now=now)
        parts.writeback.write(plan, containers=parts.containers(), now=now, etags=reading.etags)
    except GpubookError as error:
        print(f"gpubook: the calendar was not updated ({error}); the daemon writes it on its next pass",
              file=sys.stderr)
    return 0


def show_log(config_path: str, *, follow: bool = False, booking: str | None = None, last: int = 50,
             as_json: bool = False) -> int:
    """The event log; with `as_json` one JSON object a line (JSON Lines, so --follow can go on)."""
    config = config_module.load(config_path)
    zone = ZoneInfo(config.host.timezone)
    show = _json_entry if as_json else _print_entry
    database = state_dir(config) / "state.sqlite"
    if not database.is_file():  # a read-only command never makes the daemon's database
        print(f"gpubook: no event log yet: gpubook has not run with {config.path} (no {database})", file=sys.stderr)
        if not follow:
            return 0
        while not database.is_file():
            time.sleep(1.0)
    with State(database) as state:
        entries = state.events(booking_id=booking)
        entries = entries[-last:] if last else entries
        after = entries[-1].id if entries else 0
        for entry in entries:
            show(entry, zone)
        while follow:
            time.sleep(1.0)
            for entry in state.events(after_id=after, booking_id=booking):
                show(entry, zone)
                after = entry.id
    return 0


def _print_entry(entry: LogEntry, zone: ZoneInfo) -> None:
    when = entry.at.astimezone(zone).strftime("%Y-%m-%d %H:%M:%S")
    print(printable(f"{when} {entry.level:<7} {entry.booking_id or '-'}: {entry.message}"), flush=True)


def _json_entry(entry: LogEntry, zone: ZoneInfo) -> None:
    print(json.dumps({"id": entry.id, "at": entry.at.astimezone(zone).isoformat(), "level": entry.level,
                      "booking": entry.booking_id, "message": entry.message}), flush=True)
