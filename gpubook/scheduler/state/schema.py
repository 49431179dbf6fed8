"""The state database's schema and its file: migrations in order, and how a file is opened,
checked (a damaged one is set aside by State, never patched) and brought to the current version.
"""

from __future__ import annotations

import logging
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path

from gpubook.runtime.private import private_file
from gpubook.scheduler.state.errors import StateError

log = logging.getLogger(__name__)


class Corrupt(Exception):
    """The file is not a readable SQLite database."""


_DAMAGED = (sqlite3.SQLITE_CORRUPT, sqlite3.SQLITE_NOTADB)

# Schema migrations, in order. PRAGMA user_version is the number applied; each runs in one
# transaction together with the version bump, so a crash never leaves half a migration.
# Never edit a released migration: append a new one.
MIGRATIONS: tuple[str, ...] = (
    """
    CREATE TABLE ports (
        booking_id   TEXT PRIMARY KEY,
        port         INTEGER NOT NULL UNIQUE,
        allocated_at REAL NOT NULL
    );
    CREATE TABLE containers (
        id          INTEGER PRIMARY KEY,
        booking_id  TEXT NOT NULL,
        name        TEXT NOT NULL,
        user        TEXT NOT NULL,
        gpu_count   INTEGER NOT NULL CHECK (gpu_count >= 0),
        started_at  REAL NOT NULL,
        stopped_at  REAL,
        exit_reason TEXT,
        restarts    INTEGER NOT NULL DEFAULT 0
    );
    -- at most one open (running) record per container name
    CREATE UNIQUE INDEX containers_open ON containers (name) WHERE stopped_at IS NULL;
    CREATE INDEX containers_booking ON containers (booking_id);
    CREATE INDEX containers_user ON containers (user);
    CREATE TABLE write_backs (
        booking_id TEXT PRIMARY KEY,
        status     TEXT NOT NULL,
        etag       TEXT,
        written_at REAL NOT NULL
    );
    CREATE TABLE events (
        id         INTEGER PRIMARY KEY AUTOINCREMENT,
        at         REAL NOT NULL,
        booking_id TEXT,
        level      TEXT NOT NULL CHECK (level IN ('debug', 'info', 'warning', 'error')),
        message    TEXT NOT NULL
    );
    CREATE INDEX events_booking ON events (booking_id);
    CREATE TRIGGER events_no_update BEFORE UPDATE ON events
        BEGIN SELECT RAISE(ABORT, 'the event log is append-only'); END;
    CREATE TRIGGER events_no_delete BEFORE DELETE ON events
        BEGIN SELECT RAISE(ABORT, 'the event log is append-only'); END;
    """,
    # 2: what the apply stage remembers per booking beyond containers: the warning given (and the
    # stop it announced), an end extension granted while running, a note for the event.
    """
    CREATE TABLE booking_notes (
        booking_id TEXT NOT NULL,
        key        TEXT NOT NULL,
        value      TEXT NOT NULL,
        at         REAL NOT NULL,
        PRIMARY KEY (booking_id, key)
    );
    """,
    # 3: the outbox: notices a pass recorded, delivered after it by the e-mail/webhook senders.
    """
    CREATE TABLE outbox (
        id           INTEGER PRIMARY KEY AUTOINCREMENT,
        at           REAL NOT NULL,
        kind         TEXT NOT NULL,
        booking_id   TEXT NOT NULL,
        user         TEXT NOT NULL,
        subject      TEXT NOT NULL,
        text         TEXT NOT NULL,
        fields       TEXT NOT NULL,
        delivered_at REAL
    );
    CREATE INDEX outbox_pending ON outbox (id) WHERE delivered_at IS NULL;
    """,
    # 4: when gpubook first saw each occurrence in each calendar object: the plan's priority, so
    # that conflicts are decided by what gpubook observed, not by a client-written CREATED.
    """
    CREATE TABLE first_seen (
        calendar_url TEXT NOT NULL,
        href         TEXT NOT NULL,
        booking_id   TEXT NOT NULL,
        seen_at      REAL NOT NULL,
        PRIMARY KEY (calendar_url, href, booking_id)
    ) WITHOUT ROWID;
    CREATE INDEX first_seen_at ON first_seen (seen_at);
    """,
    # 5: accounting (gpubook/scheduler/state/usage.py): the bookings the passes accepted (upserted: a moved
    # booking updates its row) and rejected, the GPUs' samples (utilisation, memory) with the
    # booking running on each, and when each booking was first seen logged in.
    """
    CREATE TABLE usage_bookings (
        booking_id TEXT PRIMARY KEY,
        user       TEXT NOT NULL,
        template   TEXT NOT NULL,
        host       TEXT NOT NULL,
        gpus       TEXT NOT NULL,  -- the GPU indices, comma-separated
        gpu_count  INTEGER NOT NULL CHECK (gpu_count >= 0),
        start_at   REAL NOT NULL,
        end_at     REAL NOT NULL,
        seen_at    REAL NOT NULL
    );
    CREATE INDEX usage_bookings_start ON usage_bookings (start_at);
    CREATE INDEX usage_bookings_end ON usage_bookings (end_at);
    CREATE TABLE usage_rejections (
        booking_id TEXT PRIMARY KEY,
        user       TEXT,
        reason     TEXT NOT NULL,
        start_at   REAL NOT NULL,
        end_at     REAL NOT NULL,
        first_seen REAL NOT NULL
    );
    CREATE INDEX usage_rejections_start ON usage_rejections (start_at);
    CREATE TABLE gpu_samples (
        at               REAL NOT NULL,
        host             TEXT NOT NULL,
        gpu              INTEGER NOT NULL,
        booking_id       TEXT,
        utilisation      REAL,     -- percent busy; NULL where NVML would not say
        memory_used_mib  INTEGER,
        memory_total_mib INTEGER,
        seconds          REAL NOT NULL  -- the sample interval this row stands for
    );
    CREATE INDEX gpu_samples_at ON gpu_samples (at);
    -- each booking's sums over its samples, kept as they are written: the all-time figures
    -- (Prometheus counters, read at every scrape) never scan the samples
    CREATE TABLE usage_totals (
        booking_id   TEXT PRIMARY KEY,
        used_seconds REAL NOT NULL,  -- GPU-seconds busy: utilisation / 100 x interval, summed
        sampled      REAL NOT NULL   -- GPU-seconds sampled
    );
    CREATE TABLE logins (
        booking_id TEXT PRIMARY KEY,
        user       TEXT NOT NULL,
        at         REAL NOT NULL
    );
    """,
    # 6: bookings released as no-shows (gpubook/scheduler/state/releases.py): the plan gives them no GPU
    # for the rest of their time; and the samples of one booking's GPU found without a scan.
    """
    CREATE TABLE releases (
        booking_id TEXT PRIMARY KEY,
        start_at   REAL NOT NULL,  -- the booking's time when it was released
        end_at     REAL NOT NULL,
        at         REAL NOT NULL,
        reason     TEXT NOT NULL
    );
    CREATE INDEX gpu_samples_booking ON gpu_samples (booking_id, gpu, at);
    """,
    # 7: processes seen on GPUs outside the bookings' containers (gpubook/scheduler/state/foreign.py): one
    # row per GPU and process (pid with its start time: a reused pid is another process).
    """
    CREATE TABLE foreign_processes (
        host       TEXT NOT NULL,
        gpu        INTEGER NOT NULL,
        pid        INTEGER NOT NULL,
        started    INTEGER NOT NULL,  -- the process's start, clock ticks after boot; 0: unknown
        user       TEXT NOT NULL,
        command    TEXT NOT NULL,
        booking_id TEXT,              -- the booking on that GPU; NULL: nobody's GPU
        container  TEXT,              -- another booking's container it runs in; NULL: none
        first_seen REAL NOT NULL,
        last_seen  REAL NOT NULL,
        gone_at    REAL,
        action     TEXT NOT NULL DEFAULT '',
        PRIMARY KEY (host, gpu, pid, started)
    );
    CREATE INDEX foreign_processes_current ON foreign_processes (host) WHERE gone_at IS NULL;
    CREATE INDEX foreign_processes_booking ON foreign_processes (booking_id);
    """,
    # 8: the plan's priority (gpubook/scheduler/state/slots.py): per occurrence, the slot it asks for
    # (time and GPUs), when gpubook first saw it ask for it and when it was first accepted there.
    # Starts empty: the first pass after the upgrade orders the bookings not running as new requests.
    """
    CREATE TABLE slots (
        calendar_url TEXT NOT NULL,
        href         TEXT NOT NULL,
        booking_id   TEXT NOT NULL,
        slot         TEXT NOT NULL,
        seen_at      REAL NOT NULL,
        accepted_at  REAL,              -- NULL: never accepted at this slot, or refused since
        rank         INTEGER NOT NULL DEFAULT 0,
        placement    TEXT NOT NULL DEFAULT '[]',  -- JSON [[host, [gpu, ...]], ...]
        PRIMARY KEY (calendar_url, href, booking_id)
    ) WITHOUT ROWID;
    CREATE INDEX slots_seen ON slots (seen_at);
    """,
    # 9: a foreign-process row stands for every process its user starts on its GPU while they keep
    # coming within a window (gpubook/scheduler/state/foreign.py): how many more it stood for.
    """
    ALTER TABLE foreign_processes ADD COLUMN repeats INTEGER NOT NULL DEFAULT 0;
    """,
    # 10: each accepted booking's project (its [groups.NAME]; '' for none), for `gpubook report --by project`.
    # Bookings recorded before have none until a pass records them again.
    """
    ALTER TABLE usage_bookings ADD COLUMN project TEXT NOT NULL DEFAULT '';
    """,
    # 11: retention ([daemon] keep_days, state/retention.py): the event log stays append-only for its
    # last 30 days; an older entry may be deleted (pruned), never changed.
    """
    DROP TRIGGER events_no_delete;
    CREATE TRIGGER events_no_delete BEFORE DELETE ON events
        WHEN OLD.at > CAST(strftime('%s', 'now') AS REAL) - 30 * 86400
        BEGIN SELECT RAISE(ABORT, 'the event log is append-only for 30 days'); END;
    """,
)


def open_checked(path: Path, *, busy_timeout: float) -> sqlite3.Connection:
    """The first connection to the file: made private, in WAL mode, checked and migrated.
    Raises Corrupt when the file is damaged."""
    # Made 0600 before SQLite opens it (SQLite gives its -wal and -shm files the database's mode).
    for part in (path, *(path.with_name(path.name + s) for s in ("-wal", "-shm", "-journal"))):
        private_file(part, create=part == path)
    db = sqlite3.connect(path, timeout=busy_timeout, isolation_level=None, check_same_thread=False)
    try:
        try:
            set_up(db, busy_timeout)
            db.execute("PRAGMA journal_mode=WAL")
            (verdict,) = db.execute("PRAGMA quick_check").fetchone()
        except sqlite3.DatabaseError as error:
            # Only damage sets the file aside; "database is locked" and the like are raised.
            if getattr(error, "sqlite_errorcode", None) in _DAMAGED:
                raise Corrupt(str(error)) from error
            raise
        if verdict != "ok":
            raise Corrupt(f"quick_check: {verdict}")
        migrate(db, path)
    except BaseException:
        db.close()
        raise
    return db


def migrate(db: sqlite3.Connection, path: Path) -> None:
    (version,) = db.execute("PRAGMA user_version").fetchone()
    if version > len(MIGRATIONS):
        raise StateError(f"state database {path} has schema version {version}, newer than this "
                         f"gpubook knows ({len(MIGRATIONS)}); upgrade gpubook or move the file away")
    for number in range(version, len(MIGRATIONS)):
        # executescript() would commit on its own; run the statements inside our transaction.
        db.execute("BEGIN IMMEDIATE")
        try:
            for statement in _statements(MIGRATIONS[number]):
                db.execute(statement)
            db.execute(f"PRAGMA user_version = {number + 1}")
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise
    if version < len(MIGRATIONS):  # said once, however many steps it took
        log.info("state database %s: schema %s version %d", path,
                 f"migrated from version {version} to" if version else "made at", len(MIGRATIONS))


def set_aside(path: Path, error: Corrupt) -> None:
    aside = path.with_name(f"{path.name}.corrupt-{time.strftime('%Y%m%dT%H%M%S')}")
    log.warning("state database %s is unreadable (%s); moved to %s and starting a new one "
                "(running containers are adopted from their labels)", path, error, aside)
    path.replace(aside)
    for suffix in ("-wal", "-shm"):
        sidecar = path.with_name(path.name + suffix)
        if sidecar.exists():
            sidecar.replace(aside.with_name(aside.name + suffix))


# Each of the daemon's threads has its own connection (store.py), and each connection its own page
# cache: at SQLite's default (2 MB) twenty of them could hold 40 MB as the database grows. The file
# sits in the OS's cache anyway; 512 KiB each bounds them. (Suspected in the soak's slow RSS rise,
# bench/soak.py; the run with this bound rose alike, so that rise has another cause: BENCHMARKS.md.)
CACHE_KIB = 512


def set_up(db: sqlite3.Connection, busy_timeout: float) -> None:
    db.execute(f"PRAGMA busy_timeout={int(busy_timeout * 1000)}")
    db.execute(f"PRAGMA cache_size=-{CACHE_KIB}")
    db.execute("PRAGMA synchronous=NORMAL")
    db.execute("PRAGMA foreign_keys=ON")



def _statements(script: str) -> Iterator[str]:
    """Split a migration into statements with sqlite3.complete_statement (triggers hold ';' inside)."""
    pending = ""
    for piece in script.split(";"):
        pending += piece + ";"
        if sqlite3.complete_statement(pending):
            if pending.strip(" \n\t;"):
                yield pending.strip()
            pending = ""
    if pending.strip(" \n\t;"):
        raise ValueError(f"incomplete SQL statement in a migration: {pending.strip()[:80]!r}")
