"""Turn raw calendar objects into booking occurrences: a `Booking`, or a `Rejection` saying why not.

Recurrence, time zones (VTIMEZONE, Windows names, X-WR-TIMEZONE), all-day events, DURATION and
moved or cancelled occurrences are left to icalendar, x-wr-timezone and recurring-ical-events
(core/parsing.py reads an object into series, core/recurrence.py expands them within bounds);
the booking convention itself (who, which template, how many GPUs) is read by core/convention.py.

Every occurrence inside the asked window that is not cancelled becomes exactly one `Booking` or
`Rejection`. What cannot be tied to an occurrence at all (an unreadable object, an event without
UID or start, a repeat rule the library refuses) becomes a `Problem` naming the object.

Occurrence ids: a recurring event's occurrence is `UID@RECURRENCE-ID` (the occurrence's original
start, so a moved occurrence keeps its id); a single, non-recurring event is its UID alone, so
that moving its start or end keeps its identity (and its container and write-back state).
"""

from __future__ import annotations

import logging
import re
import time as clock
from collections import defaultdict
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from datetime import date, datetime, timedelta, tzinfo
from hashlib import sha256
from typing import Any
from zoneinfo import ZoneInfo

import icalendar

from gpubook.runtime.engines.spec import booking_id_problem
from gpubook.scheduler.core import values
from gpubook.scheduler.core.convention import Refused, request, show, text
from gpubook.scheduler.core.parsing import Parsed, Problem, error_summary, parse
from gpubook.scheduler.core.recurrence import (
    MAX_OCCURRENCES,
    TIME_BUDGET,
    OverBound,
    Series,
    check_bounds,
    dt_of,
    expand,
    repeat_rules,
    source_event,
    too_many,
    utc,
)
from gpubook.scheduler.core.topology import ONE_MACHINE, Topology
from gpubook.scheduler.settings import CalendarConfig, Config
from gpubook.scheduler.sources import RawObject

log = logging.getLogger(__name__)
MAX_SLOW = 4096  # series remembered as over the time budget


@dataclass(frozen=True)
class Booking:
    """One occurrence of a booking that follows the convention (the plan still checks it)."""

    id: str  # see the module docstring
    uid: str
    user: str  # a syntactically valid user name; the plan checks that the user exists
    template: str  # a syntactically valid template name; the plan checks that it exists
    gpu_count: int
    gpu_indices: tuple[int, ...] | None  # when the booker named GPUs; else the plan picks
    start: datetime  # aware, UTC
    end: datetime  # aware, UTC
    created: datetime | None  # CREATED (UTC): earlier bookings win conflicts
    dtstamp: datetime | None  # DTSTAMP (UTC): the next tie-breaker
    calendar_url: str
    href: str
    summary: str = ""
    nodes: int | None = None  # `nodes: K` asked for (a Slurm cluster); None: as few as its GPUs fit on
    project: str | None = None  # the [groups.NAME] it counts against (`project:`, else the user's first); None: none
    standby: bool = False  # `standby: yes`: taken GPUs or a spent quota make it wait, not refused


@dataclass(frozen=True)
class Rejection:
    """An occurrence that will not run, with a sentence its booker understands."""

    id: str
    uid: str
    start: datetime  # aware, UTC
    end: datetime  # aware, UTC
    reason: str
    user: str | None  # the booker, where known
    calendar_url: str
    href: str
    summary: str = ""  # the event's title, where it was read (a notice names the booking by it)
    standby: bool = False  # it waits on standby for its GPUs (core/plan.py), not refused for good


@dataclass(frozen=True)
class Expansion:
    occurrences: tuple[Booking | Rejection, ...]  # sorted by start, then id
    problems: tuple[Problem, ...]


class BookingReader:
    """Expands calendars into occurrences, keeping each object's parse while its ETag is unchanged.

    One reader serves every calendar of the daemon; a poll that changed nothing re-parses nothing.
    Objects that disappear from a calendar leave the cache on that calendar's next read.
    """

    def __init__(self, *, clock: Callable[[], float] = clock.thread_time,
                 time_budget: float = TIME_BUDGET) -> None:
        """`clock`: the CPU time of the reading thread, not the wall clock, so that an event's cost
        is what its own expansion burns: a busy machine (other processes on the cores) never turns an
        ordinary repeating booking into a rejected one, and a hostile rule still burns its budget."""
        self._cache: dict[tuple[str, str, str], Parsed] = {}
        # Series whose expansion took longer than the budget, by the digest of what drives the
        # expansion (not the ETag: gpubook's own write-back, a copy under another name or a touched
        # description would buy the series another second; an edit of its times gets one new try).
        self._slow: dict[str, str] = {}
        self._clock = clock
        self._time_budget = time_budget

    def read(
        self,
        objects: Iterable[RawObject],
        *,
        config: Config,
        calendar: CalendarConfig,
        templates: Collection[str],
        window_start: datetime,
        window_end: datetime,
        topology: Topology = ONE_MACHINE,
    ) -> Expansion:
        host_tz = ZoneInfo(config.host.timezone)
        seen: set[tuple[str, str, str]] = set()
        series: list[Series] = []
        problems: list[Problem] = []
        for raw in sorted(objects, key=lambda o: o.href):
            key = (calendar.url, raw.href, raw.etag or sha256(raw.ical.encode()).hexdigest())
            seen.add(key)
            if (parsed := self._cache.get(key)) is None:
                parsed = self._cache[key] = _kept(parse(raw), before=window_start - PAST_MARGIN)
            series.extend(parsed.series)
            problems.extend(parsed.problems)
        for stale in [k for k in self._cache if k[0] == calendar.url and k not in seen]:
            del self._cache[stale]

        holders: dict[str, int] = defaultdict(int)
        for one in series:
            holders[one.uid] += 1
        occurrences: list[Booking | Rejection] = []
        for one in series:
            try:
                found = self._bounded_expand(one, host_tz, window_start, window_end)
            except OverBound as over:
                occurrences.append(Rejection(
                    id=one.uid, uid=one.uid, start=window_start, end=window_end, reason=str(over),
                    user=None, calendar_url=calendar.url, href=one.href))
                continue
            except Exception as error:  # noqa: BLE001 - a hostile series must not stop the others
                reason = f"event {show(one.uid)} could not be expanded: {error_summary(error)}"
                problems.append(Problem(calendar.url, one.href, one.uid, reason))
                continue
            for component, occurrence_id, start, end in found:
                duplicate = holders[one.uid] > 1
                try:
                    occurrences.append(_occurrence(
                        component, one, occurrence_id=occurrence_id, start=start, end=end,
                        duplicate=duplicate, config=config, templates=templates,
                        host_tz=host_tz, calendar=calendar, topology=topology))
                except Exception as error:  # noqa: BLE001 - never lose an occurrence silently
                    occurrences.append(Rejection(
                        id=occurrence_id, uid=one.uid, start=start, end=end,
                        reason=f"the event cannot be read: {error_summary(error)}", user=None,
                        calendar_url=calendar.url, href=one.href))
        occurrences.sort(key=lambda o: (o.start, o.id, o.href))
        return Expansion(tuple(occurrences), tuple(problems))


    def _bounded_expand(self, series: Series, host_tz: tzinfo, window_start: datetime, window_end: datetime,
                        ) -> list[tuple[icalendar.Event, str, datetime, datetime]]:
        """Expand one series within the bounds; raise OverBound with the booker's sentence."""
        slow_key = expansion_digest(series)
        if (known := self._slow.get(slow_key)) is not None:
            raise OverBound(known)
        check_bounds(series, host_tz, window_start, window_end)
        began = self._clock()
        found = expand(series, host_tz, window_start, window_end)
        took = self._clock() - began
        if took > self._time_budget:
            reason = (f"reading this event's repeat rule took {took:.1f} s; gpubook spends at most "
                      f"{self._time_budget:g} s on one event, so it is not read again until it is edited")
            log.warning("event %s took %.1f s to expand and is rejected until it is edited",
                        show(series.uid), took)
            if len(self._slow) >= MAX_SLOW:
                del self._slow[next(iter(self._slow))]  # the oldest: a bound on what is remembered
            self._slow[slow_key] = reason
            raise OverBound(reason)
        if len(found) > MAX_OCCURRENCES:
            raise OverBound(too_many(window_end - window_start))
        return found


PAST_MARGIN = timedelta(days=1)  # beyond the window's start (a clock stepped back finds them still past)


def _kept(parsed: Parsed, *, before: datetime) -> Parsed:
    """What the cache keeps of an object: the whole parse, or, for one whose every event is over before
    `before` and repeats never (a booking long past), only its problems. A lab's calendar keeps its past
    bookings for years; their parses (about 8 KiB each) would make the daemon grow with them (found by
    bench/soak.py). Its next edit (another ETag) is parsed anew."""
    if parsed.series and all(_over(series, before) for series in parsed.series):
        return Parsed(series=[], problems=parsed.problems)
    return parsed


def _over(series: Series, before: datetime) -> bool:
    """A series that never repeats whose every event ends before `before` (else False: keep it)."""
    if series.recurring:
        return False
    for component in [*([series.master] if series.master is not None else []), *series.overrides]:
        if repeat_rules(component) or component.get("RDATE") is not None:
            return False
        start, end = component.get("DTSTART"), component.get("DTEND")
        moment = getattr(end, "dt", None) or getattr(start, "dt", None)
        if not isinstance(moment, datetime) or moment.tzinfo is None or moment >= before:
            return False  # all-day, floating or unreadable: not judged here
    return True


# Properties that never change an expansion: the booker's text, gpubook's write-back, stamps.
_NOT_EXPANDED = re.compile(
    rb"^(DESCRIPTION|X-ALT-DESC|X-GPUBOOK-[A-Z-]*|SUMMARY|LOCATION|ORGANIZER|ATTENDEE|DTSTAMP|LAST-MODIFIED|"
    rb"SEQUENCE|CREATED|COMMENT|CATEGORIES)[;:].*(\r?\n[ \t].*)*\r?\n", re.IGNORECASE | re.MULTILINE)


def expansion_digest(series: Series) -> str:
    """What the series' expansion depends on, hashed: its UID, times, rules and time zones."""
    if series.query_source:
        text = series.query_source
    else:
        text = b"".join(c.to_ical() for c in (*([series.master] if series.master else []), *series.overrides))
    return sha256(series.uid.encode() + b"\0" + _NOT_EXPANDED.sub(b"", text)).hexdigest()


# --- one occurrence ----------------------------------------------------------------------------


def _occurrence(component: icalendar.Event, series: Series, *, occurrence_id: str, start: datetime,
                end: datetime, duplicate: bool, config: Config, templates: Collection[str],
                host_tz: tzinfo, calendar: CalendarConfig, topology: Topology) -> Booking | Rejection:
    unfit = values.problem(component)  # every value the calendar gives, checked before anything reads it

    def reject(reason: str, user: str | None = None) -> Rejection:
        summary = text(component.get("SUMMARY"))
        return Rejection(id=occurrence_id, uid=series.uid, start=start, end=end, reason=reason,
                         user=user, calendar_url=calendar.url, href=series.href,
                         summary=values.shown(summary) if unfit else summary)

    if problem := booking_id_problem(occurrence_id):  # where the calendar is read, not only at the start
        return reject(problem)  # (round 3, M1: the plan and `gpubook bookings` listed it as accepted)
    if unfit:
        return reject(unfit)
    if duplicate:
        return reject(f"the UID {show(series.uid)} is used by more than one event in this "
                      "calendar, so they cannot be told apart; give each booking its own event")
    source = source_event(series, component, host_tz)
    if source is not None and (zone := _unknown_timezone(source)):
        return reject(f"time zone {show(zone)} is unknown (the calendar defines no VTIMEZONE for "
                      "it); use a time zone such as Europe/Paris")
    if source is not None and _inverted(source, host_tz):
        return reject("the booking ends before it starts; correct its end time")
    if end <= start:
        return reject("the booking starts and ends at the same time; give it an end time")
    try:
        asked = request(component, config=config, templates=templates, owner=calendar.user, topology=topology)
    except Refused as refused:
        return reject(refused.reason, refused.user)
    return Booking(
        id=occurrence_id, uid=series.uid, user=asked.user, template=asked.template,
        gpu_count=asked.gpu_count, gpu_indices=asked.gpu_indices, start=start, end=end,
        created=_stamp(component.get("CREATED"), host_tz),
        dtstamp=_stamp(component.get("DTSTAMP"), host_tz),
        calendar_url=calendar.url, href=series.href, summary=text(component.get("SUMMARY")), nodes=asked.nodes,
        project=asked.project, standby=asked.standby)


def _unknown_timezone(component: icalendar.Event) -> str | None:
    # icalendar leaves a time naive when its TZID is neither known nor defined in a VTIMEZONE;
    # reading it as floating would silently shift the booking.
    for name in ("DTSTART", "DTEND", "RECURRENCE-ID"):
        prop: Any = component.get(name)
        if prop is not None and "TZID" in prop.params and isinstance(prop.dt, datetime) \
                and prop.dt.tzinfo is None:
            return str(prop.params["TZID"])
    return None


def _inverted(component: icalendar.Event, host_tz: tzinfo) -> bool:
    # recurring-ical-events swaps an end before the start; a booking like that is a typo.
    duration = dt_of(component, "DURATION") if "DURATION" in component else None
    if isinstance(duration, timedelta):
        return duration < timedelta(0)
    if "DTEND" in component:
        return utc(dt_of(component, "DTEND"), host_tz) < utc(dt_of(component, "DTSTART"), host_tz)
    return False


def _stamp(prop: object, host_tz: tzinfo) -> datetime | None:
    value = getattr(prop, "dt", None)
    return utc(value, host_tz) if isinstance(value, date) else None
