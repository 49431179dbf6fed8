"""The plan: which booking runs on which GPUs, decided from plain data (no I/O, no clock).

Conflicts are decided by a fixed order made of what gpubook itself observed, never of what a
calendar client wrote (CREATED and DTSTAMP are the client's to forge: a booking stamped 1970 would
win every conflict): bookings whose containers already run come first (they never move GPUs), then
the occurrence gpubook saw first (`first_seen`, recorded by the apply stage in State); only among
occurrences gpubook first saw in the same poll (where it observed no order) do CREATED, DTSTAMP
and then UID break the tie (all three client-written, but a forged one can only reorder bookings
that appeared together; and an upgrade, which sees every existing booking at once, keeps the
order they had), then the occurrence's start. A booking that asks for a number of GPUs gets the lowest-numbered GPUs
of its calendar that are free for its whole time, so the choice is the same on every poll while
nothing earlier in that order changes. A UID held by several calendar objects belongs to the one
gpubook saw first; the copies are refused (a copy never displaces a running booking). Each user's
quotas (`[policy]`, scheduler/core/policy.py) are checked in the same order, before GPUs are chosen.

The plan is near-linear in the number of occurrences: each GPU keeps its accepted bookings as
disjoint intervals sorted by start, so a conflict is found by bisection, not by comparing a
booking with every accepted one.

Hosts are a dimension: the inventory maps each host to its GPU indices, and each accepted booking
is placed on (host, GPUs). The machine the daemon runs on is the host `LOCAL`; a plain list of
indices is the one-host case. A calendar's bookings go to its host (today every calendar belongs
to the local host; a cluster backend adds hosts here, not a second planner).
"""

from __future__ import annotations

import bisect
import fnmatch
import functools
from collections import defaultdict
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta, tzinfo
from types import MappingProxyType
from typing import Any
from zoneinfo import ZoneInfo

from scheduler.config import CalendarConfig, Config
from scheduler.core import policy
from scheduler.core.bookings import Booking, Rejection
from scheduler.sources.errors import redact_url

LOCAL = "local"  # the host the daemon runs on
Inventory = Mapping[str, Sequence[int]]  # host → the GPU indices present on it
SeenKey = tuple[str, str, str]  # (calendar url, object href, occurrence id): see `seen_key`
_NOTHING_RUNNING: Mapping[str, tuple[int, ...]] = MappingProxyType({})
_NOTHING_SEEN: Mapping[SeenKey, datetime] = MappingProxyType({})
# First-seen times are kept this long after they leave the calendars' reading: far beyond the
# daemon's window (a week ahead, the longest booking back), so a visible occurrence keeps its time.
FIRST_SEEN_KEPT = timedelta(days=30)
_LATEST = datetime.max.replace(tzinfo=ZoneInfo("UTC"))


@dataclass(frozen=True)
class Accepted:
    booking: Booking
    gpus: tuple[int, ...]  # concrete GPU indices, ascending
    warn_at: datetime  # when the booker is warned that the end is near (never before the start)
    host: str = LOCAL  # the host whose GPUs these are


@dataclass(frozen=True)
class Plan:
    accepted: tuple[Accepted, ...]  # sorted by start, then id
    rejected: tuple[Rejection, ...]  # sorted by start, then id
    next_wakeup: datetime | None  # the earliest start, warning or end after `now`


def plan(
    bookings: Sequence[Booking | Rejection],
    *,
    inventory: Inventory | Sequence[int],
    config: Config,
    templates: Collection[str],
    now: datetime,
    running: Mapping[str, tuple[int, ...]] = _NOTHING_RUNNING,
    first_seen: Mapping[SeenKey, datetime] = _NOTHING_SEEN,
) -> Plan:
    """Decide every occurrence: accepted on concrete GPUs, or rejected with a reason.

    `inventory` maps each host to the GPU indices present on it (a plain list: the local host's);
    `running` maps the id of each booking whose container runs now to the GPUs it runs on;
    `first_seen` maps `seen_key(occurrence)` to when gpubook first saw it (missing: seen last).
    """
    host_tz = ZoneInfo(config.host.timezone)
    calendars = {calendar.url: calendar for calendar in config.calendars}
    hosts = one_host(inventory) if not isinstance(inventory, Mapping) else \
        {name: frozenset(gpus) for name, gpus in inventory.items()}
    host = next(iter(hosts), LOCAL)  # every calendar belongs to the first host (see the docstring)
    present = frozenset(hosts.get(host, ()))
    rejected = [item for item in bookings if isinstance(item, Rejection)]
    candidates = [item for item in bookings if isinstance(item, Booking)]
    duplicated = _duplicated_uids(bookings, first_seen)

    valid: list[Booking] = []
    for booking in candidates:
        reason: str | None
        if (booking.calendar_url, booking.href) in duplicated.get(booking.uid, {}):
            reason = duplicated[booking.uid][(booking.calendar_url, booking.href)]
        else:
            reason = _static_problem(booking, calendars=calendars, present=present, config=config,
                                     templates=templates, host=_host_name(host, config))
        if reason is None:
            valid.append(booking)
        else:
            rejected.append(_rejection(booking, reason))

    busy: dict[int, _Timeline] = defaultdict(_Timeline)  # the GPUs of `host`
    accepted: list[Accepted] = []
    warn = timedelta(minutes=config.defaults.warn_minutes)
    ledger = policy.Ledger(config, now=now, host_tz=host_tz)
    for booking in sorted(valid, key=lambda b: _priority(b, running, first_seen)):
        owned = _owned(calendars[booking.calendar_url], present)
        gpus = _kept_gpus(booking, running, busy)
        # A running booking is never judged by a quota (see scheduler/core/policy.py); it counts.
        if booking.id not in running and \
                (over := ledger.problem(booking, first_seen=first_seen.get(seen_key(booking)))):
            rejected.append(_rejection(booking, over))
            continue
        if gpus is None:
            gpus_or_reason = _choose(booking, owned, busy, host_tz)
            if isinstance(gpus_or_reason, str):
                rejected.append(_rejection(booking, gpus_or_reason))
                continue
            gpus = gpus_or_reason
        for gpu in gpus:
            busy[gpu].add(booking)
        ledger.add(booking, gpus=gpus)
        accepted.append(Accepted(booking, gpus, max(booking.start, booking.end - warn), host))

    accepted.sort(key=lambda a: _order(a.booking))
    rejected.sort(key=_order)
    moments = [t for a in accepted for t in (a.booking.start, a.warn_at, a.booking.end) if t > now]
    return Plan(tuple(accepted), tuple(rejected), min(moments, default=None))


def to_json(plan: Plan) -> dict[str, Any]:
    """The plan as `gpubook bookings --json` prints it; times in ISO 8601 with their UTC offset."""
    return {
        "accepted": [
            {"id": a.booking.id, "uid": a.booking.uid, "user": a.booking.user, "gpus": list(a.gpus),
             "template": a.booking.template, "start": a.booking.start.isoformat(),
             "end": a.booking.end.isoformat()}
            for a in plan.accepted
        ],
        "rejected": [
            {"id": r.id, "uid": r.uid, "start": r.start.isoformat(), "end": r.end.isoformat(),
             "reason": r.reason}
            for r in plan.rejected
        ],
    }


def one_host(gpus: Sequence[int]) -> dict[str, frozenset[int]]:
    """The inventory of a single machine: the local host with these GPUs."""
    return {LOCAL: frozenset(gpus)}


def _host_name(host: str, config: Config) -> str:
    return config.host.name if host == LOCAL else host


def seen_key(item: Booking | Rejection) -> SeenKey:
    """The key of `first_seen`: an occurrence in one calendar object (a copied UID is another key)."""
    return (item.calendar_url, item.href, item.id)


def _duplicated_uids(items: Sequence[Booking | Rejection],
                     first_seen: Mapping[SeenKey, datetime]) -> dict[str, dict[tuple[str, str], str]]:
    """UIDs held by more than one calendar object (within or across calendars): uid → each refused
    place (calendar url, href) → why. The place gpubook saw first keeps the UID; when no place was
    seen strictly first (a tie, or nothing recorded), every place is refused."""
    places: dict[str, dict[tuple[str, str], datetime]] = defaultdict(dict)
    for item in items:
        seen = first_seen.get(seen_key(item), _LATEST)
        where = places[item.uid]
        place = (item.calendar_url, item.href)
        where[place] = min(seen, where.get(place, _LATEST))
    refused: dict[str, dict[tuple[str, str], str]] = {}
    for uid, where in places.items():
        if len(where) < 2:
            continue
        first = min(where.values())
        keeper = [place for place, seen in where.items() if seen == first]
        if first != _LATEST and len(keeper) == 1:
            kept = keeper[0]
            refused[uid] = {place: (f"the UID {uid!r} already belongs to the event {redact_url(kept[1])}, which "
                                    "gpubook saw first; give each booking its own event")
                            for place in where if place != kept}
        else:
            hrefs = ", ".join(sorted({redact_url(href) for _, href in where}))
            refused[uid] = {place: (f"the UID {uid!r} is used by events in more than one place "
                                    f"({hrefs}); give each booking its own event") for place in where}
    return refused


def _static_problem(booking: Booking, *, calendars: Mapping[str, CalendarConfig],
                    present: frozenset[int], config: Config,
                    templates: Collection[str], host: str) -> str | None:
    """What is wrong with a booking on its own, before looking at other bookings."""
    user = config.users.get(booking.user)
    if user is None:
        return f"{booking.user!r} is not a known user of {host}"
    if booking.template not in templates:
        known = ", ".join(sorted(templates)) or "none"
        return f"there is no template {booking.template!r} on {host} ({known})"
    if not any(fnmatch.fnmatchcase(booking.template, pattern) for pattern in user.templates):
        allowed = ", ".join(user.templates)
        return f"{user.name} may not use template {booking.template!r} (allowed: {allowed})"
    calendar = calendars.get(booking.calendar_url)
    if calendar is None:
        return f"the calendar {redact_url(booking.calendar_url)} is not configured on {host}"
    if user.max_gpus is not None and booking.gpu_count > user.max_gpus:
        return (f"{user.name} may book at most {_gpus_text(user.max_gpus)}; "
                f"this booking asks for {booking.gpu_count}")
    owned = _owned(calendar, present)
    if booking.gpu_indices is not None:
        for index in booking.gpu_indices:
            if index not in present:
                return f"GPU {index} is not present on {host} ({_list_text(present)})"
            if index not in owned:
                return f"GPU {index} is not booked through this calendar ({_list_text(owned)})"
    elif booking.gpu_count > len(owned):
        return (f"this calendar books {_gpus_text(len(owned))} of {host} "
                f"({_list_text(owned)}); this booking asks for {booking.gpu_count}")
    hours = (booking.end - booking.start) / timedelta(hours=1)
    if hours > config.defaults.max_hours:
        return (f"the booking lasts {hours:g} hours; bookings may last at most "
                f"{config.defaults.max_hours:g} hours")
    return None


def _owned(calendar: CalendarConfig, present: frozenset[int]) -> tuple[int, ...]:
    return tuple(sorted(present if calendar.gpus is None else present & set(calendar.gpus)))


def _priority(booking: Booking, running: Mapping[str, tuple[int, ...]],
              first_seen: Mapping[SeenKey, datetime]) -> tuple[Any, ...]:
    # Every field takes part so that equal keys only come from equal bookings: input order can
    # never decide. CREATED and DTSTAMP only order bookings first seen together (see the docstring).
    return (booking.id not in running, first_seen.get(seen_key(booking), _LATEST),
            booking.created or _LATEST, booking.dtstamp or _LATEST, booking.uid, booking.start,
            *_order(booking))


def _order(item: Booking | Rejection) -> tuple[Any, ...]:
    if isinstance(item, Booking):
        return (item.start, item.id, item.end, item.calendar_url, item.href, item.user,
                item.template, item.gpu_count, item.gpu_indices or (), item.summary)
    return (item.start, item.id, item.end, item.calendar_url, item.href, item.reason)


class _Timeline:
    """One GPU's accepted bookings: disjoint intervals sorted by start (so their ends are sorted
    too), each with its place in the priority order, so a conflict is found by bisection."""

    def __init__(self) -> None:
        self.starts: list[datetime] = []
        self.ends: list[datetime] = []  # never before the start, so sorted like the starts
        self.placed: list[tuple[int, Booking]] = []  # (rank in priority order, booking)

    def add(self, booking: Booking) -> None:
        at = bisect.bisect_right(self.starts, booking.start)
        self.starts.insert(at, booking.start)
        self.ends.insert(at, _end(booking))
        self.placed.insert(at, (len(self.placed), booking))

    def taken(self, booking: Booking) -> bool:
        """Whether an accepted booking overlaps `booking` (the last one starting before its end is
        the one that ends latest)."""
        at = bisect.bisect_left(self.starts, booking.end)
        return at > 0 and self.ends[at - 1] > booking.start

    def first_conflict(self, booking: Booking) -> Booking | None:
        """The booking placed earliest (in priority order) that overlaps `booking`, if any."""
        at = bisect.bisect_left(self.starts, booking.end)
        found: tuple[int, Booking] | None = None
        while at > 0 and self.ends[at - 1] > booking.start:
            at -= 1
            if _overlaps(booking, self.placed[at][1]) and (found is None or self.placed[at] < found):
                found = self.placed[at]
        return None if found is None else found[1]


def _end(booking: Booking) -> datetime:
    return max(booking.start, booking.end)


def _kept_gpus(booking: Booking, running: Mapping[str, tuple[int, ...]],
               busy: Mapping[int, _Timeline]) -> tuple[int, ...] | None:
    """A running booking keeps its GPUs while they still match what it asks for."""
    gpus = running.get(booking.id)
    if not gpus:
        return None
    gpus = tuple(sorted(gpus))
    wanted = booking.gpu_indices
    if (wanted is not None and wanted != gpus) or len(gpus) != booking.gpu_count:
        return None
    if any(gpu in busy and busy[gpu].taken(booking) for gpu in gpus):
        return None
    return gpus


def _choose(booking: Booking, owned: tuple[int, ...], busy: Mapping[int, _Timeline],
            host_tz: tzinfo) -> tuple[int, ...] | str:
    """Concrete GPUs for a booking, or the reason none can be given."""
    candidates = booking.gpu_indices if booking.gpu_indices is not None else owned
    free: list[int] = []
    blocked: list[int] = []
    start, end, bisect_left = booking.start, booking.end, bisect.bisect_left
    for gpu in candidates:
        line = busy.get(gpu)
        # Timeline.taken, inlined: this loop runs once per GPU of every booking.
        if line is not None and (at := bisect_left(line.starts, end)) and line.ends[at - 1] > start:
            blocked.append(gpu)
        else:
            free.append(gpu)
            if booking.gpu_indices is None and len(free) == booking.gpu_count:
                return tuple(free)  # the lowest free ones: the rest need not be looked at
    if booking.gpu_indices is not None and not blocked:
        return tuple(free)
    named = "; ".join(f"GPU {gpu} is booked by {other.user} {_when(other, host_tz)}"
                      for gpu in blocked[:3] if (other := busy[gpu].first_conflict(booking)) is not None)
    more = f" and {len(blocked) - 3} more" if len(blocked) > 3 else ""
    if booking.gpu_indices is None:
        return (f"only {len(free)} of the {booking.gpu_count} GPUs asked for "
                f"{'is' if len(free) == 1 else 'are'} free at that time: {named}{more}")
    return f"the GPUs asked for are taken: {named}{more}"


def _overlaps(a: Booking, b: Booking) -> bool:
    return a.start < b.end and b.start < a.end


def _when(booking: Booking, host_tz: tzinfo) -> str:
    return _span(booking.start, booking.end, host_tz)


@functools.lru_cache(maxsize=4096)  # a busy GPU's holder is named in many rejections
def _span(start: datetime, end: datetime, host_tz: tzinfo) -> str:
    start, end = start.astimezone(host_tz), end.astimezone(host_tz)
    until = f"{end:%H:%M}" if end.date() == start.date() else f"{end:%Y-%m-%d %H:%M}"
    return f"from {start:%Y-%m-%d %H:%M} to {until} ({start:%Z})"


def _rejection(booking: Booking, reason: str) -> Rejection:
    return Rejection(id=booking.id, uid=booking.uid, start=booking.start, end=booking.end,
                     reason=reason, user=booking.user, calendar_url=booking.calendar_url,
                     href=booking.href)


def _gpus_text(count: int) -> str:
    return f"{count} GPU" if count == 1 else f"{count} GPUs"


def _list_text(gpus: Collection[int]) -> str:
    if not gpus:
        return "it has no GPU"
    return "GPU " + ", ".join(str(g) for g in sorted(gpus)) if len(gpus) == 1 else \
        "GPUs " + ", ".join(str(g) for g in sorted(gpus))
