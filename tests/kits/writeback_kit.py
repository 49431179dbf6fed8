"""What the write-back tests share (tests/test_notify.py, bench/writeback.py): a booker's event with
their own text, put into a real CalDAV server through the booker's own client."""

from __future__ import annotations

from collections.abc import Iterator

import caldav
import icalendar

from tests.kits import servers

USER_TEXT = "template: debian-ssh\ngpus: 1\n\nTraining the ünïcode model; notes for myself:\n  - step 1"


def booker_event(uid: str = "b1@lab", description: str | None = USER_TEXT, rrule: str | None = None,
                 extra: str = "") -> str:
    lines = ["BEGIN:VCALENDAR", "VERSION:2.0", "PRODID:-//gpubook tests//EN", "BEGIN:VEVENT", f"UID:{uid}",
             "DTSTAMP:20261120T100000Z", "DTSTART:20261123T080000Z", "DTEND:20261123T160000Z",
             "SUMMARY:alice training", "SEQUENCE:3"]
    if description is not None:
        lines.append("DESCRIPTION:" + icalendar.vText(description).to_ical().decode())
    if rrule:
        lines.append(f"RRULE:{rrule}")
    lines += ["END:VEVENT", *([extra] if extra else []), "END:VCALENDAR"]
    return "\r\n".join(lines) + "\r\n"


# The servers of tests/kits/servers.py; Radicale's "none" auth takes this name (owner of the calendars),
# Xandikos ignores credentials.
USER, PASSWORD = "test", "any"


def calendar_on(kind: str) -> Iterator[str]:
    with servers.running(getattr(servers, kind)) as server:
        yield str(server.new_calendar().url)


def booker_calendar(url: str) -> caldav.Calendar:
    """The booker's own calendar client: a separate connection, as Thunderbird would be."""
    return caldav.DAVClient(url=url, username=USER, password=PASSWORD).calendar(url=url)


def put_event(url: str, text: str) -> str:
    return str(booker_calendar(url).save_event(text).url)
