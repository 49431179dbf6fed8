"""The booking convention and the expansion of hand-written events into occurrences."""

from __future__ import annotations

from datetime import timedelta

import icalendar
import pytest

from gpubook.scheduler.core.bookings import Booking, BookingReader, Rejection
from tests.kits.booking_kit import (
    CALENDAR,
    GPU1_CALENDAR,
    make_config,
    raw,
    read,
    single,
    utc,
    vcalendar,
    vevent,
)

START = "DTSTART:20261124T090000Z"
END = "DTEND:20261124T110000Z"


# --- who, which template, which GPUs --------------------------------------------------------


def test_description_lines_name_user_template_and_gpus() -> None:
    booking = single(START, END, "SUMMARY:training run",
                     "DESCRIPTION:user: bob\\nTemplate: tensorflow-cuda9\\nGPUS: 2\\n"
                     "please be nice")
    assert isinstance(booking, Booking)
    assert (booking.user, booking.template, booking.gpu_count, booking.gpu_indices) == (
        "bob", "tensorflow-cuda9", 2, None)
    assert (booking.id, booking.uid, booking.start, booking.end) == (
        "u1", "u1", utc(2026, 11, 24, 9), utc(2026, 11, 24, 11))
    assert booking.summary == "training run"
    assert booking.calendar_url == CALENDAR and booking.href == f"{CALENDAR}event.ics"
    assert booking.dtstamp == utc(2026, 11, 1, 12) and booking.created is None


def test_gpu_indices_in_the_description() -> None:
    booking = single(START, END, "DESCRIPTION:user: bob\\ngpus: 2, 0")
    assert (booking.gpu_count, booking.gpu_indices) == (2, (0, 2))
    one = single(START, END, "DESCRIPTION:user: bob\\ngpus: 3,")
    assert (one.gpu_count, one.gpu_indices) == (1, (3,))


def test_summary_short_form() -> None:
    booking = single(START, END, "SUMMARY:alice tensorflow-cuda9 gpus=2 big run")
    assert (booking.user, booking.template, booking.gpu_count, booking.gpu_indices) == (
        "alice", "tensorflow-cuda9", 2, None)
    indices = single(START, END, "SUMMARY:Bob digits-cuda8 gpus=0,3")
    assert (indices.user, indices.template, indices.gpu_indices) == ("bob", "digits-cuda8", (0, 3))


def test_description_wins_over_summary_and_location() -> None:
    booking = single(START, END, "SUMMARY:alice tensorflow-cuda9 gpus=2", "LOCATION:GPU 3",
                     "DESCRIPTION:user: bob\\ntemplate: digits-cuda8\\ngpus: 1")
    assert (booking.user, booking.template, booking.gpu_count, booking.gpu_indices) == (
        "bob", "digits-cuda8", 1, None)


def test_organizer_email_is_the_booker_and_defaults_fill_the_rest() -> None:
    booking = single(START, END, "ORGANIZER;CN=Alice:mailto:Alice@Lab.Example")
    assert (booking.user, booking.template, booking.gpu_count, booking.gpu_indices) == (
        "alice", "debian-ssh", 1, None)
    defaults = single(START, END, "ORGANIZER:mailto:alice@lab.example",
                      config=make_config(template="digits-cuda8", gpus=2))
    assert (defaults.template, defaults.gpu_count) == ("digits-cuda8", 2)


def test_user_line_names_the_booker_when_the_organizer_is_nobody_known() -> None:
    booking = single(START, END, "ORGANIZER:mailto:frontdesk@lab.example", "DESCRIPTION:user: carol")
    assert booking.user == "carol"
    assert single(START, END, "DESCRIPTION:user: carol").user == "carol"


def test_unknown_organizer_is_rejected_with_a_hint() -> None:
    rejection = single(START, END, "ORGANIZER:mailto:nobody@x")
    assert isinstance(rejection, Rejection)
    assert rejection.reason.startswith("nobody@x is not a known user; add `user: NAME`")
    assert (rejection.id, rejection.start, rejection.end) == ("u1", utc(2026, 11, 24, 9),
                                                              utc(2026, 11, 24, 11))


def test_no_booker_at_all_is_rejected() -> None:
    rejection = single(START, END, "SUMMARY:meeting")
    assert isinstance(rejection, Rejection)
    assert "names no user" in rejection.reason and "user: NAME" in rejection.reason


@pytest.mark.parametrize(("location", "indices"), [
    ("gpu 1", (1,)), ("GPU0,GPU2", (0, 2)), ("devbox1 GPUs 3, 1", (1, 3)), ("devbox1-gpu2", (2,)),
])
def test_location_names_gpus(location: str, indices: tuple[int, ...]) -> None:
    booking = single(START, END, "SUMMARY:alice", f"LOCATION:{location}")
    assert booking.gpu_indices == indices and booking.gpu_count == len(indices)


def test_location_without_gpu_is_ignored() -> None:
    booking = single(START, END, "SUMMARY:alice", "LOCATION:Room 101")
    assert (booking.gpu_count, booking.gpu_indices) == (1, None)


# --- hostile or wrong values ----------------------------------------------------------------


def _with_description(text: str) -> Booking | Rejection:
    event = icalendar.Event()
    event.add("uid", "u1")
    event.add("dtstamp", utc(2026, 11, 1))
    event.add("dtstart", utc(2026, 11, 24, 9))
    event.add("dtend", utc(2026, 11, 24, 11))
    event.add("description", text)
    calendar = icalendar.Calendar()
    calendar.add("version", "2.0")
    calendar.add("prodid", "-//gpubook tests//EN")
    calendar.add_component(event)
    result = read(raw(calendar.to_ical().decode()))
    assert len(result.occurrences) == 1 and not result.problems
    return result.occurrences[0]


@pytest.mark.parametrize(("value", "shown"), [
    ("../alice", "'../alice'"),
    ("alice/..", "'alice/..'"),
    ("alice;rm -rf ~", "'alice;rm -rf ~'"),
    ("$(id)", "'$(id)'"),
    ("al ice", "'al ice'"),
    ("alice\x1b[31m", "'alice\\x1b[31m'"),
    ("\u0430lice", "'\\u0430lice'"),  # Cyrillic a
    ("\uff41lice", "'\\uff41lice'"),  # full-width a: NFKC makes it "alice", still refused
    ("Zed", "'Zed'"),  # upper case is read in any case only for a configured user (`Alice` is alice)
    ("a" * 300, "'" + "a" * 40 + "…'"),
])
def test_bad_user_names_are_rejected_and_shown_safely(value: str, shown: str) -> None:
    rejection = _with_description(f"user: {value}")
    assert isinstance(rejection, Rejection)
    if "\x1b" in value:  # refused where every value is checked (core/values.py), before the name is read
        assert rejection.reason.startswith("the event's DESCRIPTION holds a control character (U+001B)")
    else:
        assert rejection.reason.startswith(f"user {shown} is not a valid user name"), rejection.reason
    assert rejection.reason.isascii() or "…" in rejection.reason


@pytest.mark.parametrize("value", ["../debian-ssh", "a/b", "x;y", "$(id)", "debian ssh",
                                   "d\u0435bian-ssh", "debian\x00ssh"])
def test_bad_template_names_are_rejected(value: str) -> None:
    rejection = _with_description(f"user: alice\ntemplate: {value}")
    assert isinstance(rejection, Rejection)
    if "\x00" in value:  # refused where every value is checked (core/values.py), before the name is read
        assert rejection.reason.startswith("the event's DESCRIPTION holds a control character (U+0000)")
        return
    assert "is not a valid template name" in rejection.reason and rejection.user == "alice"


@pytest.mark.parametrize(("value", "reason"), [
    ("-1", "gpus: '-1' is neither a number of GPUs (such as 2) nor a list of GPU indices"),
    ("all", "gpus: 'all' is neither a number of GPUs"),
    ("1.5", "gpus: '1.5' is neither a number of GPUs"),
    ("0,0", "gpus: '0,0' names GPU 0 twice"),
    ("0", "gpus: 0 asks for no GPU"),
    ("99999", "gpus: '99999' is neither"),
    ("\u0662", "gpus: '\\u0662' is neither"),  # an Arabic-Indic two
])
def test_bad_gpu_values_are_rejected(value: str, reason: str) -> None:
    rejection = _with_description(f"user: alice\ngpus: {value}")
    assert isinstance(rejection, Rejection)
    assert rejection.reason.startswith(reason), rejection.reason


def test_gpus_99_is_read_and_left_to_the_plan() -> None:
    booking = _with_description("user: alice\ngpus: 99")
    assert isinstance(booking, Booking) and booking.gpu_count == 99


def test_two_different_user_lines_are_rejected() -> None:
    rejection = _with_description("user: alice\nuser: bob")
    assert isinstance(rejection, Rejection) and "more than one `user:` line" in rejection.reason


def test_summary_naming_two_users_is_ambiguous() -> None:
    rejection = single(START, END, "SUMMARY:alice and bob")
    assert isinstance(rejection, Rejection) and "more than one user" in rejection.reason


# --- times ----------------------------------------------------------------------------------


def test_floating_time_is_host_local() -> None:
    booking = single("DTSTART:20261124T100000", "DTEND:20261124T120000", "SUMMARY:alice")
    assert (booking.start, booking.end) == (utc(2026, 11, 24, 9), utc(2026, 11, 24, 11))


def test_x_wr_timezone_places_floating_times() -> None:
    text = vcalendar(vevent("u1", "DTSTART:20261124T100000", "DTEND:20261124T120000",
                            "SUMMARY:alice"), header="X-WR-TIMEZONE:America/New_York")
    (booking,) = read(raw(text)).occurrences
    assert (booking.start, booking.end) == (utc(2026, 11, 24, 15), utc(2026, 11, 24, 17))


def test_all_day_event_is_host_midnight_to_midnight() -> None:
    booking = single("DTSTART;VALUE=DATE:20261124", "DTEND;VALUE=DATE:20261126", "SUMMARY:alice")
    assert (booking.start, booking.end) == (utc(2026, 11, 23, 23), utc(2026, 11, 25, 23))
    one_day = single("DTSTART;VALUE=DATE:20261124", "SUMMARY:alice")
    assert (one_day.start, one_day.end) == (utc(2026, 11, 23, 23), utc(2026, 11, 24, 23))


def test_duration_instead_of_dtend() -> None:
    booking = single("DTSTART;TZID=Europe/Berlin:20261124T100000", "DURATION:PT90M",
                     "SUMMARY:alice")
    assert (booking.start, booking.end) == (utc(2026, 11, 24, 9), utc(2026, 11, 24, 10, 30))


def test_windows_time_zone_name() -> None:
    booking = single("DTSTART;TZID=W. Europe Standard Time:20261124T100000",
                     "DTEND;TZID=W. Europe Standard Time:20261124T120000", "SUMMARY:alice")
    assert (booking.start, booking.end) == (utc(2026, 11, 24, 9), utc(2026, 11, 24, 11))


def test_unknown_time_zone_is_rejected() -> None:
    rejection = single("DTSTART;TZID=Mars/Olympus_Mons:20261124T100000",
                       "DTEND;TZID=Mars/Olympus_Mons:20261124T120000", "SUMMARY:alice")
    assert isinstance(rejection, Rejection)
    assert rejection.reason.startswith("time zone 'Mars/Olympus_Mons' is unknown")


def test_end_before_start_is_rejected() -> None:
    rejection = single(START, "DTEND:20261124T080000Z", "SUMMARY:alice")
    assert isinstance(rejection, Rejection) and "ends before it starts" in rejection.reason
    negative = single(START, "DURATION:-PT1H", "SUMMARY:alice")
    assert isinstance(negative, Rejection) and "ends before it starts" in negative.reason


@pytest.mark.parametrize("end", ["DTEND:20261124T090000Z", "DURATION:PT0S", None])
def test_zero_length_is_rejected(end: str | None) -> None:
    rejection = single(START, *([end] if end else []), "SUMMARY:alice")
    assert isinstance(rejection, Rejection)
    assert "starts and ends at the same time" in rejection.reason


def test_ten_year_booking_is_read_whole_for_the_plan_to_judge() -> None:
    booking = single(START, "DTEND:20361124T090000Z", "SUMMARY:alice")
    assert isinstance(booking, Booking) and booking.end == utc(2036, 11, 24, 9)


def test_window_overlap_bounds() -> None:
    running = single("DTSTART:20261122T090000Z", "DTEND:20261123T010000Z", "SUMMARY:alice")
    assert running.start == utc(2026, 11, 22, 9)  # started before the window, still running
    ended = read(raw(vcalendar(vevent("u1", "DTSTART:20261122T090000Z", "DTEND:20261123T000000Z",
                                      "SUMMARY:alice"))))
    assert ended.occurrences == () and ended.problems == ()
    later = read(raw(vcalendar(vevent("u1", "DTSTART:20261130T000000Z", "DTEND:20261130T010000Z",
                                      "SUMMARY:alice"))))
    assert later.occurrences == ()


# --- recurrence ---------------------------------------------------------------------------------


def test_recurring_ids_moves_exdates_and_cancellations() -> None:
    text = vcalendar(
        vevent("series", "DTSTART;TZID=Europe/Paris:20261120T100000",
               "DTEND;TZID=Europe/Paris:20261120T120000", "RRULE:FREQ=DAILY",
               "EXDATE;TZID=Europe/Paris:20261125T100000", "SUMMARY:alice"),
        vevent("series", "RECURRENCE-ID;TZID=Europe/Paris:20261126T100000",
               "DTSTART;TZID=Europe/Paris:20261126T140000",
               "DTEND;TZID=Europe/Paris:20261126T150000",
               "SUMMARY:alice gpus=2"),
        vevent("series", "RECURRENCE-ID;TZID=Europe/Paris:20261127T100000",
               "DTSTART;TZID=Europe/Paris:20261127T100000",
               "DTEND;TZID=Europe/Paris:20261127T120000",
               "STATUS:CANCELLED", "SUMMARY:alice"),
    )
    result = read(raw(text))
    got = [(o.id, o.start.hour, o.end.hour, o.gpu_count) for o in result.occurrences]
    assert got == [
        ("series@20261123T090000Z", 9, 11, 1),
        ("series@20261124T090000Z", 9, 11, 1),
        ("series@20261126T090000Z", 13, 14, 2),  # moved: keeps the id of its original start
        ("series@20261128T090000Z", 9, 11, 1),
        ("series@20261129T090000Z", 9, 11, 1),
    ]


def test_cancelled_single_event_is_dropped() -> None:
    result = read(raw(vcalendar(vevent("u1", START, END, "STATUS:CANCELLED", "SUMMARY:alice"))))
    assert result.occurrences == () and result.problems == ()


def test_moving_a_single_event_keeps_its_id() -> None:
    before = single(START, END, "SUMMARY:alice")
    after = single("DTSTART:20261125T130000Z", "DTEND:20261125T170000Z", "SUMMARY:alice")
    assert before.id == after.id == "u1"


def test_endless_rule_is_bounded_by_the_window() -> None:
    result = read(raw(vcalendar(vevent("u1", "DTSTART:20200101T090000Z", "DTEND:20200101T100000Z",
                                       "RRULE:FREQ=HOURLY", "SUMMARY:alice"))))
    assert len(result.occurrences) == 7 * 24
    assert result.occurrences[0].start == utc(2026, 11, 23, 0)
    assert result.occurrences[-1].start == utc(2026, 11, 29, 23)


def test_hundred_thousand_occurrences_only_window_expanded() -> None:
    result = read(raw(vcalendar(vevent("u1", "DTSTART:20260101T090000Z", "DTEND:20260101T093000Z",
                                       "RRULE:FREQ=HOURLY;COUNT=100000", "SUMMARY:alice"))))
    assert len(result.occurrences) == 7 * 24 and result.problems == ()


def test_rule_repeating_every_second_is_a_problem() -> None:
    result = read(raw(vcalendar(vevent("u1", START, "DTEND:20261124T090001Z", "RRULE:FREQ=SECONDLY",
                                       "SUMMARY:alice"))))
    assert result.occurrences == ()
    assert [p.reason for p in result.problems] == [
        "event 'u1' repeats every second; GPU bookings may repeat at most hourly, "
        "so it was ignored"]


# --- malformed objects and duplicates ------------------------------------------------------------


def test_event_without_start_is_a_problem_and_others_survive() -> None:
    text = vcalendar(vevent("nostart", END, "SUMMARY:alice"),
                     vevent("fine", START, END, "SUMMARY:alice"))
    result = read(raw(text))
    assert [o.id for o in result.occurrences] == ["fine"]
    assert [(p.uid, p.reason) for p in result.problems] == [
        ("nostart", "event 'nostart' has no start (DTSTART) and was ignored")]


@pytest.mark.parametrize("text", [
    "<html><body>Login required</body></html>",
    "BEGIN:VCALENDAR\r\nBEGIN:VEVENT\r\nUID:x\r\n",  # cut off
    "",
    "BEGIN:VEVENT\r\nUID:x\r\nDTSTART:20261124T090000Z\r\nEND:VEVENT\r\n",  # no VCALENDAR
    "BEGIN:VCALENDAR\r\nBEGIN:VEVENT\r\nUID:x\r\nDTSTART:2026-11-24\r\nEND:VEVENT\r\nEND:VCALENDAR\r\n",
])
def test_malformed_object_is_a_problem_not_a_crash(text: str) -> None:
    fine = raw(vcalendar(vevent("fine", START, END, "SUMMARY:alice")), "ok")
    result = read(raw(text, "bad"), fine)
    assert [o.id for o in result.occurrences] == ["fine"]
    assert len(result.problems) == 1
    assert result.problems[0].href.endswith("bad.ics")


def test_duplicate_uid_in_two_objects_rejects_all_in_any_order() -> None:
    first = raw(vcalendar(vevent("dup", START, END, "SUMMARY:alice")), "a")
    second = raw(vcalendar(vevent("dup", "DTSTART:20261125T090000Z", "DTEND:20261125T100000Z",
                                  "SUMMARY:bob")), "b")
    forward, backward = read(first, second), read(second, first)
    assert forward == backward
    assert len(forward.occurrences) == 2
    for rejection in forward.occurrences:
        assert isinstance(rejection, Rejection)
        assert rejection.reason.startswith("the UID 'dup' is used by more than one event")


def test_two_masters_with_one_uid_in_one_object_are_rejected() -> None:
    text = vcalendar(vevent("dup", START, END, "SUMMARY:alice"),
                     vevent("dup", "DTSTART:20261125T090000Z", "DTEND:20261125T100000Z",
                            "SUMMARY:bob"))
    result = read(raw(text))
    assert [type(o) for o in result.occurrences] == [Rejection, Rejection]
    assert all("'dup'" in o.reason for o in result.occurrences)


# --- the parse cache ----------------------------------------------------------------------------


def test_unchanged_etag_is_not_parsed_again_and_a_new_etag_is() -> None:
    reader = BookingReader()
    old = raw(vcalendar(vevent("u1", START, END, "SUMMARY:alice")), etag="v1")
    assert read(old, reader=reader).occurrences[0].user == "alice"
    # Same href and ETag means same content for a server; the cached parse answers.
    same_etag = raw(vcalendar(vevent("u1", START, END, "SUMMARY:bob")), etag="v1")
    assert read(same_etag, reader=reader).occurrences[0].user == "alice"
    new_etag = raw(vcalendar(vevent("u1", START, END, "SUMMARY:bob")), etag="v2")
    assert read(new_etag, reader=reader).occurrences[0].user == "bob"
    without_etag = raw(vcalendar(vevent("u1", START, END, "SUMMARY:carol")), etag=None)
    assert read(without_etag, reader=reader).occurrences[0].user == "carol"
    assert len(reader._cache) == 1  # what left the calendar left the cache


def test_a_booking_long_past_keeps_no_parse_and_an_edit_brings_it_back() -> None:
    """A lab's calendar keeps years of past bookings: the cache keeps no parse of an object whose events
    all ended over a day before the window (about 8 KiB each; the soak found the daemon growing with
    them), while a repeating one and one still in reach keep theirs."""
    reader = BookingReader()
    past = raw(vcalendar(vevent("old", "DTSTART:20260101T090000Z", "DTEND:20260101T100000Z", "SUMMARY:alice")),
               "old", etag="v1")
    repeating = raw(vcalendar(vevent("weekly", "DTSTART:20260105T090000Z", "DTEND:20260105T100000Z",
                                     "RRULE:FREQ=WEEKLY", "SUMMARY:bob")), "weekly", etag="v1")
    yesterday = raw(vcalendar(vevent("near", "DTSTART:20261122T090000Z", "DTEND:20261122T100000Z",
                                     "SUMMARY:carol")), "near", etag="v1")
    result = read(past, repeating, yesterday, reader=reader)
    assert {o.uid for o in result.occurrences} == {"weekly"}  # the week's occurrence of the series
    kept = {key[1].rsplit("/", 1)[-1]: parsed for key, parsed in reader._cache.items()}
    assert kept["old.ics"].series == [] and kept["weekly.ics"].series and kept["near.ics"].series
    # Moved into the window (a new ETag): read as any booking.
    moved = raw(vcalendar(vevent("old", START, END, "SUMMARY:alice")), "old", etag="v2")
    assert {o.uid for o in read(moved, repeating, reader=reader).occurrences} == {"old", "weekly"}


def test_cache_is_per_calendar() -> None:
    reader = BookingReader()
    text = vcalendar(vevent("u1", START, END, "SUMMARY:alice"))
    read(raw(text), reader=reader)
    other = read(raw(text, calendar_url=GPU1_CALENDAR), reader=reader, calendar_url=GPU1_CALENDAR)
    assert other.occurrences[0].calendar_url == GPU1_CALENDAR
    assert len(reader._cache) == 2


def test_window_moves_with_a_cached_parse() -> None:
    reader = BookingReader()
    text = raw(vcalendar(vevent("u1", "DTSTART:20261101T090000Z", "DTEND:20261101T100000Z",
                                "RRULE:FREQ=DAILY", "SUMMARY:alice")))
    first = read(text, reader=reader)
    second = read(text, reader=reader, start=utc(2026, 11, 24), end=utc(2026, 12, 1))
    assert first.occurrences[0].start == utc(2026, 11, 23, 9)
    assert second.occurrences[0].start == utc(2026, 11, 24, 9)
    assert second.occurrences[-1].start - first.occurrences[-1].start == timedelta(days=1)


def test_gpubooks_own_block_is_not_read_as_the_bookers_lines() -> None:
    import icalendar

    from gpubook.scheduler.sources import block as notify

    calendar = icalendar.Calendar.from_ical(vcalendar(vevent("u1", START, END, "DESCRIPTION:user: bob")))
    outcome = notify.accepted(gpus=[0, 1], template="digits-cuda8", start=utc(2026, 11, 24, 9),
                              end=utc(2026, 11, 24, 11), timezone="UTC").with_note("gpus: 0,1")
    assert notify.apply(calendar, uid="u1", occurrence=None, outcome=outcome) is True
    written = str(calendar.walk("VEVENT")[0]["DESCRIPTION"])
    assert "gpus: 0,1" in written and "user: bob" in written
    booking = single(START, END, "DESCRIPTION:" + written.replace("\n", "\\n"))
    assert isinstance(booking, Booking)
    assert (booking.user, booking.template, booking.gpu_count) == ("bob", "debian-ssh", 1)
