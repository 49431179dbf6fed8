"""What State keeps of the plan's priority: per occurrence (calendar url, href, occurrence id), the
slot it asks for (its time and GPUs, as the plan words it), when gpubook first saw it ask for that
slot and when it was first accepted there, with its rank in that pass and the GPUs it was given.

Priority is earned by acceptance at a slot: a row starts afresh when its occurrence asks for
another slot (a move is a new request), and a refusal takes its acceptance away. Mixed into State
(store.py), one transaction per method; the pass (gpubook/scheduler/apply/passes.py) writes it around
each plan.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

from gpubook.scheduler.state.records import moment, moment_of, stamp_of

Key = tuple[str, str, str]  # (calendar url, object href, occurrence id)
Placement = tuple[tuple[str, tuple[int, ...]], ...]  # (host, its GPU indices) for each node


@dataclass(frozen=True)
class SlotRow:
    slot: str
    seen_at: datetime
    accepted_at: datetime | None
    rank: int
    placement: Placement


class SlotRecords:
    """The priority half of State (its connections and transactions are State's)."""

    if TYPE_CHECKING:
        def _transaction(self, point: str) -> AbstractContextManager[sqlite3.Connection]: ...

    def slots_asked(self, asked: Mapping[Key, str], *, now: datetime,
                    forget_before: datetime | None = None) -> dict[Key, SlotRow]:
        """Record the slot each occurrence asks for now: a new occurrence, or one that asks for another
        slot than recorded, gets a fresh row (seen now, never accepted). Rows seen before
        `forget_before` and not asked for now are forgotten. Returns the rows of `asked`."""
        stamp = stamp_of(now)
        with self._transaction("state.slots_asked") as db:
            db.executemany(
                "INSERT INTO slots (calendar_url, href, booking_id, slot, seen_at) VALUES (?, ?, ?, ?, ?) "
                "ON CONFLICT (calendar_url, href, booking_id) DO UPDATE SET slot = excluded.slot, "
                "seen_at = excluded.seen_at, accepted_at = NULL, rank = 0, placement = '[]' "
                "WHERE slot != excluded.slot", [(*key, slot, stamp) for key, slot in asked.items()])
            if forget_before is not None:
                old = db.execute("SELECT calendar_url, href, booking_id FROM slots WHERE seen_at < ?",
                                 (stamp_of(forget_before),)).fetchall()
                db.executemany("DELETE FROM slots WHERE calendar_url = ? AND href = ? AND booking_id = ?",
                               [row for row in old if tuple(row) not in asked])
            rows = db.execute("SELECT calendar_url, href, booking_id, slot, seen_at, accepted_at, rank, placement "
                              "FROM slots").fetchall()
        return {key: _row(rest) for url, href, booking, *rest in rows if (key := (url, href, booking)) in asked}

    def slots_decided(self, accepted: Iterable[tuple[Key, int, Placement]], refused: Iterable[Key], *,
                      now: datetime) -> None:
        """A plan's outcome: each accepted occurrence (with its rank in the plan and its placement)
        keeps the time it was first accepted at its slot, or gets `now`; each refused one loses it."""
        stamp = stamp_of(now)
        with self._transaction("state.slots_decided") as db:
            db.executemany(
                "UPDATE slots SET rank = CASE WHEN accepted_at IS NULL THEN ? ELSE rank END, "
                "accepted_at = COALESCE(accepted_at, ?), placement = ? "
                "WHERE calendar_url = ? AND href = ? AND booking_id = ?",
                [(rank, stamp, json.dumps(placement), *key) for key, rank, placement in accepted])
            db.executemany("UPDATE slots SET accepted_at = NULL, rank = 0, placement = '[]' "
                           "WHERE calendar_url = ? AND href = ? AND booking_id = ?", list(refused))


def _row(columns: Sequence[Any]) -> SlotRow:
    slot, seen, accepted, rank, placement = columns
    nodes = tuple((str(host), tuple(int(gpu) for gpu in gpus)) for host, gpus in json.loads(str(placement)))
    return SlotRow(slot=str(slot), seen_at=moment(seen), accepted_at=moment_of(accepted),
                   rank=int(rank), placement=nodes)
