"""State's per-booking notes, one owner: each kind's key and its typed reading and writing.

A note is what the apply stage must remember about a booking across a restart and that the engine's
labels cannot tell: a container run ahead of its start, a warning given, an end moved later, an
idle stretch told of, a reminder queued, the lines a start added to the running block. A pass reads
them all at once (`read`, one query) into `Notes`, whose fields are typed; each kind's `write` and
`clear` are the only places its text form is made. A note whose text cannot be read (written by
another version, or by hand) is left out with a warning, as if it were not there.

The outcome notes (`OUTCOMES`) are what the booker is told beyond the records: a start refused or
failed (and when it is tried again), a hold, the plan's sentence, a release or idle line, the image's
line. Each has one writer, which writes it when it changes (`Kind.put`, `Kind.sync`); the outbox reads
them with the rest (gpubook/scheduler/outbox/writeback.py), so a restart loses nothing the booker was
told. A stop clears a booking's history (`clear_history`), never its outcome notes: those go when their
writer says so, or once the booking has left the plan.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from types import MappingProxyType
from typing import Any, Generic, Protocol, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")


class _Store(Protocol):
    """What the notes need of State (store.py)."""

    def set_note(self, booking_id: str, key: str, value: str, *, at: datetime | None = None) -> None: ...

    def clear_note(self, booking_id: str, key: str) -> None: ...

    def put_notes(self, key: str, values: Mapping[str, str], *, clear: Collection[str] = (),
                  at: datetime | None = None) -> None: ...

    def clear_notes(self, booking_id: str, *, keep: Collection[str] = ()) -> None: ...

    def note(self, booking_id: str, key: str) -> str | None: ...

    def all_notes(self) -> dict[str, dict[str, str]]: ...


@dataclass(frozen=True)
class Warned:
    """A warning given: when, the end it announced (None: the booking is gone), when the stop comes."""

    at: datetime
    end: datetime | None
    stop_at: datetime


@dataclass(frozen=True)
class Kind(Generic[T]):
    """One kind of note: its key in State, and how its value is written and read."""

    key: str
    dump: Callable[[T], str]
    load: Callable[[str], T]

    def write(self, state: _Store, booking_id: str, value: T, *, at: datetime | None = None) -> None:
        state.set_note(booking_id, self.key, self.dump(value), at=at)

    def clear(self, state: _Store, booking_id: str) -> None:
        state.clear_note(booking_id, self.key)

    def put(self, state: _Store, booking_id: str, value: T, *, at: datetime | None = None) -> bool:
        """Written only where State holds another value (or none): whether it was written. For a writer
        that sees one booking at a time (a handler); a StateError is the caller's."""
        text = self.dump(value)
        if state.note(booking_id, self.key) == text:
            return False
        state.set_note(booking_id, self.key, text, at=at)
        return True

    def sync(self, state: _Store, wanted: Mapping[str, T], had: Mapping[str, T], *, at: datetime | None = None,
             keep: Collection[str] = ()) -> list[str]:
        """Make this kind's notes `wanted`, `had` being what State held (as a pass read it): the changed ones
        written and the ones no longer wanted cleared (but those in `keep`), in one transaction. Returns the
        bookings whose note was written (for their log line). For a writer that sees every booking at once."""
        changed = {booking_id: value for booking_id, value in wanted.items() if had.get(booking_id) != value}
        gone = [booking_id for booking_id in had if booking_id not in wanted and booking_id not in keep]
        if changed or gone:
            state.put_notes(self.key, {k: self.dump(v) for k, v in changed.items()}, clear=gone, at=at)
        return list(changed)

    def read(self, raw: Mapping[str, Mapping[str, str]]) -> Mapping[str, T]:
        """booking id → value, from `State.all_notes()`; unreadable values left out with a warning."""
        values: dict[str, T] = {}
        for booking_id, text in raw.get(self.key, {}).items():
            try:
                values[booking_id] = self.load(text)
            except (ValueError, TypeError, KeyError, IndexError) as error:
                log.warning("booking %s: its %s note cannot be read and is ignored: %s", booking_id, self.key, error)
        return MappingProxyType(values)


def _moment(text: str) -> datetime:
    return datetime.fromisoformat(text)


def _warning_text(value: Warned) -> str:
    return json.dumps({"at": value.at.isoformat(), "end": value.end.isoformat() if value.end else None,
                       "stop_at": value.stop_at.isoformat()})


def _warning(text: str) -> Warned:
    data = json.loads(text)
    return Warned(at=_moment(data["at"]), end=_moment(data["end"]) if data["end"] else None,
                   stop_at=_moment(data["stop_at"]))


def _stretches_text(value: frozenset[tuple[int, datetime]]) -> str:
    return json.dumps([[gpu, since.isoformat()] for gpu, since in sorted(value)])


def _stretches(text: str) -> frozenset[tuple[int, datetime]]:
    return frozenset((int(gpu), _moment(since)) for gpu, since in json.loads(text))


@dataclass(frozen=True)
class Failed:
    """A booking's last action failed: why, and when it is tried again (None: on the next pass)."""

    reason: str
    retry_at: datetime | None = None


def _failed_text(value: Failed) -> str:
    return json.dumps({"reason": value.reason, "retry_at": value.retry_at.isoformat() if value.retry_at else None})


def _failed(text: str) -> Failed:
    data = _object(text)
    return Failed(reason=str(data["reason"]), retry_at=_moment(data["retry_at"]) if data.get("retry_at") else None)


def _object(text: str) -> dict[str, Any]:
    value = json.loads(text)
    if not isinstance(value, dict):
        raise TypeError("not an object")
    return value


def _lines(text: str) -> tuple[str, ...]:
    lines = json.loads(text)
    if not isinstance(lines, list):
        raise TypeError("not a list of lines")
    return tuple(str(line) for line in lines)


# The booking's container was run ahead of its start, on this port (apply/ahead.py); cleared at its start.
ARMED: Kind[int] = Kind("armed", str, int)
# The warning given and the stop it announced (apply/handlers.py's WarnHandler).
WARNED: Kind[Warned] = Kind("warned", _warning_text, _warning)
# An end moved later while the booking runs, granted (the pass's Extend actions).
AGREED_END: Kind[datetime] = Kind("agreed-end", datetime.isoformat, _moment)
# The idle stretches (GPU, since) the booker was told of (apply/reclaim.py's IdleHandler).
IDLE_TOLD: Kind[frozenset[tuple[int, datetime]]] = Kind("idle-told", _stretches_text, _stretches)
# The start a reminder notice was queued for (the pass's Remind actions): a moved booking is reminded again.
REMINDED: Kind[datetime] = Kind("reminded", datetime.isoformat, _moment)
# The lines a start adds to the running block: JupyterLab, CUDA limits (the StartHandler), for the write-back.
RUNNING_LINES: Kind[tuple[str, ...]] = Kind("running-lines", lambda lines: json.dumps(list(lines)), _lines)
# A running booking's provenance card as its start knew it (runtime/booking/provenance.py's Card.to_json, in
# UTC), for its end to complete (the StopHandler); cleared with the others at the stop.
PROVENANCE: Kind[dict[str, Any]] = Kind("provenance", json.dumps, lambda text: _object(text))
# The two provenance lines of an ended booking's block (the StopHandler, after its notes are cleared),
# for the write-back of the ended block.
ENDED_LINES: Kind[tuple[str, ...]] = Kind("ended-lines", lambda lines: json.dumps(list(lines)), _lines)
# The answers a booker was told of by notice (outbox/notices.py's Answers): "accepted", "rejected",
# "running <ssh line>"; each is told once. An event's "accepted" is noted under its UID.
ANSWERED: Kind[frozenset[str]] = Kind("answered", lambda told: json.dumps(sorted(told)),
                                      lambda text: frozenset(_lines(text)))


# When a standby (`standby: yes`) began to wait for its GPUs (the pass, core/plan.py's Rejection.standby);
# cleared when it is accepted (then PROMOTED) or gone.
STANDBY: Kind[datetime] = Kind("standby", datetime.isoformat, _moment)
# When a booking that waited on standby was accepted: its GPUs freed up (the pass).
PROMOTED: Kind[datetime] = Kind("promoted", datetime.isoformat, _moment)


# -- the outcome notes: what the booker is told beyond the records (one writer each) ---------------
# Why its start refused it (a template the host cannot run, a booking id no container may have): the StartHandler.
REFUSED: Kind[str] = Kind("refused", str, str)
# Why its last action failed and when it is tried again: the hands (apply/hands.py), cleared by its start.
FAILED: Kind[Failed] = Kind("failed", _failed_text, _failed)
# Why its start waits (its GPUs still in use, its image being prepared): the HoldHandler and the hands;
# cleared by its start, and by the pass once it is held no more.
HELD: Kind[str] = Kind("held", str, str)
# The plan's sentence for its event (how it was pinned, an end extension refused): the pass, each pass.
NOTE: Kind[str] = Kind("note", str, str)
# Its release or idle line (a no-show released, idle GPUs told of): the pass, each pass.
POLICY: Kind[str] = Kind("policy", str, str)
# Its image's line (ready, or how far its pull or build is): the pass, from its host's preparer.
IMAGE: Kind[str] = Kind("image", str, str)
OUTCOMES: tuple[Kind[Any], ...] = (REFUSED, FAILED, HELD, NOTE, POLICY, IMAGE)


def clear_history(state: _Store, booking_id: str) -> None:
    """A booking stopped for good: its warning, extension, arm and the rest are history; what it was
    told (the outcome notes) stays for the write-back of its ended block, and its promotion from
    standby for the usage report."""
    state.clear_notes(booking_id, keep=[kind.key for kind in (*OUTCOMES, PROMOTED)])  # the report counts promotions


def _empty() -> Mapping[str, Any]:
    return MappingProxyType({})


@dataclass(frozen=True)
class Notes:
    """Every booking's notes, typed, as one read found them."""

    armed: Mapping[str, int] = field(default_factory=_empty)  # booking id → the port its armed container publishes
    warned: Mapping[str, Warned] = field(default_factory=_empty)
    agreed_end: Mapping[str, datetime] = field(default_factory=_empty)
    idle_told: Mapping[str, frozenset[tuple[int, datetime]]] = field(default_factory=_empty)
    reminded: Mapping[str, datetime] = field(default_factory=_empty)
    running_lines: Mapping[str, tuple[str, ...]] = field(default_factory=_empty)
    ended_lines: Mapping[str, tuple[str, ...]] = field(default_factory=_empty)  # the provenance lines
    refused: Mapping[str, str] = field(default_factory=_empty)
    failed: Mapping[str, Failed] = field(default_factory=_empty)
    held: Mapping[str, str] = field(default_factory=_empty)
    note: Mapping[str, str] = field(default_factory=_empty)
    policy: Mapping[str, str] = field(default_factory=_empty)
    image: Mapping[str, str] = field(default_factory=_empty)
    standby: Mapping[str, datetime] = field(default_factory=_empty)  # booking id → since when it waits
    promoted: Mapping[str, datetime] = field(default_factory=_empty)

    def told(self) -> frozenset[str]:
        """The bookings with an outcome note."""
        return frozenset().union(self.refused, self.failed, self.held, self.note, self.policy, self.image)


def read(state: _Store) -> Notes:
    """All notes in one query (a StateError is the caller's)."""
    raw = state.all_notes()
    return Notes(armed=ARMED.read(raw), warned=WARNED.read(raw), agreed_end=AGREED_END.read(raw),
                 idle_told=IDLE_TOLD.read(raw), reminded=REMINDED.read(raw), running_lines=RUNNING_LINES.read(raw),
                 ended_lines=ENDED_LINES.read(raw), refused=REFUSED.read(raw), failed=FAILED.read(raw),
                 held=HELD.read(raw), note=NOTE.read(raw), policy=POLICY.read(raw), image=IMAGE.read(raw),
                 standby=STANDBY.read(raw), promoted=PROMOTED.read(raw))
