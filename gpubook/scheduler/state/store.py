"""State: the daemon's memory in one SQLite file, one transaction per method (see the package
docstring for what it holds and why it is a memory, not the truth).
"""

from __future__ import annotations

import errno
import json
import logging
import shutil
import socket
import sqlite3
import threading
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any

from gpubook.runtime import crash
from gpubook.runtime.private import private_folder
from gpubook.scheduler.state.errors import StateError, StateUnavailable
from gpubook.scheduler.state.foreign import ForeignRecords
from gpubook.scheduler.state.records import (
    LEVELS,
    ContainerRecord,
    LogEntry,
    Notice,
    Row,
    WriteBack,
    container,
    moment,
    moment_of,
    stamp_of,
)
from gpubook.scheduler.state.releases import ReleaseRecords
from gpubook.scheduler.state.retention import RetentionRecords
from gpubook.scheduler.state.schema import Corrupt, open_checked, set_aside, set_up
from gpubook.scheduler.state.slots import SlotRecords
from gpubook.scheduler.state.usage import UsageRecords

log = logging.getLogger(__name__)

_ROOM = 64 * 1024  # less free space than this, and an open that fails is put down to a full disk


def port_is_free(port: int) -> bool:
    """True when nothing on this host listens on `port` (TCP, all addresses of both families: a
    listener on [::]:PORT alone, IPV6_V6ONLY, would meet the booking's IPv6 clients).

    SO_REUSEADDR is left off on purpose: a port in TIME_WAIT would also stop the container's
    sshd from binding it.
    """
    for family, address in ((socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")):  # noqa: S104 - a probe
        try:
            probe = socket.socket(family, socket.SOCK_STREAM)
        except OSError:  # no IPv6 on this host: nobody can listen there either
            continue
        with probe:
            if family == socket.AF_INET6:
                probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                probe.bind((address, port))
            except OSError as error:
                if error.errno in (errno.EADDRINUSE, errno.EACCES):
                    return False
                if error.errno in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT):
                    continue
                raise
    return True


def port_range_problem(port_min: int, port_max: int, *, held: Collection[int],
                       probe: Callable[[int], bool] = port_is_free) -> str | None:
    """One sentence when processes other than gpubook's bookings (`held`: their ports and the SFTP
    service's) listen on ports of the bookings' range, naming them; None when none does. A port
    found busy is skipped at a start, so a host login that binds the whole range stops every start."""
    others = [port for port in range(port_min, port_max + 1) if port not in held and not probe(port)]
    if not others:
        return None
    total = port_max - port_min + 1
    left = total - len(others) - sum(1 for port in held if port_min <= port <= port_max)
    tail = "bookings cannot start" if left <= 0 else f"{left} left for bookings"
    return (f"ports {port_min}–{port_max}: {len(others)} of {total} in use by other processes "
            f"({_spans(others)}); {tail} (see who: ss -ltnp)")


def _spans(ports: Sequence[int]) -> str:
    """2200, 2201, 2202, 2210 → "2200–2202, 2210"."""
    spans: list[list[int]] = []
    for port in ports:
        if spans and port == spans[-1][1] + 1:
            spans[-1][1] = port
        else:
            spans.append([port, port])
    return ", ".join(f"{a}–{b}" if a != b else f"{a}" for a, b in spans)


class State(UsageRecords, ReleaseRecords, ForeignRecords, SlotRecords, RetentionRecords):
    """`State(path)`: open (or create, or recreate) the database; every method is one transaction.

    Safe to share between the daemon's threads: each thread gets its own connection (bookings
    are applied in parallel, and one thread waiting on a locked database must not hold the others
    behind a Python lock); SQLite itself serialises the writes. Other processes (`gpubook status`,
    `gpubook log`) may open the same file at the same time. Every sqlite3 error of a read or write
    is raised as `StateUnavailable`, a GpubookError the pass handles per booking. The accounting
    methods (bookings seen, samples, logins) are in usage.py.
    """

    def __init__(self, path: str | Path, *, port_probe: Callable[[int], bool] = port_is_free,
                 busy_timeout: float = 10.0) -> None:
        """`busy_timeout`: seconds a write waits for another process's transaction before it fails."""
        self.path = Path(path)
        self.busy_timeout = busy_timeout
        self._port_probe = port_probe
        # The port each booking last held, kept when a pass frees it (its container died): the restart
        # asks for it again, so the booker's ssh line stays right (this process's memory only).
        self._last_ports: dict[str, int] = {}
        self._lock = threading.Lock()  # guards the list of connections only
        self._local = threading.local()
        self._connections: list[sqlite3.Connection] = []
        private_folder(self.path.parent)
        if not self.path.exists():
            log.info("state database %s does not exist; starting a new one "
                        "(running containers are adopted from their labels)", self.path)
        try:
            try:
                first = open_checked(self.path, busy_timeout=busy_timeout)
            except Corrupt as error:
                set_aside(self.path, error)
                first = open_checked(self.path, busy_timeout=busy_timeout)
        except sqlite3.Error as error:  # a full disk, a read-only mount: one sentence, not a traceback
            raise self._unopened(error) from None
        self._adopt_connection(first)

    # -- opening -------------------------------------------------------------------------------

    def _connect(self) -> sqlite3.Connection:
        # isolation_level=None: transactions are explicit (BEGIN IMMEDIATE in _transaction).
        db = sqlite3.connect(self.path, timeout=self.busy_timeout, isolation_level=None, check_same_thread=False)
        try:
            set_up(db, self.busy_timeout)
        except BaseException:
            db.close()
            raise
        return db

    def _adopt_connection(self, db: sqlite3.Connection) -> None:
        self._local.db = db
        with self._lock:
            self._connections.append(db)

    def _db(self) -> sqlite3.Connection:
        """This thread's connection, opened on its first use (the file is checked and migrated once)."""
        db: sqlite3.Connection | None = getattr(self._local, "db", None)
        if db is None:
            try:
                db = self._connect()
            except sqlite3.Error as error:
                raise self._unopened(error) from None
            self._adopt_connection(db)
        return db

    def _unopened(self, error: sqlite3.Error) -> StateUnavailable:
        # SQLite says "disk I/O error" when its -shm file cannot grow on a full disk: name the cause.
        try:
            full = shutil.disk_usage(self.path.parent).free < _ROOM
        except OSError:
            full = False
        cause = f" (its disk has less than {_ROOM // 1024} KiB free)" if full else ""
        return StateUnavailable(f"state database {self.path} cannot be opened: {error}{cause}")

    def close(self) -> None:
        with self._lock:
            for db in self._connections:
                db.close()
            self._connections.clear()
        self._local = threading.local()

    def __enter__(self) -> State:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def schema_version(self) -> int:
        return int(self._query("PRAGMA user_version")[0][0])

    @contextmanager
    def _transaction(self, point: str) -> Iterator[sqlite3.Connection]:
        """One write, committed whole or not at all; `point` names it (`state.<method>`) for the
        crash point after its commit (runtime/crash.py)."""
        db = self._db()
        try:
            db.execute("BEGIN IMMEDIATE")
            try:
                yield db
            except BaseException:
                if db.in_transaction:
                    db.execute("ROLLBACK")
                raise
            db.execute("COMMIT")
        except sqlite3.Error as error:
            if db.in_transaction:
                _quietly_roll_back(db)
            raise self._unavailable(error) from None
        crash.point(f"{point}:after")

    def _query(self, sql: str, parameters: tuple[object, ...] = ()) -> list[Row]:
        try:
            return self._db().execute(sql, parameters).fetchall()
        except sqlite3.Error as error:
            raise self._unavailable(error) from None

    def _unavailable(self, error: sqlite3.Error) -> StateUnavailable:
        return StateUnavailable(f"the state database {self.path} could not be used: {error}")

    # -- ports ---------------------------------------------------------------------------------

    def port_for(self, booking_id: str, *, port_min: int, port_max: int, now: datetime | None = None,
                 reserved: frozenset[int] = frozenset()) -> int:
        """The booking's SSH port for a start in progress: the one it holds or held last (a restart),
        else the lowest port in [port_min, port_max] that no other booking holds and that is free on
        this host (a port found busy is skipped, never fatal) and not `reserved` (the SFTP service's,
        even while it is down). Raises StateError when none is left. The caller releases it when the
        start fails (`release_port`): one still busy after the engine's wait fails that start, and
        the next start gets a free one."""
        # A restart after a death asks for the port the booking had (still held in State, or remembered
        # since the pass freed it), busy or not: its died container's port forwarder lets go of it only
        # once the engine has removed that container, which the engine's start does first, and then
        # waits for the port (CliEngine.start). CI of 2026-11-29: a wait here, before that removal,
        # ran out and the restart came on the next port.
        last = self._last_ports.pop(booking_id, None)
        with self._transaction("state.port_for") as db:
            row = db.execute("SELECT port FROM ports WHERE booking_id = ?", (booking_id,)).fetchone()
            if row is not None:
                if port_min <= int(row[0]) <= port_max and int(row[0]) not in reserved:
                    return int(row[0])
                db.execute("DELETE FROM ports WHERE booking_id = ?", (booking_id,))
            taken = {port for (port,) in db.execute("SELECT port FROM ports")} | reserved
            if last is not None and port_min <= last <= port_max and last not in taken:
                db.execute("INSERT INTO ports (booking_id, port, allocated_at) VALUES (?, ?, ?)",
                           (booking_id, last, stamp_of(now)))
                return last
            for port in range(port_min, port_max + 1):
                if port not in taken and self._port_probe(port):
                    db.execute("INSERT INTO ports (booking_id, port, allocated_at) VALUES (?, ?, ?)",
                               (booking_id, port, stamp_of(now)))
                    return port
        raise StateError(f"booking {booking_id}: no free SSH port left in {port_min}-{port_max} "
                         f"({len(taken)} held by bookings, the rest in use on this host)")

    def release_ports_except(self, keep: set[str] | frozenset[str]) -> list[str]:
        """Free the ports of every booking not in `keep` (those with a running container or a start
        in progress): a start that failed, or died, or a container gone, holds none. Gives the
        bookings whose port was freed."""
        with self._transaction("state.release_ports_except") as db:
            held = dict(db.execute("SELECT booking_id, port FROM ports").fetchall())
            freed = [booking for booking in held if booking not in keep]
            db.executemany("DELETE FROM ports WHERE booking_id = ?", [(booking,) for booking in freed])
        self._last_ports.update({booking: int(held[booking]) for booking in freed})
        return freed

    def adopt_port(self, booking_id: str, port: int, *, now: datetime | None = None) -> None:
        """Record the port a running container already uses (read from its labels after a lost
        database). A stale record of another booking on that port gives way: the running container wins."""
        with self._transaction("state.adopt_port") as db:
            db.execute("DELETE FROM ports WHERE port = ? AND booking_id != ?", (port, booking_id))
            db.execute("INSERT INTO ports (booking_id, port, allocated_at) VALUES (?, ?, ?) "
                       "ON CONFLICT (booking_id) DO UPDATE SET port = excluded.port",
                       (booking_id, port, stamp_of(now)))

    def release_port(self, booking_id: str) -> None:
        with self._transaction("state.release_port") as db:
            db.execute("DELETE FROM ports WHERE booking_id = ?", (booking_id,))

    def ports(self) -> dict[str, int]:
        return {booking: port for booking, port in self._query("SELECT booking_id, port FROM ports ORDER BY port")}

    # -- containers ----------------------------------------------------------------------------

    def container_started(self, booking_id: str, name: str, *, user: str, gpu_count: int,
                          at: datetime | None = None) -> ContainerRecord:
        """Record that `name` runs for the booking. Idempotent: an open record of that name is returned
        as it is (adopting a container after a restart records nothing new)."""
        with self._transaction("state.container_started") as db:
            open_row = db.execute(_OPEN_CONTAINER, (name,)).fetchone()
            if open_row is not None:
                return container(open_row)
            (runs,) = db.execute("SELECT count(*) FROM containers WHERE booking_id = ?", (booking_id,)).fetchone()
            cursor = db.execute(
                "INSERT INTO containers (booking_id, name, user, gpu_count, started_at, restarts) "
                "VALUES (?, ?, ?, ?, ?, ?)", (booking_id, name, user, gpu_count, stamp_of(at), runs))
            row = db.execute(_CONTAINER_BY_ID, (cursor.lastrowid,)).fetchone()
        return container(row)

    def container_stopped(self, name: str, *, reason: str, at: datetime | None = None) -> ContainerRecord | None:
        """Close the open record of `name` with why it stopped ("ended", "died: exit 137", ...).
        Returns the closed record, or None when none was open (already recorded, or never seen)."""
        with self._transaction("state.container_stopped") as db:
            row = db.execute(_OPEN_CONTAINER, (name,)).fetchone()
            if row is None:
                return None
            db.execute("UPDATE containers SET stopped_at = max(started_at, ?), exit_reason = ? WHERE id = ?",
                       (stamp_of(at), reason, row[0]))
            row = db.execute(_CONTAINER_BY_ID, (row[0],)).fetchone()
        return container(row)

    def containers(self, *, booking_id: str | None = None, running_only: bool = False) -> list[ContainerRecord]:
        rows = self._query(_CONTAINERS_WHERE, (booking_id, booking_id, running_only))
        return [container(row) for row in rows]

    def restarts(self, booking_id: str) -> int:
        """How many times the booking's container was started again after its first start."""
        (runs,) = self._query("SELECT count(*) FROM containers WHERE booking_id = ?", (booking_id,))[0]
        return max(0, int(runs) - 1)

    # -- accounting ----------------------------------------------------------------------------

    def gpu_hours_by_booking(self, *, now: datetime | None = None) -> dict[str, float]:
        """GPU-hours per booking; a container still running counts up to `now`."""
        return self._gpu_hours("booking_id", now)

    def gpu_hours_by_user(self, *, now: datetime | None = None) -> dict[str, float]:
        return self._gpu_hours("user", now)

    def _gpu_hours(self, column: str, now: datetime | None) -> dict[str, float]:
        rows = self._query(
            f"SELECT {column}, sum(max(0, coalesce(stopped_at, ?) - started_at) * gpu_count) / 3600.0 "  # noqa: S608 - column is one of two literals
            f"FROM containers GROUP BY {column} ORDER BY {column}", (stamp_of(now),))
        return {key: float(hours) for key, hours in rows}

    # -- write-backs ---------------------------------------------------------------------------

    def write_back_done(self, booking_id: str, *, status: str, etag: str | None, at: datetime | None = None) -> None:
        with self._transaction("state.write_back_done") as db:
            db.execute("INSERT INTO write_backs (booking_id, status, etag, written_at) VALUES (?, ?, ?, ?) "
                       "ON CONFLICT (booking_id) DO UPDATE SET status = excluded.status, etag = excluded.etag, "
                       "written_at = excluded.written_at", (booking_id, status, etag, stamp_of(at)))

    def write_back(self, booking_id: str) -> WriteBack | None:
        """The last status written into the booking's event and the event's ETag after it, if any."""
        rows = self._query("SELECT booking_id, status, etag, written_at FROM write_backs WHERE booking_id = ?",
                           (booking_id,))
        if not rows:
            return None
        booking, status, etag, written_at = rows[0]
        return WriteBack(booking_id=booking, status=status, etag=etag, written_at=moment(written_at))

    # -- per-booking notes (apply memory) --- ---------------------------------------------------

    def set_note(self, booking_id: str, key: str, value: str, *, at: datetime | None = None) -> None:
        with self._transaction("state.set_note") as db:
            db.execute("INSERT INTO booking_notes (booking_id, key, value, at) VALUES (?, ?, ?, ?) "
                       "ON CONFLICT (booking_id, key) DO UPDATE SET value = excluded.value, at = excluded.at",
                       (booking_id, key, value, stamp_of(at)))

    def put_notes(self, key: str, values: Mapping[str, str], *, clear: Collection[str] = (),
                  at: datetime | None = None) -> None:
        """Notes of one key for many bookings, and others of that key cleared, in one transaction."""
        with self._transaction("state.put_notes") as db:
            db.executemany("INSERT INTO booking_notes (booking_id, key, value, at) VALUES (?, ?, ?, ?) "
                           "ON CONFLICT (booking_id, key) DO UPDATE SET value = excluded.value, at = excluded.at",
                           [(booking_id, key, value, stamp_of(at)) for booking_id, value in values.items()])
            db.executemany("DELETE FROM booking_notes WHERE booking_id = ? AND key = ?",
                           [(booking_id, key) for booking_id in clear])

    def clear_notes(self, booking_id: str, *, keep: Collection[str] = ()) -> None:
        """Forget a booking's notes once its container is stopped for good, but those of the keys in `keep`."""
        with self._transaction("state.clear_notes") as db:
            db.execute("DELETE FROM booking_notes WHERE booking_id = ? AND key NOT IN (SELECT value FROM json_each(?))",
                       (booking_id, json.dumps(list(keep))))

    def clear_note(self, booking_id: str, key: str) -> None:
        with self._transaction("state.clear_note") as db:
            db.execute("DELETE FROM booking_notes WHERE booking_id = ? AND key = ?", (booking_id, key))

    def notes(self, key: str) -> dict[str, str]:
        """booking id → value of every note called `key`."""
        return dict(self._query("SELECT booking_id, value FROM booking_notes WHERE key = ?", (key,)))

    def note(self, booking_id: str, key: str) -> str | None:
        """One booking's note called `key` (None: it has none)."""
        found = self._query("SELECT value FROM booking_notes WHERE booking_id = ? AND key = ?", (booking_id, key))
        return str(found[0][0]) if found else None

    def all_notes(self) -> dict[str, dict[str, str]]:
        """key → booking id → value, every note in one query (notes.py reads them typed)."""
        found: dict[str, dict[str, str]] = {}
        for key, booking_id, value in self._query("SELECT key, booking_id, value FROM booking_notes"):
            found.setdefault(key, {})[booking_id] = value
        return found

    # -- first seen (who keeps a UID that several calendar objects hold) ------------------------------

    def first_seen(self, keys: Iterable[tuple[str, str, str]], *, now: datetime,
                   forget_before: datetime | None = None) -> dict[tuple[str, str, str], datetime]:
        """When gpubook first saw each (calendar url, href, occurrence id): recorded as `now` for
        keys new to it, kept as it was for the others. Rows first seen before `forget_before` and
        not among `keys` are forgotten (occurrences long out of the window)."""
        wanted = list(dict.fromkeys(keys))
        stamp = stamp_of(now)
        with self._transaction("state.first_seen") as db:
            db.executemany("INSERT OR IGNORE INTO first_seen (calendar_url, href, booking_id, seen_at) "
                           "VALUES (?, ?, ?, ?)", [(*key, stamp) for key in wanted])
            keep = set(wanted)
            if forget_before is not None:
                old = db.execute("SELECT calendar_url, href, booking_id FROM first_seen WHERE seen_at < ?",
                                 (stamp_of(forget_before),)).fetchall()
                db.executemany("DELETE FROM first_seen WHERE calendar_url = ? AND href = ? AND booking_id = ?",
                               [row for row in old if tuple(row) not in keep])
            rows = db.execute("SELECT calendar_url, href, booking_id, seen_at FROM first_seen").fetchall()
        return {key: moment for url, href, booking, seen in rows
                if (key := (url, href, booking)) in keep and (moment := moment_of(seen)) is not None}

    # -- the outbox ------------------------------------------------------------------------------

    def queue_notice(self, *, kind: str, booking_id: str, user: str, subject: str, text: str,
                     fields: Mapping[str, Any], at: datetime | None = None) -> int:
        with self._transaction("state.queue_notice") as db:
            cursor = db.execute(
                "INSERT INTO outbox (at, kind, booking_id, user, subject, text, fields) VALUES (?, ?, ?, ?, ?, ?, ?)",
                (stamp_of(at), kind, booking_id, user, subject, text, json.dumps(dict(fields), default=str)))
            return int(cursor.lastrowid or 0)

    def pending_notices(self) -> list[Notice]:
        rows = self._query("SELECT id, at, kind, booking_id, user, subject, text, fields FROM outbox "
                           "WHERE delivered_at IS NULL ORDER BY id")
        return [Notice(id=i, at=moment(at), kind=k, booking_id=b, user=u, subject=s, text=x,
                       fields=json.loads(f)) for i, at, k, b, u, s, x, f in rows]

    def notice_delivered(self, notice_id: int, *, at: datetime | None = None) -> bool:
        """Take a pending notice for its one delivery (a failed delivery is not retried): True for
        exactly one caller, so that two deliverers (the daemon's lane, `gpubook stop`) never send
        the same notice twice."""
        with self._transaction("state.notice_delivered") as db:
            cursor = db.execute("UPDATE outbox SET delivered_at = ? WHERE id = ? AND delivered_at IS NULL",
                                (stamp_of(at), notice_id))
            return cursor.rowcount == 1

    # -- event log -----------------------------------------------------------------------------

    def log_event(self, message: str, *, level: str = "info", booking_id: str | None = None,
                  at: datetime | None = None) -> int:
        if level not in LEVELS:
            raise ValueError(f"level must be one of {', '.join(LEVELS)}, not {level!r}")
        with self._transaction("state.log_event") as db:
            cursor = db.execute("INSERT INTO events (at, booking_id, level, message) VALUES (?, ?, ?, ?)",
                                (stamp_of(at), booking_id, level, message))
            return int(cursor.lastrowid or 0)

    def events(self, *, after_id: int = 0, booking_id: str | None = None, limit: int | None = None) -> list[LogEntry]:
        """Log entries in order; `after_id` lets `gpubook log --follow` read only what is new."""
        sql = "SELECT id, at, booking_id, level, message FROM events WHERE id > ?"
        parameters: list[object] = [after_id]
        if booking_id is not None:
            sql += " AND booking_id = ?"
            parameters.append(booking_id)
        sql += " ORDER BY id"
        if limit is not None:
            sql += " LIMIT ?"
            parameters.append(limit)
        return [LogEntry(id=i, at=moment(at), booking_id=b, level=lv, message=m)
                for i, at, b, lv, m in self._query(sql, tuple(parameters))]


_OPEN_CONTAINER = ("SELECT id, booking_id, name, user, gpu_count, started_at, stopped_at, exit_reason, restarts "
                   "FROM containers WHERE name = ? AND stopped_at IS NULL")
_CONTAINER_BY_ID = ("SELECT id, booking_id, name, user, gpu_count, started_at, stopped_at, exit_reason, restarts "
                    "FROM containers WHERE id = ?")
_CONTAINERS_WHERE = ("SELECT id, booking_id, name, user, gpu_count, started_at, stopped_at, exit_reason, restarts "
                     "FROM containers WHERE (? IS NULL OR booking_id = ?) AND (NOT ? OR stopped_at IS NULL) "
                     "ORDER BY id")


def _quietly_roll_back(db: sqlite3.Connection) -> None:
    try:
        db.execute("ROLLBACK")
    except sqlite3.Error:
        pass  # the connection's own error is the one worth reporting

