"""Processes on GPUs outside the bookings' containers ("foreign"), watched each sampling round.

A process on a booked GPU that does not run in that booking's container is foreign (someone on the
host, another container); a process on a GPU nobody booked is reported too. Whose a process is
comes from gpubook/runtime/nvidia/processes.py (PID namespaces, then cgroups). Each sighting is recorded in
State once and then only its last-seen time moves; a new sighting or one that ended costs a log
line, an event-log line and, through `on_change`, a pass soon after (the booking's event and the
status file follow within the sample interval, not at the next poll). A user's processes on a GPU
that keep coming within REPEAT_WINDOW of each other are one row and one piece of news.

`[policy] foreign_processes = "stop"`: the booker is told at once (their event, a "foreign"
notice) that the process is stopped after `foreign_grace_minutes`; then SIGTERM, and SIGKILL
KILL_AFTER seconds later if it is still there. Signals go through a pidfd opened after the
process's start time was checked again, so a PID reused meanwhile is never signalled. Only
processes on a booked GPU that run in no gpubook container are stopped: a booking's own processes
are never foreign, and another booking's container is never touched. Where the daemon may not
signal (another host user's process), that is said once, with the kernel's reason.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timedelta

from gpubook.runtime.engines import ContainerInfo
from gpubook.runtime.errors import GpubookError
from gpubook.runtime.nvidia.nvml import NvmlView
from gpubook.runtime.nvidia.processes import Attribution, start_ticks
from gpubook.scheduler import clock
from gpubook.scheduler.state import ForeignRow, State, StateError
from gpubook.scheduler.state.foreign import CANNOT, DUE, SPARED, STOPPED

log = logging.getLogger(__name__)
KILL_AFTER = 5.0  # seconds between SIGTERM and SIGKILL
# A user's processes on a GPU that keep coming within this long of each other are one row and one
# piece of news (gpubook/scheduler/state/foreign.py): a cron job or a retry loop of short-lived
# processes would otherwise make a row, an event line and an e-mail at every sample.
REPEAT_WINDOW = timedelta(minutes=10)
NOTICE = "foreign"  # the notice kind ([notify.*] events)


@dataclass(frozen=True)
class Round:
    seen: int  # foreign processes on the GPUs now
    changed: tuple[ForeignRow, ...]  # new sightings and ended ones


def describe(row: ForeignRow) -> str:
    where = f"booking {row.booking_id} (GPU {row.gpu})" if row.booking_id else f"GPU {row.gpu} (not booked)"
    whose = f"in container {row.container}" if row.container else "outside the booking's container" \
        if row.booking_id else "outside any booking"
    return f"{where}: pid {row.pid} ({row.command}, {row.user}) uses the GPU {whose}"


class ForeignWatch:
    """`watch()` is one round; the daemon runs it after each GPU sampling round."""

    def __init__(self, *, state: State, host: str, running: Callable[[], Sequence[ContainerInfo]],
                 read: Callable[[], NvmlView], mode: str = "report", grace: timedelta = timedelta(minutes=5),
                 on_change: Callable[[], None] = lambda: None,
                 inspect: Callable[[str], ContainerInfo | None] | None = None,
                 window: timedelta = REPEAT_WINDOW) -> None:
        """`running`: the containers as the last pass saw them; `read`: the GPUs' live view;
        `mode`: [policy] foreign_processes; `on_change`: asks the daemon for a pass soon; `inspect`:
        the engine's look at one container (for one whose pid the pass did not have); `window`: a
        user's processes on a GPU that keep coming within it are one piece of news (REPEAT_WINDOW)."""
        self.state, self.host, self.running, self.read = state, host, running, read
        self.mode, self.grace, self.on_change, self.window = mode, grace, on_change, window
        self.inspect = inspect
        self._inspected: dict[str, ContainerInfo] = {}  # container name → the engine's view, where the pass had no pid
        self.kills: list[threading.Thread] = []  # SIGKILLs waiting for their moment (tests join them)

    def __call__(self, *, now: datetime | None = None) -> Round:
        now = now or clock.now()
        view = self.read()
        if view.driver_version is None:
            return Round(seen=0, changed=())
        seen = self.sightings(view, now=now)
        try:
            changed = self.state.record_foreign(seen, host=self.host, now=now, window=self.window)
            for row in changed:
                self._tell(row, now=now)
            stopped = self._stop_due(now) if self.mode == "stop" else 0
        except StateError as error:
            log.warning("processes on the GPUs outside the bookings are not recorded this round: %s", error)
            return Round(seen=len(seen), changed=())
        if changed or stopped:
            self.on_change()
        return Round(seen=len(seen), changed=tuple(changed))

    def sightings(self, view: NvmlView, *, now: datetime) -> list[ForeignRow]:
        """The processes on each GPU that are not the GPU's booking container's."""
        containers = self._with_pids([info for info in self.running() if info.running and info.booking_id])
        owner = {gpu: info for info in containers for gpu in info.gpus}
        attribution = Attribution(containers)
        rows = []
        for gpu in view.gpus:
            mine = owner.get(gpu.index)
            for listed in gpu.processes:
                process = attribution.process(listed.pid, name=listed.name)
                if mine is not None and process.container == mine.name:
                    continue  # the booking's own
                if process.uid is None and process.started == 0:
                    continue  # ended between NVML's list and now
                row = ForeignRow(host=self.host, gpu=gpu.index, pid=process.pid, started=process.started,
                                 user=process.user, command=process.command,
                                 booking_id=mine.booking_id if mine is not None else None,
                                 container=process.container, first_seen=now, last_seen=now)
                rows.append(replace(row, action=self._first_action(row, now=now)))  # kept for a new sighting only
        return rows

    def _with_pids(self, containers: list[ContainerInfo]) -> list[ContainerInfo]:
        """The containers with their first process's pid: a pass that opened an armed container
        folds in what its labels say, without a pid, until the next pass lists it; the engine is
        asked once for each such container (no pid: none of its processes could be told apart)."""
        names = {info.name for info in containers}
        self._inspected = {name: info for name, info in self._inspected.items() if name in names}
        found = []
        for info in containers:
            if info.pid <= 0 and self.inspect is not None:
                if info.name not in self._inspected:
                    try:
                        listed = self.inspect(info.name)
                    except GpubookError as error:
                        log.info("booking %s: its container's first process is not known now: %s",
                                 info.booking_id, error)
                        listed = None
                    if listed is not None and listed.pid > 0:
                        self._inspected[info.name] = listed
                known = self._inspected.get(info.name)
                info = replace(info, pid=known.pid, id=known.id) if known is not None else info
            found.append(info)
        return found

    def _tell(self, row: ForeignRow, *, now: datetime) -> None:
        if row.gone_at is not None:
            message = f"{describe(row)} no more (seen since {row.first_seen:%H:%M:%S} UTC)"
            log.info("%s", message)
            self.state.log_event(message, level="info", booking_id=row.booking_id, at=now)
            return
        action = row.action
        message = f"{describe(row)}; " + (
            f"it is stopped at {action[len(DUE):]} unless it ends" if action.startswith(DUE)
            else action.removeprefix(SPARED) if action else "reported, not stopped ([policy] foreign_processes)")
        log.warning("%s", message)
        self.state.log_event(message, level="warning", booking_id=row.booking_id, at=now)
        if row.booking_id is not None:
            booker = next((i.user for i in self.running() if i.booking_id == row.booking_id), "")
            self.state.queue_notice(kind=NOTICE, booking_id=row.booking_id, user=booker,
                                    subject=f"gpubook: GPU {row.gpu} of your booking is also used by another process",
                                    text=message, fields={"gpu": row.gpu, "pid": row.pid, "process_user": row.user,
                                                          "command": row.command, "host": self.host}, at=now)

    def _first_action(self, row: ForeignRow, *, now: datetime) -> str:
        if self.mode != "stop" or row.booking_id is None:
            return ""
        if row.container is not None:
            return f"{SPARED}it runs in another booking's container ({row.container}), which gpubook never stops"
        return f"{DUE}{(now + self.grace).isoformat(timespec='seconds')}"

    def _stop_due(self, now: datetime) -> int:
        """Stop the processes whose grace is over; how many were tried."""
        due = [row for row in self.state.foreign() if row.host == self.host and row.action.startswith(DUE)
               and datetime.fromisoformat(row.action[len(DUE):]) <= now]
        for row in due:
            self.state.foreign_action(row, self.stop(row, now=now))
        return len(due)

    def stop(self, row: ForeignRow, *, now: datetime) -> str:
        """SIGTERM now, SIGKILL KILL_AFTER seconds later; what happened, as ForeignRow.action."""
        try:
            pidfd = os.pidfd_open(row.pid)
        except ProcessLookupError:
            return f"{STOPPED}{now.isoformat(timespec='seconds')}"  # ended on its own meanwhile
        try:
            if start_ticks(row.pid) != row.started:
                os.close(pidfd)
                return f"{SPARED}its pid now names another process"
            signal.pidfd_send_signal(pidfd, signal.SIGTERM)
        except PermissionError as error:
            os.close(pidfd)
            why = (f"the daemon's user (uid {os.getuid()}) may not signal a process of {row.user} "
                   f"({error.strerror}); an admin of the host can")
            message = f"{describe(row)}; gpubook cannot stop it: {why}"
            log.warning("%s", message)
            self.state.log_event(message, level="warning", booking_id=row.booking_id, at=now)
            return f"{CANNOT}{why}"
        except ProcessLookupError:
            os.close(pidfd)
            return f"{STOPPED}{now.isoformat(timespec='seconds')}"
        message = f"{describe(row)}; stopped (SIGTERM, SIGKILL after {KILL_AFTER:g} s if still there)"
        log.warning("%s", message)
        self.state.log_event(message, level="warning", booking_id=row.booking_id, at=now)
        killer = threading.Thread(target=_kill_later, args=(pidfd, row), name="gpubook-foreign-kill", daemon=True)
        killer.start()
        self.kills = [*[k for k in self.kills if k.is_alive()], killer]
        return f"{STOPPED}{now.isoformat(timespec='seconds')}"


def _kill_later(pidfd: int, row: ForeignRow) -> None:
    """SIGKILL unless the process ended within KILL_AFTER (a pidfd turns readable when it ends)."""
    try:
        poller = select.poll()
        poller.register(pidfd, select.POLLIN)
        if not poller.poll(KILL_AFTER * 1000):
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            log.warning("%s; it was still there after SIGTERM: killed", describe(row))
    except OSError as error:
        log.info("%s; SIGKILL not needed or not possible: %s", describe(row), error)
    finally:
        os.close(pidfd)
