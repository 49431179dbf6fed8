"""What State forgets, and when: `[daemon] keep_days` (docs/guides/operate.md, "What grows, and what
is kept"). Each booking leaves rows behind for its report and its audit: its container's run, its
write-back, its event log lines, its notices, its accounting (booked, refused, logins, releases,
GPU samples). A lab that runs for years would keep them all; `prune` deletes those of bookings that
ended before the horizon (and log lines and samples older than it), in one transaction. What runs or
is still to come is never touched, nor anything the plan decides by: the order in which requests
were first seen (first_seen, slots) goes with its calendar object, as it did. The event log stays
append-only for its last 30 days (a trigger refuses the rest): pruning never reaches that far.
Mixed into State (store.py).
"""

from __future__ import annotations

import sqlite3
from contextlib import AbstractContextManager
from datetime import datetime
from typing import TYPE_CHECKING

from gpubook.scheduler.state.records import Row, stamp_of

# Table → the rows a prune before `?` deletes (each statement takes the horizon once).
_PRUNED = (
    ("containers", "DELETE FROM containers WHERE stopped_at IS NOT NULL AND stopped_at < ?"),
    ("events", "DELETE FROM events WHERE at < ?"),
    ("outbox", "DELETE FROM outbox WHERE delivered_at IS NOT NULL AND delivered_at < ?"),
    ("gpu_samples", "DELETE FROM gpu_samples WHERE at < ?"),
    ("usage_rejections", "DELETE FROM usage_rejections WHERE end_at < ?"),
    ("releases", "DELETE FROM releases WHERE end_at < ?"),
    ("usage_bookings", "DELETE FROM usage_bookings WHERE end_at < ?"),
    # What hangs on a booking's accounting row goes with it (after it, in this order).
    ("write_backs", "DELETE FROM write_backs WHERE written_at < ? AND booking_id NOT IN "
                    "(SELECT booking_id FROM containers WHERE stopped_at IS NULL) AND booking_id NOT IN "
                    "(SELECT booking_id FROM usage_bookings)"),
    ("logins", "DELETE FROM logins WHERE at < ? AND booking_id NOT IN (SELECT booking_id FROM usage_bookings)"),
    ("usage_totals", "DELETE FROM usage_totals WHERE booking_id NOT IN (SELECT booking_id FROM usage_bookings)"),
)


class RetentionRecords:
    """The forgetting half of State (its connections and transactions are State's)."""

    if TYPE_CHECKING:
        def _transaction(self, point: str) -> AbstractContextManager[sqlite3.Connection]: ...

        def _query(self, sql: str, parameters: tuple[object, ...] = ()) -> list[Row]: ...

    def prune(self, *, before: datetime) -> dict[str, int]:
        """Delete what ended (or was logged, or sampled) before `before`; the rows deleted, by table."""
        horizon = stamp_of(before)
        deleted: dict[str, int] = {}
        with self._transaction("state.prune") as db:
            for table, statement in _PRUNED:
                parameters = (horizon,) * statement.count("?")
                deleted[table] = db.execute(statement, parameters).rowcount
        return {table: count for table, count in deleted.items() if count}
