"""The one place where every value a calendar gives gpubook is checked, before any other code reads
it (round 3 of the hostile review, "beyond the findings"): the UID, SUMMARY, LOCATION, DESCRIPTION,
ORGANIZER, ATTENDEE and CATEGORIES of an event carry no control character (a DESCRIPTION's line
breaks and tabs aside) and are of a sane length. An event that breaks the rule is refused with a
sentence naming the property; its text is never shown raw (the refusal's summary is escaped).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import icalendar

from gpubook.logsafe import one_line

# property → (longest value, the control characters it may hold)
LIMITS: dict[str, tuple[int, str]] = {
    "UID": (1000, ""),
    "SUMMARY": (1000, "\t"),
    "LOCATION": (1000, "\t"),
    "DESCRIPTION": (65536, "\t\n\r"),
    "ORGANIZER": (1000, ""),
    "ATTENDEE": (1000, ""),
    "CATEGORIES": (1000, "\t"),
}


# The control characters each value refuses (all of U+0000-U+001F and U+007F but those it allows), one
# compiled search per value: a character loop in Python cost a calendar of 1,000 events 0.3 s a read.
_CONTROL = {allowed: re.compile("[" + "".join(re.escape(chr(code)) for code in [*range(32), 0x7F]
                                              if chr(code) not in allowed) + "]")
            for allowed in {allowed for _, allowed in LIMITS.values()}}


def problem(component: icalendar.Event) -> str | None:
    """The sentence refusing `component` for one of its values, None when every one is fine."""
    for name, (limit, allowed) in LIMITS.items():
        for value in _values(component.get(name)):
            if len(value) > limit:
                return f"the event's {name} is longer than {limit} characters; shorten it"
            if (bad := _CONTROL[allowed].search(value)) is not None:
                return (f"the event's {name} holds a control character (U+{ord(bad.group()):04X}), which gpubook "
                        "passes nowhere; remove it")
    return None


def shown(text: str, *, limit: int = 200) -> str:
    """A value of a refused event as gpubook shows it: escaped, bounded."""
    return one_line(text[:limit])


def _values(prop: object) -> Iterable[str]:
    if prop is None:
        return ()
    items = prop if isinstance(prop, list) else [prop]
    found: list[str] = []
    for item in items:
        cats = getattr(item, "cats", None)  # CATEGORIES: a list of words
        if cats is not None:
            found.extend(str(c) for c in cats)
        else:
            found.append(str(item))
        found.extend(str(v) for v in getattr(item, "params", {}).values() if isinstance(v, str))  # CN=…
    return found
