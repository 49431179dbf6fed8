"""One calendar object's text read into series ready to expand, and the problems found on the way.

icalendar reads the text (a bad VALARM is dropped and reported rather than losing the whole
object), x-wr-timezone turns X-WR-TIMEZONE into real time zones, and the VEVENTs are grouped by
UID into series (core/recurrence.py). What cannot become a series (an unreadable object, an event
without UID or start, a repeat rule the library refuses or one more frequent than hourly) becomes
a `Problem` naming the object.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import icalendar
import recurring_ical_events
import x_wr_timezone
from icalendar.parser import Contentlines

from gpubook.scheduler.core.convention import show, text
from gpubook.scheduler.core.recurrence import Series, never_matches, repeat_rules
from gpubook.scheduler.sources import RawObject

# Nobody books GPUs by the second or minute; such a rule would make millions of occurrences.
_TOO_FREQUENT = {"SECONDLY", "MINUTELY"}
_ProblemSink = Callable[[str | None, str], None]


@dataclass(frozen=True)
class Problem:
    """Something in a calendar that could not be tied to an occurrence (no UID, unreadable, …)."""

    calendar_url: str
    href: str
    uid: str | None
    reason: str


@dataclass
class Parsed:
    series: list[Series] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)


def parse(raw: RawObject) -> Parsed:
    parsed = Parsed()

    def problem(uid: str | None, reason: str) -> None:
        parsed.problems.append(Problem(raw.calendar_url, raw.href, uid, reason))

    if raw.refused:  # too large to download: the source says why, once per version of it
        problem(None, raw.refused)
        return parsed
    try:
        calendar = _read_calendar(raw.ical, problem)
        calendar = x_wr_timezone.to_standard(calendar)
    except Exception as error:  # noqa: BLE001 - any malformed text becomes a problem report
        problem(None, f"not a readable calendar object: {error_summary(error)}")
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
                             f"{error_summary(error)}")
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
        problem(None, f"reminders (VALARM) that could not be read were ignored: {error_summary(error)}")
    if not isinstance(calendar, icalendar.Calendar) or calendar.name != "VCALENDAR":
        raise ValueError("it holds no VCALENDAR")
    return calendar


def _drop_alarms(text: str) -> str:
    lines = Contentlines.from_ical(text)  # type: ignore[no-untyped-call]  # icalendar leaves it unannotated
    kept: list[str] = []
    depth = 0
    for line in lines:
        upper = str(line).upper()
        if upper.startswith("BEGIN:VALARM"):
            depth += 1
        elif upper.startswith("END:VALARM") and depth:
            depth -= 1
        elif not depth:
            kept.append(line)
    return "\r\n".join(str(line) for line in kept if str(line)) + "\r\n"


def _series(uid: str | None, href: str, group: list[icalendar.Event], timezones: list[icalendar.Timezone],
            problem: _ProblemSink) -> Series | None:
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
                     f"{error_summary(error)}")
        return None
    if uid is None:
        problem(None, f"an event {name} has no UID and was ignored; every event needs one")
        return None
    recurring = master is None or "RRULE" in master or "RDATE" in master or len(group) > 1
    return Series(uid, href, query, recurring, master, [c for c in group if c is not master],
                   never=any(never_matches(r) for r in repeat_rules(master)),
                   query_source=calendar.to_ical() if repeat_rules(master) else b"")


def error_summary(error: BaseException, limit: int = 200) -> str:
    text = f"{type(error).__name__}: {error}"
    return text if len(text) <= limit else text[:limit] + "…"
