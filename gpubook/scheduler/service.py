"""One pass of the pipeline: calendars → bookings → plan, shared by the CLI and the daemon.

Each calendar is read on its own: one that fails (unreachable, or answering with something that
is not calendar data) keeps its last good snapshot, and only its bookings are affected; the other
calendars' bookings start, stop and change as they read. Only when every calendar fails does a
read raise (the daemon then keeps the last known bookings of all of them).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from zoneinfo import ZoneInfo

from gpubook.runtime import gpus as gpu_inventory
from gpubook.runtime.templates import template_names
from gpubook.scheduler.config import Config
from gpubook.scheduler.core import plan as plan_module
from gpubook.scheduler.core import policy
from gpubook.scheduler.core.bookings import Booking, BookingReader, Rejection
from gpubook.scheduler.core.parsing import Problem
from gpubook.scheduler.core.topology import ONE_MACHINE, Topology
from gpubook.scheduler.sources import Snapshot, Source, open_source
from gpubook.scheduler.sources.errors import CalendarError, printable, redact_url

log = logging.getLogger(__name__)



@dataclass(frozen=True)
class Reading:
    """One read of every calendar over the daemon's window."""

    occurrences: list[Booking | Rejection]
    problems: list[Problem]
    etags: dict[str, str | None]  # event href → its ETag as read
    failures: dict[str, str] = field(default_factory=dict)  # calendar url → why this poll failed
    read_at: dict[str, datetime] = field(default_factory=dict)  # calendar url → its last good read


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
        occurrences, problems = self.occurrences(
            snapshots, window_start=now - policy.reach_back(self.config),
            window_end=now + policy.reach_ahead(self.config))
        etags = {href: obj.etag for snap in snapshots.values() for href, obj in snap.objects.items()}
        return Reading(occurrences, problems, etags, failures={url: str(e) for url, e in failures.items()},
                       read_at=dict(self.read_at))

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
