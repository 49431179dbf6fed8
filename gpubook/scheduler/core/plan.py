"""The plan: which booking runs on which GPUs, decided from plain data (no I/O, no clock).

Conflicts are decided by a fixed order made of what gpubook itself observed, never of what a
calendar client wrote (CREATED and DTSTAMP are the client's to forge: a booking stamped 1970 would
win every conflict): bookings whose containers already run come first (they never move GPUs), then
the bookings gpubook has accepted at the time and GPUs they ask for now, in the order it first
accepted them there (`slots`, recorded by the apply stage in State), then every other occurrence.
Priority is earned by acceptance, never by being seen: an occurrence that was refused, or never
accepted, holds none (an event saved early and refused cannot be moved later onto a booking that
was accepted in the meantime), and a booking moved to another time or other GPUs is a new request
that competes after every booking already accepted. Among the new requests of one pass (where
gpubook observed no order) the fair-share tie-break goes first: a request whose project (a group with
a week quota) used the smaller part of that quota in the week before now goes before the others
(`policy.used_shares`; no project, or one without a week quota, counts as 0). Then CREATED, DTSTAMP
and UID break the tie (all three client-written, but a forged one can only reorder requests that
nobody holds yet), then the occurrence's start.
Standbys (`standby: yes`) go before every other new request, in the order gpubook saw them ask
(their slot's `seen_at`): one refused only for GPUs taken or a quota spent is a `Rejection` with
`standby` set and a reason that says it waits; it is planned again in every pass like every
occurrence, so the first plan with room for it accepts it (a promotion), and a request made after
it can never take that room first. A standby never displaces anything accepted.
A booking that asks for a number of GPUs gets the lowest-numbered GPUs of its calendar that are
free for its whole time, so the choice is the same on every poll while nothing earlier in that
order changes; a booking accepted before keeps the GPUs it was given while they stay free for it.
A UID held by several calendar objects belongs to the one gpubook saw first; the copies are
refused (a copy never displaces a running booking). Each user's quotas (`[policy]`,
gpubook/scheduler/core/policy.py) are checked in the same order, before GPUs are chosen.

The plan is near-linear in the number of occurrences: each GPU keeps its accepted bookings as
disjoint intervals sorted by start, so a conflict is found by bisection, not by comparing a
booking with every accepted one.

Hosts are a dimension: the inventory maps each host to its GPU indices, and each accepted booking
is placed on (host, GPUs). The machine the daemon runs on is the host `LOCAL`; a plain list of
indices is the one-host case. On a Slurm cluster every node is a host and every calendar books the
whole cluster: a booking goes to the first nodes (in the inventory's order) with its GPUs free for
its whole time, one node unless it asks for more (`nodes: 2`) or its GPUs fit on no single node
(`gpus: 16` on 8-GPU nodes: two nodes of 8), always spread evenly. Quotas and `max_gpus` count
its GPUs on every node together.
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

from gpubook.scheduler.core import free, policy
from gpubook.scheduler.core.bookings import Booking, Rejection
from gpubook.scheduler.core.topology import ONE_MACHINE, Topology
from gpubook.scheduler.settings import CalendarConfig, Config
from gpubook.scheduler.sources.errors import redact_url

LOCAL = "local"  # the host the daemon runs on
Inventory = Mapping[str, Sequence[int]]  # host → the GPU indices present on it
Placement = tuple[tuple[str, tuple[int, ...]], ...]  # (host, its GPU indices) for each node a booking holds
SeenKey = tuple[str, str, str]  # (calendar url, object href, occurrence id): see `seen_key`


@dataclass(frozen=True)
class Slot:
    """What gpubook recorded of an occurrence at the slot (time and GPUs asked for) it asks for now.

    State keeps one per occurrence and starts it afresh when the occurrence asks for another slot
    (`slot_of`): a move is a new request."""

    seen_at: datetime  # when gpubook first saw it ask for this slot: when the request was made
    accepted_at: datetime | None = None  # when first accepted at this slot; None: never, or refused since
    rank: int = 0  # its place in the priority order of the pass that accepted it
    placement: Placement = ()  # the hosts and GPUs the last pass gave it


_NOTHING_RUNNING: Mapping[str, tuple[int, ...]] = MappingProxyType({})
_NOTHING_SEEN: Mapping[SeenKey, datetime] = MappingProxyType({})
_NOTHING_HELD: Mapping[SeenKey, Slot] = MappingProxyType({})
_NOTHING_PLACED: Mapping[str, Placement] = MappingProxyType({})
# First-seen times are kept this long after they leave the calendars' reading: far beyond the
# daemon's window (a week ahead, the longest booking back), so a visible occurrence keeps its time.
FIRST_SEEN_KEPT = timedelta(days=30)
_UTC = ZoneInfo("UTC")
_LATEST = datetime.max.replace(tzinfo=_UTC)


@dataclass(frozen=True)
class Accepted:
    booking: Booking
    gpus: tuple[int, ...]  # concrete GPU indices, ascending
    warn_at: datetime  # when the booker is warned that the end is near (never before the start)
    host: str = LOCAL  # the host whose GPUs these are
    others: Placement = ()  # a multi-node booking's other nodes and their GPUs (the first is `host`)
    rank: int = 0  # its place in this plan's priority order (recorded when it is first accepted)

    @property
    def placement(self) -> Placement:
        """Every node the booking holds, first `host`, with its GPUs there."""
        return ((self.host, self.gpus), *self.others)


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
    placed: Mapping[str, Placement] = _NOTHING_PLACED,
    slots: Mapping[SeenKey, Slot] = _NOTHING_HELD,
    topology: Topology = ONE_MACHINE,
) -> Plan:
    """Decide every occurrence: accepted on concrete GPUs, or rejected with a reason.

    `inventory` maps each host to the GPU indices present on it (a plain list: the local host's);
    `running` maps the id of each booking whose container runs now to the GPUs it runs on;
    `first_seen` maps `seen_key(occurrence)` to when gpubook first saw it (missing: seen last),
    which decides only who keeps a UID that several calendar objects hold;
    `slots` maps `seen_key(occurrence)` to its record at the slot it asks for now (missing: a new
    request, made now): the priority of the bookings accepted there, and when each was asked for;
    `placed` maps a running booking's id to the hosts and GPUs it runs on (missing: `running`'s
    GPUs on the first host);
    `topology` is where the backend's bookings run (one machine: its first host alone).
    """
    host_tz = ZoneInfo(config.host.timezone)
    calendars = {calendar.url: calendar for calendar in config.calendars}
    hosts = one_host(inventory) if not isinstance(inventory, Mapping) else \
        {name: frozenset(gpus) for name, gpus in inventory.items()}
    if not hosts:
        hosts = one_host(())
    if not topology.spans_nodes:  # every calendar belongs to the first host (see the docstring)
        hosts = dict([next(iter(hosts.items()))])
    where = topology.name or _host_name(next(iter(hosts)), config)
    rejected = [item for item in bookings if isinstance(item, Rejection)]
    candidates = [item for item in bookings if isinstance(item, Booking)]
    duplicated = _duplicated_uids(bookings, first_seen, running=running, slots=slots)

    valid: list[tuple[Booking, tuple[int, int]]] = []  # with its shape: (nodes, GPUs on each)
    for booking in candidates:
        reason: str | tuple[int, int] | None
        if (booking.calendar_url, booking.href) in duplicated.get(booking.uid, {}):
            reason = duplicated[booking.uid][(booking.calendar_url, booking.href)]
        else:
            reason = _static_problem(booking, calendars=calendars, hosts=hosts, config=config,
                                     templates=templates, where=where, placed=placed.get(booking.id),
                                     one_machine=not topology.spans_nodes, runs=booking.id in running)
        if isinstance(reason, tuple):
            valid.append((booking, reason))
        else:
            rejected.append(_rejection(booking, reason or "?"))

    busy: dict[str, dict[int, _Timeline]] = {name: defaultdict(_Timeline) for name in hosts}
    accepted: list[Accepted] = []
    warn = timedelta(minutes=config.defaults.warn_minutes)
    ledger = policy.Ledger(config, now=now, host_tz=host_tz)
    first = next(iter(hosts))
    conflicts: list[tuple[Booking, tuple[int, int], dict[str, tuple[int, ...]], str]] = []
    counted = (booking for booking, _ in valid if booking.id in running or _held(booking, slots))
    shares = policy.used_shares(config, counted, now=now) if config.groups else {}
    for booking, shape in sorted(valid, key=lambda item: _priority(item[0], running, slots, shares)):
        calendar = calendars[booking.calendar_url]
        owned = {name: _owned(calendar, present) for name, present in hosts.items()}
        record = slots.get(seen_key(booking))
        kept = placed.get(booking.id) or (((first, running[booking.id]),) if running.get(booking.id) else ())
        placement = _kept(booking, kept, busy) if kept else _held_placement(booking, record, owned, busy)
        # A running booking is never judged by a quota (see gpubook/scheduler/core/policy.py); it counts.
        if booking.id not in running and \
                (over := ledger.problem(booking, first_seen=record.seen_at if record else None)):
            rejected.append(_rejection(booking, over, waits=booking.standby))
            continue
        if placement is None:
            placed_or_reason = _place(booking, shape, owned, busy, host_tz)
            if isinstance(placed_or_reason, str):
                conflicts.append((booking, shape, owned, placed_or_reason))
                continue
            placement = placed_or_reason
        for name, gpus in placement:
            timelines = busy.setdefault(name, defaultdict(_Timeline))  # a node gone from the inventory
            for gpu in gpus:
                timelines[gpu].add(booking)
        ledger.add(booking, gpus=[gpu for _, gpus in placement for gpu in gpus])
        (host, gpus), *others = placement
        accepted.append(Accepted(booking, gpus, max(booking.start, booking.end - warn), host, tuple(others),
                                 rank=len(accepted)))

    # Named once every booking is placed, so that the slots named are free in this plan.
    offers = _Offers(free.Finder(busy, origin=min((b.start for b, *_ in conflicts), default=now),
                                 horizon=now + policy.reach_ahead(config)),
                     config=config, now=now, zone=host_tz, one_host=len(hosts) == 1)
    rejected.extend(_rejection(booking, offers.add_to(reason, booking, shape, owned), waits=booking.standby)
                    for booking, shape, owned, reason in conflicts)
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
             "end": a.booking.end.isoformat(),
             **({"nodes": {name: list(gpus) for name, gpus in a.placement}} if a.others or a.host != LOCAL else {}),
             **({"project": a.booking.project} if a.booking.project is not None else {})}
            for a in plan.accepted
        ],
        "rejected": [
            {"id": r.id, "uid": r.uid, "start": r.start.isoformat(), "end": r.end.isoformat(),
             "reason": r.reason, **({"standby": True} if r.standby else {})}
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


def slot_of(booking: Booking) -> str:
    """The slot a booking asks for (its time, and its GPUs as asked), as State records it: another
    slot makes the occurrence a new request (see `Slot`)."""
    gpus = ",".join(map(str, booking.gpu_indices)) if booking.gpu_indices is not None else f"{booking.gpu_count}x"
    start, end = (moment.astimezone(_UTC).isoformat() for moment in (booking.start, booking.end))
    return f"{start}/{end} gpus {gpus} nodes {booking.nodes or ''}"


def place_key(item: Booking | Rejection) -> SeenKey:
    """The key of `first_seen` for a calendar object holding a UID (every occurrence of it): kept
    while the object is read, so a place's seniority outlives its occurrences in the window (round
    3, H3: a copy of a repeating booking's UID tied with it once the occurrences seen before the
    copy had left the window). Its last part cannot be an occurrence id: those have no control
    character (`Booking.id`, refused at reading)."""
    return (item.calendar_url, item.href, f"{PLACE_MARK}{item.uid}")


PLACE_MARK = "\x1fplace "


def _duplicated_uids(items: Sequence[Booking | Rejection], first_seen: Mapping[SeenKey, datetime], *,
                     running: Mapping[str, tuple[int, ...]], slots: Mapping[SeenKey, Slot],
                     ) -> dict[str, dict[tuple[str, str], str]]:
    """UIDs held by more than one calendar object (within or across calendars): uid → each refused
    place (calendar url, href) → why. One place keeps the UID, in this order: the place whose
    occurrence runs (accepted there: a copy never touches the running booking); the place gpubook
    saw first (the object, `place_key`, or its earliest occurrence); the place whose occurrence was
    accepted first. Only when nothing tells them apart (two new objects in one pass) is every place
    refused. The sentence never names another calendar's object (round 3, L4)."""
    ranks: dict[str, dict[tuple[str, str], tuple[int, datetime, datetime]]] = defaultdict(dict)
    for item in items:
        slot = slots.get(seen_key(item))
        accepted = slot.accepted_at if slot is not None and slot.accepted_at is not None else None
        rank = (0 if accepted is not None and item.id in running else 1,
                min(first_seen.get(place_key(item), _LATEST), first_seen.get(seen_key(item), _LATEST)),
                accepted or _LATEST)
        where = ranks[item.uid]
        place = (item.calendar_url, item.href)
        before = where.get(place, (1, _LATEST, _LATEST))
        where[place] = (min(rank[0], before[0]), min(rank[1], before[1]), min(rank[2], before[2]))
    refused: dict[str, dict[tuple[str, str], str]] = {}
    for uid, where in ranks.items():
        if len(where) < 2:
            continue
        best = min(where.values())
        keeper = [place for place, rank in where.items() if rank == best]
        if best != (1, _LATEST, _LATEST) and len(keeper) == 1:
            kept = keeper[0]
            refused[uid] = {place: f"the UID {uid!r} already belongs to {_other_event(kept, place)}, which gpubook "
                                   "saw first; give each booking its own event" for place in where if place != kept}
        else:
            refused[uid] = {place: (f"the UID {uid!r} is used by events in more than one place "
                                    f"({_other_places(where, place)}); give each booking its own event")
                            for place in where}
    return refused


def _other_event(other: tuple[str, str], place: tuple[str, str]) -> str:
    """The other place as the refused event's own calendar may read it: its object in that same
    calendar, else only that it is in another calendar."""
    return f"the event {redact_url(other[1])}" if other[0] == place[0] else "an event in another calendar"


def _other_places(where: Mapping[tuple[str, str], object], place: tuple[str, str]) -> str:
    same = sorted({redact_url(href) for url, href in where if url == place[0]})
    others = len({url for url, _ in where if url != place[0]})
    return ", ".join([*same, *([f"{others} other calendar{'s' if others > 1 else ''}"] if others else [])])


def _static_problem(booking: Booking, *, calendars: Mapping[str, CalendarConfig],
                    hosts: Mapping[str, frozenset[int]], config: Config,
                    templates: Collection[str], where: str, placed: Placement | None = None,
                    one_machine: bool = True, runs: bool = False) -> str | tuple[int, int]:
    """What is wrong with a booking on its own, before looking at other bookings; else its shape
    (how many nodes, how many GPUs on each). A cluster booking that runs (`placed`) has the shape
    it runs with, whatever its nodes offer now (a node silent for a moment ends no booking). A
    booking of a user who left the directory's group runs on only if it `runs`."""
    user = config.users.get(booking.user)
    if user is None:
        return f"{booking.user!r} is not a known user of {where}"
    if (left := config.departed_users.get(user.name)) is not None and not runs:
        return (f"{user.name} is no longer among the bookers of {where} (not in the directory's group since "
                f"{left.astimezone(ZoneInfo(config.host.timezone)):%Y-%m-%d %H:%M %Z}); only a booking that was "
                "running then runs on, to its end")
    if booking.template not in templates:
        known = ", ".join(sorted(templates)) or "none"
        return f"there is no template {booking.template!r} on {where} ({known})"
    if not any(fnmatch.fnmatchcase(booking.template, pattern) for pattern in user.templates):
        allowed = ", ".join(user.templates)
        return f"{user.name} may not use template {booking.template!r} (allowed: {allowed})"
    calendar = calendars.get(booking.calendar_url)
    if calendar is None:
        return f"the calendar {redact_url(booking.calendar_url)} is not configured on {where}"
    if (most := config.policy_for(user.name).max_gpus) and booking.gpu_count > most:
        return f"{user.name} may book at most {_gpus_text(most)}; this booking asks for {booking.gpu_count}"
    if one_machine:  # one host then (the plan kept the first)
        shape = _local_shape(booking, calendar, next(iter(hosts.values())), where)
    elif placed:
        shape = (len(placed), len(placed[0][1]))
    else:
        shape = _shape(booking, sorted((len(_owned(calendar, present)) for present in hosts.values()), reverse=True))
    if isinstance(shape, str):
        return shape
    hours = (booking.end - booking.start) / timedelta(hours=1)
    if hours > config.defaults.max_hours:
        return (f"the booking lasts {hours:g} hours; bookings may last at most "
                f"{config.defaults.max_hours:g} hours")
    return shape


def _local_shape(booking: Booking, calendar: CalendarConfig, present: frozenset[int],
                 where: str) -> str | tuple[int, int]:
    """One machine: the booking's GPUs must be there, and booked through its calendar."""
    owned = _owned(calendar, present)
    if (booking.nodes or 1) > 1:
        return (f"nodes: {booking.nodes} asks for {booking.nodes} machines; {where} is one machine "
                "(a booking spans nodes on a Slurm cluster)")
    if booking.gpu_indices is not None:
        for index in booking.gpu_indices:
            if index not in present:
                return f"GPU {index} is not present on {where} ({_list_text(present)})"
            if index not in owned:
                return f"GPU {index} is not booked through this calendar ({_list_text(owned)})"
    elif booking.gpu_count > len(owned):
        return (f"this calendar books {_gpus_text(len(owned))} of {where} "
                f"({_list_text(owned)}); this booking asks for {booking.gpu_count}")
    return (1, booking.gpu_count)


def _shape(booking: Booking, sizes: Sequence[int]) -> str | tuple[int, int]:
    """A cluster booking's nodes and GPUs on each, given each node's GPUs for its calendar (largest
    first): `nodes: K` spreads its GPUs evenly; without it, the fewest nodes its GPUs fit on."""
    count, largest = booking.gpu_count, (sizes[0] if sizes else 0)
    if booking.nodes is not None:
        per, nodes = count // booking.nodes, booking.nodes
        fitting = sum(1 for size in sizes if size >= per)
        if fitting < nodes:
            return (f"the booking asks for {nodes} nodes with {_gpus_text(per)} each; the cluster has "
                    f"{fitting} such node{'' if fitting == 1 else 's'}")
        return (nodes, per)
    for nodes in range(1, len(sizes) + 1):
        per = count // nodes
        if count % nodes == 0 and per <= largest and sum(1 for size in sizes if size >= per) >= nodes:
            return (nodes, per)
    return (f"the booking asks for {_gpus_text(count)}; the cluster's nodes have at most {largest} each and "
            f"{sum(sizes)} together, and they cannot be spread evenly over its nodes")


def _owned(calendar: CalendarConfig, present: frozenset[int]) -> tuple[int, ...]:
    return tuple(sorted(present if calendar.gpus is None else present & set(calendar.gpus)))


def _held(booking: Booking, slots: Mapping[SeenKey, Slot]) -> bool:
    """Whether gpubook accepted the booking before, at the slot it asks for now."""
    record = slots.get(seen_key(booking))
    return record is not None and record.accepted_at is not None


def _priority(booking: Booking, running: Mapping[str, tuple[int, ...]],
              slots: Mapping[SeenKey, Slot], shares: Mapping[str, float]) -> tuple[Any, ...]:
    # Every field takes part so that equal keys only come from equal bookings: input order can
    # never decide. Accepted bookings keep the order gpubook gave them (time, then rank in that
    # pass); among the new requests, the project that used the least of its share goes first (the
    # fair-share tie-break, docs/guides/operate.md), then CREATED and DTSTAMP (see the docstring).
    # Standbys then wait in the order gpubook saw them ask (their slot's seen_at, never a client's
    # stamp), ahead of every other new request: a later request never overtakes an earlier standby.
    record = slots.get(seen_key(booking))
    held = (record.accepted_at, record.rank) if record is not None and record.accepted_at is not None else (_LATEST, 0)
    queued = record.seen_at if booking.standby and record is not None and record.accepted_at is None else _LATEST
    share = shares.get(booking.project, 0.0) if booking.project is not None else 0.0
    return (booking.id not in running, *held, queued, share, booking.created or _LATEST,
            booking.dtstamp or _LATEST, booking.uid, booking.start, *_order(booking))


def _order(item: Booking | Rejection) -> tuple[Any, ...]:
    if isinstance(item, Booking):
        return (item.start, item.id, item.end, item.calendar_url, item.href, item.user,
                item.template, item.gpu_count, item.gpu_indices or (), item.summary, item.project or "")
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


def _kept(booking: Booking, placement: Placement, busy: Mapping[str, Mapping[int, _Timeline]]) -> Placement | None:
    """A running booking keeps its nodes and GPUs while they still match what it asks for."""
    if not placement or not all(gpus for _, gpus in placement):
        return None
    placement = tuple((name, tuple(sorted(gpus))) for name, gpus in placement)
    if sum(len(gpus) for _, gpus in placement) != booking.gpu_count:
        return None
    if booking.gpu_indices is not None and (len(placement) != 1 or booking.gpu_indices != placement[0][1]):
        return None
    if booking.nodes is not None and booking.nodes != len(placement):
        return None
    for name, gpus in placement:
        timelines = busy.get(name, {})
        if any(gpu in timelines and timelines[gpu].taken(booking) for gpu in gpus):
            return None
    return placement


def _held_placement(booking: Booking, record: Slot | None, owned: Mapping[str, tuple[int, ...]],
                    busy: Mapping[str, Mapping[int, _Timeline]]) -> Placement | None:
    """An accepted booking keeps the GPUs it was given while they are still its calendar's and
    free: a booking ahead of it that went away moves nobody behind it."""
    if record is None or record.accepted_at is None or \
            not all(set(gpus) <= set(owned.get(name, ())) for name, gpus in record.placement):
        return None
    return _kept(booking, record.placement, busy)


def _place(booking: Booking, shape: tuple[int, int], owned: Mapping[str, tuple[int, ...]],
           busy: Mapping[str, Mapping[int, _Timeline]], host_tz: tzinfo) -> Placement | str:
    """The first nodes (inventory order) with the GPUs free for the booking's whole time, or why none."""
    nodes, per = shape
    found: list[tuple[str, tuple[int, ...]]] = []
    first_reason = ""
    for name, gpus in owned.items():
        if len(gpus) < per:
            continue
        chosen = _choose(booking, gpus, busy[name], host_tz, count=per)
        if isinstance(chosen, str):
            first_reason = first_reason or (chosen if len(owned) == 1 else f"{name}: {chosen}")
            continue
        found.append((name, chosen))
        if len(found) == nodes:
            return tuple(found)
    if len(owned) == 1:
        return first_reason
    if nodes == 1:
        return f"no node of the cluster has {_gpus_text(per)} free at that time ({first_reason})"
    return (f"only {len(found)} of the {nodes} nodes asked for have {_gpus_text(per)} free at that time "
            f"({first_reason})")


def _choose(booking: Booking, owned: tuple[int, ...], busy: Mapping[int, _Timeline],
            host_tz: tzinfo, *, count: int) -> tuple[int, ...] | str:
    """Concrete GPUs for a booking (`count` of them on this host), or the reason none can be given."""
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
            if booking.gpu_indices is None and len(free) == count:
                return tuple(free)  # the lowest free ones: the rest need not be looked at
    if booking.gpu_indices is not None and not blocked:
        return tuple(free)
    # The refusal is written into the refused event: another calendar's booker is not named there
    # (per-user calendars; round 3, L4), one in the same calendar (whose writers all see it) is.
    named = "; ".join(f"GPU {gpu} is booked{_by(other, booking)} {_when(other, host_tz)}"
                      for gpu in blocked[:3] if (other := busy[gpu].first_conflict(booking)) is not None)
    more = f" and {len(blocked) - 3} more" if len(blocked) > 3 else ""
    if booking.gpu_indices is None:
        return f"{_how_many_free(len(free), count)} at that time: {named}{more}"
    return f"the GPUs asked for are taken: {named}{more}"


def _how_many_free(free: int, count: int) -> str:
    """"only 1 of the 2 GPUs asked for is free", in words a booker reads (not "only 0 of the 1")."""
    if count == 1:
        return "the GPU asked for is not free"
    if free == 0:
        return f"none of the {count} GPUs asked for is free"
    return f"only {free} of the {count} GPUs asked for {'is' if free == 1 else 'are'} free"


def _by(other: Booking, booking: Booking) -> str:
    return f" by {other.user}" if other.calendar_url == booking.calendar_url else ""


class _Offers:
    """The next free slots that fit a refused booking's request, added to its reason: the same
    GPUs it could have (its calendar's, or those it named), as many, for as long, from its own
    start on. Searches are remembered by request and bounded in number, so that a calendar of
    thousands of clashing copies costs a bounded time."""

    SEARCHES = 1024  # distinct requests searched in one plan; a refusal past them names no slot

    def __init__(self, finder: free.Finder, *, config: Config, now: datetime, zone: tzinfo, one_host: bool) -> None:
        self.finder, self.config, self.now, self.zone, self.one_host = finder, config, now, zone, one_host
        self.known: dict[tuple[Any, ...], str] = {}

    def add_to(self, reason: str, booking: Booking, shape: tuple[int, int],
               owned: Mapping[str, tuple[int, ...]]) -> str:
        offer = self.offer(booking, shape, owned)
        return f"{reason}; {offer}" if offer else reason

    def offer(self, booking: Booking, shape: tuple[int, int], owned: Mapping[str, tuple[int, ...]]) -> str:
        nodes, per = shape
        exact = booking.gpu_indices is not None
        among = {next(iter(owned)): booking.gpu_indices} if booking.gpu_indices is not None else \
            {name: gpus for name, gpus in owned.items() if len(gpus) >= per}
        duration = booking.end - booking.start
        # A slot further ahead than the booker may book would be refused in its turn: none is named.
        days = policy.limits(self.config, booking.user).max_days_ahead
        last_start = self.now + timedelta(days=days) if days is not None else None
        key = (tuple(among.items()), per, nodes, exact, duration, booking.start, last_start)
        if key not in self.known:
            if len(self.known) >= self.SEARCHES:
                return ""
            request = free.Request(among=among, count=per, duration=duration, nodes=nodes, exact=exact)
            found = self.finder.next_slots(request, after=booking.start, not_before=self.now, last_start=last_start)
            # Without the horizon's own time: the sentence stays the same from pass to pass.
            days = (self.finder.horizon - self.now).days
            self.known[key] = free.describe(found, zone=self.zone, now=self.now, one_host=self.one_host) \
                if found else f"no such slot is free in the {days} days ahead that gpubook reads"
        return self.known[key]


def _overlaps(a: Booking, b: Booking) -> bool:
    return a.start < b.end and b.start < a.end


def _when(booking: Booking, host_tz: tzinfo) -> str:
    return _span(booking.start, booking.end, host_tz)


@functools.lru_cache(maxsize=4096)  # a busy GPU's holder is named in many rejections
def _span(start: datetime, end: datetime, host_tz: tzinfo) -> str:
    start, end = start.astimezone(host_tz), end.astimezone(host_tz)
    until = f"{end:%H:%M}" if end.date() == start.date() else f"{end:%Y-%m-%d %H:%M}"
    return f"from {start:%Y-%m-%d %H:%M} to {until} ({start:%Z})"


STANDBY = "on standby, waiting for its GPUs to free up: "  # the head of a waiting standby's reason


def _rejection(booking: Booking, reason: str, *, waits: bool = False) -> Rejection:
    """`waits`: a standby refused only for GPUs taken or a quota spent, which waits instead (its
    reason says so; it stays in every plan, and is accepted in the first one with room for it)."""
    return Rejection(id=booking.id, uid=booking.uid, start=booking.start, end=booking.end,
                     reason=STANDBY + reason if waits else reason, user=booking.user,
                     calendar_url=booking.calendar_url, href=booking.href, summary=booking.summary, standby=waits)


def _gpus_text(count: int) -> str:
    return f"{count} GPU" if count == 1 else f"{count} GPUs"


def _list_text(gpus: Collection[int]) -> str:
    if not gpus:
        return "it has no GPU"
    return "GPU " + ", ".join(str(g) for g in sorted(gpus)) if len(gpus) == 1 else \
        "GPUs " + ", ".join(str(g) for g in sorted(gpus))
