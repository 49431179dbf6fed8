"""No-shows and idle GPUs, judged from plain data (no I/O, no clock): which running booking is
released, and which booker is told that their GPUs sit idle.

- No-show (`[policy] no_show_minutes`): a running booking whose booker has not logged in and whose
  GPUs showed no use (no sample at or above `idle_percent`) for no_show_minutes after its container
  started is released: its container stops and its GPUs go back to the pool for the rest of its
  time. No samples at all (no GPU to sample, the sampler off) is no evidence of use: the login
  decides alone. A login, or one busy sample of any of its GPUs, and it is no no-show.
- Idle (`idle_minutes`): a GPU of a running booking whose samples stayed under idle_percent for
  idle_minutes in a row is idle; its booker is told once per idle stretch (a stretch begins at the
  start or at the last busy sample). Unlike a no-show, idleness needs evidence: a stretch counts
  only as far as samples were taken in it. With `idle_action = "release"`, a booking whose every
  GPU is idle is released as a no-show is.

A release is recorded (`Released`) and the plan sees the booking end at its release
(`apply_releases`): it keeps no GPU for the rest of its slot, never starts again (after a restart
too), and a booking made for that time is accepted.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta, tzinfo
from types import MappingProxyType

from gpubook.runtime.engines.spec import ContainerInfo
from gpubook.scheduler.core.bookings import Booking, Rejection
from gpubook.scheduler.settings import Config

RELEASED = "released"  # the first word of a release's sentence, and of the event's line


@dataclass(frozen=True)
class Rules:
    """One user's no-show and idle rules; None: off."""

    no_show: timedelta | None = None
    idle: timedelta | None = None
    idle_percent: float = 5.0
    release_idle: bool = False  # idle_action = "release"

    @property
    def active(self) -> bool:
        return self.no_show is not None or self.idle is not None


def rules(config: Config, user: str) -> Rules:
    """The user's rules (their effective minutes, resolved when the config was read); 0 means off."""
    own, policy = config.policy_for(user), config.policy
    return Rules(no_show=_span(own.no_show_minutes), idle=_span(own.idle_minutes),
                 idle_percent=policy.idle_percent, release_idle=policy.idle_action == "release")


def _span(minutes: float) -> timedelta | None:
    return timedelta(minutes=minutes) if minutes else None


def any_rules(config: Config) -> bool:
    """Whether any user may be judged (else the pass reads no evidence)."""
    policy = config.policy
    return bool(policy.no_show_minutes or policy.idle_minutes
                or any(p.no_show_minutes or p.idle_minutes for p in config.policies.values()))


@dataclass(frozen=True)
class GpuUse:
    """One GPU's samples (those with a utilisation) since its booking's container started."""

    first: datetime | None = None  # the earliest sample; None: none at all
    last: datetime | None = None  # the latest sample
    last_busy: datetime | None = None  # the latest sample at or above idle_percent


@dataclass(frozen=True)
class Evidence:
    """What the sampler saw of one running booking."""

    since: datetime  # when its container started (its start, or later when it started late)
    gpus: tuple[int, ...]
    logged_in: datetime | None = None  # the booker's first login; None: none seen
    use: Mapping[int, GpuUse] = field(default_factory=lambda: MappingProxyType({}))


@dataclass(frozen=True)
class NoShow:
    """Release the booking: `reason` is the sentence its event and its booker get."""

    reason: str


@dataclass(frozen=True)
class Idle:
    """GPUs idle long enough to tell the booker; `stretches`: (GPU, idle since), by GPU."""

    stretches: tuple[tuple[int, datetime], ...]
    least: timedelta  # idle_minutes: each stretch is at least this long
    release: str = ""  # idle_action = "release" and every GPU idle: the release's sentence


@dataclass(frozen=True)
class Verdict:
    """What the judge found about one running booking; `due`: when to look again (None: nothing due)."""

    no_show: NoShow | None = None
    idle: Idle | None = None
    due: datetime | None = None


NOTHING = Verdict()


def judge(evidence: Evidence, rules: Rules, *, now: datetime) -> Verdict:
    """The verdict on one running booking at `now`."""
    no_show, due = _no_show(evidence, rules, now=now)
    if no_show is not None:
        return Verdict(no_show=no_show)
    idle, idle_due = _idle(evidence, rules, now=now)
    dues = [t for t in (due, idle_due) if t is not None]
    return Verdict(idle=idle, due=min(dues, default=None))


def _no_show(evidence: Evidence, rules: Rules, *, now: datetime) -> tuple[NoShow | None, datetime | None]:
    if rules.no_show is None or evidence.logged_in is not None:
        return None, None
    if any(evidence.use.get(gpu, GpuUse()).last_busy is not None for gpu in evidence.gpus):
        return None, None
    due = evidence.since + rules.no_show
    if now < due:
        return None, due
    minutes = _minutes(now - evidence.since)
    seen = any(evidence.use.get(gpu, GpuUse()).first is not None for gpu in evidence.gpus)
    what = (f"{_gpus(evidence.gpus)} stayed under {rules.idle_percent:g} %" if seen
            else f"no use of {_gpus(evidence.gpus)} was seen")
    return NoShow(f"nobody logged in and {what} for {minutes} min after the start"), None


def _idle(evidence: Evidence, rules: Rules, *, now: datetime) -> tuple[Idle | None, datetime | None]:
    if rules.idle is None or not evidence.gpus:
        return None, None
    stretches: list[tuple[int, datetime]] = []
    dues: list[datetime] = []
    for gpu in evidence.gpus:
        use = evidence.use.get(gpu, GpuUse())
        if use.last is None:
            continue  # no evidence of idleness
        since = max(evidence.since, use.last_busy) if use.last_busy is not None else evidence.since
        if use.last_busy is not None and use.last_busy >= use.last:
            dues.append(use.last + rules.idle)  # busy at the last sample
        elif use.last - since >= rules.idle:
            stretches.append((gpu, since))
        else:
            dues.append(since + rules.idle)
    if not stretches:
        return None, min(dues, default=None)
    release = ""
    if rules.release_idle and len(stretches) == len(evidence.gpus):
        since = min(s for _, s in stretches)
        release = (f"{_gpus(evidence.gpus)} stayed under {rules.idle_percent:g} % for "
                   f"{_minutes(now - since)} min")
    return Idle(tuple(stretches), least=rules.idle, release=release), min(dues, default=None)


def idle_line(idle: Idle, *, percent: float, zone: tzinfo, now: datetime | None = None) -> str:
    """The booker's line, e.g. "idle: GPU 0 under 5 % since 14:05 (60 min)". Without `now` (the
    event's line, the same while the stretch lasts, so the event is not written again every pass):
    "(60 min or more)", idle_minutes."""
    def length(since: datetime) -> str:
        return f"{_minutes(now - since)} min" if now is not None else f"{_minutes(idle.least)} min or more"

    parts = [f"GPU {gpu} under {percent:g} % since {since.astimezone(zone):%H:%M} ({length(since)})"
             for gpu, since in idle.stretches]
    return "idle: " + "; ".join(parts)


# -- actions (decide.decide emits them) ---------------------------------------------------------


@dataclass(frozen=True)
class Release:
    """Stop a no-show's container (its outputs kept, as at an end) and record the release."""

    name: str
    booking_id: str
    user: str
    reason: str
    start: datetime  # the booking's time, as released
    end: datetime
    grace: float
    host: str = "local"


@dataclass(frozen=True)
class IdleNotice:
    """Tell a booker that GPUs of their running booking sit idle (once per idle stretch)."""

    name: str
    booking_id: str
    user: str
    stretches: tuple[tuple[int, datetime], ...]
    line: str  # the sentence the booker reads
    host: str = "local"


def actions(verdicts: Mapping[str, Verdict], running: Mapping[str, tuple[ContainerInfo, Booking]], *,
            told: Mapping[str, frozenset[tuple[int, datetime]]], percent: float, zone: tzinfo, now: datetime,
            grace: float) -> list[Release | IdleNotice | tuple[datetime, str]]:
    """The releases and idle notices `verdicts` call for, and (when, what) to look at again.

    `running`: booking id → its container and booking, for the bookings running in their time
    (not stopping); `told`: the idle stretches each booker was told of."""
    found: list[Release | IdleNotice | tuple[datetime, str]] = []
    for booking_id, verdict in sorted(verdicts.items()):
        if booking_id not in running:
            continue
        info, booking = running[booking_id]
        reason = verdict.no_show.reason if verdict.no_show else (verdict.idle.release if verdict.idle else "")
        if reason:
            found.append(Release(info.name, booking_id, info.user or booking.user, reason, booking.start,
                                 booking.end, grace, info.host or "local"))
            continue
        if verdict.idle is not None and not set(verdict.idle.stretches) <= told.get(booking_id, frozenset()):
            found.append(IdleNotice(info.name, booking_id, info.user or booking.user, verdict.idle.stretches,
                                    idle_line(verdict.idle, percent=percent, zone=zone, now=now),
                                    info.host or "local"))
        if verdict.due is not None and verdict.due > now:
            found.append((verdict.due, f"no-show or idle check of {booking_id}"))
    return found


# -- releases ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Released:
    """A recorded release: the booking's time (as it was when released), when, and why."""

    booking_id: str
    start: datetime
    end: datetime
    at: datetime
    reason: str


def release_sentence(released: Released, *, zone: tzinfo) -> str:
    """The event's line, e.g. "released: nobody logged in and GPU 0 stayed under 5 % for 30 min
    after the start; the GPUs went back to the pool until 18:00"."""
    until = released.end.astimezone(zone)
    day = "" if until.date() == released.at.astimezone(zone).date() else f"{until:%Y-%m-%d} "
    return f"{RELEASED}: {released.reason}; the GPUs went back to the pool until {day}{until:%H:%M}"


def applies(released: Released, booking: Booking) -> bool:
    """A release holds for the booking's time it was made in (a booking moved since is a new time)."""
    return booking.start == released.start and released.at < booking.end


def released_ids(occurrences: Sequence[Booking | Rejection], releases: Mapping[str, Released]) -> frozenset[str]:
    """The bookings among `occurrences` whose release holds."""
    return frozenset(item.id for item in occurrences if isinstance(item, Booking) and item.id in releases
                     and applies(releases[item.id], item))


def apply_releases(occurrences: Sequence[Booking | Rejection], releases: Mapping[str, Released]
                   ) -> list[Booking | Rejection]:
    """Released bookings end at their release: they hold no GPU for the rest of their slot."""
    held = released_ids(occurrences, releases)
    return [replace(item, end=max(item.start, releases[item.id].at)) if isinstance(item, Booking) and item.id in held
            else item for item in occurrences]


def _gpus(gpus: Sequence[int]) -> str:
    return f"GPU{'s' if len(gpus) != 1 else ''} {', '.join(map(str, gpus)) or '-'}"


def _minutes(amount: timedelta) -> str:
    return f"{round(amount.total_seconds() / 60, 1):g}"
