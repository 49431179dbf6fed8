"""Times and lengths as people type them on a command line or in the page's form, one reader for every
command (`gpubook book --at`, `free` and `bookings --from/--to`, `report --from/--to`, the page).

A time: `now`, `now+2h`, `14:00` (today), `today`, `today 14:00`, `tomorrow 09:00`, `2026-12-01`,
`2026-12-01 09:00`, a month `2026-12` (its first day), or an ISO 8601 time (with its offset, or in
`zone`). A length: `2h`, `90m`, `1h30m`, `1d`, or a bare number of hours (`2`, `1.5`). A wrong one
is `TimeWords`, a sentence that says what is understood. Pure: `now` and `zone` are given.
"""

from __future__ import annotations

import re
from datetime import date, datetime, time, timedelta, tzinfo

MAX_HOURS = 24 * 31.0  # the longest length read at all (each command's own limits decide the rest)

_DURATION = re.compile(r"^\s*(?:(?P<days>\d+(?:\.\d+)?)\s*d)?\s*(?:(?P<hours>\d+(?:\.\d+)?)\s*h)?\s*"
                       r"(?:(?P<minutes>\d+(?:\.\d+)?)\s*m(?:in)?)?\s*$", re.IGNORECASE)
_CLOCK = re.compile(r"^(?P<hour>[01]?\d|2[0-3]):(?P<minute>[0-5]\d)$")
_RELATIVE = re.compile(r"^now\s*\+\s*(?P<span>.+)$", re.IGNORECASE)
_DATE = re.compile(r"^(?P<date>\d{4}-\d{2}-\d{2})(?:[ T](?P<clock>\d{1,2}:\d{2}))?$")
_MONTH = re.compile(r"^(?P<year>\d{4})-(?P<month>\d{2})$")
EXAMPLES = "now, now+2h, 14:00, today, tomorrow 09:00, 2026-12-01 09:00 or 2026-12"


class TimeWords(ValueError):
    """A time or length that is not understood; the message is the sentence to show."""


def duration(text: str, *, what: str = "a duration") -> timedelta:
    """`2h`, `90m`, `1h30m`, `1d`, or a bare number of hours; more than 0 and at most MAX_HOURS."""
    text = str(text).strip()
    if re.fullmatch(r"\d+(?:\.\d+)?", text):
        span = timedelta(hours=float(text))
    elif (match := _DURATION.match(text)) and any(match.groupdict().values()):
        parts = {key: float(value) for key, value in match.groupdict().items() if value}
        span = timedelta(days=parts.get("days", 0), hours=parts.get("hours", 0), minutes=parts.get("minutes", 0))
    else:
        raise TimeWords(f"{what} {text[:32]!r} is not understood: say e.g. 2h, 90m, 1h30m or 1d")
    if span <= timedelta(0) or span > timedelta(hours=MAX_HOURS):
        raise TimeWords(f"{what} {text[:32]!r} must be more than 0 and at most {MAX_HOURS / 24:g} days")
    return span


def moment(text: str, *, now: datetime, zone: tzinfo, what: str = "the start", end: bool = False) -> datetime:
    """The time `text` names, whole seconds, in `zone` unless it names its offset. `end`: the time
    ends a window, so a month named whole (`2026-12`) includes that month (its next month's first day)."""
    text = " ".join(str(text).split()).lower()
    now = now.replace(microsecond=0)  # an event's times are whole seconds
    local = now.astimezone(zone)
    if text in ("", "now"):
        return now
    if match := _RELATIVE.match(text):
        return now + duration(match.group("span"), what="the time after now")
    day, _, rest = text.partition(" ")
    if day in ("today", "tomorrow"):
        on = local.date() + timedelta(days=1 if day == "tomorrow" else 0)
        return datetime.combine(on, _clock(rest or "00:00", text), tzinfo=zone)
    if _CLOCK.match(text):
        return datetime.combine(local.date(), _clock(text, text), tzinfo=zone)
    if match := _DATE.match(text):
        try:
            on = datetime.strptime(match.group("date"), "%Y-%m-%d").date()
        except ValueError:
            raise TimeWords(f"{what} {text[:40]!r} is not a date") from None
        return datetime.combine(on, _clock(match.group("clock") or "00:00", text), tzinfo=zone)
    if match := _MONTH.match(text):
        first = datetime.combine(month_start(text, match, what=what), time(), tzinfo=zone)
        return after_month(first) if end else first
    try:
        parsed = datetime.fromisoformat(text.upper())
    except ValueError:
        raise TimeWords(f"{what} {text[:40]!r} is not understood: say {EXAMPLES}") from None
    return parsed if parsed.tzinfo is not None else parsed.replace(tzinfo=zone)


def after_month(start: datetime) -> datetime:
    """The first midnight of the month after `start`'s (a month named as an end includes the month)."""
    year, month = (start.year + 1, 1) if start.month == 12 else (start.year, start.month + 1)
    return start.replace(year=year, month=month, day=1)


def month_start(text: str, match: re.Match[str], *, what: str) -> date:
    try:
        return date(int(match.group("year")), int(match.group("month")), 1)
    except ValueError:
        raise TimeWords(f"{what} {text[:40]!r} is not a month") from None


def _clock(text: str, whole: str) -> time:
    match = _CLOCK.match(text.strip())
    if match is None:
        raise TimeWords(f"the time in {whole[:40]!r} is not understood: say HH:MM, e.g. 09:00")
    return time(int(match.group("hour")), int(match.group("minute")))
