"""What State keeps for no-shows and idle GPUs: the bookings released (a durable record, so a
released booking never starts again, also after a restart) and each running booking's GPU samples
summed up as the judge needs them. Mixed into State (store.py), one transaction per method.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING

from gpubook.scheduler.state.records import Row, moment, moment_of, stamp_of


@dataclass(frozen=True)
class ReleaseRow:
    """A booking released: its time when released, when, and the sentence why."""

    booking_id: str
    start: datetime
    end: datetime
    at: datetime
    reason: str


@dataclass(frozen=True)
class GpuSamples:
    """One GPU's samples of one booking since a moment (only those with a utilisation)."""

    gpu: int
    first: datetime | None
    last: datetime | None
    last_busy: datetime | None  # the latest at or above the threshold asked for


class ReleaseRecords:
    """The no-show half of State (its connections and transactions are State's)."""

    if TYPE_CHECKING:
        def _transaction(self, point: str) -> AbstractContextManager[sqlite3.Connection]: ...

        def _query(self, sql: str, parameters: tuple[object, ...] = ()) -> list[Row]: ...

    def record_release(self, booking_id: str, *, start: datetime, end: datetime, at: datetime, reason: str) -> None:
        """Record a release; a booking released again (moved, then a no-show again) gets the new one."""
        with self._transaction("state.record_release") as db:
            db.execute("INSERT INTO releases (booking_id, start_at, end_at, at, reason) VALUES (?, ?, ?, ?, ?) "
                       "ON CONFLICT (booking_id) DO UPDATE SET start_at = excluded.start_at, "
                       "end_at = excluded.end_at, at = excluded.at, reason = excluded.reason",
                       (booking_id, stamp_of(start), stamp_of(end), stamp_of(at), reason))

    def releases(self, *, ending_after: datetime | None = None) -> dict[str, ReleaseRow]:
        """booking id → its release (of bookings whose time ends after `ending_after`, where given)."""
        rows = self._query("SELECT booking_id, start_at, end_at, at, reason FROM releases WHERE end_at > ?",
                           (stamp_of(ending_after) if ending_after is not None else float("-inf"),))
        return {booking: ReleaseRow(booking_id=booking, start=moment(s), end=moment(e), at=moment(a),
                                    reason=reason) for booking, s, e, a, reason in rows}

    def gpu_samples_of(self, booking_id: str, gpus: Sequence[int], *, since: datetime,
                       busy_percent: float, busy_since: datetime | None = None) -> list[GpuSamples]:
        """Each GPU's first, last and last busy sample of the booking since `since` (busy ones only
        from `busy_since`, where given). Each is read from the index (booking, GPU, time) from one
        end, so a pass never scans a long booking."""
        stamp = stamp_of(since)
        busy_stamp = stamp_of(busy_since) if busy_since is not None else stamp
        found = []
        for gpu in gpus:
            where = "booking_id = ? AND gpu = ? AND at >= ? AND utilisation IS NOT NULL"
            first = self._one(f"SELECT at FROM gpu_samples WHERE {where} ORDER BY at LIMIT 1",  # noqa: S608 - constant
                              (booking_id, gpu, stamp))
            last = self._one(f"SELECT at FROM gpu_samples WHERE {where} ORDER BY at DESC LIMIT 1",  # noqa: S608 - constant
                             (booking_id, gpu, stamp))
            busy = self._one(f"SELECT at FROM gpu_samples WHERE {where} AND utilisation >= ? "  # noqa: S608 - constant
                             "ORDER BY at DESC LIMIT 1", (booking_id, gpu, busy_stamp, busy_percent))
            found.append(GpuSamples(gpu=gpu, first=first, last=last, last_busy=busy))
        return found

    def _one(self, sql: str, parameters: tuple[object, ...]) -> datetime | None:
        rows = self._query(sql, parameters)
        return moment_of(rows[0][0]) if rows else None
