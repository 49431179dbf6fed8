"""Desired containers (the plan at time t) against actual ones (the engine's labels) → actions.

`decide` is pure: plain data in, a list of frozen actions out, in the order they must be applied
(clear dead leftovers, stop, start, warn; holds and rechecks only inform). It is level-triggered:
applying its actions and calling it again with the new actual state yields no further change, and
calling it twice on the same input gives the same list. What cannot be read from the engine (a
warning already given, how often a booking's container died) comes in as `Memory`, read from
State by the apply stage (gpubook/scheduler/apply/memory.py).

Rules, in the words a booker would use:

- A booking runs from its start to its end. Its container is found by booking id, never by spec
  hash: a running booking whose GPUs or template were edited keeps its container (the change takes
  effect at the next booking; `pin_running` says so).
- At the warning time the booker is warned once; at the end the container stops.
- End moved earlier past the warning time, or event deleted (or the booking no longer accepted)
  while it runs: warn now, give `Policy.notice`, then stop.
- Moved to a later time while it runs (its new start is after now): the running occurrence ends
  (warn now, stop after `Policy.notice`, never after its old end) and the booking starts again at
  its new time; until then it holds no GPU (`pin_running` does not count it as running).
- A gpubook container whose booking gpubook never knew (another host's config, a lost database)
  is left alone until the end written in its labels.
- A container that died during its booking is started again at most `restart_limit` times, with a
  back-off that doubles each time. One stopped by an admin stays stopped.
- Nothing starts from calendar data older than the staleness bound (`may_start=False`, or the
  booking's calendar in `stale_calendars`: one broken calendar stops nothing in the others).
- A container run ahead of its booking's start ("armed", gpubook/scheduler/apply/ahead.py) lets nobody
  in before that start (its entrypoint waits for it). Before the start it is left alone; at the
  start it gets a `Start` (the same spec: the engine keeps it; the SSH probe, the record and the
  write-back follow). One whose booking is gone, moved, or changed (GPUs, template, end, user or
  the booker's SSH keys: the old booker is never let in), or whose calendar data is too old to
  start from, is removed at once (`Disarm`), before its start: nobody can be logged in, so no
  warning is due.
- While some calendar has never been read (`complete=False`), a running booking found in no
  calendar is not taken for deleted: it may be in the unread one; it runs to its labels' end.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from types import MappingProxyType
from zoneinfo import ZoneInfo

from gpubook.runtime.engines.spec import ContainerInfo, container_name
from gpubook.scheduler.core import reclaim
from gpubook.scheduler.core.bookings import Booking, Rejection
from gpubook.scheduler.core.plan import LOCAL, Accepted, Plan

ADMIN_STOP = "stopped by an admin"  # container_stopped reason that keeps a booking from restarting
ENDED = "ended"  # container_stopped reason of a stop at the booking's end
DIED = "died"  # prefix of the reason recorded for a container that died during its booking
_ON_TIME = timedelta(seconds=60)  # a warning this late after its time still counts as on time


# -- actions -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Clear:
    """Remove a dead container's leftover and record why it is gone."""

    name: str
    booking_id: str
    reason: str
    host: str = LOCAL


@dataclass(frozen=True)
class Stop:
    name: str
    booking_id: str
    reason: str  # "ended", "the event was deleted", ...
    grace: float  # seconds between SIGTERM and SIGKILL
    host: str = LOCAL


@dataclass(frozen=True)
class Start:
    accepted: Accepted
    attempt: int = 0  # 0: first start; n: the n-th restart after the container died
    port: int | None = None  # the port its armed container already publishes (None: allocate one)
    armed: str = ""  # the spec hash its armed container runs with ("": none is armed)


@dataclass(frozen=True)
class Disarm:
    """Remove a container run ahead of its booking's start that must not open (nobody is logged in)."""

    name: str
    booking_id: str
    reason: str
    host: str = LOCAL


@dataclass(frozen=True)
class Warn:
    name: str
    booking_id: str
    user: str
    end: datetime | None  # the end warned about; None: the booking is gone from the calendar
    stop_at: datetime  # when the container will be stopped
    reason: str  # "end-near", "end-moved", "gone"
    host: str = LOCAL


@dataclass(frozen=True)
class Hold:
    """A booking that should run but is not started now, and why (logged once)."""

    booking_id: str
    reason: str


@dataclass(frozen=True)
class Recheck:
    """Something is due at `at` that the plan's own boundaries do not cover."""

    at: datetime
    reason: str


Action = Clear | Disarm | Stop | Start | Warn | Hold | Recheck | reclaim.Release | reclaim.IdleNotice
_ORDER = {Clear: 0, Disarm: 0, Stop: 1, reclaim.Release: 1, Start: 2, Warn: 3, reclaim.IdleNotice: 3, Hold: 4,
          Recheck: 5}


# -- what decide needs besides the plan and the engine -----------------------------------------


@dataclass(frozen=True)
class Warned:
    at: datetime
    end: datetime | None  # as in Warn
    stop_at: datetime


@dataclass(frozen=True)
class Runs:
    """A booking's container history from State."""

    restarts: int = 0  # starts after the first
    running: bool = False  # State has an open record (the container should be there)
    last_stopped: datetime | None = None
    last_reason: str | None = None


@dataclass(frozen=True)
class Memory:
    known: frozenset[str] = frozenset()  # bookings gpubook started a container for (a record, or a port held)
    warned: Mapping[str, Warned] = field(default_factory=lambda: MappingProxyType({}))
    runs: Mapping[str, Runs] = field(default_factory=lambda: MappingProxyType({}))
    armed: frozenset[str] = frozenset()  # bookings whose container was run ahead of their start
    released: frozenset[str] = frozenset()  # bookings released as no-shows (gpubook/scheduler/core/reclaim.py)
    idle_told: Mapping[str, frozenset[tuple[int, datetime]]] = field(default_factory=lambda: MappingProxyType({}))
    # ^ booking id → the idle stretches (GPU, since) its booker was told of


@dataclass(frozen=True)
class Policy:
    notice: timedelta = timedelta(minutes=5)  # warning → stop when the end comes early
    stop_grace: float = 10.0  # SIGTERM → SIGKILL, seconds
    restart_limit: int = 3
    restart_backoff: timedelta = timedelta(seconds=10)  # doubled after each restart
    warn_before: timedelta = timedelta(minutes=15)  # for containers with no booking in the plan
    idle_percent: float = 5.0  # [policy] idle_percent, for the idle notices' sentence
    timezone: str = "UTC"  # the host's, for the idle notices' sentence


# -- the decision ------------------------------------------------------------------------------


def decide(plan: Plan, actual: Sequence[ContainerInfo], *, now: datetime, memory: Memory = Memory(),
           policy: Policy = Policy(), may_start: bool = True, stale_reason: str = "",
           stale_calendars: Mapping[str, str] = MappingProxyType({}), complete: bool = True,
           verdicts: Mapping[str, reclaim.Verdict] = MappingProxyType({}),
           held: Mapping[str, str] = MappingProxyType({}),
           bookers: Mapping[str, str] = MappingProxyType({})) -> list[Action]:
    """The actions that bring `actual` to what `plan` wants at `now`, in the order to apply them.

    `stale_calendars`: calendar url → why its bookings do not start now (its data is too old);
    `held`: booking id → why it does not start now (a cluster refused its reservation);
    `complete`: every calendar was read at least once (see the module docstring); `verdicts`:
    the no-show and idle judge's, by booking id (gpubook/scheduler/core/reclaim.py); `bookers`:
    booking id → who its container would let in now (`booker_digest` of the booker's account and
    keys), which an armed container must match (missing: only its user is compared)."""
    wanted = {a.booking.id: a for a in plan.accepted}
    actions: list[Action] = []
    present: dict[str, ContainerInfo] = {}
    for info in sorted(actual, key=lambda i: (i.booking_id, i.name)):
        if not info.booking_id:
            continue
        accepted = wanted.get(info.booking_id)
        if _armed(info, now=now, memory=memory):
            stale = stale_calendars.get(accepted.booking.calendar_url) if accepted else None
            found = _armed_actions(info, accepted, now=now, may_start=may_start and stale is None,
                                   booker=bookers.get(info.booking_id))
        else:
            found = _container_actions(info, accepted, now=now, memory=memory, policy=policy, complete=complete)
        if not any(isinstance(a, Disarm) for a in found):  # a disarmed booking may start the normal way
            present[info.booking_id] = info
        actions.extend(replace(a, host=_host(info)) if isinstance(a, Clear | Disarm | Stop | Warn) else a
                       for a in found)
    stopping = {a.booking_id for a in actions if isinstance(a, Stop | Clear | Disarm)}
    if verdicts:
        actions.extend(_reclaim_actions(verdicts, present, wanted, stopping, now=now, memory=memory, policy=policy))
        stopping |= {a.booking_id for a in actions if isinstance(a, reclaim.Release)}
    busy = {(host, gpu): info.booking_id for info in present.values()
            if info.running and info.booking_id not in stopping
            for host, gpus in ((_host(info), info.gpus), *info.others) for gpu in gpus}
    for accepted in plan.accepted:
        if accepted.booking.id not in present:
            stale = held.get(accepted.booking.id) or stale_calendars.get(accepted.booking.calendar_url)
            actions.extend(_start_actions(accepted, now=now, memory=memory, policy=policy, busy=busy,
                                          may_start=may_start and stale is None,
                                          stale_reason=stale or stale_reason))
    actions = [a for a in actions if not (isinstance(a, Warn) and a.booking_id in stopping)]
    return sorted(actions, key=lambda a: _ORDER[type(a)])


def _reclaim_actions(verdicts: Mapping[str, reclaim.Verdict], present: Mapping[str, ContainerInfo],
                     wanted: Mapping[str, Accepted], stopping: set[str], *, now: datetime, memory: Memory,
                     policy: Policy) -> list[Action]:
    """Releases and idle notices, for the bookings that run in their time and are not stopping."""
    running = {booking_id: (info, wanted[booking_id].booking) for booking_id, info in present.items()
               if info.running and booking_id in wanted and booking_id not in stopping
               and not _armed(info, now=now, memory=memory)
               and wanted[booking_id].booking.start <= now < wanted[booking_id].booking.end}
    found = reclaim.actions(verdicts, running, told=memory.idle_told, percent=policy.idle_percent,
                            zone=ZoneInfo(policy.timezone), now=now, grace=policy.stop_grace)
    return [Recheck(*item) if isinstance(item, tuple) else item for item in found]


def _armed(info: ContainerInfo, *, now: datetime, memory: Memory) -> bool:
    """A container run ahead of its booking's start whose start is not recorded yet."""
    runs = memory.runs.get(info.booking_id)
    if runs is not None and runs.running:
        return False
    return (info.start is not None and info.start > now) or info.booking_id in memory.armed


def _armed_actions(info: ContainerInfo, accepted: Accepted | None, *, now: datetime,
                   may_start: bool, booker: str | None = None) -> list[Action]:
    """An armed container: left alone until its start, then started (recorded, probed); removed at
    once when it no longer fits its booking. Its SSH is closed until the start, so no warning.
    Another booker (user, ids or keys) is removed before the start too: the armed container would
    open at the start for the old one (its entrypoint opens by itself) until its start replaced it."""
    def disarm(reason: str) -> list[Action]:
        return [Disarm(info.name, info.booking_id, reason)]

    if accepted is None:
        return disarm("its booking is gone before its start")
    booking = accepted.booking
    if not info.running:
        return disarm(f"its container, run ahead of its start, was {info.state}")
    if info.start != booking.start:
        return disarm("its booking was moved to another start")
    if info.gpus != accepted.gpus or info.template != booking.template or info.end != booking.end:
        return disarm("its booking's GPUs, template or end changed before its start")
    if info.user != booking.user or (booker is not None and info.booker != booker):
        return disarm("its booking's user or SSH keys changed before its start")
    if not may_start:  # before its start too: it would open by itself at the start
        return disarm("the calendar data is too old to start anything from")
    if now < booking.start:
        return [Recheck(booking.start, f"start of {booking.id}")]
    if now >= booking.end:
        return disarm("its booking ended before it was started")
    return [Start(accepted, port=info.port, armed=info.spec_hash)]


def _container_actions(info: ContainerInfo, accepted: Accepted | None, *, now: datetime,
                       memory: Memory, policy: Policy, complete: bool = True) -> list[Action]:
    if not info.running:
        runs = memory.runs.get(info.booking_id)
        if accepted is None or now >= accepted.booking.end:
            return [Clear(info.name, info.booking_id, f"its container was {info.state}")]
        if runs is not None and not runs.running:
            # State closed its run before the container went (an admin's `gpubook stop` caught
            # between its stop and its removal): a leftover to remove, not a death to restart.
            return [Clear(info.name, info.booking_id, f"its container was {info.state} after {runs.last_reason}")]
        return [Clear(info.name, info.booking_id, f"{DIED}: the container was {info.state}"),
                _restart_check(info.booking_id, now=now, memory=memory, policy=policy)]
    if info.booking_id in memory.released:  # its release was recorded and its stop failed: stop it now
        return [Stop(info.name, info.booking_id, f"{reclaim.RELEASED} as a no-show", policy.stop_grace)]
    if accepted is not None and _moved_later_than(info, accepted.booking, now):
        return _moved_later(info, accepted.booking.end, now=now, memory=memory, policy=policy)
    if accepted is not None:
        return _ending(info, accepted.booking.end, accepted.warn_at, now=now, memory=memory, policy=policy,
                       moved=info.end is not None and accepted.booking.end < info.end)
    if info.booking_id in memory.known and complete:
        return _gone(info, now=now, memory=memory, policy=policy)
    # Not ours to judge: stop it only after the end its labels carry.
    if info.end is None or now >= info.end:
        return [Stop(info.name, info.booking_id, "it has no booking here and its end has passed",
                     policy.stop_grace)]
    return [Recheck(info.end, f"end of unknown container {info.name}")]


def _ending(info: ContainerInfo, end: datetime, warn_at: datetime, *, now: datetime, memory: Memory,
            policy: Policy, moved: bool) -> list[Action]:
    warned = memory.warned.get(info.booking_id)
    if warned is not None and warned.end == end:
        if now >= warned.stop_at:
            return [Stop(info.name, info.booking_id, ENDED, policy.stop_grace)]
        return [Recheck(warned.stop_at, f"stop of {info.booking_id}")]
    if now < warn_at:
        return []
    on_time = now <= warn_at + _ON_TIME or not moved
    stop_at = end if on_time else max(end, now + policy.notice)
    actions: list[Action] = [Warn(info.name, info.booking_id, info.user, end, stop_at,
                                  "end-moved" if moved else "end-near")]
    if now >= stop_at:
        actions.append(Stop(info.name, info.booking_id, ENDED, policy.stop_grace))
    else:
        actions.append(Recheck(stop_at, f"stop of {info.booking_id}"))
    return actions


def _gone(info: ContainerInfo, *, now: datetime, memory: Memory, policy: Policy) -> list[Action]:
    """The booking of a running container is no longer in the plan: deleted, or not accepted now."""
    warned = memory.warned.get(info.booking_id)
    if warned is not None and warned.end is None:
        if now >= warned.stop_at:
            return [Stop(info.name, info.booking_id, "its booking is gone from the calendar",
                         policy.stop_grace)]
        return [Recheck(warned.stop_at, f"stop of {info.booking_id}")]
    stop_at = now + policy.notice
    if warned is not None:
        stop_at = min(stop_at, max(now, warned.stop_at))
    return [Warn(info.name, info.booking_id, info.user, None, stop_at, "gone"),
            Recheck(stop_at, f"stop of {info.booking_id}")]


def _moved_later(info: ContainerInfo, end: datetime, *, now: datetime, memory: Memory,
                 policy: Policy) -> list[Action]:
    """The booking of a running container now starts later: this occurrence of it is over."""
    warned = memory.warned.get(info.booking_id)
    if warned is not None and warned.end == end:
        if now >= warned.stop_at:
            return [Stop(info.name, info.booking_id, "the booking was moved to a later time", policy.stop_grace)]
        return [Recheck(warned.stop_at, f"stop of {info.booking_id}")]
    stop_at = now + policy.notice
    if info.end is not None:  # never past the end it was started with
        stop_at = min(stop_at, max(now, info.end))
    return [Warn(info.name, info.booking_id, info.user, end, stop_at, "moved"),
            Recheck(stop_at, f"stop of {info.booking_id}")]


def _restart_check(booking_id: str, *, now: datetime, memory: Memory, policy: Policy) -> Recheck:
    runs = memory.runs.get(booking_id, Runs())
    return Recheck(now + policy.restart_backoff * (2 ** runs.restarts), f"restart of {booking_id}")


def _start_actions(accepted: Accepted, *, now: datetime, memory: Memory, policy: Policy,
                   busy: dict[tuple[str, int], str], may_start: bool, stale_reason: str) -> list[Action]:
    booking = accepted.booking
    if not booking.start <= now < booking.end:
        return []
    runs = memory.runs.get(booking.id)
    attempt = 0
    if runs is not None and runs.last_stopped is not None and runs.last_stopped < booking.start \
            and runs.last_reason != ADMIN_STOP:
        runs = None  # those runs were of an earlier time of this booking (it was moved later)
    if runs is not None and runs.running:
        # State says it runs, the engine lists nothing: it vanished. Record that first.
        return [Clear(container_name(booking.id), booking.id, f"{DIED}: the container vanished", accepted.host),
                _restart_check(booking.id, now=now, memory=memory, policy=policy)]
    if runs is not None and runs.last_reason == ENDED:
        # Stopped at its end, and its end has not come: the wall clock stepped forward past it and
        # back, or the end moved later since. Due again: it starts (its outputs were kept).
        runs = None
    if runs is not None and runs.last_reason is not None:
        if not runs.last_reason.startswith(DIED):
            return []  # stopped on purpose (an admin, a release, a move): stays stopped
        if runs.restarts >= policy.restart_limit:
            return [Hold(booking.id, f"its container died {runs.restarts + 1} times; not starting it again")]
        due = (runs.last_stopped or now) + policy.restart_backoff * (2 ** runs.restarts)
        if now < due:
            return [Hold(booking.id, f"its container died; starting it again at {due:%H:%M:%S}"),
                    Recheck(due, f"restart of {booking.id}")]
        attempt = runs.restarts + 1
    if not may_start:
        return [Hold(booking.id, stale_reason or "the calendar data is too old to start anything from")]
    places = [(host, gpu) for host, gpus in accepted.placement for gpu in gpus]
    holders = sorted({busy[place] for place in places if place in busy and busy[place] != booking.id})
    if holders:
        return [Hold(booking.id, f"GPU {', '.join(map(str, accepted.gpus))} still used by {', '.join(holders)}"),
                Recheck(now + timedelta(seconds=2), f"start of {booking.id}")]
    for place in places:
        busy[place] = booking.id
    return [Start(accepted, attempt)]


def _moved_later_than(info: ContainerInfo, booking: Booking, now: datetime) -> bool:
    """A running container's booking now starts after `now`, and the container was started for
    another start: the booking was moved later. One started for this very start while `now` is
    before it means the wall clock stepped back: it goes on."""
    return booking.start > now and info.start != booking.start


def _host(info: ContainerInfo) -> str:
    return info.host or LOCAL


# -- before planning: running bookings keep what they run with ---------------------------------


@dataclass(frozen=True)
class Pinned:
    occurrences: tuple[Booking | Rejection, ...]
    notes: Mapping[str, str]  # booking id → a sentence for its event
    running: Mapping[str, tuple[int, ...]] = field(default_factory=lambda: MappingProxyType({}))
    # ^ booking id → GPUs, of the bookings that run now in their booked time: the plan's `running`


def pin_running(occurrences: Sequence[Booking | Rejection], actual: Sequence[ContainerInfo], *,
                now: datetime | None = None) -> Pinned:
    """Give each running booking the GPUs and template its container runs with, noting edits.

    A booking whose container runs but whose start is now after `now` was moved to a later time:
    it is not pinned and does not count as running (its container is stopped by `decide`), so at
    its new time it competes like any other booking and keeps no GPU in between."""
    running = {i.booking_id: i for i in actual if i.running and i.booking_id}
    result: list[Booking | Rejection] = []
    notes: dict[str, str] = {}
    held: dict[str, tuple[int, ...]] = {}
    for item in occurrences:
        info = running.get(item.id) if isinstance(item, Booking) else None
        if info is None or not isinstance(item, Booking) or (now is not None and _moved_later_than(info, item, now)):
            result.append(item)
            continue
        held[item.id] = info.gpus
        pinned = item
        changed = []
        total = len(info.gpus) + sum(len(gpus) for _, gpus in info.others)
        if info.gpus and (item.gpu_indices not in (None, info.gpus) or item.gpu_count != total
                          or (info.others and item.nodes not in (None, 1 + len(info.others)))):
            changed.append("GPUs")
        if info.others:  # a multi-node booking keeps its nodes (the plan's `placed`) and its count
            pinned = replace(pinned, gpu_indices=None, gpu_count=total, nodes=1 + len(info.others))
        elif info.gpus:
            pinned = replace(pinned, gpu_indices=info.gpus, gpu_count=len(info.gpus))
        if info.template and item.template != info.template:
            changed.append("template")
            pinned = replace(pinned, template=info.template)
        if changed:
            notes[item.id] = (f"the change of {' and '.join(changed)} takes effect at the next booking; "
                              f"this one keeps running with GPU {','.join(map(str, info.gpus)) or '-'} "
                              f"and template {info.template}")
        result.append(pinned)
    return Pinned(tuple(result), notes, MappingProxyType(held))


def plan_with_extensions(occurrences: Sequence[Booking | Rejection], *, agreed_ends: Mapping[str, datetime],
                         plan: Callable[[Sequence[Booking | Rejection]], Plan],
                         describe: Callable[[datetime], str] = lambda t: t.isoformat()
                         ) -> tuple[Plan, dict[str, datetime], dict[str, str]]:
    """Plan, letting a running booking's end move later only where that takes nobody's slot.

    `agreed_ends` holds each running booking's end as last agreed (its label, or an extension
    granted earlier). Returns the plan, the new agreed ends and a note per refused extension.
    """
    later = {b.id: b for b in occurrences
             if isinstance(b, Booking) and b.id in agreed_ends and b.end > agreed_ends[b.id]}
    if not later:
        return plan(occurrences), {}, {}
    clamped = [replace(b, end=agreed_ends[b.id]) if isinstance(b, Booking) and b.id in later else b
               for b in occurrences]
    best = plan(clamped)
    granted: dict[str, datetime] = {}
    notes: dict[str, str] = {}
    for booking_id, booking in sorted(later.items()):
        trial_input = [booking if isinstance(b, Booking) and b.id == booking_id else b for b in clamped]
        trial = plan(trial_input)
        before = {a.booking.id for a in best.accepted}
        after = {a.booking.id for a in trial.accepted}
        if before <= after:
            clamped, best = trial_input, trial
            granted[booking_id] = booking.end
        else:
            lost = sorted(before - after)
            notes[booking_id] = (f"the end was not moved to {describe(booking.end)}: the GPUs are booked "
                                 f"then ({', '.join(lost)}); this booking still ends at "
                                 f"{describe(agreed_ends[booking_id])}")
    return best, granted, notes
