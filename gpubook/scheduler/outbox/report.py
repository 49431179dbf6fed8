"""`gpubook report`'s figures over a window, from what State recorded: booked and used GPU-hours, the
booked-but-idle share, no-shows and rejected requests, per user, GPU or template; the weekly and
daily series the plots draw (report_plots.py); the printed table and the CSV.

Definitions (the README's "Reports" says the same):
- booked GPU-hours: each accepted booking's (end - start) x GPUs inside the window, up to now;
- used GPU-hours: over the samples of a booked GPU, utilisation / 100 x the sample interval;
- idle share: 1 - used / booked;
- a no-show: a booking that ended in the window with nobody seen logged in (not the daemon's probe);
- rejected requests: those whose time starts in the window, counted by kind of reason.
"""

from __future__ import annotations

import csv
import re
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import Any, TextIO, TypeVar

from gpubook.scheduler.core.plan import LOCAL
from gpubook.scheduler.sources.errors import printable
from gpubook.scheduler.state import BookedRow, RejectedRow, SampleSum, State, notes

BY = ("user", "gpu", "template", "project")
NO_PROJECT = "(no project)"  # the row of bookings that counted against no [groups.NAME]
DAY = timedelta(days=1)
WEEK = timedelta(days=7)
T = TypeVar("T", BookedRow, SampleSum)
UNRECORDED = "(unrecorded)"  # samples of a booking the passes never recorded (an older database)


@dataclass(frozen=True)
class Row:
    key: str
    bookings: int
    booked_hours: float
    used_hours: float
    no_shows: int
    rejected: int | None  # by user only: rejections name a user, not a GPU or template

    @property
    def idle_share(self) -> float | None:
        """The booked time the GPUs were not busy (None: nothing booked)."""
        return None if self.booked_hours <= 0 else max(0.0, 1 - self.used_hours / self.booked_hours)


@dataclass(frozen=True)
class Report:
    start: datetime
    end: datetime
    until: datetime  # min(end, now): booked hours count to here
    by: str
    rows: tuple[Row, ...]
    total: Row
    rejections: tuple[tuple[str, int], ...]  # kind of reason → count, most first
    weeks: tuple[datetime, ...]  # each week's start (weeks from the window's start)
    weekly_booked: dict[str, tuple[float, ...]]  # user → booked GPU-hours per week
    weekly_used: dict[str, tuple[float, ...]]  # user → used GPU-hours per week
    days: tuple[datetime, ...]
    daily_utilisation: dict[str, tuple[float | None, ...]]  # "host:gpu" → mean % busy per day (None: no sample)
    samples: bool  # whether any GPU sample lies in the window
    # Booked GPU-hours of bookings that waited on standby and ran on GPUs freed up (an early end, a
    # cancellation, a no-show or idle release): time that would have gone unused (issue 40).
    reused_hours: float = 0.0

    @property
    def rejected(self) -> int:
        return sum(count for _, count in self.rejections)


def build(state: State, *, start: datetime, end: datetime, now: datetime, by: str = "user",
          host_name: str = LOCAL) -> Report:
    """The report over [start, end) as State recorded it by `now`; `host_name`: this machine's
    [host] name, which its GPUs' keys carry ("gpu1:0") instead of the internal "local"."""
    if by not in BY:
        raise ValueError(f"by must be one of {', '.join(BY)}, not {by!r}")
    until = max(start, min(end, now))
    booked = [_named(b, host_name) for b in state.booked_between(start, until) if b.hours_between(start, until) > 0]
    logged_in = state.logins([b.booking_id for b in booked])
    no_shows = {b.booking_id for b in booked if start < b.end <= until and b.booking_id not in logged_in}
    sums = [_named(s, host_name) for s in state.sample_sums(start, until, bucket_seconds=DAY.total_seconds())]
    rejections = state.rejections_between(start, end)
    rows = _rows(by, booked, sums, no_shows, rejections, start=start, until=until)
    total = Row(key="total", bookings=len(booked), booked_hours=sum(b.hours_between(start, until) for b in booked),
                used_hours=sum(s.used_hours for s in sums if s.booking_id is not None), no_shows=len(no_shows),
                rejected=len(rejections))
    weeks = _steps(start, end, WEEK)
    days = _steps(start, end, DAY)
    promoted = notes.PROMOTED.read(state.all_notes())
    reused = sum(b.hours_between(start, until) for b in booked if b.booking_id in promoted)
    return Report(start=start, end=end, until=until, by=by, rows=rows, total=total, reused_hours=reused,
                  rejections=tuple(Counter(reason_kind(r.reason) for r in rejections).most_common()),
                  weeks=weeks, weekly_booked=_weekly_booked(booked, weeks, until=until),
                  weekly_used=_weekly_used(booked, sums, len(weeks)),
                  days=days, daily_utilisation=_daily_utilisation(sums, len(days)), samples=bool(sums))


def _named(row: T, host_name: str) -> T:
    return replace(row, host=host_name) if row.host == LOCAL else row  # type: ignore[type-var]


def reason_kind(reason: str) -> str:
    """A rejection's reason without what is particular to it (names, numbers, times, details after
    a colon), so that requests refused for the same cause are counted together."""
    text = reason.split(": ", 1)[0]
    text = re.sub(r"\([^)]*\)", "", text)
    text = re.sub(r"'[^']*'|\"[^\"]*\"", "…", text)
    text = re.sub(r"\b\d+\b", "N", text)
    return printable(" ".join(text.split()))  # calendar text: no control characters reach a terminal


def _rows(by: str, booked: Sequence[BookedRow], sums: Sequence[SampleSum], no_shows: set[str],
          rejections: Sequence[RejectedRow], *, start: datetime, until: datetime) -> tuple[Row, ...]:
    bookings: dict[str, set[str]] = defaultdict(set)
    hours: dict[str, float] = defaultdict(float)
    used: dict[str, float] = defaultdict(float)
    by_id = {b.booking_id: b for b in booked}
    for b in booked:
        for key in _keys(by, b):
            bookings[key].add(b.booking_id)
            hours[key] += b.hours_between(start, until) / (len(b.gpus) if by == "gpu" else 1)
    for s in sums:
        if s.booking_id is None:
            continue
        row = by_id.get(s.booking_id)
        key = f"{s.host}:{s.gpu}" if by == "gpu" else _keys(by, row)[0] if row is not None else UNRECORDED
        used[key] += s.used_hours
    refused = Counter(r.user or "?" for r in rejections) if by == "user" else Counter[str]()
    keys = sorted(set(bookings) | set(used) | set(refused))
    return tuple(Row(key=key, bookings=len(bookings[key]), booked_hours=hours[key], used_hours=used[key],
                     no_shows=len(bookings[key] & no_shows), rejected=refused[key] if by == "user" else None)
                 for key in keys)


def _keys(by: str, booking: BookedRow) -> tuple[str, ...]:
    if by == "gpu":
        return tuple(f"{booking.host}:{gpu}" for gpu in booking.gpus)
    if by == "project":
        return (booking.project or NO_PROJECT,)
    return (booking.user if by == "user" else booking.template,)


def _steps(start: datetime, end: datetime, step: timedelta) -> tuple[datetime, ...]:
    count = max(1, -(-int((end - start).total_seconds()) // int(step.total_seconds())))
    return tuple(start + step * n for n in range(count))


def _weekly_booked(booked: Sequence[BookedRow], weeks: Sequence[datetime], *, until: datetime
                   ) -> dict[str, tuple[float, ...]]:
    series: dict[str, list[float]] = defaultdict(lambda: [0.0] * len(weeks))
    for b in booked:
        for n, week in enumerate(weeks):
            series[b.user][n] += b.hours_between(week, min(week + WEEK, until))
    return {user: tuple(values) for user, values in sorted(series.items())}


def _weekly_used(booked: Sequence[BookedRow], sums: Sequence[SampleSum], weeks: int) -> dict[str, tuple[float, ...]]:
    users = {b.booking_id: b.user for b in booked}
    series: dict[str, list[float]] = defaultdict(lambda: [0.0] * weeks)
    for s in sums:
        if s.booking_id is not None:
            series[users.get(s.booking_id, UNRECORDED)][min(weeks - 1, s.bucket // 7)] += s.used_hours
    return {user: tuple(values) for user, values in sorted(series.items())}


def _daily_utilisation(sums: Sequence[SampleSum], days: int) -> dict[str, tuple[float | None, ...]]:
    busy: dict[str, list[float]] = defaultdict(lambda: [0.0] * days)
    sampled: dict[str, list[float]] = defaultdict(lambda: [0.0] * days)
    for s in sums:
        key, day = f"{s.host}:{s.gpu}", min(days - 1, s.bucket)
        busy[key][day] += s.busy_percent_hours
        sampled[key][day] += s.sampled_hours
    return {key: tuple(b / h if h > 0 else None for b, h in zip(busy[key], sampled[key], strict=True))
            for key in sorted(sampled)}


# -- text and CSV ---------------------------------------------------------------------------------

COLUMNS = ("bookings", "booked GPU-h", "used GPU-h", "idle", "no-shows", "rejected")


def table(report: Report) -> list[str]:
    """The printed report: a table, then the rejected requests by kind."""
    head = (report.by, *COLUMNS)
    lines = [_cells(head), *(_cells(text_row(row)) for row in (*report.rows, report.total))]
    width = max(len(line) for line in lines)
    out = [f"gpubook report {report.start:%Y-%m-%d %H:%M} to {report.end:%Y-%m-%d %H:%M} ({report.start:%Z}), "
           f"by {report.by}" + (f"; counted up to {report.until:%Y-%m-%d %H:%M}" if report.until < report.end else ""),
           "", lines[0], "-" * width, *lines[1:-1], "-" * width, lines[-1], ""]
    if not report.samples:
        out.append("no GPU samples in this window: used GPU-hours are 0 (no GPU, or [daemon] sample_seconds = 0)")
    out.append(f"GPU-hours reused from releases (bookings that waited on standby): {_hours(report.reused_hours)}")
    out.append(f"rejected requests: {report.rejected}")
    out += [f"  {count:5d}  {kind}" for kind, count in report.rejections]
    return out


def text_row(row: Row) -> tuple[str, ...]:
    idle = "-" if row.idle_share is None else f"{row.idle_share * 100:.0f} %"
    return (row.key, str(row.bookings), _hours(row.booked_hours), _hours(row.used_hours), idle,
            str(row.no_shows), "-" if row.rejected is None else str(row.rejected))


def _hours(hours: float) -> str:
    """One decimal, as a month's table wants; a short test booking's hundredths show rather than 0.0."""
    return f"{hours:.1f}" if hours == 0 or hours >= 1 else f"{hours:.3f}"


def _cells(cells: Sequence[str]) -> str:
    return f"{cells[0]:<24} " + " ".join(f"{cell:>12}" for cell in cells[1:])


def write_csv(report: Report, out: TextIO) -> None:
    """One row per key and a "total" row; hours unrounded (to 6 places), the idle share as a fraction."""
    writer = csv.writer(out)
    writer.writerow([report.by, "bookings", "booked_gpu_hours", "used_gpu_hours", "idle_share", "no_shows",
                     "rejected"])
    for row in _with_total(report.rows, report.total):
        writer.writerow([row.key, row.bookings, f"{row.booked_hours:.6f}", f"{row.used_hours:.6f}",
                         "" if row.idle_share is None else f"{row.idle_share:.6f}", row.no_shows,
                         "" if row.rejected is None else row.rejected])


def _with_total(rows: Iterable[Row], total: Row) -> Iterable[Row]:
    yield from rows
    yield total


# -- JSON, and the lab's sum of several servers' JSON ---------------------------------------------------

NUMBERS = ("bookings", "booked_gpu_hours", "used_gpu_hours", "no_shows")


def to_json(report: Report, *, host_name: str | None = None) -> dict[str, Any]:
    """The table's rows as the CSV has them (hours unrounded, the idle share a fraction or null);
    `host_name`: the server it is from (the lab report names each)."""
    def row(item: Row) -> dict[str, Any]:
        return {report.by: item.key, "bookings": item.bookings, "booked_gpu_hours": round(item.booked_hours, 6),
                "used_gpu_hours": round(item.used_hours, 6), "idle_share":
                None if item.idle_share is None else round(item.idle_share, 6), "no_shows": item.no_shows,
                "rejected": item.rejected}

    return {**({"host": host_name} if host_name is not None else {}),
            "from": report.start.isoformat(), "to": report.end.isoformat(), "until": report.until.isoformat(),
            "by": report.by, "rows": [row(r) for r in report.rows], "total": row(report.total),
            "rejected": report.rejected, "rejections": dict(report.rejections), "gpu_samples": report.samples,
            "reused_gpu_hours": round(report.reused_hours, 6)}


def merge_usage(reports: Sequence[Any]) -> dict[str, Any]:
    """Several servers' `to_json` reports of one window as one: rows with the same key (a user, a
    template; GPUs are "host:index", distinct per server) summed, the idle share computed again.
    Entries of the wrong type are left out (another server's answer is data)."""
    first = reports[0] if reports else {}
    by = first.get("by", "user")
    rows: dict[str, dict[str, Any]] = {}
    rejections: Counter[str] = Counter()
    samples = False
    reused = 0.0
    for report in reports:
        if report.get("by") != by:
            continue
        reused += _number(report.get("reused_gpu_hours"))
        for item in report.get("rows") or ():
            if not isinstance(item, dict) or not isinstance(item.get(by), str):
                continue
            row = rows.setdefault(item[by], {by: item[by], **dict.fromkeys(NUMBERS, 0), "rejected": None})
            for name in NUMBERS:
                row[name] += _number(item.get(name))
            if isinstance(item.get("rejected"), int):
                row["rejected"] = (row["rejected"] or 0) + item["rejected"]
        kinds = report.get("rejections")
        for kind, count in (kinds.items() if isinstance(kinds, Mapping) else ()):  # a peer's answer: any shape
            rejections[str(kind)] += _number(count)
        samples = samples or report.get("gpu_samples") is True
    total = {by: "total", **{name: sum(row[name] for row in rows.values()) for name in NUMBERS},
             "rejected": sum(rejections.values())}
    return {"from": first.get("from"), "to": first.get("to"), "by": by,
            "hosts": [str(r.get("host", "?")) for r in reports],
            "rows": [_idle(rows[key]) for key in sorted(rows)], "total": _idle(total),
            "rejected": sum(rejections.values()), "rejections": dict(rejections.most_common()),
            "gpu_samples": samples, "reused_gpu_hours": round(reused, 6)}


def _number(value: Any) -> Any:
    return value if isinstance(value, int | float) and not isinstance(value, bool) else 0


def _idle(row: dict[str, Any]) -> dict[str, Any]:
    booked = row["booked_gpu_hours"]
    row["booked_gpu_hours"], row["used_gpu_hours"] = round(booked, 6), round(row["used_gpu_hours"], 6)
    row["idle_share"] = None if booked <= 0 else round(max(0.0, 1 - row["used_gpu_hours"] / booked), 6)
    return row


def json_table(merged: dict[str, Any]) -> list[str]:
    """The merged report printed as `table` prints one server's."""
    by = merged["by"]
    rows = [*merged["rows"], merged["total"]]
    lines = [_cells((by, *COLUMNS)), *(_cells((
        str(r[by]), str(r["bookings"]), _hours(r["booked_gpu_hours"]), _hours(r["used_gpu_hours"]),
        "-" if r["idle_share"] is None else f"{r['idle_share'] * 100:.0f} %", str(r["no_shows"]),
        "-" if r["rejected"] is None else str(r["rejected"]))) for r in rows)]
    width = max(len(line) for line in lines)
    out = [f"gpubook report, the lab's servers ({', '.join(merged['hosts'])}): {merged['from']} to {merged['to']}, "
           f"by {by}", "", lines[0], "-" * width, *lines[1:-1], "-" * width, lines[-1], "",
           f"rejected requests: {merged['rejected']}"]
    out += [f"  {count:5d}  {kind}" for kind, count in merged["rejections"].items()]
    return out
