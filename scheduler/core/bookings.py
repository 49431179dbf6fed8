"""Turn raw calendar objects into booking occurrences: a `Booking`, or a `Rejection` saying why not.

Recurrence, time zones (VTIMEZONE, Windows names, X-WR-TIMEZONE), all-day events, DURATION and
moved or cancelled occurrences are left to icalendar, x-wr-timezone and recurring-ical-events;
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
import math
import time as clock
import warnings
from collections import defaultdict
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, time, timedelta, tzinfo
from hashlib import sha256
from typing import Any
from zoneinfo import ZoneInfo

import icalendar
import recurring_ical_events
import x_wr_timezone
from icalendar.parser import Contentlines

from scheduler.config import CalendarConfig, Config
from scheduler.core.convention import Refused, request, show, text
from scheduler.sources import RawObject

log = logging.getLogger(__name__)

# Occurrences are asked for with this margin on both sides, then filtered exactly in UTC: floating
# and all-day times are only placed on the time line by us (host time zone), not by the library.
_MARGIN = timedelta(days=1)
# Nobody books GPUs by the second or minute; such a rule would make millions of occurrences.
_TOO_FREQUENT = {"SECONDLY", "MINUTELY"}
# Bounds on one event's expansion, so that no event can stall a poll (issue 9, finding 4). The
# library steps through a rule's times from DTSTART and materialises the window's occurrences,
# so both are bounded before it runs, from the rule alone; a series over a bound is rejected.
MAX_OCCURRENCES = 1000  # occurrences of one event in the window read (a week and the margins)
MAX_STEPS = 100_000  # times of a rule stepped through from its DTSTART to the window's end
TIME_BUDGET = 1.0  # seconds one event's expansion may take; a slower one is rejected until edited
_DAY = timedelta(days=1)
_ProblemSink = Callable[[str | None, str], None]


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


@dataclass(frozen=True)
class Problem:
    """Something in a calendar that could not be tied to an occurrence (no UID, unreadable, …)."""

    calendar_url: str
    href: str
    uid: str | None
    reason: str


@dataclass(frozen=True)
class Expansion:
    occurrences: tuple[Booking | Rejection, ...]  # sorted by start, then id
    problems: tuple[Problem, ...]


@dataclass
class _Series:
    """One UID's master (or lone overrides) and overrides, ready to expand."""

    uid: str
    href: str
    query: recurring_ical_events.CalendarQuery
    recurring: bool
    master: icalendar.Event | None
    overrides: list[icalendar.Event]
    # The query with every rule ending at a horizon past the window (UNTIL), rebuilt when the
    # horizon moves (once a day): a rule that never matches then stops there, not in year 9999.
    never: bool = False  # a rule whose day filters allow no day (see _never_matches)
    query_source: bytes = b""  # the calendar the query reads (time zones and this UID's events)
    bounded: tuple[date, recurring_ical_events.CalendarQuery] | None = None


@dataclass
class _Parsed:
    series: list[_Series] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)


class BookingReader:
    """Expands calendars into occurrences, keeping each object's parse while its ETag is unchanged.

    One reader serves every calendar of the daemon; a poll that changed nothing re-parses nothing.
    Objects that disappear from a calendar leave the cache on that calendar's next read.
    """

    def __init__(self, *, clock: Callable[[], float] = clock.monotonic,
                 time_budget: float = TIME_BUDGET) -> None:
        self._cache: dict[tuple[str, str, str], _Parsed] = {}
        # Series whose expansion took longer than the budget: (calendar, href, etag, uid) → reason.
        self._slow: dict[tuple[str, str, str, str], str] = {}
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
    ) -> Expansion:
        host_tz = ZoneInfo(config.host.timezone)
        seen: set[tuple[str, str, str]] = set()
        series: list[_Series] = []
        problems: list[Problem] = []
        for raw in sorted(objects, key=lambda o: o.href):
            key = (calendar.url, raw.href, raw.etag or sha256(raw.ical.encode()).hexdigest())
            seen.add(key)
            if (parsed := self._cache.get(key)) is None:
                parsed = self._cache[key] = _parse(raw)
            series.extend(parsed.series)
            problems.extend(parsed.problems)
        for stale in [k for k in self._cache if k[0] == calendar.url and k not in seen]:
            del self._cache[stale]
        for stale_slow in [k for k in self._slow if k[0] == calendar.url and k[:3] not in seen]:
            del self._slow[stale_slow]
        keys = {(calendar.url, key[1]): key for key in seen}

        holders: dict[str, int] = defaultdict(int)
        for one in series:
            holders[one.uid] += 1
        occurrences: list[Booking | Rejection] = []
        for one in series:
            slow_key = (*keys[(calendar.url, one.href)], one.uid)
            try:
                found = self._bounded_expand(one, slow_key, host_tz, window_start, window_end)
            except _OverBound as over:
                occurrences.append(Rejection(
                    id=one.uid, uid=one.uid, start=window_start, end=window_end, reason=str(over),
                    user=None, calendar_url=calendar.url, href=one.href))
                continue
            except Exception as error:  # noqa: BLE001 - a hostile series must not stop the others
                reason = f"event {show(one.uid)} could not be expanded: {_short(error)}"
                problems.append(Problem(calendar.url, one.href, one.uid, reason))
                continue
            for component, occurrence_id, start, end in found:
                duplicate = holders[one.uid] > 1
                try:
                    occurrences.append(_occurrence(
                        component, one, occurrence_id=occurrence_id, start=start, end=end,
                        duplicate=duplicate, config=config, templates=templates,
                        host_tz=host_tz, calendar=calendar))
                except Exception as error:  # noqa: BLE001 - never lose an occurrence silently
                    occurrences.append(Rejection(
                        id=occurrence_id, uid=one.uid, start=start, end=end,
                        reason=f"the event cannot be read: {_short(error)}", user=None,
                        calendar_url=calendar.url, href=one.href))
        occurrences.sort(key=lambda o: (o.start, o.id, o.href))
        return Expansion(tuple(occurrences), tuple(problems))


    def _bounded_expand(self, series: _Series, slow_key: tuple[str, str, str, str], host_tz: tzinfo,
                        window_start: datetime, window_end: datetime,
                        ) -> list[tuple[icalendar.Event, str, datetime, datetime]]:
        """Expand one series within the bounds; raise _OverBound with the booker's sentence."""
        if (known := self._slow.get(slow_key)) is not None:
            raise _OverBound(known)
        _check_bounds(series, host_tz, window_start, window_end)
        began = self._clock()
        found = _expand(series, host_tz, window_start, window_end)
        took = self._clock() - began
        if took > self._time_budget:
            reason = (f"reading this event's repeat rule took {took:.1f} s; gpubook spends at most "
                      f"{self._time_budget:g} s on one event, so it is not read again until it is edited")
            log.warning("event %s took %.1f s to expand and is rejected until it is edited",
                        show(series.uid), took)
            self._slow[slow_key] = reason
            raise _OverBound(reason)
        if len(found) > MAX_OCCURRENCES:
            raise _OverBound(_too_many(window_end - window_start))
        return found


# --- parsing one calendar object -------------------------------------------------------------


def _parse(raw: RawObject) -> _Parsed:
    parsed = _Parsed()

    def problem(uid: str | None, reason: str) -> None:
        parsed.problems.append(Problem(raw.calendar_url, raw.href, uid, reason))

    try:
        calendar = _read_calendar(raw.ical, problem)
        calendar = x_wr_timezone.to_standard(calendar)
    except Exception as error:  # noqa: BLE001 - any malformed text becomes a problem report
        problem(None, f"not a readable calendar object: {_short(error)}")
        return parsed
    timezones = [c for c in calendar.subcomponents if c.name == "VTIMEZONE"]
    by_uid: dict[str | None, list[icalendar.Event]] = defaultdict(list)
    for component in calendar.subcomponents:
        if component.name == "VEVENT":
            uid = str(component.get("UID", "")).strip() or None
            by_uid[uid].append(component)
    for uid, components in by_uid.items():
        masters = [c for c in components if "RECURRENCE-ID" not in c]
        overrides = [c for c in components if "RECURRENCE-ID" in c]
        # Two masters with one UID are a duplicate: expand each alone so that all are rejected.
        groups = [[m, *overrides] for m in masters] if len(masters) > 1 else [components]
        for group in groups:
            try:
                series = _series(uid, raw.href, group, timezones, problem)
            except Exception as error:  # noqa: BLE001 - e.g. a broken property: report, skip
                problem(uid, f"event {show(uid or '')} cannot be read, so it was ignored: "
                             f"{_short(error)}")
                continue
            if series is not None:
                parsed.series.append(series)
    return parsed


def _read_calendar(text: str, problem: _ProblemSink) -> icalendar.Calendar:
    try:
        calendar = icalendar.Calendar.from_ical(text)
    except ValueError as error:
        # Reminders do not matter for a booking, and a bad VALARM (TRIGGER:PT-2H, seen from a
        # railway's ticket export) makes icalendar refuse the whole file: read it without them.
        without_alarms = _drop_alarms(text)
        if without_alarms == text:
            raise
        calendar = icalendar.Calendar.from_ical(without_alarms)
        problem(None, f"reminders (VALARM) that could not be read were ignored: {_short(error)}")
    if not isinstance(calendar, icalendar.Calendar) or calendar.name != "VCALENDAR":
        raise ValueError("it holds no VCALENDAR")
    return calendar


def _drop_alarms(text: str) -> str:
    lines = Contentlines.from_ical(text)
    kept, depth = [], 0
    for line in lines:
        upper = str(line).upper()
        if upper.startswith("BEGIN:VALARM"):
            depth += 1
        elif upper.startswith("END:VALARM") and depth:
            depth -= 1
        elif not depth:
            kept.append(line)
    return "\r\n".join(str(line) for line in kept if str(line)) + "\r\n"


def _series(uid: str | None, href: str, group: list[icalendar.Event], timezones: list,
            problem: _ProblemSink) -> _Series | None:
    master = next((c for c in group if "RECURRENCE-ID" not in c), None)
    title = text(group[0].get("SUMMARY"))
    name = repr(uid) if uid else f"without UID (titled {show(title)})"
    rule = master.get("RRULE") if master is not None else None
    rules = rule if isinstance(rule, list) else [rule]
    frequencies = {str(r.get("FREQ", [""])[0]).upper() for r in rules
                   if isinstance(r, icalendar.vRecur)}
    if frequencies & _TOO_FREQUENT:
        unit = "second" if "SECONDLY" in frequencies else "minute"
        problem(uid, f"event {name} repeats every {unit}; GPU bookings may repeat at most hourly, "
                     "so it was ignored")
        return None
    if any("DTSTART" not in c for c in group):
        problem(uid, f"event {name} has no start (DTSTART) and was ignored")
        return None
    calendar = icalendar.Calendar()
    for zone in timezones:
        calendar.add_component(zone)
    for component in group:
        calendar.add_component(component)
    try:
        query = recurring_ical_events.of(calendar)
    except Exception as error:  # noqa: BLE001 - e.g. Outlook's "BYDAY=MO, TU": report, skip
        problem(uid, f"the repeat rule of event {name} cannot be read, so it was ignored: "
                     f"{_short(error)}")
        return None
    if uid is None:
        problem(None, f"an event {name} has no UID and was ignored; every event needs one")
        return None
    recurring = master is None or "RRULE" in master or "RDATE" in master or len(group) > 1
    return _Series(uid, href, query, recurring, master, [c for c in group if c is not master],
                   never=any(_never_matches(r) for r in _rules(master)),
                   query_source=calendar.to_ical() if _rules(master) else b"")


# --- expanding one series ----------------------------------------------------------------------


class _OverBound(Exception):
    """A series over one of the expansion bounds; the message is the booker's sentence."""


def _rules(component: icalendar.cal.Component | None) -> list[icalendar.vRecur]:
    found = component.get("RRULE") if component is not None else None
    return [r for r in (found if isinstance(found, list) else [found]) if isinstance(r, icalendar.vRecur)]


def _sizes(rule: icalendar.vRecur, name: str) -> int:
    values = rule.get(name)
    return len(values) if isinstance(values, list) else int(values is not None)


def _per_day(rule: icalendar.vRecur) -> float:
    """At most how many times a rule gives in one day: each day holds at most one candidate day,
    times its hours, minutes and seconds (an HOURLY rule: every INTERVAL-th hour or its BYHOUR)."""
    frequency = str(rule.get("FREQ", [""])[0]).upper()
    interval = max(1, int(str(rule.get("INTERVAL", [1])[0]) or 1))
    hours = _sizes(rule, "BYHOUR")
    if frequency == "HOURLY":
        hours = min(hours or 24, math.ceil(24 / interval))
    return max(1, hours) * max(1, _sizes(rule, "BYMINUTE")) * max(1, _sizes(rule, "BYSECOND"))


def _too_many(window: timedelta) -> str:
    days = max(1, round(window / _DAY))
    return (f"this event repeats more than {MAX_OCCURRENCES} times in the next {days} days; gpubook "
            f"reads at most {MAX_OCCURRENCES} occurrences of one event, so book fewer, longer ones")


def _check_bounds(series: _Series, host_tz: tzinfo, window_start: datetime, window_end: datetime) -> None:
    """Reject, before the library runs, a series whose rules alone say it is too big: more
    occurrences in the window than MAX_OCCURRENCES, or more than MAX_STEPS times to step through
    from its DTSTART to the window (the library walks every one of them on every poll)."""
    rules = _rules(series.master)
    if series.master is None or not rules:
        return
    if series.never:
        raise _OverBound("this event's repeat rule names no day that exists (such as April 31), so "
                         "it never happens; correct the rule")
    per_day = sum(_per_day(rule) for rule in rules)
    span_days = (window_end - window_start + 2 * _MARGIN) / _DAY
    extra = len(series.overrides) + _rdate_count(series.master)
    if per_day * span_days + extra > MAX_OCCURRENCES:
        raise _OverBound(_too_many(window_end - window_start))
    first = _utc(_dt(series.master, "DTSTART"), host_tz)
    walked = max(0.0, (window_end + _MARGIN - first) / _DAY) * per_day
    if walked > MAX_STEPS:
        raise _OverBound(
            f"this event repeats up to {per_day:g} times a day since {first:%Y-%m-%d}, so reading "
            f"the next days means stepping through more than {MAX_STEPS} of its times; gpubook "
            "steps through at most that many, so start the series closer to today (a new event)")


_WEEKDAYS = ("MO", "TU", "WE", "TH", "FR", "SA", "SU")
# 2000-2027: a whole 28-year cycle of weekdays and leap years (2000 is a leap year), so a date
# that the day filters allow at all appears in it.
_CYCLE = [date(2000, 1, 1) + n * _DAY for n in range((date(2028, 1, 1) - date(2000, 1, 1)).days)]


def _never_matches(rule: icalendar.vRecur) -> bool:
    """Whether a rule's day filters (BYMONTH, BYMONTHDAY, BYYEARDAY, BYDAY's weekdays) allow no
    day at all, like BYMONTH=4;BYMONTHDAY=31: the library would step day by day to year 9999
    looking for one. Ordinals, BYWEEKNO and BYSETPOS only narrow a rule further and are left
    out, so a rule said to match may still not; the time budget is the bound for those."""
    def ints(name: str) -> set[int] | None:
        values = rule.get(name)
        return None if not values else {int(v) for v in values}

    months, monthdays, yeardays = ints("BYMONTH"), ints("BYMONTHDAY"), ints("BYYEARDAY")
    byday = rule.get("BYDAY")
    weekdays = {_WEEKDAYS.index(str(d)[-2:].upper()) for d in byday} if byday else None
    if monthdays is None and yeardays is None:
        return False  # months and weekdays alone always meet
    for day in _CYCLE:
        if months is not None and day.month not in months:
            continue
        if weekdays is not None and day.weekday() not in weekdays:
            continue
        if monthdays is not None:
            length = ((day.replace(day=28) + 4 * _DAY).replace(day=1) - _DAY).day
            if day.day not in monthdays and day.day - length - 1 not in monthdays:
                continue
        if yeardays is not None:
            ordinal = day.timetuple().tm_yday
            length = 366 if day.year % 4 == 0 else 365
            if ordinal not in yeardays and ordinal - length - 1 not in yeardays:
                continue
        return False
    return True


def _rdate_count(component: icalendar.Event) -> int:
    found = component.get("RDATE")
    return sum(len(getattr(one, "dts", [])) for one in (found if isinstance(found, list) else [found] if found else []))


def _query(series: _Series, window_end: datetime) -> recurring_ical_events.CalendarQuery:
    """The series' query with its rules ending at the horizon (a day past the window's margin)."""
    if not _rules(series.master):
        return series.query
    horizon = (window_end + _MARGIN).date() + _DAY
    if series.bounded is None or series.bounded[0] != horizon:
        calendar = icalendar.Calendar.from_ical(series.query_source)
        for component in calendar.walk("VEVENT"):
            _end_rules_at(component, horizon)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # dateutil warns when COUNT and UNTIL meet; both bound it
            series.bounded = (horizon, recurring_ical_events.of(calendar))
    return series.bounded[1]


def _end_rules_at(component: icalendar.cal.Component, horizon: date) -> None:
    """Give each RRULE an UNTIL no later than `horizon`, in the type its DTSTART needs."""
    start = _dt(component, "DTSTART") if "DTSTART" in component else None
    if isinstance(start, datetime):
        until: date | datetime = (datetime.combine(horizon, time(), UTC) if start.tzinfo
                                  else datetime.combine(horizon, time()))
    else:
        until = horizon
    for rule in _rules(component):
        old = rule.get("UNTIL")
        old_value = old[0] if isinstance(old, list) and old else None
        if old_value is None or _until_after(old_value, until):
            rule["UNTIL"] = [until]


def _until_after(old: Any, until: date | datetime) -> bool:
    return _utc(old, UTC) > _utc(until, UTC)


def _expand(series: _Series, host_tz: tzinfo, window_start: datetime,
            window_end: datetime) -> list[tuple[icalendar.Event, str, datetime, datetime]]:
    found = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # dateutil warns when COUNT and UNTIL meet; both bound it
        components = _query(series, window_end).between(window_start - _MARGIN, window_end + _MARGIN)
    for component in components:
        if str(component.get("STATUS", "")).upper() == "CANCELLED":
            continue
        start = _utc(_dt(component, "DTSTART"), host_tz)
        end = _utc(_dt(component, "DTEND"), host_tz) if "DTEND" in component else start
        inside = (start < window_end and end > window_start) or (
            start == end and window_start <= start < window_end)
        if not inside:
            continue
        found.append((component, _occurrence_id(series, component, host_tz), start, end))
    return found


def _occurrence_id(series: _Series, component: icalendar.Event, host_tz: tzinfo) -> str:
    if not series.recurring:
        return series.uid
    value = _dt(component, "RECURRENCE-ID" if "RECURRENCE-ID" in component else "DTSTART")
    source = _source(series, component, host_tz)
    if source is not None and "RECURRENCE-ID" in source \
            and str(source["RECURRENCE-ID"].params.get("RANGE", "")).upper() == "THISANDFUTURE" \
            and _dt(component, "DTSTART") != _dt(source, "DTSTART"):
        # A later occurrence moved by a RANGE=THISANDFUTURE override carries that override's
        # RECURRENCE-ID; its own original start is its start moved back by the same amount.
        moved_by = (_utc(_dt(source, "DTSTART"), host_tz)
                    - _utc(_dt(source, "RECURRENCE-ID"), host_tz))
        value = _utc(_dt(component, "DTSTART"), host_tz) - moved_by
    if isinstance(value, datetime):
        return f"{series.uid}@{_utc(value, host_tz):%Y%m%dT%H%M%SZ}"
    return f"{series.uid}@{value:%Y%m%d}"


def _source(series: _Series, component: icalendar.Event, host_tz: tzinfo) -> icalendar.Event | None:
    """The VEVENT an occurrence comes from: its override, else the master."""
    if "RECURRENCE-ID" in component:
        key = _utc(_dt(component, "RECURRENCE-ID"), host_tz)
        for override in series.overrides:
            if _utc(_dt(override, "RECURRENCE-ID"), host_tz) == key:
                return override
    return series.master or (series.overrides[0] if series.overrides else None)


def _utc(value: date | datetime, host_tz: tzinfo) -> datetime:
    """Place a calendar time on the time line: floating times and dates are host-local."""
    if isinstance(value, datetime):
        if value.tzinfo is None:
            value = value.replace(tzinfo=host_tz)
        return value.astimezone(UTC)
    return datetime.combine(value, time(), host_tz).astimezone(UTC)


# --- one occurrence ----------------------------------------------------------------------------


def _occurrence(component: icalendar.Event, series: _Series, *, occurrence_id: str, start: datetime,
                end: datetime, duplicate: bool, config: Config, templates: Collection[str],
                host_tz: tzinfo, calendar: CalendarConfig) -> Booking | Rejection:
    def reject(reason: str, user: str | None = None) -> Rejection:
        return Rejection(id=occurrence_id, uid=series.uid, start=start, end=end, reason=reason,
                         user=user, calendar_url=calendar.url, href=series.href)

    if duplicate:
        return reject(f"the UID {show(series.uid)} is used by more than one event in this "
                      "calendar, so they cannot be told apart; give each booking its own event")
    source = _source(series, component, host_tz)
    if source is not None and (zone := _unknown_timezone(source)):
        return reject(f"time zone {show(zone)} is unknown (the calendar defines no VTIMEZONE for "
                      "it); use a time zone such as Europe/Paris")
    if source is not None and _inverted(source, host_tz):
        return reject("the booking ends before it starts; correct its end time")
    if end <= start:
        return reject("the booking starts and ends at the same time; give it an end time")
    try:
        asked = request(component, config=config, templates=templates)
    except Refused as refused:
        return reject(refused.reason, refused.user)
    return Booking(
        id=occurrence_id, uid=series.uid, user=asked.user, template=asked.template,
        gpu_count=asked.gpu_count, gpu_indices=asked.gpu_indices, start=start, end=end,
        created=_stamp(component.get("CREATED"), host_tz),
        dtstamp=_stamp(component.get("DTSTAMP"), host_tz),
        calendar_url=calendar.url, href=series.href, summary=text(component.get("SUMMARY")))


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
    duration = _dt(component, "DURATION") if "DURATION" in component else None
    if isinstance(duration, timedelta):
        return duration < timedelta(0)
    if "DTEND" in component:
        return _utc(_dt(component, "DTEND"), host_tz) < _utc(_dt(component, "DTSTART"), host_tz)
    return False


def _dt(component: icalendar.Component, name: str) -> Any:
    # icalendar types a property as a union of every value type; these names hold times.
    prop: Any = component[name]
    return prop.dt


def _stamp(prop: object, host_tz: tzinfo) -> datetime | None:
    value = getattr(prop, "dt", None)
    return _utc(value, host_tz) if isinstance(value, date) else None


# --- the booking convention --------------------------------------------------------------------


def _short(error: BaseException, limit: int = 200) -> str:
    text = f"{type(error).__name__}: {error}"
    return text if len(text) <= limit else text[:limit] + "…"
