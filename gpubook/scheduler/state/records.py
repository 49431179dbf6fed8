"""What State hands out (frozen records read from its rows), and how moments are stored (UTC seconds)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from gpubook.scheduler import clock

LEVELS = ("debug", "info", "warning", "error")


@dataclass(frozen=True)
class ContainerRecord:
    id: int
    booking_id: str
    name: str
    user: str
    gpu_count: int
    started_at: datetime
    stopped_at: datetime | None
    exit_reason: str | None
    restarts: int  # runs of this booking before this one

    def gpu_hours(self, now: datetime) -> float:
        end = self.stopped_at or now
        return max(0.0, (end - self.started_at).total_seconds()) / 3600 * self.gpu_count


@dataclass(frozen=True)
class WriteBack:
    booking_id: str
    status: str
    etag: str | None
    written_at: datetime


@dataclass(frozen=True)
class Notice:
    """A notice waiting in the outbox: what the e-mail says and what the webhook posts."""

    id: int
    at: datetime
    kind: str  # "warning", "ended", ...
    booking_id: str
    user: str
    subject: str
    text: str
    fields: Mapping[str, Any]


@dataclass(frozen=True)
class LogEntry:
    id: int
    at: datetime
    booking_id: str | None
    level: str
    message: str



def stamp_of(moment: datetime | None) -> float:
    if moment is None:
        return clock.now().timestamp()
    if moment.tzinfo is None:
        raise ValueError(f"a naive datetime has no place in the state database: {moment!r}")
    return moment.timestamp()


def moment_of(stamp: float | None) -> datetime | None:
    """A nullable column's time (None: NULL)."""
    return None if stamp is None else datetime.fromtimestamp(stamp, UTC)


def moment(stamp: float) -> datetime:
    """A NOT NULL column's time."""
    return datetime.fromtimestamp(stamp, UTC)


# A row as sqlite3 gives it: its columns' types are the schema's (schema.py), not Python's to check.
Row = tuple[Any, ...]



def container(row: Row) -> ContainerRecord:
    id_, booking, name, user, gpus, started, stopped, reason, restarts = row
    return ContainerRecord(id=id_, booking_id=booking, name=name, user=user, gpu_count=gpus,
                           started_at=moment(started), stopped_at=moment_of(stopped),
                           exit_reason=reason, restarts=restarts)
