"""What the apply stage remembers: per booking, in this process, and in State across restarts.

`Recall` is this process's memory between passes (a failed start and when to retry it, a booking
refused for good, the hold or note last logged): losing it on a restart only means one more log
line. What must survive a restart (a warning given, an end extension granted) is a State note;
`decide_memory` turns State's records and notes into decide()'s plain `Memory`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from scheduler.core import decide
from scheduler.state import ContainerRecord, State

PERMANENT_RETRY = timedelta(minutes=5)  # a start that failed for good is tried again after this
WARNED = "warned"  # State note: the warning given and the stop it announced (JSON)
AGREED_END = "agreed-end"  # State note: an end moved later while running, granted (ISO time)


@dataclass(frozen=True)
class Failure:
    """Why a booking's last action failed, and whether a retry can cure it soon."""

    reason: str
    at: datetime
    permanent: bool

    @property
    def retry_at(self) -> datetime | None:
        """When a permanent failure may be tried again; None: on the next pass."""
        return self.at + PERMANENT_RETRY if self.permanent else None

    def waiting(self, now: datetime) -> bool:
        return self.retry_at is not None and now < self.retry_at


@dataclass
class Recall:
    failures: dict[str, Failure] = field(default_factory=dict)  # booking id → its last failure
    refused: dict[str, str] = field(default_factory=dict)  # booking id → why it can never start
    held: dict[str, str] = field(default_factory=dict)  # booking id → the hold reason last logged
    notes: dict[str, str] = field(default_factory=dict)  # booking id → this pass's note for its event
    logged_notes: dict[str, str] = field(default_factory=dict)  # booking id → the note last logged

    def retries(self) -> list[datetime]:
        return [f.retry_at for f in self.failures.values() if f.retry_at is not None]


def decide_memory(records: Iterable[ContainerRecord], warned: Mapping[str, str]) -> decide.Memory:
    """decide()'s memory from State: each booking's runs, and the warnings given."""
    runs: dict[str, decide.Runs] = {}
    for record in records:  # in id order: the last record of a booking is its latest run
        before = runs.get(record.booking_id)
        runs[record.booking_id] = decide.Runs(
            restarts=0 if before is None else before.restarts + 1, running=record.stopped_at is None,
            last_stopped=record.stopped_at, last_reason=record.exit_reason)
    given = {}
    for booking_id, text in warned.items():
        data = json.loads(text)
        given[booking_id] = decide.Warned(
            at=datetime.fromisoformat(data["at"]),
            end=datetime.fromisoformat(data["end"]) if data["end"] else None,
            stop_at=datetime.fromisoformat(data["stop_at"]))
    return decide.Memory(known=frozenset(runs), warned=given, runs=runs)


def warned_note(action: decide.Warn, *, now: datetime) -> str:
    return json.dumps({"at": now.isoformat(), "end": action.end.isoformat() if action.end else None,
                       "stop_at": action.stop_at.isoformat()})


class Journal:
    """Log lines about a named booking, each also kept in State's event log."""

    def __init__(self, state: State, recall: Recall, logger_name: str = "scheduler.apply") -> None:
        self.state = state
        self.recall = recall
        self.log = logging.getLogger(logger_name)

    def say(self, booking_id: str | None, message: str, *, now: datetime | None, level: str = "info",
            detail: str | None = None) -> None:
        getattr(self.log, level)("booking %s: %s", booking_id or "-", message)
        self.state.log_event(detail or message, booking_id=booking_id, level=level, at=now)

    def note(self, booking_id: str, message: str, *, now: datetime) -> None:
        """A note for the booking's event, logged once while it stays the same."""
        if self.recall.logged_notes.get(booking_id) != message:
            self.recall.logged_notes[booking_id] = message
            self.say(booking_id, message, now=now)
