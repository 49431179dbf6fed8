"""The plan, from plain data: who gets which GPUs, who is refused and why."""

from __future__ import annotations

import json
from datetime import datetime, timedelta

from gpubook.scheduler.core.bookings import Booking, Rejection
from gpubook.scheduler.core.plan import Plan, Slot, place_key, plan, seen_key, to_json
from tests.kits.booking_kit import (
    CALENDAR,
    GPU1_CALENDAR,
    TEMPLATES,
    booking,
    make_config,
    raw,
    read,
    utc,
    vcalendar,
    vevent,
)

NOW = utc(2026, 11, 23, 8)
CONFIG = make_config()
INVENTORY = (0, 1, 2, 3)


def run(*items: Booking | Rejection, running: dict[str, tuple[int, ...]] | None = None,
        inventory: tuple[int, ...] = INVENTORY, now: datetime = NOW,
        seen: dict[str, datetime] | None = None) -> Plan:
    """`seen`: booking id → when gpubook first saw it and accepted it at the slot it asks for now
    (keyed by `seen_key` for the plan)."""
    first_seen = {seen_key(item): (seen or {})[item.id] for item in items if item.id in (seen or {})}
    slots = {key: Slot(seen_at=at, accepted_at=at) for key, at in first_seen.items()}
    return plan(items, inventory=inventory, config=CONFIG, templates=TEMPLATES, now=now,
                running=running or {}, first_seen=first_seen, slots=slots)


def gpus(result: Plan) -> dict[str, tuple[int, ...]]:
    return {a.booking.id: a.gpus for a in result.accepted}


def reasons(result: Plan) -> dict[str, str]:
    return {r.id: r.reason for r in result.rejected}


def test_count_requests_get_the_lowest_free_gpus() -> None:
    result = run(booking("a", gpus=2, created=utc(2026, 11, 1)),
                 booking("b", user="bob", gpus=2, created=utc(2026, 11, 2)),
                 booking("c", user="bob", start=20, created=utc(2026, 11, 3)))
    assert gpus(result) == {"a": (0, 1), "b": (2, 3), "c": (0,)}
    assert result.rejected == ()


def test_indices_are_honoured() -> None:
    result = run(booking("a", indices=(1, 3)), booking("b", user="bob", gpus=2),
                 seen={"a": utc(2026, 11, 2), "b": utc(2026, 11, 1)})
    # b was seen first, so it is placed first on 0 and 1; a's GPU 1 is then taken.
    assert gpus(result) == {"b": (0, 1)}
    assert reasons(result)["a"].startswith("the GPUs asked for are taken: GPU 1 is booked by bob "
                                           "from 2026-11-24 11:00 to 13:00 (CET)")


def test_first_seen_wins_whatever_the_input_order() -> None:
    early = booking("late-uid", indices=(0,))
    late = booking("early-uid", user="bob", indices=(0,), start=11)
    seen = {"late-uid": utc(2026, 11, 1), "early-uid": utc(2026, 11, 2)}
    for order in ((early, late), (late, early)):
        result = run(*order, seen=seen)
        assert gpus(result) == {"late-uid": (0,)}
        assert reasons(result) == {"early-uid": "the GPUs asked for are taken: GPU 0 is booked by "
                                                "alice from 2026-11-24 11:00 to 13:00 (CET); "
                                                "GPU 0 is free tomorrow from 13:00 (CET)"}


def test_created_dtstamp_then_uid_break_ties_of_first_seen() -> None:
    same = utc(2026, 11, 1)
    seen = {"x": same, "y": same, "a": same, "b": same}
    by_created = run(booking("x", indices=(0,), created=utc(2026, 11, 2)),
                     booking("y", user="bob", indices=(0,), created=utc(2026, 10, 1)), seen=seen)
    assert gpus(by_created) == {"y": (0,)}
    by_stamp = run(booking("x", indices=(0,), created=same, dtstamp=utc(2026, 11, 5)),
                   booking("y", user="bob", indices=(0,), created=same, dtstamp=utc(2026, 11, 4)), seen=seen)
    assert gpus(by_stamp) == {"y": (0,)}
    by_uid = run(booking("y", user="bob", indices=(0,)), booking("x", indices=(0,)), seen=seen)
    assert gpus(by_uid) == {"x": (0,)}
    unseen_loses = run(booking("a", indices=(0,), created=utc(1970, 1, 1)),
                       booking("b", user="bob", indices=(0,)), seen={"b": same})
    assert gpus(unseen_loses) == {"b": (0,)}


def test_a_forged_created_or_dtstamp_does_not_win_a_conflict() -> None:
    """Hostile: CREATED and DTSTAMP are the client's; a booking stamped 1970, made after bob's,
    must not knock bob's booking out (it did while the plan ordered by CREATED)."""
    forged = booking("forged", indices=(0,), hours=0.02, created=utc(1970, 1, 1), dtstamp=utc(1970, 1, 1))
    real = booking("real", user="bob", indices=(0,), created=utc(2026, 11, 20), dtstamp=utc(2026, 11, 20))
    result = run(forged, real, seen={"real": utc(2026, 11, 20), "forged": utc(2026, 11, 22)})
    assert gpus(result) == {"real": (0,)}
    assert reasons(result)["forged"].startswith("the GPUs asked for are taken: GPU 0 is booked by bob")


def test_running_booking_keeps_its_gpus_against_an_earlier_created_one() -> None:
    result = run(booking("old", gpus=1, created=utc(2026, 1, 1)),
                 booking("runs", user="bob", gpus=1, created=utc(2026, 11, 1)),
                 running={"runs": (0,)})
    assert gpus(result) == {"runs": (0,), "old": (1,)}


def test_running_booking_whose_request_changed_is_planned_again() -> None:
    result = run(booking("runs", gpus=2), running={"runs": (3,)})
    assert gpus(result) == {"runs": (0, 1)}


def test_a_count_choice_is_stable_when_a_later_booking_appears() -> None:
    first = run(booking("a", gpus=1, created=utc(2026, 11, 1)))
    second = run(booking("a", gpus=1, created=utc(2026, 11, 1)),
                 booking("b", user="bob", indices=(1,), created=utc(2026, 11, 2)))
    assert gpus(first)["a"] == gpus(second)["a"] == (0,)


def test_a_count_none_of_which_is_free_is_said_in_words() -> None:
    """Not "only 0 of the 1 GPUs asked for are free" (issue 37)."""
    taken = booking("a", user="bob", gpus=4, created=utc(2026, 11, 1))
    one = reasons(run(taken, booking("b", gpus=1, start=11, created=utc(2026, 11, 2))))["b"]
    assert one.startswith("the GPU asked for is not free at that time: GPU 0 is booked by bob from "), one
    two = reasons(run(taken, booking("b", gpus=2, start=11, created=utc(2026, 11, 2))))["b"]
    assert two.startswith("none of the 2 GPUs asked for is free at that time: GPU 0 is booked by bob from "), two


def test_adjacent_bookings_do_not_conflict() -> None:
    result = run(booking("a", indices=(0,), start=10, hours=2),
                 booking("b", indices=(0,), start=12))
    assert gpus(result) == {"a": (0,), "b": (0,)}


def test_not_enough_free_gpus_names_who_holds_them() -> None:
    result = run(booking("a", user="bob", gpus=3, created=utc(2026, 11, 1)),
                 booking("b", gpus=2, start=11, created=utc(2026, 11, 2)))
    assert reasons(result) == {"b": "only 1 of the 2 GPUs asked for is free at that time: "
                                    "GPU 0 is booked by bob from 2026-11-24 11:00 to 13:00 (CET); "
                                    "GPU 1 is booked by bob from 2026-11-24 11:00 to 13:00 (CET); "
                                    "GPU 2 is booked by bob from 2026-11-24 11:00 to 13:00 (CET); "
                                    "GPUs 0,1 are free tomorrow from 13:00 (CET)"}


def test_static_rejections() -> None:
    result = run(
        booking("unknown-user", user="mallory"),
        booking("unknown-template", template="cuda-1"),
        booking("not-allowed", user="carol", template="tensorflow-cuda9"),
        booking("over-user-limit", gpus=3),
        booking("over-calendar", user="bob", gpus=99),
        booking("not-present", user="bob", indices=(7,)),
        booking("not-owned", user="bob", indices=(0,), calendar_url=GPU1_CALENDAR),
        booking("too-many-for-calendar", user="bob", gpus=2, calendar_url=GPU1_CALENDAR),
        booking("ten-years", start=0, hours=24 * 3652),
        booking("unknown-calendar", calendar_url="http://elsewhere/cal/"),
    )
    assert result.accepted == ()
    assert reasons(result) == {
        "unknown-user": "'mallory' is not a known user of devbox1",
        "unknown-template": "there is no template 'cuda-1' on devbox1 "
                            "(debian-ssh, digits-cuda8, tensorflow-cuda9)",
        "not-allowed": "carol may not use template 'tensorflow-cuda9' (allowed: debian-*)",
        "over-user-limit": "alice may book at most 2 GPUs; this booking asks for 3",
        "over-calendar": "this calendar books 4 GPUs of devbox1 (GPUs 0, 1, 2, 3); "
                         "this booking asks for 99",
        "not-present": "GPU 7 is not present on devbox1 (GPUs 0, 1, 2, 3)",
        "not-owned": "GPU 0 is not booked through this calendar (GPU 1)",
        "too-many-for-calendar": "this calendar books 1 GPU of devbox1 (GPU 1); "
                                 "this booking asks for 2",
        "ten-years": "the booking lasts 87648 hours; bookings may last at most 72 hours",
        "unknown-calendar": "the calendar http://elsewhere/cal/ is not configured on devbox1",
    }


def test_an_unconfigured_calendar_url_with_a_password_is_redacted_in_the_reason() -> None:
    """The reason goes into the event log and the status file: a password in the URL must not."""
    result = run(booking("a", calendar_url="https://alice:s3cret@elsewhere/cal/"))
    (reason,) = reasons(result).values()
    assert "s3cret" not in reason
    assert reason == "the calendar https://alice:***@elsewhere/cal/ is not configured on devbox1"


def test_calendar_gpus_missing_from_the_inventory() -> None:
    result = run(booking("a", calendar_url=GPU1_CALENDAR), inventory=(0,))
    assert reasons(result) == {"a": "this calendar books 0 GPUs of devbox1 (it has no GPU); "
                                    "this booking asks for 1"}


def test_a_refused_occurrence_seen_first_does_not_evict_an_accepted_booking() -> None:
    """Hostile (issue 22, finding 1): bob's event was seen long before alice's booking but refused
    (an unknown template), with CREATED forged to 1970; moved onto alice's accepted slot with a
    valid template, it comes after her (before, the earlier first-seen time won and evicted her)."""
    parked = booking("parked", user="bob", indices=(0, 1), created=utc(1970, 1, 1), dtstamp=utc(1970, 1, 1))
    alice = booking("alice", indices=(0, 1), created=utc(2026, 11, 22))
    first_seen = {seen_key(parked): utc(2026, 10, 1), seen_key(alice): utc(2026, 11, 22)}
    slots = {seen_key(parked): Slot(seen_at=NOW), seen_key(alice): Slot(seen_at=utc(2026, 11, 22),
                                                                    accepted_at=utc(2026, 11, 22))}
    for order in ((parked, alice), (alice, parked)):
        result = plan(order, inventory=INVENTORY, config=CONFIG, templates=TEMPLATES, now=NOW,
                      first_seen=first_seen, slots=slots)
        assert gpus(result) == {"alice": (0, 1)}
        assert reasons(result)["parked"].startswith("the GPUs asked for are taken: GPU 0 is booked by alice")


def test_bookings_accepted_together_keep_their_rank_whatever_their_created() -> None:
    """Hostile: two bookings accepted in one pass; bob forges his CREATED afterwards (same slot).
    The rank gpubook gave them decides, so he cannot take alice's GPU."""
    alice = booking("alice", indices=(0,), created=utc(2026, 11, 22))
    bob = booking("bob", user="bob", gpus=1, created=utc(1970, 1, 1))  # accepted second, on GPU 1
    at = utc(2026, 11, 22)
    slots = {seen_key(alice): Slot(seen_at=at, accepted_at=at, rank=0),
             seen_key(bob): Slot(seen_at=at, accepted_at=at, rank=1)}
    result = plan((bob, alice), inventory=(0, 1), config=CONFIG, templates=TEMPLATES, now=NOW, slots=slots)
    assert gpus(result) == {"alice": (0,), "bob": (1,)}
    assert {a.booking.id: a.rank for a in result.accepted} == {"alice": 0, "bob": 1}


def test_an_accepted_booking_keeps_its_gpus_when_one_ahead_of_it_goes() -> None:
    """A count booking keeps the GPUs it was given: when the booking ahead of it is deleted it does
    not slide onto the lower GPU and push out a booking that was accepted there after it."""
    at = utc(2026, 11, 22)
    b = booking("b", user="bob", gpus=1, start=11)  # 11-13; accepted on GPU 1 while a held GPU 0
    c = booking("c", user="carol", indices=(0,), start=12)  # 12-14 on GPU 0, accepted after b
    slots = {seen_key(b): Slot(seen_at=at, accepted_at=at, placement=(("local", (1,)),)),
             seen_key(c): Slot(seen_at=at, accepted_at=at + timedelta(minutes=1))}
    result = plan((b, c), inventory=(0, 1), config=CONFIG, templates=TEMPLATES, now=NOW, slots=slots)
    assert gpus(result) == {"b": (1,), "c": (0,)}
    # Without its record b is a new request placed on the lowest free GPU (and c, new too, loses).
    fresh = plan((b, c), inventory=(0, 1), config=CONFIG, templates=TEMPLATES, now=NOW)
    assert gpus(fresh) == {"b": (0,)}


def test_gpu1_calendar_books_gpu1() -> None:
    result = run(booking("a", calendar_url=GPU1_CALENDAR))
    assert gpus(result) == {"a": (1,)}


def test_a_copied_uid_belongs_to_the_event_seen_first() -> None:
    """Hostile: a running booking's UID copied into another calendar; the copy is refused and the
    original, seen first, keeps its GPUs (before, both were refused and the container stopped)."""
    original = booking("a", uid="shared")
    copy = booking("a", uid="shared", calendar_url=GPU1_CALENDAR, user="bob")
    seen = {seen_key(original): utc(2026, 11, 20), seen_key(copy): utc(2026, 11, 24)}
    for order in ((original, copy), (copy, original)):
        result = plan(order, inventory=INVENTORY, config=CONFIG, templates=TEMPLATES, now=NOW,
                      running={"a": (0,)}, first_seen=seen)
        assert [(a.booking.href, a.gpus) for a in result.accepted] == [(original.href, (0,))]
        assert [(r.href, r.reason) for r in result.rejected] == [
            (copy.href, "the UID 'shared' already belongs to an event in another calendar, which gpubook "
                        "saw first; give each booking its own event")]  # never its path (round 3, L4)
    twin = booking("a", uid="shared", user="bob", href=f"{CALENDAR}copy.ics")  # in the same calendar: named
    result = plan((original, twin), inventory=INVENTORY, config=CONFIG, templates=TEMPLATES, now=NOW,
                  first_seen={seen_key(original): utc(2026, 11, 20), seen_key(twin): utc(2026, 11, 24)})
    assert [r.reason for r in result.rejected] == [
        f"the UID 'shared' already belongs to the event {original.href}, which gpubook saw first; give each "
        "booking its own event"]


def test_a_copy_of_a_repeating_bookings_uid_never_ties_with_it_once_old_occurrences_left_the_window() -> None:
    """Round 3, H3: mallory copies the UID of alice's daily booking into her own calendar. Ten days
    later every occurrence in the window was first seen by both places in the same pass: they tied,
    both were refused, and alice's running occurrence was stopped. The object's own first-seen
    (place_key) keeps alice's place first; and a place whose occurrence runs keeps the UID even
    where nothing else tells them apart."""
    original = booking("a", uid="daily")
    copy = booking("a", uid="daily", calendar_url=GPU1_CALENDAR, user="bob")
    same_pass = utc(2026, 11, 24)  # the occurrence entered the window for both at once
    seen = {seen_key(original): same_pass, seen_key(copy): same_pass,
            place_key(original): utc(2026, 11, 10), place_key(copy): utc(2026, 11, 12)}
    result = plan((copy, original), inventory=INVENTORY, config=CONFIG, templates=TEMPLATES, now=NOW,
                  running={"a": (0,)}, first_seen=seen)
    assert [a.booking.href for a in result.accepted] == [original.href]
    assert [r.href for r in result.rejected] == [copy.href]
    # A tie on every time (the records lost): the place whose accepted occurrence runs keeps it.
    tied = {key: same_pass for key in seen}
    slots = {seen_key(original): Slot(seen_at=same_pass, accepted_at=same_pass)}
    result = plan((copy, original), inventory=INVENTORY, config=CONFIG, templates=TEMPLATES, now=NOW,
                  running={"a": (0,)}, first_seen=tied, slots=slots)
    assert [a.booking.href for a in result.accepted] == [original.href]
    # Nothing at all tells two new objects apart: both refused, as before.
    result = plan((copy, original), inventory=INVENTORY, config=CONFIG, templates=TEMPLATES, now=NOW,
                  first_seen=tied)
    assert result.accepted == () and len(result.rejected) == 2
    assert all("1 other calendar" in r.reason and "devbox1-gpu1" not in r.reason or r.href == copy.href
               for r in result.rejected)


def test_same_uid_in_two_calendars_is_rejected_everywhere() -> None:
    result = run(booking("a", uid="shared"), booking("b", uid="shared", calendar_url=GPU1_CALENDAR),
                 booking("c"))
    assert gpus(result) == {"c": (0,)}
    assert set(reasons(result)) == {"a", "b"}
    assert all(r.startswith("the UID 'shared' is used by events in more than one place")
               for r in reasons(result).values())


def test_rejections_pass_through() -> None:
    refused = Rejection(id="r", uid="r", start=utc(2026, 11, 24, 9), end=utc(2026, 11, 24, 10),
                        reason="the booking names no user", user=None, calendar_url=CALENDAR,
                        href=f"{CALENDAR}r.ics")
    result = run(refused, booking("a"))
    assert result.rejected == (refused,)


def test_warning_time_and_next_wakeup() -> None:
    result = run(booking("a", start=10, hours=2), booking("b", start=30, hours=0.1))
    warn = {a.booking.id: a.warn_at for a in result.accepted}
    assert warn == {"a": utc(2026, 11, 24, 11, 45), "b": utc(2026, 11, 25, 6)}  # not before start
    assert result.next_wakeup == utc(2026, 11, 24, 10)
    during = run(booking("a", start=10, hours=2), now=utc(2026, 11, 24, 11))
    assert during.next_wakeup == utc(2026, 11, 24, 11, 45)
    after = run(booking("a", start=10, hours=2), now=utc(2026, 11, 24, 12))
    assert after.next_wakeup is None and len(after.accepted) == 1
    assert run().next_wakeup is None


def test_json_shape() -> None:
    refused = Rejection(id="r", uid="r", start=utc(2026, 11, 24, 9), end=utc(2026, 11, 24, 10),
                        reason="because", user=None, calendar_url=CALENDAR, href=f"{CALENDAR}r.ics")
    document = to_json(run(booking("a@20261124T100000Z", uid="a", gpus=2), refused))
    assert document == {
        "accepted": [{"id": "a@20261124T100000Z", "uid": "a", "user": "alice", "gpus": [0, 1],
                      "template": "debian-ssh", "start": "2026-11-24T10:00:00+00:00",
                      "end": "2026-11-24T12:00:00+00:00"}],
        "rejected": [{"id": "r", "uid": "r", "start": "2026-11-24T09:00:00+00:00",
                      "end": "2026-11-24T10:00:00+00:00", "reason": "because"}],
    }
    assert json.loads(json.dumps(document)) == document


def test_from_calendar_text_to_plan() -> None:
    text = vcalendar(
        vevent("train", "DTSTART;TZID=Europe/Paris:20261124T100000",
               "DTEND;TZID=Europe/Paris:20261124T180000", "CREATED:20261101T000000Z",
               "SUMMARY:alice tensorflow-cuda9 gpus=2"),
        vevent("clash", "DTSTART;TZID=Europe/Paris:20261124T120000",
               "DTEND;TZID=Europe/Paris:20261124T130000", "CREATED:20261102T000000Z",
               "DESCRIPTION:user: bob\\ngpus: 1,"),
        vevent("weekly", "DTSTART;TZID=Europe/Paris:20261123T200000",
               "DTEND;TZID=Europe/Paris:20261123T230000", "RRULE:FREQ=WEEKLY",
               "ORGANIZER:mailto:carol@lab.example", "LOCATION:gpu 3"),
    )
    expansion = read(raw(text))
    # gpubook saw "train" before "clash" (CREATED says the same, but it takes no part).
    seen = {seen_key(item): utc(2026, 11, 1 if item.uid != "clash" else 2) for item in expansion.occurrences}
    result = plan(expansion.occurrences, inventory=INVENTORY, config=CONFIG, templates=TEMPLATES,
                  now=NOW, first_seen=seen)
    assert [(a.booking.id, a.booking.user, a.gpus) for a in result.accepted] == [
        ("weekly@20261123T190000Z", "carol", (3,)), ("train", "alice", (0, 1))]
    assert [(r.id, r.reason) for r in result.rejected] == [
        ("clash", "the GPUs asked for are taken: GPU 1 is booked by alice from 2026-11-24 10:00 "
                  "to 18:00 (CET); GPU 1 is free tomorrow from 18:00 (CET)")]


def test_a_refusal_names_the_other_booker_only_in_the_same_calendar() -> None:
    """Round 3, L4: the refusal is written into the refused event, in its booker's own calendar: a
    booker of another calendar (per-user calendars) is not named there; one of the same calendar is."""
    first = booking("a", indices=(1,), created=utc(2026, 11, 1))
    across = booking("b", user="bob", indices=(1,), calendar_url=GPU1_CALENDAR, created=utc(2026, 11, 2))
    reason = reasons(run(first, across))["b"]
    assert reason.startswith("the GPUs asked for are taken: GPU 1 is booked from ") and "alice" not in reason
    same = booking("c", user="bob", indices=(1,), created=utc(2026, 11, 2))
    assert reasons(run(first, same))["c"].startswith("the GPUs asked for are taken: GPU 1 is booked by alice from ")


def test_a_user_who_left_the_directorys_group_keeps_a_running_booking_and_no_other() -> None:
    """Issue 38: bob left the group at 10:15; his running booking runs to its end, his later one and
    one that had not started are refused with a sentence that says why; alice is not touched."""
    import dataclasses

    left = dataclasses.replace(CONFIG, departed_users={"bob": utc(2026, 11, 24, 10, 15)})
    now = utc(2026, 11, 24, 10, 30)
    items = (booking("runs", user="bob", start=10), booking("later", user="bob", start=14),
             booking("alices", start=14))
    result = plan(items, inventory=INVENTORY, config=left, templates=TEMPLATES, now=now, running={"runs": (0,)})
    assert set(gpus(result)) == {"runs", "alices"}
    assert reasons(result) == {"later": "bob is no longer among the bookers of devbox1 (not in the directory's group "
                                        "since 2026-11-24 11:15 CET); only a booking that was running then runs on, to "
                                        "its end"}
    # Without the departure, both of bob's bookings are his as before.
    assert set(gpus(run(*items, running={"runs": (0,)}, now=now))) == {"runs", "later", "alices"}
