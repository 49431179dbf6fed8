"""What State keeps for accounting: the bookings the passes accepted and rejected, the GPUs' samples,
and when each booking was first seen logged in. Mixed into State (store.py), one transaction per method.

Booked GPU-hours are (end - start) x GPUs of each accepted booking as the last pass saw it, counted
up to now (a booking moved or shortened before its end updates its row). Used GPU-hours are the
sum over a booked GPU's samples of utilisation / 100 x the sample interval. The all-time sums per
user are what Prometheus counters read at every scrape, so the samples' sums are kept per booking
as they are written (`usage_totals`) and those reads never scan the samples.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Collection, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING

from gpubook.scheduler.state.records import Row, moment, moment_of, stamp_of


@dataclass(frozen=True)
class BookedRow:
    """An accepted booking as a pass placed it."""

    booking_id: str
    user: str
    template: str
    host: str
    gpus: tuple[int, ...]
    start: datetime
    end: datetime
    project: str = ""  # the [groups.NAME] it counted against; "": none

    def hours_between(self, start: datetime, end: datetime) -> float:
        """Its booked GPU-hours inside [start, end)."""
        overlap = (min(self.end, end) - max(self.start, start)).total_seconds()
        return max(0.0, overlap) / 3600 * len(self.gpus)


@dataclass(frozen=True)
class RejectedRow:
    """A request that will not run, with the reason its booker was given."""

    booking_id: str
    user: str | None
    reason: str
    start: datetime
    end: datetime
    first_seen: datetime | None = None  # filled when read back; a pass's row gets `now`


@dataclass(frozen=True)
class Sample:
    """One GPU at one moment, and the booking running on it (None: nobody's)."""

    at: datetime
    host: str
    gpu: int
    booking_id: str | None
    utilisation: float | None  # percent; None where NVML would not say
    memory_used_mib: int | None
    memory_total_mib: int | None
    seconds: float  # the sample interval this sample stands for


@dataclass(frozen=True)
class SampleSum:
    """Samples of one GPU (and booking) in one time bucket of a report's window, summed."""

    host: str
    gpu: int
    booking_id: str | None
    bucket: int  # whole buckets since the window's start
    used_hours: float  # utilisation / 100 x interval, in hours
    sampled_hours: float  # the interval of samples with a utilisation
    busy_percent_hours: float  # utilisation x interval, in %·h: / sampled_hours is the mean


class UsageRecords:
    """The accounting half of State (its connections and transactions are State's)."""

    if TYPE_CHECKING:
        def _transaction(self, point: str) -> AbstractContextManager[sqlite3.Connection]: ...

        def _query(self, sql: str, parameters: tuple[object, ...] = ()) -> list[Row]: ...

    # -- what the passes saw ---------------------------------------------------------------------

    def record_bookings(self, *, accepted: Sequence[BookedRow], rejected: Sequence[RejectedRow], now: datetime,
                        complete: bool) -> None:
        """A pass's verdicts: accepted bookings upserted (a moved booking updates its row), rejections
        upserted with the time first seen kept. A booking accepted now loses its rejection. With
        `complete` (every calendar was read), bookings and rejections still to start that the pass
        no longer sees are forgotten: cancelled or moved out of the window before their start."""
        stamp = stamp_of(now)
        with self._transaction("state.record_bookings") as db:
            db.executemany(_UPSERT_BOOKING, [(b.booking_id, b.user, b.template, b.host, ",".join(map(str, b.gpus)),
                                              len(b.gpus), stamp_of(b.start), stamp_of(b.end), stamp, b.project)
                                             for b in accepted])
            db.executemany(_UPSERT_REJECTION, [(r.booking_id, r.user, r.reason, stamp_of(r.start), stamp_of(r.end),
                                                stamp) for r in rejected])
            db.executemany("DELETE FROM usage_rejections WHERE booking_id = ?", [(b.booking_id,) for b in accepted])
            if complete:
                _forget_future(db, "usage_bookings", {b.booking_id for b in accepted}, stamp)
                _forget_future(db, "usage_rejections", {r.booking_id for r in rejected}, stamp)

    def booked_between(self, start: datetime, end: datetime) -> list[BookedRow]:
        """Accepted bookings overlapping [start, end), by start."""
        rows = self._query("SELECT booking_id, user, template, host, gpus, start_at, end_at, project FROM "
                           "usage_bookings WHERE start_at < ? AND end_at > ? ORDER BY start_at, booking_id",
                           (stamp_of(end), stamp_of(start)))
        return [BookedRow(booking_id=i, user=u, template=t, host=h, gpus=_gpus(g), start=moment(s),
                          end=moment(e), project=p) for i, u, t, h, g, s, e, p in rows]

    def rejections_between(self, start: datetime, end: datetime) -> list[RejectedRow]:
        """Rejected requests whose time starts in [start, end), by start."""
        rows = self._query("SELECT booking_id, user, reason, start_at, end_at, first_seen FROM usage_rejections "
                           "WHERE start_at >= ? AND start_at < ? ORDER BY start_at, booking_id",
                           (stamp_of(start), stamp_of(end)))
        return [RejectedRow(booking_id=i, user=u, reason=r, start=moment(s), end=moment(e),
                            first_seen=moment_of(f)) for i, u, r, s, e, f in rows]

    # -- samples -------------------------------------------------------------------------------

    def record_samples(self, samples: Sequence[Sample]) -> None:
        """One sampling round: a row per GPU, and each booking's running sums."""
        totals: dict[str, tuple[float, float]] = {}
        for sample in samples:
            if sample.booking_id is not None:
                used, sampled = totals.get(sample.booking_id, (0.0, 0.0))
                totals[sample.booking_id] = (used + (sample.utilisation or 0.0) / 100 * sample.seconds,
                                             sampled + sample.seconds)
        with self._transaction("state.record_samples") as db:
            db.executemany("INSERT INTO gpu_samples (at, host, gpu, booking_id, utilisation, memory_used_mib, "
                           "memory_total_mib, seconds) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                           [(stamp_of(s.at), s.host, s.gpu, s.booking_id, s.utilisation, s.memory_used_mib,
                             s.memory_total_mib, s.seconds) for s in samples])
            db.executemany("INSERT INTO usage_totals (booking_id, used_seconds, sampled) VALUES (?, ?, ?) "
                           "ON CONFLICT (booking_id) DO UPDATE SET "
                           "used_seconds = used_seconds + excluded.used_seconds, sampled = sampled + excluded.sampled",
                           [(booking, used, sampled) for booking, (used, sampled) in totals.items()])

    def sample_sums(self, start: datetime, end: datetime, *, bucket_seconds: float) -> list[SampleSum]:
        """The samples taken in [start, end), summed per GPU, booking and bucket (`bucket_seconds`
        from `start` on): what a report's tables and plots are made of, without a row per sample."""
        origin = stamp_of(start)
        rows = self._query(
            "SELECT host, gpu, booking_id, CAST((at - ?) / ? AS INTEGER) AS bucket, "
            "sum(coalesce(utilisation, 0) / 100.0 * seconds) / 3600.0, "
            "sum(CASE WHEN utilisation IS NULL THEN 0 ELSE seconds END) / 3600.0, "
            "sum(coalesce(utilisation, 0) * seconds) / 3600.0 "
            "FROM gpu_samples WHERE at >= ? AND at < ? GROUP BY host, gpu, booking_id, bucket "
            "ORDER BY host, gpu, bucket, booking_id",
            (origin, bucket_seconds, origin, stamp_of(end)))
        return [SampleSum(host=h, gpu=g, booking_id=b, bucket=k, used_hours=float(u), sampled_hours=float(s),
                          busy_percent_hours=float(p)) for h, g, b, k, u, s, p in rows]

    def samples_count(self) -> int:
        return int(self._query("SELECT count(*) FROM gpu_samples")[0][0])

    # -- logins --------------------------------------------------------------------------------

    def record_login(self, booking_id: str, *, user: str, at: datetime) -> None:
        """The booking's first login; a later one changes nothing."""
        with self._transaction("state.record_login") as db:
            db.execute("INSERT OR IGNORE INTO logins (booking_id, user, at) VALUES (?, ?, ?)",
                       (booking_id, user, stamp_of(at)))

    def logins(self, booking_ids: Collection[str] | None = None) -> dict[str, datetime]:
        """booking id → its first login seen (of `booking_ids` only, where given)."""
        if booking_ids is None:
            rows = self._query("SELECT booking_id, at FROM logins")
        else:
            wanted = list(booking_ids)
            rows = [row for first in range(0, len(wanted), 500)  # SQLite's limit on parameters
                    for row in self._query(f"SELECT booking_id, at FROM logins WHERE booking_id IN "  # noqa: S608 - placeholders only
                                           f"({', '.join('?' * len(wanted[first:first + 500]))})",
                                           tuple(wanted[first:first + 500]))]
        return {booking: moment for booking, at in rows if (moment := moment_of(at)) is not None}

    # -- all time, per user (Prometheus counters) --------------------------------------------------

    def gpu_hours_booked_by_user(self, *, now: datetime | None = None) -> dict[str, float]:
        """Booked GPU-hours per user, all time, up to `now` (a booking under way counts its part so far)."""
        stamp = stamp_of(now)
        rows = self._query("SELECT user, sum(max(0, min(end_at, ?) - start_at) * gpu_count) / 3600.0 "
                           "FROM usage_bookings WHERE start_at < ? GROUP BY user ORDER BY user", (stamp, stamp))
        return {user: float(hours) for user, hours in rows}

    def gpu_hours_used_by_user(self) -> dict[str, float]:
        """Used GPU-hours per user, all time: utilisation / 100 x interval over their bookings' samples."""
        rows = self._query("SELECT b.user, sum(t.used_seconds) / 3600.0 FROM usage_totals t "
                           "JOIN usage_bookings b USING (booking_id) GROUP BY b.user ORDER BY b.user")
        return {user: float(hours) for user, hours in rows}


_UPSERT_BOOKING = (
    "INSERT INTO usage_bookings (booking_id, user, template, host, gpus, gpu_count, start_at, end_at, seen_at, "
    "project) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (booking_id) DO UPDATE SET user = excluded.user, "
    "template = excluded.template, host = excluded.host, gpus = excluded.gpus, gpu_count = excluded.gpu_count, "
    "start_at = excluded.start_at, end_at = excluded.end_at, seen_at = excluded.seen_at, project = excluded.project "
    # an unchanged row is not written again (seen_at says when it last changed)
    "WHERE (user, template, host, gpus, start_at, end_at, project) IS NOT "
    "(excluded.user, excluded.template, excluded.host, excluded.gpus, excluded.start_at, excluded.end_at, "
    "excluded.project)")
_UPSERT_REJECTION = (
    "INSERT INTO usage_rejections (booking_id, user, reason, start_at, end_at, first_seen) VALUES (?, ?, ?, ?, ?, ?) "
    "ON CONFLICT (booking_id) DO UPDATE SET user = excluded.user, reason = excluded.reason, "
    "start_at = excluded.start_at, end_at = excluded.end_at "
    "WHERE (user, reason, start_at, end_at) IS NOT "
    "(excluded.user, excluded.reason, excluded.start_at, excluded.end_at)")


def _forget_future(db: sqlite3.Connection, table: str, keep: set[str], now: float) -> None:
    future = db.execute(f"SELECT booking_id FROM {table} WHERE start_at > ?", (now,)).fetchall()  # noqa: S608 - table is one of two literals
    db.executemany(f"DELETE FROM {table} WHERE booking_id = ?",  # noqa: S608 - table is one of two literals
                   [(booking,) for (booking,) in future if booking not in keep])


def _gpus(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(",") if part)
