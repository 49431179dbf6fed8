"""Decided actions that keep gpubook's memory in step with what runs and what is due: adopt, extend,
remind. Pure like decide.py (plain data in, frozen actions out); the apply stage's handlers record
them (gpubook/scheduler/apply/handlers.py), before decide() runs, since decide reads what they record.

- A running container of an accepted booking that State has no record of (a lost database) is
  adopted, unless its record is closed (it is being stopped: an admin's `gpubook stop` records the
  stop before the container goes, and adopting it would turn that stop into a death and a
  restart), its start is still at work (the start records it when its probe answers, and a failed
  start is no death), or it is armed (run ahead of its start: its start probes its SSH and records it).
- A running booking's end moved later, where that takes nobody's slot (`plan_with_extensions`), is
  agreed: the agreed end is what the next passes plan with.
- An accepted booking is reminded `minutes` before its start, once per start (moved to another start,
  it is reminded again); a reminder whose start already came is not sent.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from gpubook.runtime.engines.spec import ContainerInfo
from gpubook.scheduler.core.plan import Accepted, Plan


@dataclass(frozen=True)
class Adopt:
    """Record a running container found by its labels (its run, and the port it publishes)."""

    booking_id: str
    name: str
    user: str
    gpu_count: int
    port: int | None


@dataclass(frozen=True)
class Extend:
    """Agree a running booking's later end."""

    booking_id: str
    end: datetime


@dataclass(frozen=True)
class Remind:
    """Queue the reminder notice of an accepted booking's start."""

    accepted: Accepted

    @property
    def booking_id(self) -> str:
        return self.accepted.booking.id


Upkeep = Adopt | Extend | Remind


def adoptions(plan: Plan, actual: Sequence[ContainerInfo], *, recorded: Collection[str],
              busy: Collection[str], now: datetime) -> list[Adopt]:
    """`recorded`: the container names State has a record of (open or closed); `busy`: the bookings
    whose start (or arm) is at work, or that are armed."""
    wanted = {a.booking.id for a in plan.accepted} - set(busy)
    return [Adopt(info.booking_id, info.name, info.user, len(info.gpus), info.port) for info in actual
            if info.running and info.booking_id in wanted and info.name not in recorded
            and not (info.start is not None and info.start > now)]  # armed, its note lost: left until its start


def extensions(granted: Mapping[str, datetime]) -> list[Extend]:
    """The later ends `plan_with_extensions` granted, in booking order."""
    return [Extend(booking_id, end) for booking_id, end in sorted(granted.items())]


def reminders(plan: Plan, *, reminded: Mapping[str, datetime], minutes: Callable[[str], float],
              now: datetime) -> tuple[list[Remind], datetime | None]:
    """The reminders due now, and when the next one is due (None: none ahead). `reminded`: booking
    id → the start it was reminded of; `minutes`: a booker's minutes before the start (0: none)."""
    due: list[Remind] = []
    ahead: list[datetime] = []
    for accepted in plan.accepted:
        booking = accepted.booking
        before = minutes(booking.user)
        if before <= 0 or now >= booking.start or reminded.get(booking.id) == booking.start:
            continue
        at = booking.start - timedelta(minutes=before)
        if at > now:
            ahead.append(at)
        else:
            due.append(Remind(accepted))
    return due, min(ahead, default=None)
