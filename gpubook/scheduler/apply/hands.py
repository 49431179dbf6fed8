"""The pass's hands: each action through the handler for its kind, its failure kept and logged.

The bookings' actions run in their lanes (lanes.py: each booking's in order, different bookings in
parallel); the upkeep (adopt, extend, remind: gpubook/scheduler/core/upkeep.py) runs in the pass
itself, before decide(), which reads what it records. Each recorded outcome is folded into the
pass's view of the world. A booking's failure is caught, logged as a sentence naming the booking,
and retried on a later pass (temporary errors after a growing delay, permanent ones after
`PERMANENT_RETRY`); it never stops the other bookings. An image still being prepared is no failure:
the booking is held with a note until it is ready.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from concurrent.futures import Future
from datetime import datetime
from typing import Protocol

import paramiko

from gpubook.runtime.engines import ContainerInfo
from gpubook.runtime.errors import GpubookError, Preparing
from gpubook.runtime.templates.catalog import TemplateSet
from gpubook.scheduler.apply import reclaim as reclaim_apply
from gpubook.scheduler.apply.handlers import (
    AdoptHandler,
    Change,
    ClearHandler,
    DisarmHandler,
    ExtendHandler,
    HoldHandler,
    RemindHandler,
    StartHandler,
    StopHandler,
    WarnHandler,
)
from gpubook.scheduler.apply.lanes import BookingLanes, booking_of
from gpubook.scheduler.apply.memory import PERMANENT_RETRY, PREPARING_RECHECK, Journal, Recall, failure
from gpubook.scheduler.core import decide, reclaim, upkeep
from gpubook.scheduler.hosts import Host
from gpubook.scheduler.outbox.metrics import Metrics, start_failure_reason
from gpubook.scheduler.settings import Config
from gpubook.scheduler.state import State, StateError, StateUnavailable, notes


class Folding(Protocol):
    """The pass's view (passes.py's World), as the hands update it."""

    def fold(self, change: Change) -> None: ...

    def gpus_of(self, name: str) -> frozenset[int]: ...


class Hands:
    """The handlers, built once, the bookings' lanes, and the memory of their failures."""

    def __init__(self, config: Config, *, hosts: Mapping[str, Host], state: State, templates: TemplateSet,
                 metrics: Metrics | None = None, logged_in: Callable[[ContainerInfo], bool] | None = None,
                 address: Callable[[str], str] | None = None) -> None:
        """`address`: where a booker logs in to a booking on a host (the backend's)."""
        self.metrics = metrics
        self.state = state
        self.recall = Recall()
        self.journal = journal = Journal(state)
        self.lanes = BookingLanes()
        zone = config.host.timezone
        self.stop = StopHandler(hosts=hosts, state=state, journal=journal, timezone=zone)
        self.handlers: dict[type, Callable[..., Change]] = {
            decide.Start: StartHandler(config, hosts=hosts, state=state, templates=templates, recall=self.recall,
                                       journal=journal, metrics=metrics, address=address),
            decide.Stop: self.stop,
            decide.Clear: ClearHandler(hosts=hosts, state=state, journal=journal),
            decide.Disarm: DisarmHandler(hosts=hosts, state=state, journal=journal),
            decide.Warn: WarnHandler(hosts=hosts, state=state, journal=journal, timezone=zone),
            decide.Hold: HoldHandler(journal=journal),
            reclaim.Release: reclaim_apply.ReleaseHandler(hosts=hosts, state=state, journal=journal, timezone=zone,
                                                          logged_in=logged_in, metrics=metrics),
            reclaim.IdleNotice: reclaim_apply.IdleHandler(hosts=hosts, state=state, journal=journal),
            upkeep.Adopt: AdoptHandler(state=state, journal=journal),
            upkeep.Extend: ExtendHandler(state=state, journal=journal, hosts=hosts),
            upkeep.Remind: RemindHandler(config, state=state, journal=journal),
        }

    def keep(self, actions: Sequence[upkeep.Upkeep], world: Folding, *, now: datetime) -> None:
        """The upkeep, here and now (each handler keeps its own failure to a warning)."""
        for action in actions:
            world.fold(self.handlers[type(action)](action, now=now))

    def dispatch(self, actions: Sequence[decide.Action], world: Folding, *, now: datetime,
                 failures: dict[str, str], done: Callable[[decide.Start], None] | None = None,
                 stale: Collection[str] = ()) -> list[Future[None]]:
        """The bookings' actions in their lanes; `failures` gets why each failed (booking id → reason),
        `done` is told of each start once it is recorded (or failed); `stale`: the bookings at work
        when `world` was read (their actions wait for the next pass)."""
        handled = [a for a in actions if type(a) in self.handlers]  # Recheck only informs the wake-up time

        def apply(action: decide.Action) -> None:
            try:
                self._handle(action, world, now=now, failures=failures)
            finally:
                if done is not None and isinstance(action, decide.Start):
                    done(action)

        return self.lanes.dispatch(handled, apply=apply, gpus_of=world.gpus_of, stale=stale)

    def _handle(self, action: decide.Action, world: Folding, *, now: datetime, failures: dict[str, str]) -> None:
        booking_id = booking_of(action)
        try:
            world.fold(self.handlers[type(action)](action, now=now))
        except Preparing as waiting:  # not a failure: held with a note until its image is ready
            if booking_id:
                self.recall.preparing[booking_id] = now + PREPARING_RECHECK
                self.journal.tell(notes.HELD, booking_id, str(waiting), str(waiting), now=now)
        except (GpubookError, OSError, paramiko.SSHException) as error:
            self._failed(action, booking_id, error, now=now, failures=failures)

    def _failed(self, action: decide.Action, booking_id: str | None, error: Exception, *, now: datetime,
                failures: dict[str, str]) -> None:
        what = type(action).__name__.lower()
        permanent = getattr(error, "temporary", True) is False
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        failures[booking_id or "?"] = reason
        if isinstance(action, decide.Start) and self.metrics is not None:
            self.metrics.start_failed(reason=start_failure_reason(error))
        retry = f"retry in {PERMANENT_RETRY.seconds // 60} min" if permanent else "retry on the next pass"
        if booking_id:
            self.recall.preparing.pop(booking_id, None)
            before = self.recall.failures.get(booking_id)
            backoff = isinstance(action, decide.Start)
            on_state = backoff and isinstance(error, StateUnavailable)  # its disk full: soon again, not later
            failed = (before.after(reason, now=now, permanent=permanent, backoff=backoff, on_state=on_state)
                      if before else failure(reason, now=now, permanent=permanent, backoff=backoff, on_state=on_state))
            self.recall.failures[booking_id] = failed
            if failed.delay:
                retry = f"retry in {int(failed.delay.total_seconds())} s"
            self._tell_failed(booking_id, notes.Failed(reason, failed.retry_at), now=now)
        self.journal.say(booking_id, f"{what} failed: {reason}; {retry}", now=now, level="error", detail=str(error))

    def _tell_failed(self, booking_id: str, failed: notes.Failed, *, now: datetime) -> None:
        """Why it failed, for its event (a State note: a restart keeps it); the log line is the caller's."""
        try:
            notes.FAILED.write(self.state, booking_id, failed, at=now)
        except StateError as error:  # a start that failed on State itself: its log line says why
            self.journal.log.warning("booking %s: why it failed is not in its event yet: %s", booking_id, error)

    def close(self) -> None:
        self.lanes.close()
