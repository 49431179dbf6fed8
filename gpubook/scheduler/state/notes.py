"""State's per-booking notes, one owner: each kind's key and its typed reading and writing.

A note is what the apply stage must remember about a booking across a restart and that the engine's
labels cannot tell: a container run ahead of its start, a warning given, an end moved later, an
idle stretch told of, a reminder queued, the lines a start added to the running block. A pass reads
them all at once (`read`, one query) into `Notes`, whose fields are typed; each kind's `write` and
`clear` are the only places its text form is made. A note whose text cannot be read (written by
another version, or by hand) is left out with a warning, as if it were not there.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
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
# A running booking's provenance card as its start knew it (runtime/provenance.py's Card.to_json, in
# UTC), for its end to complete (the StopHandler); cleared with the others at the stop.
PROVENANCE: Kind[dict[str, Any]] = Kind("provenance", json.dumps, lambda text: _object(text))
# The two provenance lines of an ended booking's block (the StopHandler, after its notes are cleared),
# for the write-back of the ended block.
ENDED_LINES: Kind[tuple[str, ...]] = Kind("ended-lines", lambda lines: json.dumps(list(lines)), _lines)
# The answers a booker was told of by notice (outbox/notices.py's Answers): "accepted", "rejected",
# "running <ssh line>"; each is told once. An event's "accepted" is noted under its UID.
ANSWERED: Kind[frozenset[str]] = Kind("answered", lambda told: json.dumps(sorted(told)),
                                      lambda text: frozenset(_lines(text)))


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


def read(state: _Store) -> Notes:
    """All notes in one query (a StateError is the caller's)."""
    raw = state.all_notes()
    return Notes(armed=ARMED.read(raw), warned=WARNED.read(raw), agreed_end=AGREED_END.read(raw),
                 idle_told=IDLE_TOLD.read(raw), reminded=REMINDED.read(raw), running_lines=RUNNING_LINES.read(raw),
                 ended_lines=ENDED_LINES.read(raw))
