"""What the apply stage remembers: per booking, in this process, and in State across restarts.

`Recall` is this process's memory between passes, and only of timing: when a failed or refused start
is tried again, when a booking held for its image is looked at again. Losing it on a restart only
means one try sooner. What the booker was told (why a start was refused or failed, a hold, the plan's
sentence) and what must survive a restart (a warning given, an end extension granted) are State
notes (gpubook/scheduler/state/notes.py); `decide_memory` turns State's records and the pass's notes
into decide()'s plain `Memory`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import TypeVar

from gpubook.scheduler.core import decide
from gpubook.scheduler.hosts.images import EVENT_REFRESH
from gpubook.scheduler.state import ContainerRecord, State, StateError
from gpubook.scheduler.state.notes import Kind, Notes

T = TypeVar("T")

PERMANENT_RETRY = timedelta(minutes=5)  # a start that failed for good is tried again after this
START_BACKOFF = timedelta(seconds=10)  # a failed start's first wait; doubled each time, up to PERMANENT_RETRY
# A start that failed on State itself (its disk full, another process holding it): no fault of the
# booking's, so tried again this soon, never backed off; it starts as soon as State works again.
STATE_RETRY = timedelta(seconds=5)
# A booking held for its image is looked at again this often: as often as its event's sentence may change
# (hosts/images.py EVENT_REFRESH). At 30 s, a hold whose start pass still showed the sentence of the
# pull's first seconds ("0 of 15 MB", no time yet) kept it until the image was ready: issue 35's lanes
# and the sequential run both failed test_daemon_images on it.
PREPARING_RECHECK = EVENT_REFRESH


@dataclass(frozen=True)
class Failure:
    """Why a booking's last action failed, and whether a retry can cure it soon."""

    reason: str
    at: datetime
    permanent: bool
    delay: timedelta = timedelta(0)  # a temporary failure's wait before the next try (backoff)
    count: int = 1  # failures in a row

    @property
    def retry_at(self) -> datetime | None:
        """When the booking may be tried again; None: on the next pass."""
        if self.permanent:
            return self.at + PERMANENT_RETRY
        return self.at + self.delay if self.delay else None

    def after(self, reason: str, *, now: datetime, permanent: bool, backoff: bool,
              on_state: bool = False) -> Failure:
        """The failure that follows this one: with `backoff`, a temporary one waits twice as long."""
        return failure(reason, now=now, permanent=permanent, backoff=backoff, count=self.count + 1, on_state=on_state)

    def waiting(self, now: datetime) -> bool:
        return self.retry_at is not None and now < self.retry_at


def failure(reason: str, *, now: datetime, permanent: bool, backoff: bool, count: int = 1,
            on_state: bool = False) -> Failure:
    """A start that keeps failing the same temporary way (sshd never answering: 60 s each) backs off,
    10 s, 20 s, 40 s ... up to PERMANENT_RETRY, instead of costing its time on every pass; one that
    failed `on_state` is tried again after STATE_RETRY each time."""
    if on_state:
        return Failure(reason, now, permanent, delay=STATE_RETRY, count=count)
    delay = min(START_BACKOFF * 2 ** (count - 1), PERMANENT_RETRY) if backoff and not permanent else timedelta(0)
    return Failure(reason, now, permanent, delay=delay, count=count)


@dataclass
class Recall:
    """When each booking may be tried again (the threads of the bookings' lanes change these)."""

    failures: dict[str, Failure] = field(default_factory=dict)  # booking id → its last failure (or refusal)
    preparing: dict[str, datetime] = field(default_factory=dict)  # booking id → when to look at it again

    def retries(self) -> list[datetime]:
        # Copies: bookings' actions run in parallel threads that change these dicts.
        failures, preparing = dict(self.failures), dict(self.preparing)
        return [*(f.retry_at for f in failures.values() if f.retry_at is not None), *preparing.values()]


def decide_memory(records: Iterable[ContainerRecord], notes: Notes, *,
                  released: frozenset[str] = frozenset(), ported: frozenset[str] = frozenset()) -> decide.Memory:
    """decide()'s memory from State: each booking's runs, the warnings given, the containers armed,
    the idle stretches told of, the bookings released as no-shows. `ported`: the bookings holding a
    port in State, which gpubook took for a start of its own (a start cut short by the daemon's death
    before its record leaves only that)."""
    runs: dict[str, decide.Runs] = {}
    for record in records:  # in id order: the last record of a booking is its latest run
        before = runs.get(record.booking_id)
        runs[record.booking_id] = decide.Runs(
            restarts=0 if before is None else before.restarts + 1, running=record.stopped_at is None,
            last_stopped=record.stopped_at, last_reason=record.exit_reason)
    given = {booking_id: decide.Warned(at=w.at, end=w.end, stop_at=w.stop_at) for booking_id, w in notes.warned.items()}
    return decide.Memory(known=frozenset(runs) | ported, warned=given, runs=runs, armed=frozenset(notes.armed),
                         released=released, idle_told=dict(notes.idle_told))


class Journal:
    """Log lines about a named booking, each also kept in State's event log."""

    def __init__(self, state: State, logger_name: str = "gpubook.scheduler.apply") -> None:
        self.state = state
        self.log = logging.getLogger(logger_name)

    def say(self, booking_id: str | None, message: str, *, now: datetime | None, level: str = "info",
            detail: str | None = None) -> None:
        """Logged always; kept in State's event log when the database can be written (a locked or
        full database costs the event log line, never the pass)."""
        getattr(self.log, level)("booking %s: %s", booking_id or "-", message)
        try:
            self.state.log_event(detail or message, booking_id=booking_id, level=level, at=now)
        except StateError as error:
            self.log.warning("booking %s: this line is not in the event log: %s", booking_id or "-", error)

    def tell(self, kind: Kind[T], booking_id: str, value: T, message: str, *, now: datetime,
             level: str = "info") -> bool:
        """An outcome note for the booking's event, written and logged once while it stays the same
        (whether it was new); a database that cannot be written costs the note until the next try,
        never the booking's action."""
        try:
            changed = kind.put(self.state, booking_id, value, at=now)
        except StateError as error:
            self.log.warning("booking %s: its event's %s note waits for a later pass: %s", booking_id, kind.key, error)
            changed = True
        if changed:
            self.say(booking_id, message, now=now, level=level)
        return changed
