"""Expanding one series (a UID's master and overrides) into its occurrences in a window, within bounds.

recurring-ical-events does the expansion; this module keeps any one event from stalling a poll
(issue 9, finding 4): before the library runs, a series whose rules alone say it is too big (too
many occurrences in the window, too many times to step through from DTSTART, or a rule that names
no day that exists) is refused with the booker's sentence (`OverBound`), and every rule is ended
at a horizon past the window, so a rule that never matches stops there, not in year 9999. The time
budget per event is kept by core/bookings.py's reader, which remembers the slow ones.

Floating and all-day times are placed on the time line here, in the host's time zone (`utc`).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from datetime import UTC, date, datetime, time, timedelta, tzinfo
from typing import Any

import icalendar
import recurring_ical_events

# Occurrences are asked for with this margin on both sides, then filtered exactly in UTC: floating
# and all-day times are only placed on the time line by us (host time zone), not by the library.
_MARGIN = timedelta(days=1)
# Bounds on one event's expansion, so that no event can stall a poll (issue 9, finding 4). The
# library steps through a rule's times from DTSTART and materialises the window's occurrences,
# so both are bounded before it runs, from the rule alone; a series over a bound is rejected.
MAX_OCCURRENCES = 1000  # occurrences of one event in the window read (a week and the margins)
MAX_STEPS = 100_000  # times of a rule stepped through from its DTSTART to the window's end
TIME_BUDGET = 1.0  # seconds one event's expansion may take; a slower one is rejected until edited
_DAY = timedelta(days=1)


@dataclass
class Series:
    """One UID's master (or lone overrides) and overrides, ready to expand."""

    uid: str
    href: str
    query: recurring_ical_events.CalendarQuery
    recurring: bool
    master: icalendar.Event | None
    overrides: list[icalendar.Event]
    # The query with every rule ending at a horizon past the window (UNTIL), rebuilt when the
    # horizon moves (once a day): a rule that never matches then stops there, not in year 9999.
    never: bool = False  # a rule whose day filters allow no day (see never_matches)
    query_source: bytes = b""  # the calendar the query reads (time zones and this UID's events)
    bounded: tuple[date, recurring_ical_events.CalendarQuery] | None = None


class OverBound(Exception):
    """A series over one of the expansion bounds; the message is the booker's sentence."""


def repeat_rules(component: icalendar.cal.Component | None) -> list[icalendar.vRecur]:
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


def too_many(window: timedelta) -> str:
    days = max(1, round(window / _DAY))
    return (f"this event repeats more than {MAX_OCCURRENCES} times in the next {days} days; gpubook "
            f"reads at most {MAX_OCCURRENCES} occurrences of one event, so book fewer, longer ones")


def check_bounds(series: Series, host_tz: tzinfo, window_start: datetime, window_end: datetime) -> None:
    """Reject, before the library runs, a series whose rules alone say it is too big: more
    occurrences in the window than MAX_OCCURRENCES, or more than MAX_STEPS times to step through
    from its DTSTART to the window (the library walks every one of them on every poll)."""
    rules = repeat_rules(series.master)
    if series.master is None or not rules:
        return
    if series.never:
        raise OverBound("this event's repeat rule names no day that exists (such as April 31), so "
                         "it never happens; correct the rule")
    per_day = sum(_per_day(rule) for rule in rules)
    span_days = (window_end - window_start + 2 * _MARGIN) / _DAY
    extra = len(series.overrides) + _rdate_count(series.master)
    if per_day * span_days + extra > MAX_OCCURRENCES:
        raise OverBound(too_many(window_end - window_start))
    first = utc(dt_of(series.master, "DTSTART"), host_tz)
    walked = max(0.0, (window_end + _MARGIN - first) / _DAY) * per_day
    if walked > MAX_STEPS:
        raise OverBound(
            f"this event repeats up to {per_day:g} times a day since {first:%Y-%m-%d}, so reading "
            f"the next days means stepping through more than {MAX_STEPS} of its times; gpubook "
            "steps through at most that many, so start the series closer to today (a new event)")


_WEEKDAYS = ("MO", "TU", "WE", "TH", "FR", "SA", "SU")
# 2000-2027: a whole 28-year cycle of weekdays and leap years (2000 is a leap year), so a date
# that the day filters allow at all appears in it.
_CYCLE = [date(2000, 1, 1) + n * _DAY for n in range((date(2028, 1, 1) - date(2000, 1, 1)).days)]


def never_matches(rule: icalendar.vRecur) -> bool:
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


def _query(series: Series, window_end: datetime) -> recurring_ical_events.CalendarQuery:
    """The series' query with its rules ending at the horizon (a day past the window's margin)."""
    if not repeat_rules(series.master):
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
    start = dt_of(component, "DTSTART") if "DTSTART" in component else None
    if isinstance(start, datetime):
        until: date | datetime = (datetime.combine(horizon, time(), UTC) if start.tzinfo
                                  else datetime.combine(horizon, time()))
    else:
        until = horizon
    for rule in repeat_rules(component):
        old = rule.get("UNTIL")
        old_value = old[0] if isinstance(old, list) and old else None
        if old_value is None or _until_after(old_value, until):
            rule["UNTIL"] = [until]


def _until_after(old: Any, until: date | datetime) -> bool:
    return utc(old, UTC) > utc(until, UTC)


def expand(series: Series, host_tz: tzinfo, window_start: datetime,
            window_end: datetime) -> list[tuple[icalendar.Event, str, datetime, datetime]]:
    found = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # dateutil warns when COUNT and UNTIL meet; both bound it
        components = _query(series, window_end).between(window_start - _MARGIN, window_end + _MARGIN)
    for component in components:
        if str(component.get("STATUS", "")).upper() == "CANCELLED":
            continue
        start = utc(dt_of(component, "DTSTART"), host_tz)
        end = utc(dt_of(component, "DTEND"), host_tz) if "DTEND" in component else start
        inside = (start < window_end and end > window_start) or (
            start == end and window_start <= start < window_end)
        if not inside:
            continue
        found.append((component, _occurrence_id(series, component, host_tz), start, end))
    return found


def _occurrence_id(series: Series, component: icalendar.Event, host_tz: tzinfo) -> str:
    if not series.recurring:
        return series.uid
    value = dt_of(component, "RECURRENCE-ID" if "RECURRENCE-ID" in component else "DTSTART")
    source = source_event(series, component, host_tz)
    if source is not None and "RECURRENCE-ID" in source \
            and str(source["RECURRENCE-ID"].params.get("RANGE", "")).upper() == "THISANDFUTURE" \
            and dt_of(component, "DTSTART") != dt_of(source, "DTSTART"):
        # A later occurrence moved by a RANGE=THISANDFUTURE override carries that override's
        # RECURRENCE-ID; its own original start is its start moved back by the same amount.
        moved_by = (utc(dt_of(source, "DTSTART"), host_tz)
                    - utc(dt_of(source, "RECURRENCE-ID"), host_tz))
        value = utc(dt_of(component, "DTSTART"), host_tz) - moved_by
    if isinstance(value, datetime):
        return f"{series.uid}@{utc(value, host_tz):%Y%m%dT%H%M%SZ}"
    return f"{series.uid}@{value:%Y%m%d}"


def source_event(series: Series, component: icalendar.Event, host_tz: tzinfo) -> icalendar.Event | None:
    """The VEVENT an occurrence comes from: its override, else the master."""
    if "RECURRENCE-ID" in component:
        key = utc(dt_of(component, "RECURRENCE-ID"), host_tz)
        for override in series.overrides:
            if utc(dt_of(override, "RECURRENCE-ID"), host_tz) == key:
                return override
    return series.master or (series.overrides[0] if series.overrides else None)


def utc(value: date | datetime, host_tz: tzinfo) -> datetime:
    """Place a calendar time on the time line: floating times and dates are host-local."""
    if isinstance(value, datetime):
        if value.tzinfo is None:
            value = value.replace(tzinfo=host_tz)
        return value.astimezone(UTC)
    return datetime.combine(value, time(), host_tz).astimezone(UTC)


def dt_of(component: icalendar.Component, name: str) -> Any:
    # icalendar types a property as a union of every value type; these names hold times.
    prop: Any = component[name]
    return prop.dt
