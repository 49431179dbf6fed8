"""gpubook's reminder in the booker's event: one VALARM of its own, never the booker's (pure, no I/O).

With `[policy] remind_minutes` set, an accepted booking's event carries one alarm that gpubook
owns, so that the booker's own calendar program reminds them before the start::

    BEGIN:VALARM
    UID:gpubook-<event UID>
    X-GPUBOOK-ALARM:1
    ACTION:DISPLAY
    TRIGGER;RELATED=START:-PT15M
    DESCRIPTION:gpubook: "training" starts in 15 min on devbox1 (1 GPU (0))
    END:VALARM

Ownership is the ``X-GPUBOOK-ALARM`` property (the VALARM ``UID`` of RFC 9074 says the same to
clients that know it): only such alarms are added, updated or removed here. The booker's own
alarms are never touched, not even re-ordered; a client that drops X- properties turns gpubook's
alarm into one of the booker's, which gpubook then leaves alone (a duplicate, never a loss).

A series keeps its alarm on the master, so that every occurrence rings; its text names no
occurrence (no port, no date): each occurrence's write-back then finds the same alarm and the
master is not rewritten once per occurrence. An overridden occurrence (RECURRENCE-ID) carries
its own copy, since iCalendar does not inherit VALARMs from the master into an override.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import icalendar

MARK_PROPERTY = "X-GPUBOOK-ALARM"


@dataclass(frozen=True)
class Reminder:
    """The alarm an accepted booking's event gets: `minutes` before its start.

    `text` names the booking; `detail` (its ssh line, its date) is added on a component that is
    one occurrence, and left out on a series' master, which serves every occurrence."""

    minutes: float
    text: str
    detail: str = ""

    def description(self, *, series: bool) -> str:
        return self.text if series or not self.detail else f"{self.text}; {self.detail}"


def _is_ours(component: icalendar.cal.Component) -> bool:
    return component.name == "VALARM" and MARK_PROPERTY in component


def _build(reminder: Reminder, *, uid: str, series: bool) -> icalendar.Alarm:
    alarm = icalendar.Alarm()
    alarm.add("uid", f"gpubook-{uid}")
    alarm.add(MARK_PROPERTY, "1")
    alarm.add("action", "DISPLAY")
    alarm.add("trigger", -timedelta(minutes=reminder.minutes), parameters={"RELATED": "START"})
    alarm.add("description", reminder.description(series=series))
    return alarm


def put(event: icalendar.cal.Component, reminder: Reminder | None, *, series: bool = False) -> bool:
    """Make gpubook's alarm in `event` say `reminder` (None: no alarm of gpubook's); True if changed.

    The booker's alarms stay where they are; gpubook's is replaced in place, or added last."""
    ours = [index for index, sub in enumerate(event.subcomponents) if _is_ours(sub)]
    wanted = _build(reminder, uid=str(event.get("UID", "")), series=series) if reminder is not None else None
    if wanted is not None and len(ours) == 1 and event.subcomponents[ours[0]].to_ical() == wanted.to_ical():
        return False
    if wanted is None and not ours:
        return False
    keep = [sub for sub in event.subcomponents if not _is_ours(sub)]
    if wanted is not None:
        keep.insert(ours[0] if ours else len(keep), wanted)
    event.subcomponents[:] = keep
    return True
