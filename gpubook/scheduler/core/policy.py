"""Quotas: how much one user may book, decided in the plan's order from plain data (no I/O, no clock).

The plan hands bookings to a `Ledger` in its deterministic priority order (running first, then the
order gpubook first saw them); the ledger says why a booking is over one of its user's quotas, or
records it once the plan accepted it. So the booking that came first keeps its place, and the one
that would go over is rejected with the numbers.

The rolling week: for every booking of a user, the GPU-hours of that user's accepted bookings inside
the 7 days (168 real hours) that end at that booking's end must stay within `week_gpu_hours`. A
new booking is accepted only if its own week and the week of each of the user's accepted bookings
that it reaches into stay within it. GPU-hours are GPUs times real elapsed hours (times are UTC,
so a week across a change of daylight saving time is still 168 hours, a 10:00-14:00 booking 4).

A running booking is never rejected by a quota (a quota never stops a running container); it
counts. Every other booking, past ones included, is judged in the order above, so with an
unchanged config the same bookings pass on every poll. When an admin lowers a quota, the running
bookings keep running and the others are judged again in that order: what no longer fits is
rejected (a booking that ended is then no longer counted; rejections of ended bookings are not
written back).

GPUs at once (`max_gpus`): at no moment may the user's accepted bookings hold more GPUs together; a
booking asking for more on its own is refused by the plan before it gets here.

Groups as projects: a booking counts against its project (`Booking.project`, a [groups.NAME]) as
well as its user, and each group has the same quotas over every booking of the group (`week_gpu_hours`,
`max_gpus`, `max_future_bookings`; no `max_days_ahead`). A booking must fit both; the refusal names
every limit it is over, the user's first ("group vision has 38 of 40 GPU-hours in the week before this
booking ends; this booking needs 4"). A running booking counts against its group as against its user.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta, tzinfo

from gpubook.scheduler.core.bookings import Booking
from gpubook.scheduler.settings import Config

WEEK = timedelta(days=7)
# How far back the daemon reads when a week quota is set: a booking's week reaches a week back, and
# whether the bookings in it were accepted depends on their own weeks, another week back.
WEEK_REACH = 2 * WEEK
_HOUR = timedelta(hours=1)


@dataclass(frozen=True)
class Limits:
    """One user's or group's quotas; None: no limit."""

    week_gpu_hours: float | None = None
    max_days_ahead: float | None = None
    max_future_bookings: int | None = None
    max_gpus: int | None = None


def limits(config: Config, user: str) -> Limits:
    """The user's quotas (their effective policy, resolved when the config was read); 0 means no limit."""
    own = config.policy_for(user)
    return Limits(week_gpu_hours=own.week_gpu_hours or None, max_days_ahead=own.max_days_ahead or None,
                  max_future_bookings=int(own.max_future_bookings) or None, max_gpus=int(own.max_gpus) or None)


def group_limits(config: Config, group: str) -> Limits:
    """A group's quotas ([groups.NAME]; none for a name that is not one); 0 means no limit."""
    own = config.groups.get(group)
    if own is None:
        return Limits()
    return Limits(week_gpu_hours=own.week_gpu_hours or None, max_future_bookings=own.max_future_bookings or None,
                  max_gpus=own.max_gpus or None)


def any_week_quota(config: Config) -> bool:
    return bool(config.policy.week_gpu_hours) or any(p.week_gpu_hours for p in config.policies.values()) \
        or any(g.week_gpu_hours for g in config.groups.values())


def reach_back(config: Config) -> timedelta:
    """How far before `now` the daemon must read bookings: the longest booking, plus the reach of
    the week quota where one is set."""
    longest = timedelta(hours=config.defaults.max_hours)
    return longest + WEEK_REACH if any_week_quota(config) else longest


def reach_ahead(config: Config) -> timedelta:
    """How far after `now` the daemon reads bookings: a week, or a day past the longest
    `max_days_ahead` set, so a booking made further ahead than allowed is seen (and refused with
    the reason) rather than unseen until it comes within the week, when it would pass."""
    days = [config.policy.max_days_ahead, *(p.max_days_ahead for p in config.policies.values())]
    return max(WEEK, timedelta(days=max(days) + 1))


@dataclass(frozen=True)
class _Held:
    start: datetime
    end: datetime
    gpus: int

    def within(self, since: datetime, until: datetime) -> timedelta:
        """GPU-time of this booking between `since` and `until`."""
        overlap = min(self.end, until) - max(self.start, since)
        return overlap * self.gpus if overlap > timedelta(0) else timedelta(0)


@dataclass(frozen=True)
class _Holder:
    """Whose quotas a check is about, as its sentence names them."""

    name: str  # "alice", or "group vision"
    their: str  # "their", or "the group's"
    theirs: str  # "theirs", or "the group's"


class _Account:
    """One user's or group's accepted bookings, kept so that each check looks only at the bookings of
    the weeks it concerns: sorted by start (with the longest's length, so the bookings that reach into
    a window are found by bisection), and with a week quota, each accepted end's week used so far
    (updated as each booking is added), so a group of hundreds of bookings costs linear time, not
    quadratic (bench/plan_groups.py)."""

    def __init__(self, *, weekly: bool) -> None:
        self.starts: list[datetime] = []
        self.held: list[_Held] = []  # in the order of `starts`
        self.longest = timedelta(0)
        self.future = 0  # bookings not started at the ledger's `now`
        self.weekly = weekly
        self.ends: list[datetime] = []  # the distinct ends, sorted (weekly only)
        self.week: dict[datetime, timedelta] = {}  # each end → GPU-time held in the week before it

    def overlapping(self, since: datetime, until: datetime) -> list[_Held]:
        low = bisect.bisect_left(self.starts, since - self.longest)
        high = bisect.bisect_left(self.starts, until)
        return [item for item in self.held[low:high] if item.end > since]

    def used(self, since: datetime, until: datetime) -> timedelta:
        return sum((item.within(since, until) for item in self.overlapping(since, until)), timedelta(0))

    def reached(self, item: _Held) -> list[datetime]:
        """The accepted ends whose week `item` reaches into (after its start, less than a week after its end)."""
        return self.ends[bisect.bisect_right(self.ends, item.start):bisect.bisect_left(self.ends, item.end + WEEK)]

    def add(self, item: _Held, *, now: datetime) -> None:
        if self.weekly:
            for end in self.reached(item):
                self.week[end] += item.within(end - WEEK, end)
        at = bisect.bisect_right(self.starts, item.start)
        self.starts.insert(at, item.start)
        self.held.insert(at, item)
        self.longest = max(self.longest, item.end - item.start)
        self.future += item.start > now
        if self.weekly and item.end not in self.week:
            bisect.insort(self.ends, item.end)
            self.week[item.end] = self.used(item.end - WEEK, item.end)


class Ledger:
    """Each user's and each group's accepted bookings, in the order the plan accepted them."""

    def __init__(self, config: Config, *, now: datetime, host_tz: tzinfo) -> None:
        self.config = config
        self.now = now
        self.host_tz = host_tz
        self.accounts: dict[str, _Account] = {}
        self.group_accounts: dict[str, _Account] = {}
        self.limits: dict[str, Limits] = {}
        self.group_quota: dict[str, Limits] = {}

    def _limits(self, user: str) -> Limits:
        if user not in self.limits:
            self.limits[user] = limits(self.config, user)
            self.accounts[user] = _Account(weekly=self.limits[user].week_gpu_hours is not None)
        return self.limits[user]

    def _group_limits(self, group: str) -> Limits:
        if group not in self.group_quota:
            self.group_quota[group] = group_limits(self.config, group)
            self.group_accounts[group] = _Account(weekly=self.group_quota[group].week_gpu_hours is not None)
        return self.group_quota[group]

    def problem(self, booking: Booking, *, first_seen: datetime | None) -> str | None:
        """Why `booking` is over one of its user's or its project's quotas (None: it is within them);
        over both, both are named, the user's first.

        `first_seen`: when gpubook first saw it ask for its time and GPUs (None: now; a move is a
        new request)."""
        quota = self._limits(booking.user)
        if quota.max_days_ahead is not None:
            made = min(first_seen or self.now, self.now)
            ahead = (booking.start - made) / timedelta(days=1)
            if ahead > quota.max_days_ahead:
                return (f"{booking.user} may book at most {_number(quota.max_days_ahead)} days ahead; this "
                        f"booking starts {_number(ahead)} days after gpubook first saw it at this time")
        over = [self._over(booking, quota, self.accounts[booking.user], _Holder(booking.user, "their", "theirs"))]
        if booking.project is not None:
            group_quota = self._group_limits(booking.project)
            over.append(self._over(booking, group_quota, self.group_accounts[booking.project],
                                   _Holder(f"group {booking.project}", "the group's", "the group's")))
        found = [problem for problem in over if problem is not None]
        return "; and ".join(found) if found else None

    def add(self, booking: Booking, *, gpus: Collection[int] | None = None) -> None:
        """Count an accepted booking (a running one too: it is never judged, but it counts)."""
        count = len(gpus) if gpus is not None else booking.gpu_count
        held = _Held(booking.start, booking.end, count)
        self._limits(booking.user)
        self.accounts[booking.user].add(held, now=self.now)
        if booking.project is not None:
            self._group_limits(booking.project)
            self.group_accounts[booking.project].add(held, now=self.now)

    def _over(self, booking: Booking, quota: Limits, account: _Account, holder: _Holder) -> str | None:
        """The first of `quota`'s limits that `booking` would go over, beside `account`'s bookings."""
        if quota.max_future_bookings is not None and booking.start > self.now:
            future = account.future
            if future >= quota.max_future_bookings:
                return (f"{holder.name} may hold at most {quota.max_future_bookings} "
                        f"{'booking' if quota.max_future_bookings == 1 else 'bookings'} that have not "
                        f"started; {future} {'is' if future == 1 else 'are'} held already")
        if quota.max_gpus is not None:
            peak = _peak(account.overlapping(booking.start, booking.end), booking.start, booking.end)
            if peak + booking.gpu_count > quota.max_gpus:
                return (f"{holder.name} may hold at most {_gpus(quota.max_gpus)} at once; {holder.their} other "
                        f"bookings hold {peak} during this booking's time, and it asks for {booking.gpu_count}")
        if quota.week_gpu_hours is not None:
            return self._week_problem(booking, quota.week_gpu_hours, account, holder)
        return None

    def _week_problem(self, booking: Booking, quota_hours: float, account: _Account,
                      holder: _Holder) -> str | None:
        quota = timedelta(hours=quota_hours)
        new = _Held(booking.start, booking.end, booking.gpu_count)
        # The weeks this booking reaches into: its own, then those of the accepted bookings that
        # end after its start and less than a week after its end, earliest first.
        ends = [booking.end, *(end for end in account.reached(new) if end != booking.end)]
        for end in ends:
            since = end - WEEK
            used = account.week[end] if end in account.week else account.used(since, end)
            needs = new.within(since, end)
            if used + needs > quota:
                where = "in the week before this booking ends" if end == booking.end else \
                    f"in the week before {_moment(end, self.host_tz)} (the end of another booking of {holder.theirs})"
                return (f"{holder.name} has {_hours(used)} of {_number(quota_hours)} GPU-hours {where}; "
                        f"this booking needs {_hours(needs)}")
        return None


def used_shares(config: Config, counted: Iterable[Booking], *, now: datetime) -> dict[str, float]:
    """The fair-share tie-break's figure of each group with a week quota (its share): the GPU-hours
    its `counted` bookings (those running or accepted before this pass) held in the week before
    `now`, over `week_gpu_hours`. A group without a week quota has no share and is not listed."""
    used: dict[str, timedelta] = defaultdict(timedelta)
    since = now - WEEK
    for booking in counted:
        if booking.project is not None and booking.project in config.groups:
            used[booking.project] += _Held(booking.start, booking.end, booking.gpu_count).within(since, now)
    return {name: used[name] / timedelta(hours=group.week_gpu_hours)
            for name, group in config.groups.items() if group.week_gpu_hours}


def _peak(held: list[_Held], start: datetime, end: datetime) -> int:
    """The most GPUs `held` hold together at any moment between `start` and `end`."""
    changes = sorted((moment, step) for item in held if item.start < end and start < item.end
                     for moment, step in ((max(item.start, start), item.gpus), (item.end, -item.gpus)))
    peak = now = 0
    for _, step in changes:  # at one moment an end (negative step) sorts before a start
        now += step
        peak = max(peak, now)
    return peak


def _gpus(count: int) -> str:
    return f"{count} GPU" if count == 1 else f"{count} GPUs"


def _hours(amount: timedelta) -> str:
    return _number(amount / _HOUR)


def _number(value: float) -> str:
    return f"{round(value, 2):g}"


def _moment(moment: datetime, zone: tzinfo) -> str:
    local = moment.astimezone(zone)
    return f"{local:%Y-%m-%d %H:%M} ({local:%Z})"

