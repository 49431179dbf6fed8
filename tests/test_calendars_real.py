"""Real calendar exports (Google, Outlook/Exchange, Thunderbird, Nextcloud, …): exact occurrences.

The files come from the test suites of icalendar, recurring-ical-events, khal and x-wr-timezone
(tests/data/calendars/SOURCES.md). None follows the booking convention, so every occurrence is a
Rejection for want of a user: what is checked here is that each one is found, at the right time,
with a stable id, and that what cannot be read is reported.
"""

from __future__ import annotations

from datetime import datetime

import pytest

from gpubook.scheduler.core.bookings import Expansion, Rejection
from tests.kits.booking_kit import DATA, raw, read, utc


def expand_file(name: str, start: datetime, end: datetime) -> Expansion:
    return read(raw((DATA / name).read_text(encoding="utf-8"), name.removesuffix(".ics")),
                start=start, end=end)


def occurrences(name: str, start: datetime, end: datetime) -> list[tuple[str, str, str]]:
    """(id, start, end) of each occurrence, times in UTC as `YYYY-MM-DD HH:MM`."""
    result = expand_file(name, start, end)
    assert result.problems == (), result.problems
    ids = [o.id for o in result.occurrences]
    assert len(set(ids)) == len(ids), "occurrence ids must be unique"
    for occurrence in result.occurrences:
        assert isinstance(occurrence, Rejection) and "names no user" in occurrence.reason
    return [(o.id, f"{o.start:%Y-%m-%d %H:%M}", f"{o.end:%Y-%m-%d %H:%M}")
            for o in result.occurrences]


def test_google_monthly_series_with_a_moved_occurrence_and_x_wr_timezone() -> None:
    uid = "38m812jicsrer5gorh3mlp7qhc@google.com"
    result = expand_file("rie__issue_62_moved_event.ics", utc(2021, 11, 1), utc(2022, 3, 1))
    got = [(o.id, f"{o.start:%Y-%m-%d %H:%M}") for o in result.occurrences]
    # Last Friday of the month, 21:30 Berlin; December's moved to the 17th but keeps its id.
    assert got == [(f"{uid}@20211126T203000Z", "2021-11-26 20:30"),
                   (f"{uid}@20211231T203000Z", "2021-12-17 20:30"),
                   (f"{uid}@20220128T203000Z", "2022-01-28 20:30"),
                   (f"{uid}@20220225T203000Z", "2022-02-25 20:30")]
    # Google wrote DTSTART == DTEND: zero length is refused.
    assert all("starts and ends at the same time" in o.reason for o in result.occurrences)


def test_thunderbird_cancelled_occurrence_is_dropped() -> None:
    uid = "b65c2b5b-b785-4edc-9560-e0379036d1f2"
    assert occurrences("rie__issue_18_cancel_status.ics", utc(2020, 1, 1), utc(2020, 3, 1)) == [
        (f"{uid}@20200128T210000Z", "2020-01-28 21:00", "2020-01-28 22:00"),
        (f"{uid}@20200130T210000Z", "2020-01-30 21:00", "2020-01-30 22:00"),
    ]


def test_nextcloud_override_with_duration() -> None:
    uid = "5d4c6843-9300-4f91-8d88-6094d4b0b840"
    assert occurrences("rie__duration_edited.ics", utc(2019, 3, 1), utc(2019, 4, 1)) == [
        (f"{uid}@20190318T030000Z", "2019-03-18 03:00", "2019-03-18 04:00"),
        (f"{uid}@20190319T030000Z", "2019-03-19 03:00", "2019-03-19 06:00"),  # DURATION:PT3H
        (f"{uid}@20190320T030000Z", "2019-03-20 03:00", "2019-03-20 04:00"),
    ]


def test_thunderbird_occurrences_moved_earlier_and_later() -> None:
    uid = "a0c78729-30b1-4ba3-a86e-6aedd995d788"
    got = occurrences("rie__recurring_events_moved.ics", utc(2019, 3, 1), utc(2019, 3, 15))
    assert got == [
        (f"{uid}@20190307T010000Z", "2019-03-07 01:00", "2019-03-07 02:00"),
        (f"{uid}@20190308T010000Z", "2019-03-08 00:00", "2019-03-08 01:00"),  # an hour earlier
        (f"{uid}@20190309T010000Z", "2019-03-09 02:00", "2019-03-09 03:00"),  # an hour later
        (f"{uid}@20190310T010000Z", "2019-03-10 01:00", "2019-03-10 02:00"),
    ]


def test_exdates_in_utc_against_a_local_series_across_dst() -> None:
    uid = "SX2CURHKFTKKFFU3VUD7K"
    got = occurrences("rie__each_week_but_two_deleted.ics", utc(2019, 3, 1), utc(2019, 6, 1))
    # Eight weekly Mondays 00:30 Berlin, two deleted; summer time from 31 March.
    assert got == [
        (f"{uid}@20190303T233000Z", "2019-03-03 23:30", "2019-03-04 00:00"),
        (f"{uid}@20190317T233000Z", "2019-03-17 23:30", "2019-03-18 00:00"),
        (f"{uid}@20190331T223000Z", "2019-03-31 22:30", "2019-03-31 23:00"),
        (f"{uid}@20190407T223000Z", "2019-04-07 22:30", "2019-04-07 23:00"),
        (f"{uid}@20190414T223000Z", "2019-04-14 22:30", "2019-04-14 23:00"),
        (f"{uid}@20190421T223000Z", "2019-04-21 22:30", "2019-04-21 23:00"),
    ]


def test_exchange_all_day_series_with_windows_time_zone_overrides() -> None:
    black = ("040000008200E00074C5B7101A82E00800000000017E1BADC42ED601000000000000000"
             "010000000FBF1FBAE2E9FBC4D81F16854E2F4D51B")
    blue = ("040000008200E00074C5B7101A82E00800000000C6B92310C52ED601000000000000000"
            "010000000605B5A30BB664D469D7A9A45CF7F2FB3")
    got = occurrences("rie__issue_28_rrule_with_UTC_endinginZ.ics", utc(2020, 4, 1),
                      utc(2020, 5, 1))
    # All-day: host (Paris) midnight to midnight. The 16 April bin moved to the 17th; its
    # RECURRENCE-ID is an Outlook "GMT Standard Time" midnight.
    assert got == [
        (f"{black}@20200402", "2020-04-01 22:00", "2020-04-02 22:00"),
        (f"{blue}@20200409", "2020-04-08 22:00", "2020-04-09 22:00"),
        (f"{black}@20200415T230000Z", "2020-04-16 22:00", "2020-04-17 22:00"),
        (f"{blue}@20200423", "2020-04-22 22:00", "2020-04-23 22:00"),
        (f"{black}@20200430", "2020-04-29 22:00", "2020-04-30 22:00"),
    ]


def test_outlook_all_day_holidays() -> None:
    got = occurrences("rie__Germany.ics", utc(2015, 12, 20), utc(2016, 1, 10))
    assert [(start, end) for _, start, end in got] == [
        ("2015-12-24 23:00", "2015-12-25 23:00"),
        ("2015-12-25 23:00", "2015-12-26 23:00"),
        ("2015-12-31 23:00", "2016-01-01 23:00"),
    ]
    assert len(expand_file("rie__Germany.ics", utc(2000, 1, 1), utc(2030, 1, 1)).occurrences) == 159


def test_google_x_wr_timezone_with_utc_times_keeps_the_instant() -> None:
    assert occurrences("rie__x_wr_timezone_simple_events_issue_59.ics", utc(2021, 12, 1),
                       utc(2022, 1, 1)) == [
        ("3bc4jff97631or97ntnk75n4se@google.com", "2021-12-22 17:00", "2021-12-22 18:00"),
        ("14n7h56i35m32ukcq76s46d45p@google.com", "2021-12-23 02:00", "2021-12-23 03:00"),
    ]


def test_google_tzid_wins_over_a_stray_z() -> None:
    assert occurrences("x-wr-timezone__single-event-x-wr-timezone-not-used.in.ics",
                       utc(2021, 1, 1), utc(2022, 1, 1)) == [
        ("2tsd6j1s661b7pvlcuopnoa2fe@google.com", "2021-12-22 22:00", "2021-12-22 23:00")]


def test_weekly_series_across_a_dst_change_keeps_local_time() -> None:
    got = occurrences("rie__issue_48_daylight_aware_repeats.ics", utc(2020, 10, 19),
                      utc(2020, 11, 3))
    assert [(start, end) for _, start, end in got] == [
        ("2020-10-19 10:30", "2020-10-19 12:00"),  # 11:30 Lisbon summer time
        ("2020-10-26 11:30", "2020-10-26 13:00"),  # 11:30 Lisbon winter time
        ("2020-11-02 11:30", "2020-11-02 13:00"),
    ]


def test_booking_system_this_and_future_overrides_get_distinct_ids() -> None:
    got = occurrences("rie__issue_75_range_parameter.ics", utc(2024, 9, 10), utc(2024, 9, 26))
    assert got == [
        ("210@20240911T120000Z", "2024-09-11 12:00", "2024-09-11 14:00"),
        ("210@20240913T120000Z", "2024-09-13 09:00", "2024-09-13 16:00"),  # THISANDFUTURE
        ("210@20240914T090000Z", "2024-09-14 06:00", "2024-09-14 13:00"),  # RDATE, moved along
        ("210@20240915T120000Z", "2024-09-15 17:00", "2024-09-15 19:00"),
        ("210@20240917T120000Z", "2024-09-17 09:00", "2024-09-17 16:00"),
        ("210@20240919T120000Z", "2024-09-19 09:00", "2024-09-19 16:00"),
        ("210@20240921T120000Z", "2024-09-22 14:22", "2024-09-22 16:13"),  # second THISANDFUTURE
        ("210@20240923T120000Z", "2024-09-24 14:22", "2024-09-24 16:13"),
    ]


def test_endless_all_day_series_is_bounded_by_the_window() -> None:
    got = occurrences("rie__one_day_event_repeat_every_day.ics", utc(2026, 11, 23),
                      utc(2026, 11, 26))
    assert got == [
        ("UYDQSG9TH4DE0WM3QFL2J@20261123", "2026-11-22 23:00", "2026-11-23 23:00"),
        ("UYDQSG9TH4DE0WM3QFL2J@20261124", "2026-11-23 23:00", "2026-11-24 23:00"),
        ("UYDQSG9TH4DE0WM3QFL2J@20261125", "2026-11-24 23:00", "2026-11-25 23:00"),
        ("UYDQSG9TH4DE0WM3QFL2J@20261126", "2026-11-25 23:00", "2026-11-26 23:00"),
    ]


@pytest.mark.parametrize(("name", "uid", "start", "end"), [
    # Exchange meeting request, quoted Windows TZID with a 1601-based VTIMEZONE.
    ("icalendar__timezone_same_start.ics",
     "040000008200E00074C5B7101A82E0080000000090E19664858ED20100000000000000",
     "2017-02-24 20:00", "2017-02-24 20:30"),
    # Unquoted Windows TZID with spaces; Eastern daylight time on 28 October.
    ("icalendar__issue_836_do_not_quote_tzid.ics", "minimal-demo-event-est-20241028@example.com",
     "2024-10-28 21:00", "2024-10-28 22:00"),
])
def test_outlook_windows_time_zone_names(name: str, uid: str, start: str, end: str) -> None:
    assert occurrences(name, utc(2000, 1, 1), utc(2030, 1, 1)) == [(uid, start, end)]


@pytest.mark.slow  # a second or more: out of the fast lane
def test_google_overrides_without_their_series() -> None:
    name = "rie__issue_173_only_modifications_error.ics"
    uid = "_6krj2dhl74q34b9j60sj4b9k8h238b9p6gok2ba68gojgchl6cpj0h1o88_R20231009T130000@google.com"
    got = occurrences(name, utc(2024, 1, 1), utc(2024, 2, 1))
    # An accepted instance of somebody else's series: only the override is in the file.
    assert (f"{uid}@20240108T140000Z", "2024-01-08 16:00", "2024-01-08 16:40") in got
    assert len(occurrences(name, utc(2024, 6, 1), utc(2024, 7, 1))) == 90


def test_outlook_rule_with_spaces_is_reported_as_a_problem() -> None:
    result = expand_file("icalendar__issue_165_missing_event.ics", utc(2015, 1, 1), utc(2016, 1, 1))
    assert result.occurrences == ()
    (problem,) = result.problems
    assert problem.href.endswith("icalendar__issue_165_missing_event.ics")
    assert problem.reason.startswith(
        "the repeat rule of event without UID (titled 'Sprint 25 Daily Standup') cannot be read, "
        "so it was ignored: BadRuleStringFormat")


def test_event_without_uid_is_reported() -> None:
    result = expand_file("rie__issue_107_omitting_last_event.ics", utc(2023, 1, 1), utc(2024, 1, 1))
    assert result.occurrences == ()
    assert [p.reason for p in result.problems] == [
        "an event without UID (titled '') has no UID and was ignored; every event needs one"]


def test_invalid_alarm_is_reported_and_the_events_still_read() -> None:
    result = expand_file("khal__non_dst_error.ics", utc(2023, 1, 1), utc(2024, 1, 1))
    assert [p.reason for p in result.problems] == [
        "reminders (VALARM) that could not be read were ignored: "
        "InvalidCalendar: Invalid iCalendar duration: PT-2H"]
    assert [(o.id, f"{o.start:%Y-%m-%d %H:%M}", f"{o.end:%Y-%m-%d %H:%M}")
            for o in result.occurrences] == [
        ("4e3e3186-28c6-42d4-81cf-eb4f56d587f1", "2023-02-03 14:15", "2023-02-03 17:06"),
        ("28d25a55-84cd-4564-910b-088066fd5244", "2023-02-06 08:50", "2023-02-06 11:50"),
    ]
