"""Every value a calendar gives gpubook is checked in one place (gpubook/scheduler/core/values.py)
before any other code reads it (issue 36, beyond round three's findings): a property test feeds each
of an event's properties arbitrary text and checks that no control character reaches what a booking
becomes: its id, user, template and title (a container's environment and labels, booking.json, the
argv of every command gpubook runs for it), a refusal's sentence and summary (the event, the page),
and a log line."""

from __future__ import annotations

import io
import json
import logging
from datetime import UTC, datetime, timedelta

import icalendar
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from gpubook.logsafe import OneLineFormatter
from gpubook.runtime.booking.booking_json import Card
from gpubook.scheduler.core import values
from gpubook.scheduler.core.bookings import Booking, Rejection
from tests.kits.booking_kit import raw, read

PROPERTIES = ("UID", "SUMMARY", "LOCATION", "DESCRIPTION", "CATEGORIES", "ORGANIZER", "ATTENDEE")
START = datetime(2026, 11, 24, 9, tzinfo=UTC)
TEXT = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=200)


def _control(text: str) -> bool:
    return any(ord(c) < 32 or ord(c) == 0x7F for c in text)


def event(name: str, value: str) -> str:
    calendar = icalendar.Calendar()
    calendar.add("prodid", "-//gpubook tests//EN")
    calendar.add("version", "2.0")
    one = icalendar.Event()
    one.add("uid", value if name == "UID" else "values-test")
    one.add("dtstamp", START)
    one.add("dtstart", START)
    one.add("dtend", START + timedelta(hours=2))
    one.add("summary", value if name == "SUMMARY" else "alice debian-ssh")
    one.add("description", "user: alice\ngpus: 1\n" + (value if name == "DESCRIPTION" else ""))
    if name == "LOCATION":
        one.add("location", value)
    if name == "CATEGORIES":
        one.add("categories", [value or "x"])
    if name in ("ORGANIZER", "ATTENDEE"):
        one.add(name.lower(), f"mailto:alice{value}@lab.example")
    calendar.add_component(one)
    return calendar.to_ical().decode()


@pytest.mark.slow  # a second or more: out of the fast lane
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(PROPERTIES), value=TEXT)
def test_no_control_character_from_a_calendar_reaches_a_booking_a_refusal_a_file_or_a_log(name: str,
                                                                                          value: str) -> None:
    try:
        text = event(name, value)
    except ValueError:  # icalendar itself will not write it (a CR in an address): no client sends it
        assume(False)
    expansion = read(raw(text))
    for problem in expansion.problems:
        assert not _control(problem.reason), problem
    for item in expansion.occurrences:
        if isinstance(item, Booking):
            for field in (item.id, item.uid, item.user, item.template, item.summary):
                assert not _control(field.replace("\t", "")), (name, value, item)
            card = Card(booking=item.id, uid=item.uid, title=item.summary, user=item.user, start=item.start,
                        end=item.end, gpus=(0,), template=item.template, host="gpu1", port=2200)
            assert not _control(json.dumps(card.to_json(zone=UTC)))
        else:
            assert isinstance(item, Rejection)
            assert not _control(item.reason) and not _control(item.summary.replace("\t", "")), (name, value, item)
        written = io.StringIO()
        handler = logging.StreamHandler(written)
        handler.setFormatter(OneLineFormatter("%(message)s"))
        record = logging.LogRecord("gpubook", logging.WARNING, __file__, 1, "booking %s (%s): %s",
                                   (item.id, item.summary, getattr(item, "reason", "")), None)
        handler.emit(record)
        assert written.getvalue().count("\n") == 1 and not _control(written.getvalue()[:-1].replace("\t", ""))
    parsed = icalendar.Calendar.from_ical(text).walk("VEVENT")
    if parsed and (values.problem(parsed[0]) or _control(str(parsed[0].get("UID", "")))):
        assert not [o for o in expansion.occurrences if isinstance(o, Booking)], (name, value)  # refused


def test_each_property_is_named_in_its_refusal() -> None:
    for name in PROPERTIES:
        refused = [o for o in read(raw(event(name, "x\x07y"))).occurrences if isinstance(o, Rejection)]
        assert refused, name
        expected = "booking id" if name == "UID" else f"the event's {name} holds a control character (U+0007)"
        assert expected in refused[0].reason, (name, refused[0].reason)
    long = [o for o in read(raw(event("SUMMARY", "a" * 1001))).occurrences if isinstance(o, Rejection)]
    assert long and long[0].reason == "the event's SUMMARY is longer than 1000 characters; shorten it"
