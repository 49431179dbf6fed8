"""Properties of the plan over generated bookings: no double booking, order never matters."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from datetime import timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpubook.scheduler.core.bookings import Booking, Rejection
from gpubook.scheduler.core.plan import Plan, Slot, plan, seen_key
from tests.kits.booking_kit import CALENDAR, GPU1_CALENDAR, TEMPLATES, make_config, utc

CONFIG = make_config()
INVENTORY = (0, 1, 2, 3)
NOW = utc(2026, 11, 24, 12)
BASE = utc(2026, 11, 24)
SETTINGS = settings(max_examples=200, deadline=None)


@st.composite
def items(draw: st.DrawFn, prefix: str = "b") -> list[Booking | Rejection]:
    count = draw(st.integers(min_value=0, max_value=25))
    result: list[Booking | Rejection] = []
    for number in range(count):
        start = BASE + timedelta(minutes=15 * draw(st.integers(0, 4 * 48)))
        end = start + timedelta(minutes=15 * draw(st.integers(1, 4 * 12)))
        # A small UID pool makes duplicates happen; ids stay unique so every item can be found.
        uid = draw(st.sampled_from([f"{prefix}{number}", f"{prefix}{number}", "shared"]))
        calendar = draw(st.sampled_from([CALENDAR, CALENDAR, GPU1_CALENDAR]))
        href = f"{calendar}{uid}.ics"
        if draw(st.integers(0, 9)) == 0:
            result.append(Rejection(id=f"{prefix}{number}", uid=uid, start=start, end=end,
                                    reason="refused earlier", user=None, calendar_url=calendar,
                                    href=href))
            continue
        indices = draw(st.one_of(st.none(), st.sets(st.integers(0, 4), min_size=1, max_size=3)))
        stamp = st.one_of(st.none(), st.sampled_from([utc(2026, 11, d) for d in (1, 2, 3)]))
        result.append(Booking(
            id=f"{prefix}{number}", uid=uid,
            user=draw(st.sampled_from(["alice", "bob", "bob", "carol", "mallory"])),
            template=draw(st.sampled_from(["debian-ssh", "debian-ssh", "tensorflow-cuda9", "x"])),
            gpu_count=len(indices) if indices else draw(st.integers(1, 4)),
            gpu_indices=tuple(sorted(indices)) if indices else None,
            start=start, end=end, created=draw(stamp), dtstamp=draw(stamp),
            calendar_url=calendar, href=href, summary=""))
    return result


def make_plan(bookings: list[Booking | Rejection],
              running: dict[str, tuple[int, ...]] | None = None) -> Plan:
    return plan(bookings, inventory=INVENTORY, config=CONFIG, templates=TEMPLATES, now=NOW,
                running=running or {})


def identity(item: Booking | Rejection) -> tuple[object, ...]:
    return (item.id, item.uid, item.calendar_url, item.href, item.start, item.end)


def assert_no_double_booking(result: Plan) -> None:
    accepted = result.accepted
    for position, first in enumerate(accepted):
        for second in accepted[position + 1:]:
            overlap = first.booking.start < second.booking.end and \
                second.booking.start < first.booking.end
            assert not (overlap and set(first.gpus) & set(second.gpus)), (first, second)


@pytest.mark.slow  # a second or more: out of the fast lane
@SETTINGS
@given(items())
def test_no_gpu_is_in_two_overlapping_accepted_bookings(
        bookings: list[Booking | Rejection]) -> None:
    result = make_plan(bookings)
    assert_no_double_booking(result)
    owned = {CALENDAR: set(INVENTORY), GPU1_CALENDAR: {1}}
    for accepted in result.accepted:
        assert len(accepted.gpus) == accepted.booking.gpu_count
        assert set(accepted.gpus) <= owned[accepted.booking.calendar_url]
        if accepted.booking.gpu_indices is not None:
            assert accepted.gpus == accepted.booking.gpu_indices


@pytest.mark.slow  # a second or more: out of the fast lane
@SETTINGS
@given(items(), st.randoms(use_true_random=False))
def test_the_plan_does_not_depend_on_input_order(bookings: list[Booking | Rejection],
                                                 random: object) -> None:
    shuffled = list(bookings)
    random.shuffle(shuffled)  # type: ignore[attr-defined]
    assert make_plan(shuffled) == make_plan(bookings)


@pytest.mark.slow  # a second or more: out of the fast lane
@SETTINGS
@given(items())
def test_every_occurrence_appears_exactly_once(bookings: list[Booking | Rejection]) -> None:
    result = make_plan(bookings)
    planned = [identity(a.booking) for a in result.accepted]
    planned += [identity(r) for r in result.rejected]
    assert Counter(planned) == Counter(identity(item) for item in bookings)


@pytest.mark.slow  # a second or more: out of the fast lane
@SETTINGS
@given(items(), items(prefix="new"), st.data())
def test_running_bookings_keep_their_gpus(bookings: list[Booking | Rejection],
                                          newcomers: list[Booking | Rejection],
                                          data: st.DataObject) -> None:
    first = make_plan(bookings)
    running = {a.booking.id: a.gpus for a in first.accepted if data.draw(st.booleans())}
    # Newcomers arrive with the earliest CREATED of all, and still cannot displace what runs.
    earliest = [replace(b, uid=f"new-{b.uid}", href=f"{b.href}.new") if isinstance(b, Rejection)
                else replace(b, uid=f"new-{b.uid}", href=f"{b.href}.new", created=utc(2020, 1, 1))
                for b in newcomers]
    second = make_plan(bookings + earliest, running=running)
    kept = {a.booking.id: a.gpus for a in second.accepted if a.booking.id in running}
    assert kept == running
    assert_no_double_booking(second)


@pytest.mark.slow  # a second or more: out of the fast lane
@SETTINGS
@given(items(), items(prefix="n"), st.sets(st.integers(0, 24), max_size=5), st.integers(1, 4 * 24))
def test_no_new_request_or_move_evicts_an_accepted_booking(
        bookings: list[Booking | Rejection], newcomers: list[Booking | Rejection], moved: set[int],
        shift: int) -> None:
    """Issue 22, finding 1: once accepted (its slot recorded as State records it), a booking keeps
    its GPUs whatever comes next: new requests with any CREATED, copies of its UID, and bookings
    that were refused or accepted before and are now moved anywhere (a move is a new request)."""
    first_pass, second_pass = utc(2026, 11, 20), utc(2026, 11, 21)
    before = plan(bookings, inventory=INVENTORY, config=CONFIG, templates=TEMPLATES, now=NOW,
                  first_seen={seen_key(b): first_pass for b in bookings})
    slots = {seen_key(b): Slot(seen_at=first_pass) for b in bookings}
    slots |= {seen_key(a.booking): Slot(seen_at=first_pass, accepted_at=first_pass, rank=a.rank,
                                        placement=a.placement) for a in before.accepted}
    later = [replace(b, start=b.start + timedelta(minutes=15 * shift), end=b.end + timedelta(minutes=15 * shift))
             if number in moved and isinstance(b, Booking) else b for number, b in enumerate(bookings)]
    for number in moved:  # State starts a moved occurrence's row afresh
        if number < len(later) and isinstance(later[number], Booking):
            slots[seen_key(later[number])] = Slot(seen_at=second_pass)
    everything = later + newcomers
    after = plan(everything, inventory=INVENTORY, config=CONFIG, templates=TEMPLATES, now=NOW,
                 first_seen={seen_key(b): first_pass for b in bookings} | {seen_key(b): second_pass for b in newcomers},
                 slots=slots)
    kept = {a.booking.id: a.gpus for a in after.accepted}
    unchanged = {b.id for number, b in enumerate(bookings) if number not in moved}
    for accepted in before.accepted:
        if accepted.booking.id in unchanged:
            assert kept.get(accepted.booking.id) == accepted.gpus, (accepted, after.rejected)
