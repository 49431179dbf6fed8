"""What State keeps of processes seen on GPUs outside the bookings' containers ("foreign"): one row
per sighting (a GPU, a process), first and last seen, and what gpubook did about it. Mixed into
State (store.py), one transaction per method. The sampler (gpubook/scheduler/hosts/foreign.py) writes it;
the write-back, the status file and the metrics read it.

Short-lived processes are not news at every sample: a new process of a user on a GPU (same booking,
same container) whose earlier one ended within the window takes over that row (its pid, start and
command; `repeats` counts them), and one that appears beside a live one of its group within the
window gets a row of its own (it may have to be stopped) but no news. Only a process with no other
of its group seen within the window is news (a log line, an event line, a notice), and only such a
row's end is.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import TYPE_CHECKING

from gpubook.scheduler.state.records import Row, moment, moment_of, stamp_of

# ForeignRow.action's forms: a stop due at, done at (ISO times); why not stoppable, why spared
DUE, STOPPED, CANNOT, SPARED = "due ", "stopped ", "cannot: ", "spared: "
Key = tuple[str, int, int, int]  # (host, gpu, pid, process start)
_COLUMNS = ("host, gpu, pid, started, user, command, booking_id, container, first_seen, last_seen, gone_at, action, "
            "repeats")


@dataclass(frozen=True)
class ForeignRow:
    """A process on a GPU that is not the booking's own (or on a GPU nobody booked)."""

    host: str
    gpu: int
    pid: int
    started: int  # the process's start in clock ticks after boot: with pid, which process it is
    user: str
    command: str
    booking_id: str | None  # the booking on that GPU; None: an unbooked GPU
    container: str | None  # the gpubook container the process runs in (another booking's); None: none
    first_seen: datetime
    last_seen: datetime
    gone_at: datetime | None = None  # when it was no longer on the GPU; None: still there
    action: str = ""  # what gpubook did: "", "stop due at ISO", "stopped at ISO", "cannot stop: why"
    repeats: int = 0  # other processes of its group this row stood for (0: the group's first, which is news)

    @property
    def key(self) -> tuple[str, int, int, int]:
        return self.host, self.gpu, self.pid, self.started

    @property
    def group(self) -> tuple[str, int, str, str | None, str | None]:
        """Whose processes on which GPU: one piece of news per window, however many processes."""
        return self.host, self.gpu, self.user, self.booking_id, self.container


class ForeignRecords:
    """The foreign-process half of State (its connections and transactions are State's)."""

    if TYPE_CHECKING:
        def _transaction(self, point: str) -> AbstractContextManager[sqlite3.Connection]: ...

        def _query(self, sql: str, parameters: tuple[object, ...] = ()) -> list[Row]: ...

    def record_foreign(self, seen: Sequence[ForeignRow], *, host: str, now: datetime,
                       window: timedelta = timedelta(0)) -> list[ForeignRow]:
        """One round's sightings on `host`: new ones inserted (with their action), known ones' last_seen moved on, those
        of the host no longer seen marked gone now. Returns the rows that are news: new, back, gone (see the
        module docstring for the processes of a group seen within `window`, which are not)."""
        stamp = stamp_of(now)
        with self._transaction("state.record_foreign") as db:
            before = {row.key: row for row in _rows(db.execute(
                f"SELECT {_COLUMNS} FROM foreign_processes WHERE host = ? AND gone_at IS NULL", (host,)))}  # noqa: S608 - a constant
            seen, taken_over = _fold_repeats(db, seen, before, host=host, now=now, window=window)
            # A process still there when its GPU's booking changes is news for the new booking.
            changed = [row for row in seen if not row.repeats and
                       (row.key not in before or before[row.key].booking_id != row.booking_id)]
            db.executemany(
                f"INSERT INTO foreign_processes ({_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, NULL, ?, ?) "  # noqa: S608 - a constant
                "ON CONFLICT (host, gpu, pid, started) DO UPDATE SET last_seen = excluded.last_seen, gone_at = NULL, "
                "booking_id = excluded.booking_id, action = CASE WHEN booking_id IS excluded.booking_id "
                "THEN action ELSE excluded.action END",
                [(*row.key, row.user, row.command, row.booking_id, row.container, stamp_of(row.first_seen), stamp,
                  row.action, row.repeats) for row in seen])
            keep = {row.key for row in seen}
            gone = [row for key, row in before.items() if key not in keep and key not in taken_over]
            db.executemany("UPDATE foreign_processes SET gone_at = ? WHERE host = ? AND gpu = ? AND pid = ? "
                           "AND started = ?", [(stamp, *row.key) for row in gone])
        return changed + [ForeignRow(**{**row.__dict__, "gone_at": now}) for row in gone if not row.repeats]

    def foreign_action(self, row: ForeignRow, action: str) -> None:
        with self._transaction("state.foreign_action") as db:
            db.execute("UPDATE foreign_processes SET action = ? WHERE host = ? AND gpu = ? AND pid = ? AND started = ?",
                       (action, *row.key))

    def foreign(self, *, current: bool = True, booking_ids: Sequence[str] | None = None) -> list[ForeignRow]:
        """Sightings by first seen: those still there (`current`), or also gone ones of `booking_ids`."""
        if current:
            rows = self._query(f"SELECT {_COLUMNS} FROM foreign_processes WHERE gone_at IS NULL "  # noqa: S608
                               "ORDER BY first_seen, host, gpu, pid")
        else:
            wanted = list(booking_ids or ())
            rows = [row for first in range(0, len(wanted), 500)  # SQLite's limit on parameters
                    for row in self._query(f"SELECT {_COLUMNS} FROM foreign_processes WHERE booking_id IN "  # noqa: S608 - placeholders only
                                           f"({', '.join('?' * len(wanted[first:first + 500]))}) "
                                           "ORDER BY first_seen, gpu, pid", tuple(wanted[first:first + 500]))]
        return _rows(rows)


def _fold_repeats(db: sqlite3.Connection, seen: Sequence[ForeignRow], before: dict[Key, ForeignRow], *, host: str,
                  now: datetime, window: timedelta) -> tuple[list[ForeignRow], set[Key]]:
    """The round's sightings with each new process of a group seen within `window` made a repeat:
    it takes over a row of its group that ended (this round or within the window; that row's key
    moves to it), or, beside a live one, gets a row of its own marked as a repeat. Other sightings
    are as they came. Also the keys of the rows taken over (they are not gone)."""
    if window <= timedelta(0):
        return list(seen), set()
    keys = {row.key for row in seen}
    ended = [row for key, row in before.items() if key not in keys]  # ending now: the most recent first
    ended += _rows(db.execute(f"SELECT {_COLUMNS} FROM foreign_processes WHERE host = ? AND gone_at >= ? "  # noqa: S608 - a constant
                              "ORDER BY gone_at DESC", (host, stamp_of(now - window))))
    known = {row.key for row in seen if row.key in before or db.execute(
        "SELECT 1 FROM foreign_processes WHERE host = ? AND gpu = ? AND pid = ? AND started = ?", row.key).fetchone()}
    reusable: dict[tuple[str, int, str, str | None, str | None], list[ForeignRow]] = {}
    for row in ended:
        reusable.setdefault(row.group, []).append(row)
    live = {row.group for row in before.values()} | set(reusable)
    taken_over: set[Key] = set()
    folded = []
    for row in seen:
        if row.key in known:  # the same process (pid and start): its own row
            folded.append(row)
            continue
        if reusable.get(row.group):
            old = reusable[row.group].pop(0)
            taken_over.add(old.key)
            db.execute("DELETE FROM foreign_processes WHERE host = ? AND gpu = ? AND pid = ? AND started = ?", old.key)
            folded.append(replace(row, first_seen=old.first_seen, action=_repeat_action(old.action, row.action),
                                  repeats=old.repeats + 1))
        elif row.group in live:
            folded.append(replace(row, repeats=1))
        else:
            folded.append(row)
        live.add(row.group)
    return folded, taken_over


def _repeat_action(old: str, new: str) -> str:
    """A repeat keeps its group's stop time (one grace per window) and its reason not to stop; a
    group whose last process was stopped gets the new process's own."""
    return new if old.startswith(STOPPED) or not old else old


def _rows(rows: Iterable[Row]) -> list[ForeignRow]:
    return [ForeignRow(host=h, gpu=g, pid=p, started=s, user=u, command=c, booking_id=b, container=k,
                       first_seen=moment(f), last_seen=moment(seen), gone_at=moment_of(gone),
                       action=a or "", repeats=r or 0)
            for h, g, p, s, u, c, b, k, f, seen, gone, a, r in rows]
