"""One pass of the pipeline: calendars → bookings → plan, shared by the CLI and the daemon.

Each calendar is read on its own: one that fails (unreachable, or answering with something that
is not calendar data) keeps its last good snapshot, and only its bookings are affected; the other
calendars' bookings start, stop and change as they read. Only when every calendar fails does a
read raise (the daemon then keeps the last known bookings of all of them).

`Freshness` is what the daemon knows of the calendars between polls: the last good reading, the
outage of all of them and the failure of each one (each said once when it starts and once when it
ends), and whether the data is fresh enough to start anything from.

Between polls, the daemon's change check (`Calendars.check`, `Freshness.check`) polls only the
calendars whose source can tell cheaply whether anything changed (CalDAV by sync token or ctag):
a check that finds nothing new is fresh data and nothing more (no expansion, no pass); one that
finds a change has already fetched it, and the bookings are expanded again for a pass. Its pace
(`check_interval`) keeps the server's cost bounded: a check never comes sooner than
`CHECK_COST_FACTOR` times its own request time after the last one.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from zoneinfo import ZoneInfo

from gpubook.runtime.nvidia import gpus as gpu_inventory
from gpubook.runtime.templates.catalog import template_names
from gpubook.scheduler.core import plan as plan_module
from gpubook.scheduler.core import policy
from gpubook.scheduler.core.bookings import Booking, BookingReader, Rejection
from gpubook.scheduler.core.parsing import Problem
from gpubook.scheduler.core.topology import ONE_MACHINE, Topology
from gpubook.scheduler.settings import CalendarConfig, Config
from gpubook.scheduler.sources import Snapshot, Source, open_source
from gpubook.scheduler.sources.errors import CalendarError, printable, redact_url

log = logging.getLogger(__name__)

# A change check waits at least this many times its own last request time: one daemon keeps the
# calendar server busy with its checks at most a tenth of the time (Radicale with 10,000 events,
# 0.67 s a no-change sync: a check every 6.7 s; 40 events, a few ms: every check_seconds).
CHECK_COST_FACTOR = 10.0


@dataclass(frozen=True)
class Reading:
    """One read of every calendar over the daemon's window."""

    occurrences: list[Booking | Rejection]
    problems: list[Problem]
    etags: dict[str, str | None]  # event href → its ETag as read
    failures: dict[str, str] = field(default_factory=dict)  # calendar url → why this poll failed
    read_at: dict[str, datetime] = field(default_factory=dict)  # calendar url → its last good read


@dataclass(frozen=True)
class Checked:
    """One change check of the calendars that can tell cheaply (`Calendars.check`)."""

    checked: tuple[str, ...] = ()  # calendar urls checked (their sources check cheaply)
    changed: bool = False  # one of them holds something new, already read
    failures: dict[str, CalendarError] = field(default_factory=dict)  # calendar url → why its check failed
    seconds: float = 0.0  # the requests' time, all calendars together (never the wait for a pass)


def check_interval(*, check_seconds: float, poll_seconds: float, took: float, failed: int = 0,
                   spread: Callable[[], float] = random.random) -> float:
    """Seconds until the next change check: `check_seconds`, but never less than CHECK_COST_FACTOR
    times the last check's request time (`took`), and never more than a poll interval (the poll
    reads everything then anyway). While checks fail (`failed` in a row): doubled for each, at most
    a poll interval, then between half of that and all of it at random (`spread`, 0 to 1). The
    daemons of a department that lost their calendar server together then come back to it apart:
    without the spread, 20 daemons on one Radicale heard it again 31.6-31.7 s after it was back,
    all in the same tenth of a second (bench/department.py, BENCHMARKS.md)."""
    pace = min(max(check_seconds, CHECK_COST_FACTOR * took), poll_seconds)
    if not failed:
        return pace
    backoff = min(max(pace, check_seconds * 2 ** min(failed, 20)), poll_seconds)
    return backoff * (0.5 + 0.5 * spread())


@dataclass
class Calendars:
    """The configured calendars' sources and the parse cache, kept between polls."""

    config: Config
    sources: dict[str, Source] = field(default_factory=dict)
    reader: BookingReader = field(default_factory=BookingReader)
    last: dict[str, Snapshot] = field(default_factory=dict)  # calendar url → its last good snapshot
    read_at: dict[str, datetime] = field(default_factory=dict)  # calendar url → when it was read
    topology: Topology = ONE_MACHINE  # where the backend runs bookings (the convention's GPU indices)

    def poll(self) -> dict[str, Snapshot]:
        """Poll every calendar; a CalendarError of one stops the pass (the caller decides)."""
        snapshots, failures = self.poll_each()
        if failures:
            raise next(iter(failures.values()))
        return snapshots

    def poll_each(self, *, now: datetime | None = None) -> tuple[dict[str, Snapshot], dict[str, CalendarError]]:
        """Poll every calendar on its own: the good snapshots (a failed calendar's last good one,
        if any) and each failed calendar's error."""
        snapshots: dict[str, Snapshot] = {}
        failures: dict[str, CalendarError] = {}
        for calendar in self.config.calendars:
            try:
                source = self.sources.get(calendar.url)
                if source is None:
                    source = self.sources[calendar.url] = open_source(calendar)
                snapshot = source.poll()
            except CalendarError as error:
                failures[calendar.url] = error
                if calendar.url in self.last:
                    snapshots[calendar.url] = self.last[calendar.url]
                continue
            snapshots[calendar.url] = self.last[calendar.url] = snapshot
            if now is not None:
                self.read_at[calendar.url] = now
        return snapshots, failures

    def read(self, *, now: datetime) -> Reading:
        """Poll and expand over the daemon's window: from the longest booking back (two weeks more
        where a week quota is set: see gpubook/scheduler/core/policy.py) to a week ahead (further where
        `max_days_ahead` reaches further).

        A calendar that fails keeps its last good snapshot (`failures` says why, `read_at` since
        when); a CalendarError is raised only when every calendar failed."""
        snapshots, failures = self.poll_each(now=now)
        if failures and len(failures) == len(self.config.calendars):
            errors = list(failures.values())
            raise errors[0] if len(errors) == 1 else CalendarError("; ".join(str(e) for e in errors))
        return self.reading(snapshots, now=now, failures={url: str(e) for url, e in failures.items()})

    def reading(self, snapshots: Mapping[str, Snapshot], *, now: datetime, failures: dict[str, str]) -> Reading:
        """The snapshots expanded over the daemon's window (see `read`)."""
        occurrences, problems = self.occurrences(
            snapshots, window_start=now - policy.reach_back(self.config),
            window_end=now + policy.reach_ahead(self.config))
        etags = {href: obj.etag for snap in snapshots.values() for href, obj in snap.objects.items()}
        return Reading(occurrences, problems, etags, failures=failures, read_at=dict(self.read_at))

    def check(self, *, now: datetime) -> Checked:
        """Poll the calendars whose source checks cheaply (opened and loaded by an earlier poll);
        the others keep their last snapshot until the next poll. Never raises: each failure is
        in `failures`."""
        checked: list[str] = []
        changed = False
        failures: dict[str, CalendarError] = {}
        began = time.monotonic()
        for calendar in self.config.calendars:
            source = self.sources.get(calendar.url)
            if source is None or not source.checks_cheaply:
                continue
            checked.append(calendar.url)
            try:
                snapshot = source.poll()
            except CalendarError as error:
                failures[calendar.url] = error
                continue
            self.last[calendar.url] = snapshot
            self.read_at[calendar.url] = now
            changed = changed or snapshot.changed
        return Checked(checked=tuple(checked), changed=changed, failures=failures, seconds=time.monotonic() - began)

    def occurrences(self, snapshots: Mapping[str, Snapshot], *, window_start: datetime,
                    window_end: datetime) -> tuple[list[Booking | Rejection], list[Problem]]:
        templates = template_names(self.config.templates_dir)
        occurrences: list[Booking | Rejection] = []
        problems: list[Problem] = []
        for calendar in self.config.calendars:
            if calendar.url not in snapshots:
                continue  # never read yet: none of its bookings is known
            expansion = self.reader.read(snapshots[calendar.url].objects.values(), config=self.config,
                                         calendar=calendar, templates=templates,
                                         window_start=window_start, window_end=window_end,
                                         topology=self.topology)
            occurrences.extend(expansion.occurrences)
            problems.extend(expansion.problems)
        return occurrences, problems


@dataclass
class Freshness:
    """What the daemon knows of the calendars between polls. Each outage and each calendar's
    failure is logged once when it starts and once when it ends, and told to `event` (the daemon's
    event log)."""

    event: Callable[[str, datetime], None]
    occurrences: Sequence[Booking | Rejection] = ()
    etags: dict[str, str | None] = field(default_factory=dict)
    last_poll: datetime | None = None
    last_ok: datetime | None = None
    outage: str | None = None
    outage_since: datetime | None = None
    problems: list[str] = field(default_factory=list)
    read_at: dict[str, datetime] = field(default_factory=dict)  # calendar url → its last good read
    failing: dict[str, tuple[str, datetime]] = field(default_factory=dict)  # url → (cause, since)

    def poll(self, calendars: Calendars, *, now: datetime, lock: AbstractContextManager[object],
             failed: Callable[..., None]) -> None:
        """Read the calendars: what was read is known from now on; a CalendarError (every calendar
        failed) keeps the last known bookings. `failed(url=, cause=)` is told of each failed calendar;
        `lock`: the daemon's, held while what is known changes."""
        try:
            reading = calendars.read(now=now)
        except CalendarError as error:
            for calendar in calendars.config.calendars:  # read() raises only when every calendar failed
                failed(url=calendar.url, cause=str(error))
            with lock:
                self.unreachable(str(error), now=now, stale_after_minutes=calendars.config.daemon.stale_after_minutes)
        else:
            for url, cause in reading.failures.items():
                failed(url=url, cause=cause)
            with lock:
                self.read(reading, now=now)
        self.last_poll = now

    def check(self, calendars: Calendars, *, now: datetime, lock: AbstractContextManager[object]) -> Checked:
        """The change check between polls (`Calendars.check`): a calendar that answered is fresh
        from now on; a change is read into the known bookings (the caller runs a pass only then).
        A calendar whose check fails is said once, as a poll's failure is, and keeps its data."""
        result = calendars.check(now=now)
        if not result.checked:
            return result
        # The calendars not checked keep what the last poll said of them.
        failures = {url: cause for url, (cause, _since) in self.failing.items() if url not in result.checked}
        failures.update({url: str(error) for url, error in result.failures.items()})
        answered = [url for url in result.checked if url not in result.failures]
        with lock:
            if not answered:  # nothing heard: no fresher than before; a new failure said once
                if self.outage is not None:
                    pass  # said when it began
                elif len(failures) == len(calendars.config.calendars):
                    self.unreachable("; ".join(dict.fromkeys(failures.values())), now=now,
                                     stale_after_minutes=calendars.config.daemon.stale_after_minutes)
                else:
                    self._failures(failures, now)
            elif result.changed:
                self.read(calendars.reading(calendars.last, now=now, failures=failures), now=now)
            else:
                self.heard(failures, read_at=dict(calendars.read_at), now=now)
        return result

    def read(self, reading: Reading, *, now: datetime) -> None:
        """A poll that read at least one calendar: its bookings are the known ones from now on."""
        self.occurrences = reading.occurrences
        self.etags = reading.etags
        self.problems = [f"{p.uid or p.href}: {p.reason}" for p in reading.problems]
        self.heard(reading.failures, read_at=reading.read_at, now=now)

    def heard(self, failures: dict[str, str], *, read_at: dict[str, datetime], now: datetime) -> None:
        """At least one calendar answered: fresh data from now on (the known bookings stay as they
        are unless `read` replaced them); each calendar's failure or recovery said once."""
        self.last_ok = now
        self.read_at = read_at
        self._failures(failures, now)
        if self.outage is not None:
            since = self.outage_since or now
            self.say(f"calendar reachable again after {duration(now - since)} (was: {self.outage})", now)
            self.outage = self.outage_since = None

    def say(self, message: str, now: datetime) -> None:
        log.warning("%s", message)
        self.event(message, now)

    def unreachable(self, cause: str, *, now: datetime, stale_after_minutes: float) -> None:
        """Every calendar failed: the last known bookings are kept; said once, when it starts."""
        if self.outage is None:
            self.outage, self.outage_since = cause, now
            self.say(f"calendar unreachable: {cause}; keeping the last known bookings, "
                     f"nothing starts from data older than {stale_after_minutes:g} min", now)

    def _failures(self, failures: dict[str, str], now: datetime) -> None:
        """One calendar failing while others read: said once when it starts and once when it ends."""
        for url, cause in failures.items():
            if url not in self.failing:
                self.failing[url] = (cause, now)
                self.say(f"calendar {redact_url(url)} cannot be read: {cause}; its last good reading is kept, "
                         "the other calendars go on", now)
        for url in [u for u in self.failing if u not in failures]:
            cause, since = self.failing.pop(url)
            self.say(f"calendar {redact_url(url)} readable again after {duration(now - since)} (was: {cause})", now)

    def fresh(self, now: datetime, *, stale_after_minutes: float) -> tuple[bool, str]:
        """May anything start from the known bookings, and if not, why."""
        if self.last_ok is None:
            return False, "no calendar data read yet"
        age = now - self.last_ok
        if age > timedelta(minutes=stale_after_minutes):
            return False, (f"the calendar data is {duration(age)} old (calendar unreachable: "
                           f"{self.outage or 'unknown'})")
        return True, ""

    def stale(self, now: datetime, *, calendars: Sequence[CalendarConfig],
              stale_after_minutes: float) -> dict[str, str]:
        """Calendars whose own data is too old to start anything from (the others start as usual)."""
        bound = timedelta(minutes=stale_after_minutes)
        stale = {}
        for calendar in calendars:
            read = self.read_at.get(calendar.url)
            cause = self.failing.get(calendar.url, ("unknown", now))[0]
            if read is None or now - read > bound:
                age = "never read" if read is None else f"{duration(now - read)} old"
                stale[calendar.url] = f"its calendar's data is {age} (calendar {redact_url(calendar.url)}: {cause})"
        return stale

    def complete(self, calendars: Sequence[CalendarConfig]) -> bool:
        """Has every calendar been read at least once."""
        return all(c.url in self.read_at for c in calendars)


def duration(span: timedelta) -> str:
    seconds = int(span.total_seconds())
    if seconds < 120:
        return f"{seconds} s"
    if seconds < 7200:
        return f"{seconds // 60} min"
    return f"{seconds / 3600:.1f} h"


@dataclass(frozen=True)
class PlanResult:
    plan: plan_module.Plan
    problems: tuple[Problem, ...]
    inventory: gpu_inventory.Inventory


def inventory_indices(inventory: gpu_inventory.Inventory) -> tuple[int, ...]:
    return tuple(gpu.index for gpu in inventory.gpus)


def plan_window(config: Config, *, window_start: datetime, window_end: datetime, now: datetime,
                calendars: Calendars | None = None,
                running: Mapping[str, tuple[int, ...]] | None = None,
                topology: Topology = ONE_MACHINE) -> PlanResult:
    """Read every calendar once and plan the window (read from further back where a week quota is
    set, so that the weeks of the window's bookings are counted; only the window's bookings are kept)."""
    calendars = calendars or Calendars(config, topology=topology)
    snapshots = calendars.poll()
    earlier = policy.reach_back(config) - timedelta(hours=config.defaults.max_hours)
    occurrences, problems = calendars.occurrences(snapshots, window_start=window_start - earlier,
                                                  window_end=window_end)
    inventory = gpu_inventory.inventory(static_count=config.gpu_count)
    result = plan_module.plan(occurrences, inventory=inventory_indices(inventory), config=config,
                              templates=template_names(config.templates_dir), now=now, running=running or {},
                              topology=topology)
    if earlier:
        result = replace(result, accepted=tuple(a for a in result.accepted if a.booking.end > window_start),
                         rejected=tuple(r for r in result.rejected if r.end > window_start))
    for problem in problems:
        log.warning("calendar %s: %s: %s", redact_url(problem.calendar_url),
                    printable(problem.uid or redact_url(problem.href)), printable(problem.reason))
    return PlanResult(plan=result, problems=tuple(problems), inventory=inventory)


def _local(moment: datetime, zone: ZoneInfo) -> str:
    return moment.astimezone(zone).strftime("%a %Y-%m-%d %H:%M")


def describe_plan(result: PlanResult, *, timezone: str) -> str:
    """The plan as a person reads it: accepted bookings, then rejections with their reasons."""
    zone = ZoneInfo(timezone)
    inventory = result.inventory
    lines: list[str] = []
    if inventory.source != "nvml":
        lines.append(f"GPUs: {inventory.count} from the config's [gpus] count "
                     f"({gpu_inventory.no_gpu_line(inventory)})" if inventory.count
                     else gpu_inventory.no_gpu_line(inventory))
    accepted: Sequence[plan_module.Accepted] = sorted(result.plan.accepted, key=lambda a: (a.booking.start, a.gpus))
    lines.append(f"Accepted ({len(accepted)}), times in {timezone}:")
    for item in accepted:
        booking = item.booking
        gpu_list = ",".join(map(str, item.gpus))
        lines.append(f"  {_local(booking.start, zone)} → {_local(booking.end, zone)}  {booking.user:<12} "
                     f"GPU {gpu_list:<7} {booking.template:<18} {printable(booking.summary)}")
    rejected = sorted(result.plan.rejected, key=lambda r: (r.start, r.id))
    lines.append(f"Rejected ({len(rejected)}):")
    for rejection in rejected:
        lines.append(f"  {_local(rejection.start, zone)} → {_local(rejection.end, zone)}  "
                     f"{rejection.user or '?':<12} {printable(rejection.reason)}")
    if result.problems:
        lines.append(f"Not readable as bookings ({len(result.problems)}):")
        for problem in result.problems:
            lines.append(f"  {printable(problem.uid or redact_url(problem.href))}: {printable(problem.reason)}")
    return "\n".join(lines)
