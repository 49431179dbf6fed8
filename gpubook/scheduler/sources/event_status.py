"""The event's STATUS, where gpubook may say its answer there (pure, no I/O).

The host's attendee carries the answer (gpubook/scheduler/sources/attendee.py), but no client
tried draws another attendee's answer in its views. STATUS is what they draw (Thunderbird 153
and khal 0.10, tried for issue 24; docs/reference/event-block.md): Thunderbird fades a TENTATIVE
event (and fades and strikes through a CANCELLED one); khal prefixes a CANCELLED one.
So gpubook writes:

- ``TENTATIVE`` for a refused booking and for a held one (its start came, it does not run yet);
- ``CONFIRMED`` for an accepted, running or ended one, which draws like an event without STATUS
  and takes back a TENTATIVE gpubook wrote before (a refused booking moved to a free time).

Never ``CANCELLED``, though it draws the clearest "refused": gpubook's own reader skips cancelled
events (gpubook/scheduler/core/recurrence.py), so a booking fixed by its booker would never be
read again; a scheduling server (Sabre: Nextcloud, Baïkal) sends a CANCEL to every attendee of
an event whose organizer's copy becomes cancelled, and Thunderbird does on the next save; and
some clients hide cancelled events, the opposite of what the booker needs.

The booker's STATUS is never changed. gpubook writes STATUS only where the event has none, or
still has the one gpubook wrote (``X-GPUBOOK-OWNS-STATUS`` holds that value). A STATUS that
differs from it is the booker's: gpubook's mark goes and STATUS is theirs from then on.

Nor does gpubook change STATUS where a server schedules other attendees (an attendee without
``SCHEDULE-AGENT=CLIENT`` or ``NONE``): a scheduling server takes a STATUS change for a
significant one and sends each of them an update. There gpubook's own STATUS, if it wrote one
before the booker invited them, goes once, and the attendee alone carries the answer.
"""

from __future__ import annotations

from collections.abc import Sequence

import icalendar

from gpubook.scheduler.sources.attendee import Answer

PROPERTY = "STATUS"
MARK = "X-GPUBOOK-OWNS-STATUS"  # the STATUS gpubook wrote, so that it knows that one for its own
_STATUS = {Answer.ACCEPTED: "CONFIRMED", Answer.TENTATIVE: "TENTATIVE", Answer.DECLINED: "TENTATIVE"}
_UNSCHEDULED = ("CLIENT", "NONE")  # RFC 6638 SCHEDULE-AGENT values a server leaves alone


def status_of(answer: Answer) -> str:
    return _STATUS[answer]


def _value(component: icalendar.cal.Component, name: str) -> str | None:
    value = component.get(name)
    return None if value is None else str(value).strip().upper()


def _scheduled_by_a_server(component: icalendar.cal.Component, own: str) -> bool:
    """Whether a server would send updates to some attendee other than gpubook's (`own`)."""
    found = component.get("ATTENDEE")
    attendees: Sequence[object] = found if isinstance(found, list) else [] if found is None else [found]
    for attendee in attendees:
        agent = str(getattr(attendee, "params", {}).get("SCHEDULE-AGENT", "SERVER")).upper()
        if str(attendee).strip().lower() != own.lower() and agent not in _UNSCHEDULED:
            return True
    return False


def put(component: icalendar.cal.Component, answer: Answer, *, own_attendee: str) -> bool:
    """Make the event's STATUS say `answer` where gpubook may (module docstring); True if changed."""
    status, mark = _value(component, PROPERTY), _value(component, MARK)
    ours = mark is not None and status == mark
    if status is not None and not ours:  # the booker's: never touched; a stale mark goes
        return component.pop(MARK, None) is not None
    if _scheduled_by_a_server(component, own_attendee):
        if not ours:
            return False
        component.pop(PROPERTY, None)
        component.pop(MARK, None)
        return True
    wanted = status_of(answer)
    if ours and status == wanted:
        return False
    component.pop(PROPERTY, None)
    component.pop(MARK, None)
    component.add(PROPERTY, wanted)
    component.add(MARK, wanted)
    return True
