"""The desk's pure parts (outbox/desk.py): times and lengths as people type them, the request's
values checked, the calendar that books for a user, and the event it writes."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path
from zoneinfo import ZoneInfo

import icalendar
import pytest

from gpubook.scheduler import config as config_module
from gpubook.scheduler.core import when
from gpubook.scheduler.core.bookings import Booking, BookingReader
from gpubook.scheduler.outbox import desk
from gpubook.scheduler.outbox.asking import AskError, Viewer
from gpubook.scheduler.sources import RawObject

PARIS = ZoneInfo("Europe/Paris")
NOW = datetime(2026, 11, 30, 15, 20, tzinfo=UTC)  # 16:20 in Paris


@pytest.mark.parametrize(("text", "expected"), [
    ("now", NOW),
    ("", NOW),
    ("now+2h", NOW + timedelta(hours=2)),
    ("now + 90m", NOW + timedelta(minutes=90)),
    ("18:00", datetime(2026, 11, 30, 18, 0, tzinfo=PARIS)),
    ("today 18:00", datetime(2026, 11, 30, 18, 0, tzinfo=PARIS)),
    ("tomorrow 09:00", datetime(2026, 12, 1, 9, 0, tzinfo=PARIS)),
    ("Tomorrow  9:30", datetime(2026, 12, 1, 9, 30, tzinfo=PARIS)),
    ("2026-12-03 09:00", datetime(2026, 12, 3, 9, 0, tzinfo=PARIS)),
    ("2026-12-03T09:00+00:00", datetime(2026, 12, 3, 9, 0, tzinfo=UTC)),
])
def test_a_start_as_people_type_it(text: str, expected: datetime) -> None:
    assert desk.moment(text, now=NOW, zone=PARIS) == expected


@pytest.mark.parametrize("text", ["next tuesday", "25:00", "tomorrow 9", "2026-13-01 09:00", "now+forever"])
def test_a_start_not_understood_is_one_sentence(text: str) -> None:
    with pytest.raises(AskError, match="not understood|is not a date"):
        desk.moment(text, now=NOW, zone=PARIS)


@pytest.mark.parametrize(("text", "expected"), [
    ("2026-12", datetime(2026, 12, 1, tzinfo=PARIS)),
    ("today", datetime(2026, 11, 30, tzinfo=PARIS)),
    ("now+90m", NOW.replace(microsecond=0) + timedelta(minutes=90)),
])
def test_a_month_today_and_a_time_after_now_read_as_people_mean_them(text: str, expected: datetime) -> None:
    assert when.moment(text, now=NOW, zone=PARIS) == expected
    # Only a month named whole ends a window after itself: as an end, the others are the same time.
    assert when.moment(text, now=NOW, zone=PARIS, end=True) == (
        when.after_month(expected) if text == "2026-12" else expected)


def test_a_month_as_a_windows_end_includes_the_month() -> None:
    assert when.after_month(datetime(2026, 12, 1, tzinfo=PARIS)) == datetime(2027, 1, 1, tzinfo=PARIS)
    assert when.after_month(datetime(2026, 2, 1, tzinfo=PARIS)) == datetime(2026, 3, 1, tzinfo=PARIS)
    with pytest.raises(when.TimeWords, match="the start '2026-13' is not a month"):
        when.moment("2026-13", now=NOW, zone=PARIS)


@pytest.mark.parametrize(("text", "hours"), [("2", 2), ("1.5", 1.5), ("2h", 2), ("90m", 1.5), ("1h30m", 1.5),
                                             ("1d", 24), ("45min", 0.75)])
def test_a_length_as_people_type_it(text: str, hours: float) -> None:
    assert desk.duration(text) == timedelta(hours=hours)


@pytest.mark.parametrize("text", ["0", "0h", "-1", "forever", "2 weeks", "999d"])
def test_a_length_that_is_no_length_is_refused(text: str) -> None:
    with pytest.raises(AskError):
        desk.duration(text)


def test_the_request_names_no_user_and_each_value_is_checked() -> None:
    read = desk.read_book({"gpus": 2, "hours": "3h", "at": "tomorrow 09:00", "template": "debian-ssh",
                           "title": "alice fine-tune"}, now=NOW, zone=PARIS)
    assert (read.gpus, read.template, read.title) == (2, "debian-ssh", "alice fine-tune")
    assert read.end - read.start == timedelta(hours=3)
    for bad, said in (({"user": "bob"}, "never for a user named in the request"),
                      ({"gpus": True}, "--gpus must be"), ({"gpus": "2"}, "--gpus must be"),
                      ({"template": "../etc"}, "is no template name"), ({"title": "a\nb"}, "one line"),
                      ({"at": "2026-11-29 09:00", "hours": "1"}, "would be over already")):
        with pytest.raises(AskError, match=said):
            desk.read_book(bad, now=NOW, zone=PARIS)


def _config(tmp_path: Path, calendars: str) -> config_module.Config:
    path = tmp_path / "gpubook.toml"
    path.write_text('[host]\nname = "devbox1"\ntimezone = "Europe/Paris"\n' + calendars
                    + "[users.alice]\nuid = 2001\n[users.bob]\nuid = 2002\n")
    return config_module.load(path)


def test_the_calendar_that_books_for_a_user_is_their_own_else_the_shared_one(tmp_path: Path) -> None:
    config = _config(tmp_path, '[[calendar]]\nurl = "http://127.0.0.1:9/shared/"\n'
                               '[[calendar]]\nurl = "http://127.0.0.1:9/alice/"\nuser = "alice"\n'
                               '[[calendar]]\nurl = "http://127.0.0.1:9/feed.ics"\nkind = "ics"\n')
    assert desk.calendar_for(config, "alice").url == "http://127.0.0.1:9/alice/"
    assert desk.calendar_for(config, "bob").url == "http://127.0.0.1:9/shared/"
    feed_only = _config(tmp_path, '[[calendar]]\nurl = "http://127.0.0.1:9/feed.ics"\nkind = "ics"\n')
    with pytest.raises(AskError, match="no CalDAV calendar books for alice"):
        desk.calendar_for(feed_only, "alice")


def test_who_books_is_the_askers_own_user() -> None:
    assert desk.user_of(Viewer(users=frozenset({"alice"}), login="al"), {}) == "alice"
    with pytest.raises(AskError, match="your login nobody is no gpubook user"):
        desk.user_of(Viewer(login="nobody"), {})
    both = Viewer(users=frozenset({"alice", "lab"}), login="al")
    with pytest.raises(AskError, match="say which with --as NAME"):
        desk.user_of(both, {})
    assert desk.user_of(both, {"as": "lab"}) == "lab"
    with pytest.raises(AskError, match="--as 'bob' is not one of your gpubook users"):
        desk.user_of(both, {"as": "bob"})


def test_the_event_written_reads_back_as_the_booking_asked_for(tmp_path: Path) -> None:
    """The convention's own reader reads the desk's event as the same booking (shared calendar: user line)."""
    config = _config(tmp_path, '[[calendar]]\nurl = "http://127.0.0.1:9/shared/"\n')
    booked = desk.read_book({"gpus": 2, "hours": "2h", "at": "tomorrow 09:00", "template": "debian-ssh"},
                            now=NOW, zone=PARIS)
    uid = desk.new_uid()
    text = desk.event_text(uid, booked, user="bob", shared=True, made_by="bob", host="devbox1", now=NOW)
    event = icalendar.Calendar.from_ical(text).walk("VEVENT")[0]
    assert "Made with `gpubook book` by bob on devbox1." in str(event["DESCRIPTION"])
    read = BookingReader().read([RawObject(href="http://127.0.0.1:9/shared/x.ics", etag='"1"', ical=text.decode(),
                                           calendar_url="http://127.0.0.1:9/shared/")],
                                config=config, calendar=config.calendars[0], templates=frozenset({"debian-ssh"}),
                                window_start=NOW, window_end=NOW + timedelta(days=7))
    (occurrence,) = read.occurrences
    assert isinstance(occurrence, Booking), occurrence
    assert (occurrence.id, occurrence.user, occurrence.gpu_count, occurrence.template) == (uid, "bob", 2,
                                                                                         "debian-ssh")
    assert (occurrence.start, occurrence.end) == (booked.start, booked.end)
