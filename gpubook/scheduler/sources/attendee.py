"""gpubook's answer as a room gives it: the booked host as a resource attendee (pure, no I/O).

Room booking in Exchange and Google Workspace (RFC 6638's room scheduling) puts the room into the
event as an attendee that accepts or declines. gpubook does the same for the booked host::

    ATTENDEE;CUTYPE=RESOURCE;ROLE=REQ-PARTICIPANT;PARTSTAT=ACCEPTED;RSVP=FALSE;
     SCHEDULE-AGENT=CLIENT;CN="devbox1 GPU 0,1":urn:x-gpubook:host:devbox1

- The address is the host's own, made of `[host] name`. It is how gpubook finds its attendee:
  the attendee with this exact address is replaced in place, and every other attendee (the
  booker's colleagues, a room, another server's resource) is never touched or re-ordered.
  It is a URN, not a ``mailto:``: a booker's Thunderbird that has their mail identity e-mails an
  invitation update to every mailto attendee when they move the booking (even with
  SCHEDULE-AGENT=CLIENT or NONE; tried on Thunderbird 153), and a scheduling server whose
  SCHEDULE-AGENT the client removed would do the same; neither sends anything to a URN.
  Thunderbird shows it as ``devbox1 GPU 0,1 <urn:...>``, khal as its last part (``devbox1``).
- ``SCHEDULE-AGENT=CLIENT`` (RFC 6638): no server schedules this attendee; gpubook is the client
  that answers for it. ``RSVP=FALSE``: no client asks it for a reply. A client that drops either
  has them back at gpubook's next write (the attendee differs, so it is written again).
- ``ROLE=REQ-PARTICIPANT``: the booking cannot happen without its GPUs, which is what "required"
  means; ``NON-PARTICIPANT`` ("for information only") would tell clients the opposite.
- ``PARTSTAT`` is the answer (`Answer`): ACCEPTED for an accepted, running or ended booking (an
  ended booking was accepted and ran: "ended" is in the block and X-GPUBOOK-STATUS), DECLINED for
  a refused one, TENTATIVE while an accepted booking's start has come but it is held (its GPUs
  still used, its image being prepared, its start failed and is tried again, the calendar data
  too old to start from). Thunderbird shows it as a badge on the attendee in the event's dialog
  and tooltip; no client tried draws another attendee's answer in its day or week view, which is
  why the event's STATUS says it too where gpubook may write it (gpubook/scheduler/sources/event_status.py).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

import icalendar

PREFIX = "urn:x-gpubook:host:"  # + the host's name (the urn:x- form of Apple's urn:x-uid: addresses)
PROPERTY = "ATTENDEE"


class Answer(StrEnum):
    ACCEPTED = "ACCEPTED"
    DECLINED = "DECLINED"
    TENTATIVE = "TENTATIVE"


@dataclass(frozen=True)
class Resource:
    """The booked host, and its GPUs where the booking has them (a refused booking has none)."""

    host: str
    gpus: tuple[int, ...] = ()

    @property
    def address(self) -> str:
        return address_of(self.host)

    @property
    def name(self) -> str:
        return f"{self.host} GPU {','.join(map(str, self.gpus))}" if self.gpus else f"{self.host} GPUs"


def address_of(host: str) -> str:
    """The host's cal-address: its name in lower case, characters other than letters, digits, `.`
    and `-` made `-` (a URN's allowed characters, none that a client would split on)."""
    name = re.sub(r"[^a-z0-9.-]+", "-", host.lower()).strip(".-") or "gpubook"
    return PREFIX + name


def _parameters(resource: Resource, answer: Answer) -> dict[str, str]:
    return {"CUTYPE": "RESOURCE", "ROLE": "REQ-PARTICIPANT", "PARTSTAT": str(answer), "RSVP": "FALSE",
            "SCHEDULE-AGENT": "CLIENT", "CN": resource.name}


def _attendees(component: icalendar.cal.Component) -> list[icalendar.vCalAddress]:
    found = component.get(PROPERTY)
    return found if isinstance(found, list) else [] if found is None else [found]


def _is(attendee: object, address: str) -> bool:
    return str(attendee).strip().lower() == address.lower()


def _said(attendee: object) -> tuple[str, dict[str, str]]:
    parameters = getattr(attendee, "params", {})
    return str(attendee).strip().lower(), {str(k).upper(): str(v) for k, v in parameters.items()}


def put(component: icalendar.cal.Component, resource: Resource, answer: Answer) -> bool:
    """Make the host's attendee in `component` say `answer`; True if it changed. Only the attendee
    with the host's address is written (in place, or added last); a second one of gpubook's, left
    by a client's copy, goes."""
    wanted = icalendar.vCalAddress(resource.address)
    wanted.params.update(_parameters(resource, answer))
    attendees: Sequence[icalendar.vCalAddress] = _attendees(component)
    ours = [index for index, attendee in enumerate(attendees) if _is(attendee, resource.address)]
    if len(ours) == 1 and _said(attendees[ours[0]]) == _said(wanted):
        return False
    kept = [attendee for attendee in attendees if not _is(attendee, resource.address)]
    kept.insert(ours[0] if ours else len(kept), wanted)
    component.pop(PROPERTY, None)
    for attendee in kept:
        component.add(PROPERTY, attendee, encode=False)
    return True
