"""The plan: which booking runs on which GPUs, decided from plain data (no I/O, no clock).

Conflicts are decided by a fixed order, never by which poll saw a booking first: bookings whose
containers already run come first (they never move GPUs), then the earliest CREATED, then DTSTAMP,
then UID, then the occurrence's start. A booking that asks for a number of GPUs gets the
lowest-numbered GPUs of its calendar that are free for its whole time, so the choice is the same
on every poll while nothing earlier in that order changes.

Hosts are a dimension: the inventory maps each host to its GPU indices, and each accepted booking
is placed on (host, GPUs). The machine the daemon runs on is the host `LOCAL`; a plain list of
indices is the one-host case. A calendar's bookings go to its host (today every calendar belongs
to the local host; a cluster backend adds hosts here, not a second planner).
"""

from __future__ import annotations

import fnmatch
from collections import defaultdict
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta, tzinfo
from types import MappingProxyType
from typing import Any
from zoneinfo import ZoneInfo

from scheduler.config import CalendarConfig, Config
from scheduler.core.bookings import Booking, Rejection

LOCAL = "local"  # the host the daemon runs on
Inventory = Mapping[str, Sequence[int]]  # host → the GPU indices present on it
_NOTHING_RUNNING: Mapping[str, tuple[int, ...]] = MappingProxyType({})
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
) -> Plan:
    """Decide every occurrence: accepted on concrete GPUs, or rejected with a reason.

    `inventory` maps each host to the GPU indices present on it (a plain list: the local host's);
    `running` maps the id of each booking whose container runs now to the GPUs it runs on.
    """
    host_tz = ZoneInfo(config.host.timezone)
    calendars = {calendar.url: calendar for calendar in config.calendars}
    hosts = one_host(inventory) if not isinstance(inventory, Mapping) else \
        {name: frozenset(gpus) for name, gpus in inventory.items()}
    host = next(iter(hosts), LOCAL)  # every calendar belongs to the first host (see the docstring)
    present = frozenset(hosts.get(host, ()))
    rejected = [item for item in bookings if isinstance(item, Rejection)]
    candidates = [item for item in bookings if isinstance(item, Booking)]
    duplicated = _duplicated_uids(bookings)

    valid: list[Booking] = []
    for booking in candidates:
        reason: str | None
        if booking.uid in duplicated:
            places = ", ".join(sorted(duplicated[booking.uid]))
            reason = (f"the UID {booking.uid!r} is used by events in more than one place "
                      f"({places}); give each booking its own event")
        else:
            reason = _static_problem(booking, calendars=calendars, present=present, config=config,
                                     templates=templates, host=_host_name(host, config))
        if reason is None:
            valid.append(booking)
        else:
            rejected.append(_rejection(booking, reason))

    busy: dict[int, list[Booking]] = defaultdict(list)  # the GPUs of `host`
    accepted: list[Accepted] = []
    warn = timedelta(minutes=config.defaults.warn_minutes)
    for booking in sorted(valid, key=lambda b: _priority(b, running)):
        owned = _owned(calendars[booking.calendar_url], present)
        gpus = _kept_gpus(booking, running, busy)
        if gpus is None:
            gpus_or_reason = _choose(booking, owned, busy, host_tz)
            if isinstance(gpus_or_reason, str):
                rejected.append(_rejection(booking, gpus_or_reason))
                continue
            gpus = gpus_or_reason
        for gpu in gpus:
            busy[gpu].append(booking)
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


def _duplicated_uids(items: Sequence[Booking | Rejection]) -> dict[str, set[str]]:
    """UIDs held by more than one calendar object (within or across calendars)."""
    places: dict[str, set[tuple[str, str]]] = defaultdict(set)
    for item in items:
        places[item.uid].add((item.calendar_url, item.href))
    return {uid: {href for _, href in where} for uid, where in places.items() if len(where) > 1}


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
        return f"the calendar {booking.calendar_url} is not configured on {host}"
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


def _priority(booking: Booking, running: Mapping[str, tuple[int, ...]]) -> tuple[Any, ...]:
    # Every field takes part so that equal keys only come from equal bookings: input order can
    # never decide.
    return (booking.id not in running, booking.created or _LATEST, booking.dtstamp or _LATEST,
            booking.uid, booking.start, *_order(booking))


def _order(item: Booking | Rejection) -> tuple[Any, ...]:
    if isinstance(item, Booking):
        return (item.start, item.id, item.end, item.calendar_url, item.href, item.user,
                item.template, item.gpu_count, item.gpu_indices or (), item.summary)
    return (item.start, item.id, item.end, item.calendar_url, item.href, item.reason)


def _kept_gpus(booking: Booking, running: Mapping[str, tuple[int, ...]],
               busy: Mapping[int, list[Booking]]) -> tuple[int, ...] | None:
    """A running booking keeps its GPUs while they still match what it asks for."""
    gpus = running.get(booking.id)
    if not gpus:
        return None
    gpus = tuple(sorted(gpus))
    wanted = booking.gpu_indices
    if (wanted is not None and wanted != gpus) or len(gpus) != booking.gpu_count:
        return None
    if any(_overlaps(booking, other) for gpu in gpus for other in busy.get(gpu, ())):
        return None
    return gpus


def _choose(booking: Booking, owned: tuple[int, ...], busy: Mapping[int, list[Booking]],
            host_tz: tzinfo) -> tuple[int, ...] | str:
    """Concrete GPUs for a booking, or the reason none can be given."""
    candidates = booking.gpu_indices if booking.gpu_indices is not None else owned
    taken = {gpu: next((o for o in busy.get(gpu, ()) if _overlaps(booking, o)), None)
             for gpu in candidates}
    free = [gpu for gpu in candidates if taken[gpu] is None]
    if booking.gpu_indices is None and len(free) >= booking.gpu_count:
        return tuple(free[: booking.gpu_count])
    if booking.gpu_indices is not None and len(free) == len(candidates):
        return tuple(free)
    blocked = [(gpu, other) for gpu, other in taken.items() if other is not None]
    named = "; ".join(f"GPU {gpu} is booked by {other.user} {_when(other, host_tz)}"
                      for gpu, other in blocked[:3])
    more = f" and {len(blocked) - 3} more" if len(blocked) > 3 else ""
    if booking.gpu_indices is None:
        return (f"only {len(free)} of the {booking.gpu_count} GPUs asked for "
                f"{'is' if len(free) == 1 else 'are'} free at that time: {named}{more}")
    return f"the GPUs asked for are taken: {named}{more}"


def _overlaps(a: Booking, b: Booking) -> bool:
    return a.start < b.end and b.start < a.end


def _when(booking: Booking, host_tz: tzinfo) -> str:
    start, end = booking.start.astimezone(host_tz), booking.end.astimezone(host_tz)
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
