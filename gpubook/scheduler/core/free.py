"""Free GPU time, from the plan: each GPU's busy blocks, and the next slots that fit a request.

Pure (no I/O, no clock): the plan's accepted bookings in, plain values out. A request is a number
of GPUs (on each of `nodes` hosts), optionally among given GPUs (a calendar's, a model's, the
indices a booker named), for a duration. A slot is a start where enough GPUs stay free for the
whole duration, with the GPUs chosen and how long they stay free together.

Candidate starts are the search's own start and the starts of free gaps long enough for the
duration after it (a GPU turns free only when something on it ends), never "now", so the answer is
the same on every pass while the bookings stay: a refusal that names a slot is not written again
on each poll. Each GPU's gaps are disjoint and sorted, so "free from t for d" is one bisection; a
search costs (candidates × GPUs × log gaps) at most, and stops at the slots asked for.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta, tzinfo
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from gpubook.scheduler.core.plan import Accepted

SHOWN = 2  # slots a refusal names: short enough to read in a calendar's description


class Beyond(ValueError):
    """A window asked for from a time past what gpubook reads ahead: nothing is known of it yet."""


@dataclass(frozen=True)
class Window:
    """The free time asked for: from `start` until `end`, and why it was cut ("": it was not)."""

    start: datetime
    end: datetime
    capped: str = ""


def window(start: datetime | None, *, days: float, now: datetime, reach_ahead: timedelta) -> Window:
    """From `start` (`--from`, never before now; None: now) for `days`, cut at what is read ahead
    (saying so, rather than showing less than asked); Beyond for a start at or past that."""
    start = max(start or now, now)
    limit = now + reach_ahead
    if start >= limit:
        raise Beyond(f"--from {start.isoformat()} is past what gpubook reads ahead ({reach_ahead.days} days, "
                     f"until {limit.isoformat()}): nothing is known of it yet")
    end = start + timedelta(days=days)
    if end <= limit:
        return Window(start, end)
    return Window(start, limit, f"--days {days:g} reaches past what the daemon reads ahead ({reach_ahead.days} "
                                "days): shown until then")


class Lane(Protocol):
    """One GPU's busy time: disjoint intervals sorted by start (so the ends are sorted too)."""

    @property
    def starts(self) -> Sequence[datetime]: ...

    @property
    def ends(self) -> Sequence[datetime]: ...


Lanes = Mapping[str, Mapping[int, Lane]]  # host → GPU index → its busy time


@dataclass(frozen=True)
class Block:
    """A booking's busy time on one host: its GPUs there, from start to end."""

    host: str
    gpus: tuple[int, ...]
    start: datetime
    end: datetime
    booking: str  # the booking id
    user: str


@dataclass(frozen=True)
class Request:
    """What must fit: `count` GPUs on each of `nodes` hosts, among `among` (host → the GPUs that
    may be chosen there), for `duration`."""

    among: Mapping[str, Sequence[int]]
    count: int
    duration: timedelta
    nodes: int = 1
    exact: bool = False  # the GPUs of `among` exactly (a booker named their indices)


@dataclass(frozen=True)
class Slot:
    start: datetime
    end: datetime | None  # when the first of its GPUs is booked again; None: free to the horizon
    placement: tuple[tuple[str, tuple[int, ...]], ...]  # (host, its GPUs) for each node


@dataclass
class Busy:
    """A lane built from blocks: merged, sorted, disjoint (`Lane`)."""

    starts: list[datetime]
    ends: list[datetime]


def blocks(accepted: Iterable[Accepted]) -> list[Block]:
    """Each accepted booking's busy time on each host it holds, sorted by start."""
    found = [Block(host=host, gpus=gpus, start=a.booking.start, end=a.booking.end, booking=a.booking.id,
                   user=a.booking.user)
             for a in accepted for host, gpus in a.placement if gpus and a.booking.end > a.booking.start]
    return sorted(found, key=lambda b: (b.start, b.host, b.gpus, b.booking))


def lanes(found: Iterable[Block]) -> dict[str, dict[int, Busy]]:
    """Each GPU's busy time from blocks (touching or overlapping blocks merged)."""
    spans: dict[str, dict[int, list[tuple[datetime, datetime]]]] = defaultdict(lambda: defaultdict(list))
    for block in found:
        for gpu in block.gpus:
            spans[block.host][gpu].append((block.start, block.end))
    result: dict[str, dict[int, Busy]] = {}
    for host, per_gpu in spans.items():
        result[host] = {gpu: _merged(sorted(items)) for gpu, items in per_gpu.items()}
    return result


def _merged(items: Sequence[tuple[datetime, datetime]]) -> Busy:
    starts: list[datetime] = []
    ends: list[datetime] = []
    for start, end in items:
        if ends and start <= ends[-1]:
            ends[-1] = max(ends[-1], end)
        else:
            starts.append(start)
            ends.append(end)
    return Busy(starts, ends)


def free_spans(lane: Lane | None, *, start: datetime, end: datetime) -> list[tuple[datetime, datetime]]:
    """The free stretches of one GPU between `start` and `end`."""
    spans: list[tuple[datetime, datetime]] = []
    cursor = start
    starts, ends = (lane.starts, lane.ends) if lane is not None else ((), ())
    at = max(0, bisect.bisect_right(ends, start))  # the first block ending after `start`
    while cursor < end:
        if at >= len(starts) or starts[at] >= end:
            spans.append((cursor, end))
            break
        if starts[at] > cursor:
            spans.append((cursor, starts[at]))
        cursor = max(cursor, ends[at])
        at += 1
    return spans


def next_slots(busy: Lanes, request: Request, *, after: datetime, horizon: datetime, not_before: datetime | None = None,
               last_start: datetime | None = None, limit: int = SHOWN) -> list[Slot]:
    """The first `limit` slots at or after `after` where the request fits whole before `horizon`
    (what lies beyond is unknown), one after the other (each starts after the last one's end);
    a slot whose time is over by `not_before` (now) is skipped, and none starts after `last_start`
    (the booker's `max_days_ahead`)."""
    return Finder(busy, origin=after, horizon=horizon).next_slots(
        request, after=after, not_before=not_before, last_start=last_start, limit=limit)


@dataclass(frozen=True)
class _Windows:
    """Where one GPU can start a stretch of one duration: the starts and latest starts of its free
    gaps at least that long (sorted, disjoint), in POSIX seconds."""

    starts: list[float]
    lasts: list[float]

    def at(self, moment: float) -> int | None:
        """The gap `moment` may start in (its index), if any."""
        index = bisect.bisect_right(self.starts, moment) - 1
        return index if index >= 0 and self.lasts[index] >= moment else None


class Finder:
    """Slot searches over one set of lanes, from `origin` to `horizon`. Each GPU's gaps long enough
    for a duration are found once and kept (a plan's refusals ask for a few durations over the same
    lanes), so a search looks only at where a stretch that long can start: in a dense calendar the
    short gaps, which are most of them, cost nothing. Times are POSIX seconds inside (datetime
    arithmetic across time zones is what made it slow), datetimes outside."""

    def __init__(self, busy: Lanes, *, origin: datetime, horizon: datetime) -> None:
        self.busy, self.origin, self.horizon = busy, origin, horizon
        self._origin, self._horizon = origin.timestamp(), horizon.timestamp()
        self._gaps: dict[tuple[str, int], list[tuple[float, float]]] = {}
        self._windows: dict[tuple[str, int, float], _Windows] = {}
        self._starts_of: dict[tuple[tuple[tuple[str, tuple[int, ...]], ...], float], list[float]] = {}
        self._lanes_of: dict[tuple[tuple[tuple[str, tuple[int, ...]], ...], float],
                             dict[tuple[str, int], _Windows]] = {}

    def gaps(self, host: str, gpu: int) -> list[tuple[float, float]]:
        """The GPU's free stretches from the origin to the horizon."""
        if (found := self._gaps.get((host, gpu))) is None:
            found = self._gaps[(host, gpu)] = [
                (start.timestamp(), end.timestamp())
                for start, end in free_spans(self.busy.get(host, {}).get(gpu), start=self.origin, end=self.horizon)]
        return found

    def windows(self, host: str, gpu: int, duration: float) -> _Windows:
        key = (host, gpu, duration)
        if (found := self._windows.get(key)) is None:
            long = [(start, end - duration) for start, end in self.gaps(host, gpu) if end - start >= duration]
            found = self._windows[key] = _Windows([s for s, _ in long], [last for _, last in long])
        return found

    def next_slots(self, request: Request, *, after: datetime, not_before: datetime | None = None,
                   last_start: datetime | None = None, limit: int = SHOWN) -> list[Slot]:
        """As the module's `next_slots`, with `after` not before this finder's origin."""
        duration = request.duration.total_seconds()
        among = (tuple((host, tuple(gpus)) for host, gpus in request.among.items()), duration)
        if (lanes := self._lanes_of.get(among)) is None:  # a plan's refusals ask the same GPUs again and again
            lanes = self._lanes_of[among] = {(host, gpu): self.windows(host, gpu, duration)
                                             for host, gpus in request.among.items() for gpu in gpus}
        now = not_before.timestamp() if not_before is not None else None
        latest = last_start.timestamp() if last_start is not None else None
        first = max(after.timestamp(), now - duration) if now is not None else after.timestamp()
        found: list[tuple[float, float | None, tuple[tuple[str, tuple[int, ...]], ...]]] = []
        ends: list[float] = []
        for start in _with_ends(self._starts(request, lanes.values(), duration, after=first), ends):
            if latest is not None and start > latest:
                break
            if (now is not None and start + duration <= now) or \
                    (found and (found[-1][1] is None or start < found[-1][1])):
                continue
            slot = self._fit(lanes, request, start=start, duration=duration)
            if slot is not None:
                found.append(slot)
                if slot[1] is not None:
                    ends.append(slot[1])
                if len(found) == limit or slot[1] is None:
                    break
        return [Slot(start=_moment(start), end=_moment(end) if end is not None else None, placement=placement)
                for start, end, placement in found]

    def _starts(self, request: Request, lanes: Iterable[_Windows], duration: float, *,
                after: float) -> Iterator[float]:
        """Every moment a stretch can start on one of the request's GPUs, from `after` on, in
        order: `after` itself, and each later gap's start (merged once per set of GPUs and duration)."""
        key = (tuple((host, tuple(gpus)) for host, gpus in request.among.items()), duration)
        if (starts := self._starts_of.get(key)) is None:
            starts = self._starts_of[key] = sorted({start for windows in lanes for start in windows.starts})
        yield after
        yield from _from(starts, bisect.bisect_right(starts, after))

    def _fit(self, lanes: Mapping[tuple[str, int], _Windows], request: Request, *, start: float,
             duration: float) -> tuple[float, float | None, tuple[tuple[str, tuple[int, ...]], ...]] | None:
        """The GPUs (on the first hosts that have them, inventory order) free for the request from
        `start`: on each host the lowest-numbered free ones, as the plan itself gives a booking
        moved there (gpubook/scheduler/core/plan.py `_choose`); the slot lasts while all stay free.
        (start, end or None: to the horizon, placement)."""
        placement: list[tuple[str, tuple[int, ...]]] = []
        until: list[float] = []
        for host, gpus in request.among.items():
            needed = len(gpus) if request.exact else request.count
            spare = len(gpus) - needed  # busy GPUs that can still be afforded
            chosen: list[tuple[int, float]] = []
            for gpu in gpus:
                windows = lanes[(host, gpu)]
                if (index := windows.at(start)) is not None:
                    chosen.append((gpu, windows.lasts[index] + duration))
                    if len(chosen) == needed:
                        break
                else:
                    spare -= 1
                    if spare < 0:
                        break
            if len(chosen) < needed or needed == 0:
                continue
            placement.append((host, tuple(gpu for gpu, _ in chosen)))
            until.extend(reach for _, reach in chosen)
            if len(placement) == request.nodes:
                last = min(until)
                return (start, None if last >= self._horizon else last, tuple(placement))
        return None


def _moment(seconds: float) -> datetime:
    return datetime.fromtimestamp(seconds, UTC)


def _with_ends(starts: Iterator[float], ends: Sequence[float]) -> Iterator[float]:
    """`starts`, with the end of each slot found on the way put in its place: where a slot's GPUs
    are booked again, others may have been free for a while (no gap of theirs starts there)."""
    upcoming = next(starts, None)
    pending: float | None = None
    seen = 0
    while True:
        if len(ends) > seen:
            pending, seen = ends[-1], len(ends)
        if pending is not None and (upcoming is None or pending <= upcoming):
            if pending == upcoming:
                upcoming = next(starts, None)
            yield pending
            pending = None
            continue
        if upcoming is None:
            return
        yield upcoming
        upcoming = next(starts, None)


def _from(items: Sequence[float], at: int) -> Iterator[float]:
    return (items[index] for index in range(at, len(items)))


def describe(slots: Sequence[Slot], *, zone: tzinfo, now: datetime, one_host: bool = True) -> str:
    """The slots as a booker reads them: "GPUs 0,1 are free from 13:00 to 18:00 today; tomorrow from
    09:00 (CET)" (a later slot names its GPUs only where they differ)."""
    parts: list[str] = []
    previous: tuple[tuple[str, tuple[int, ...]], ...] = ()
    for slot in slots:
        when = _when(slot, zone=zone, now=now)
        if slot.placement == previous:
            parts.append(when)
        else:
            where = _where(slot.placement, one_host=one_host)
            single = _single(slot.placement) and (one_host or len(slot.placement) == 1)
            parts.append(f"{where} {'is' if single else 'are'} free {when}" if not parts
                         else f"{where} {when}")
        previous = slot.placement
    if not parts:
        return ""
    return "; ".join(parts) + f" ({slots[0].start.astimezone(zone):%Z})"


def _single(placement: Sequence[tuple[str, tuple[int, ...]]]) -> bool:
    return len(placement) == 1 and len(placement[0][1]) == 1


def _where(placement: Sequence[tuple[str, tuple[int, ...]]], *, one_host: bool) -> str:
    def gpus(indices: tuple[int, ...]) -> str:
        return f"GPU {indices[0]}" if len(indices) == 1 else "GPUs " + ",".join(map(str, indices))

    if one_host:
        return gpus(placement[0][1])
    # A cluster picks a node's GPUs itself (Topology.picks_gpus): the booker asks for a count.
    return " and ".join(f"{len(indices)} GPU{'' if len(indices) == 1 else 's'} on {host}"
                        for host, indices in placement)


def _when(slot: Slot, *, zone: tzinfo, now: datetime) -> str:
    start = slot.start.astimezone(zone)
    if slot.end is None:
        return f"{day(start, zone=zone, now=now)} from {start:%H:%M}"
    end = slot.end.astimezone(zone)
    until = f"{end:%H:%M}" if end.date() == start.date() else f"{day(end, zone=zone, now=now)} {end:%H:%M}"
    return f"from {start:%H:%M} to {until} {day(start, zone=zone, now=now)}" if end.date() == start.date() \
        else f"from {day(start, zone=zone, now=now)} {start:%H:%M} to {until}"


def day(moment: datetime, *, zone: tzinfo, now: datetime) -> str:
    """"today", "tomorrow", or the weekday and date ("Mon 30 Nov") in the host's time zone."""
    days = (moment.astimezone(zone).date() - now.astimezone(zone).date()).days
    if days == 0:
        return "today"
    if days == 1:
        return "tomorrow"
    return f"{moment.astimezone(zone):%a %d %b}"
