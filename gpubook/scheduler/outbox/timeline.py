"""Each GPU's timeline for the status page: what is booked, running, held, or ended on it, from a
week back to the end of the daemon's window (a week ahead), and the bookings refused with why.

Built by the daemon after each pass from what the pass saw (the plan, the containers running, the
Hold actions) and from State's containers table (what ran and ended); the page picks today and
this week out of it in the browser's time zone. Free time is the gaps. Everything is plain data
(ISO 8601 UTC strings), so the status file carries it as it is.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from gpubook.runtime.engines import ContainerInfo
from gpubook.scheduler.core.decide import Hold
from gpubook.scheduler.core.plan import LOCAL, Plan
from gpubook.scheduler.sources.errors import printable
from gpubook.scheduler.state.records import ContainerRecord

PAST = timedelta(days=7)  # ended containers are kept this far back (the page's week)
REJECTED_SHOWN = 500  # refused bookings kept in the status; the rest are counted
TITLE_KEPT = 200  # characters of an event's title kept in the status
TITLE_WIDTH = 40  # characters of a title a row shows (the page, `gpubook status`)


@dataclass(frozen=True)
class Segment:
    kind: str  # "booked" (accepted, not started), "running", "held" (should run, does not), "ended"
    booking: str
    user: str
    start: str  # ISO 8601, UTC
    end: str
    template: str = ""
    note: str = ""  # held: why; ended: how it ended ("ended", "died: exit 137", ...)
    title: str = ""  # the event's SUMMARY, as the calendar has it (kept_title): shown escaped, shortened
    project: str = ""  # the [groups.NAME] the booking counts against, where the plan has it; "": none


@dataclass(frozen=True)
class GpuTimeline:
    gpu: int
    segments: tuple[Segment, ...]  # sorted by start

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> GpuTimeline:
        return cls(gpu=data["gpu"], segments=tuple(Segment(**s) for s in data["segments"]))


@dataclass(frozen=True)
class RejectedBooking:
    id: str
    user: str  # "" where the booker is unknown
    start: str  # ISO 8601, UTC
    end: str
    reason: str
    standby: bool = False  # it waits on standby for its GPUs (`standby: yes`), not refused for good


def _iso(moment: datetime) -> str:
    return moment.astimezone(UTC).isoformat()


def gpu_timelines(plan: Plan, *, host: str, gpus: Sequence[int], now: datetime,
                  containers: Iterable[ContainerInfo] = (), held: Mapping[str, str] | None = None,
                  records: Iterable[ContainerRecord] = (),
                  known_gpus: Mapping[str, tuple[int, ...]] | None = None,
                  titles: Mapping[str, str] | None = None,
                  projects: Mapping[str, str] | None = None) -> tuple[GpuTimeline, ...]:
    """One timeline per GPU of `host`. `held`: booking id → the Hold's reason this pass;
    `records`: State's container records (those stopped in the last week become "ended");
    `known_gpus`: booking id → its GPUs where neither the plan nor a container says any more
    (the previous status's timelines), for an ended booking that has left the calendar window;
    `titles`, `projects`: booking id → its title, its project where the plan has it no more (the
    previous status's)."""
    held = held or {}
    titles = titles or {}
    projects = projects or {}
    lanes: dict[int, list[Segment]] = {gpu: [] for gpu in gpus}
    running = {info.booking_id: info for info in containers
               if info.running and (info.host or LOCAL) == host}
    placed = dict(known_gpus or {})

    def put(on: Iterable[int], segment: Segment) -> None:
        for gpu in on:
            lanes.setdefault(gpu, []).append(segment)

    for accepted in plan.accepted:
        booking = accepted.booking
        # A multi-node booking holds GPUs on each of its nodes: the first (`host`) and the `others`.
        on = next((gpus for name, gpus in accepted.placement if name == host), None)
        if on is None:
            continue
        placed[booking.id] = on
        info = running.get(booking.id)
        if booking.end <= now and info is None:
            continue  # over: its container record (below) shows it as ended
        kind, note = "booked", ""
        if info is not None and booking.start <= now:
            kind = "running"
        elif booking.id in held:
            kind, note = "held", held[booking.id]
        put(on, Segment(kind=kind, booking=booking.id, user=booking.user, start=_iso(booking.start),
                        end=_iso(booking.end), template=booking.template, note=note,
                        title=kept_title(booking.summary), project=booking.project or ""))
    planned = {a.booking.id for a in plan.accepted if any(name == host for name, _ in a.placement)}
    for info in running.values():  # running, though gone from the plan (being stopped, or its end moved)
        placed[info.booking_id] = info.gpus
        if info.booking_id not in planned and info.end is not None:
            put(info.gpus, Segment(kind="running", booking=info.booking_id, user=info.user,
                                   start=_iso(info.start or now), end=_iso(info.end), template=info.template,
                                   title=titles.get(info.booking_id, ""), project=projects.get(info.booking_id, "")))
    for record in records:
        stopped = record.stopped_at
        if stopped is None or stopped < now - PAST or record.booking_id not in placed:
            continue
        put(placed[record.booking_id], Segment(kind="ended", booking=record.booking_id, user=record.user,
                                               start=_iso(record.started_at), end=_iso(stopped),
                                               note=record.exit_reason or "",
                                               title=titles.get(record.booking_id, ""),
                                               project=projects.get(record.booking_id, "")))
    return tuple(GpuTimeline(gpu=gpu, segments=tuple(sorted(lanes[gpu], key=lambda s: (s.start, s.kind))))
                 for gpu in sorted(lanes))


def kept_title(summary: str) -> str:
    """An event's title as the status keeps it: at most TITLE_KEPT characters, otherwise as the
    calendar has it (hostile: every view escapes it; `short_title` is what a row shows)."""
    return summary[:TITLE_KEPT]


def short_title(title: str, *, width: int = TITLE_WIDTH) -> str:
    """A title for one row of a terminal or the page: its whitespace runs (newlines too) one space,
    control characters written as \\xNN (an ESC cannot recolour a terminal), cut to `width` with
    an ellipsis."""
    text = printable(" ".join(title.split()))
    return text if len(text) <= width else text[:width - 1].rstrip() + "…"


def held_reasons(actions: Iterable[object]) -> dict[str, str]:
    """Booking id → why decide holds it this pass (its Hold actions)."""
    return {action.booking_id: action.reason for action in actions if isinstance(action, Hold)}


def rejected_bookings(plan: Plan) -> tuple[RejectedBooking, ...]:
    """The refused bookings with their reasons (at most REJECTED_SHOWN, the earliest first)."""
    return tuple(RejectedBooking(id=r.id, user=r.user or "", start=_iso(r.start), end=_iso(r.end), reason=r.reason,
                                 standby=r.standby)
                 for r in plan.rejected[:REJECTED_SHOWN])


def gpus_of(timelines: Iterable[GpuTimeline]) -> dict[str, tuple[int, ...]]:
    """Booking id → the GPUs its segments are on (to keep placing an ended booking)."""
    found: dict[str, set[int]] = {}
    for lane in timelines:
        for segment in lane.segments:
            found.setdefault(segment.booking, set()).add(lane.gpu)
    return {booking: tuple(sorted(gpus)) for booking, gpus in found.items()}
