"""Free GPU time from the plan (gpubook/scheduler/core/free.py), and the refusal that names the next
free slots: each slot named is checked against the plan itself (no accepted booking on its GPUs)."""

from __future__ import annotations

import re
from dataclasses import replace
from datetime import datetime, timedelta
from zoneinfo import ZoneInfo

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpubook.scheduler.core import free
from gpubook.scheduler.core.bookings import Booking
from gpubook.scheduler.core.plan import LOCAL, Plan, plan
from gpubook.scheduler.core.topology import CLUSTER
from tests.kits.booking_kit import CALENDAR, TEMPLATES, booking, make_config, utc
from tests.kits.policy_kit import booking as policy_booking
from tests.kits.policy_kit import config as policy_config

NOW = utc(2026, 11, 23, 8)  # Monday 09:00 in Paris
CONFIG = make_config()
PARIS = ZoneInfo("Europe/Paris")
HOUR = timedelta(hours=1)


def run(*items: Booking, inventory: tuple[int, ...] = (0, 1, 2, 3)) -> Plan:
    return plan(items, inventory=inventory, config=CONFIG, templates=TEMPLATES, now=NOW)


def lanes_of(result: Plan) -> dict[str, dict[int, free.Busy]]:
    return free.lanes(free.blocks(result.accepted))


def request(gpus: tuple[int, ...], count: int, hours: float, *, exact: bool = False) -> free.Request:
    return free.Request(among={LOCAL: gpus}, count=count, duration=timedelta(hours=hours), exact=exact)


def test_busy_blocks_are_the_accepted_bookings_merged_per_gpu() -> None:
    result = run(booking("a", indices=(0,), start=10), booking("b", indices=(0,), start=12),
                 booking("c", user="bob", gpus=2, indices=(1, 2), start=20, hours=1))
    assert [(b.booking, b.gpus, b.start, b.end) for b in free.blocks(result.accepted)] == [
        ("a", (0,), utc(2026, 11, 24, 10), utc(2026, 11, 24, 12)),
        ("b", (0,), utc(2026, 11, 24, 12), utc(2026, 11, 24, 14)),
        ("c", (1, 2), utc(2026, 11, 24, 20), utc(2026, 11, 24, 21))]
    lanes = lanes_of(result)[LOCAL]
    assert (lanes[0].starts, lanes[0].ends) == ([utc(2026, 11, 24, 10)], [utc(2026, 11, 24, 14)])
    assert free.free_spans(lanes[0], start=utc(2026, 11, 24), end=utc(2026, 11, 25)) == [
        (utc(2026, 11, 24), utc(2026, 11, 24, 10)), (utc(2026, 11, 24, 14), utc(2026, 11, 25))]
    assert free.free_spans(lanes.get(3), start=utc(2026, 11, 24), end=utc(2026, 11, 25)) == [
        (utc(2026, 11, 24), utc(2026, 11, 25))]


def test_the_next_slots_fit_count_duration_and_the_gpus_allowed() -> None:
    # GPU 0 busy 10-14, GPU 1 busy 12-16, GPU 2 busy 10-20 (UTC, 24 November).
    result = run(booking("a", indices=(0,), start=10, hours=4), booking("b", indices=(1,), start=12, hours=4),
                 booking("c", user="bob", indices=(2,), start=10, hours=10))
    lanes = lanes_of(result)
    horizon = utc(2026, 11, 30)
    two = free.next_slots(lanes, request((0, 1, 2), 2, 3), after=utc(2026, 11, 24, 9), horizon=horizon)
    # 09:00 fits no two for 3 h (GPU 0 busy at 10, GPU 1 at 12: 0 and 1 only 1 h); 14:00 GPU 0 free
    # and GPU 1 busy to 16; 16:00: GPUs 0 and 1, free to the horizon.
    assert [(s.start, s.end, s.placement) for s in two] == [(utc(2026, 11, 24, 16), None, ((LOCAL, (0, 1)),))]
    short = free.next_slots(lanes, request((0, 1, 2), 1, 1), after=utc(2026, 11, 24, 9), horizon=horizon)
    assert [(s.start, s.end, s.placement) for s in short] == [
        (utc(2026, 11, 24, 9), utc(2026, 11, 24, 10), ((LOCAL, (0,)),)),  # the lowest free, as the plan gives
        (utc(2026, 11, 24, 10), utc(2026, 11, 24, 12), ((LOCAL, (1,)),))]  # from where the last one's ends
    named = free.next_slots(lanes, request((2,), 1, 1, exact=True), after=utc(2026, 11, 24, 9), horizon=horizon)
    assert [(s.start, s.end) for s in named] == [(utc(2026, 11, 24, 9), utc(2026, 11, 24, 10)),
                                                 (utc(2026, 11, 24, 20), None)]
    assert free.next_slots(lanes, request((0, 1, 2), 4, 1), after=utc(2026, 11, 24, 9), horizon=horizon) == []
    past = free.next_slots(lanes, request((2,), 1, 1, exact=True), after=utc(2026, 11, 24, 9), horizon=horizon,
                           not_before=utc(2026, 11, 24, 11))
    assert [s.start for s in past] == [utc(2026, 11, 24, 20)]  # 09:00-10:00 is over by then


def test_the_words_of_a_slot() -> None:
    slots = [free.Slot(utc(2026, 11, 23, 12), utc(2026, 11, 23, 17), ((LOCAL, (0, 1)),)),
             free.Slot(utc(2026, 11, 24, 8), None, ((LOCAL, (0, 1)),))]
    assert free.describe(slots, zone=PARIS, now=NOW) == \
        "GPUs 0,1 are free from 13:00 to 18:00 today; tomorrow from 09:00 (CET)"
    other = [free.Slot(utc(2026, 11, 25, 12), utc(2026, 11, 26, 7), ((LOCAL, (3,)),)),
             free.Slot(utc(2026, 11, 27, 8), None, ((LOCAL, (1,)),))]
    assert free.describe(other, zone=PARIS, now=NOW) == \
        "GPU 3 is free from Wed 25 Nov 13:00 to Thu 26 Nov 08:00; GPU 1 Fri 27 Nov from 09:00 (CET)"


def slots_named(reason: str, *, day: datetime) -> list[tuple[tuple[int, ...], datetime, datetime | None]]:
    """The slots a refusal names, read back: (GPUs, start, end) in UTC, for slots on `day` (Paris)."""
    found = []
    for gpus, start, end in re.findall(r"GPUs? ([\d,]+) (?:is|are) free from (\d\d:\d\d) to (\d\d:\d\d) tomorrow",
                                       reason):
        def at(text: str) -> datetime:
            hour, minute = map(int, text.split(":"))
            return day.replace(hour=hour, minute=minute, tzinfo=PARIS).astimezone(ZoneInfo("UTC"))
        found.append((tuple(map(int, gpus.split(","))), at(start), at(end)))
    return found


def test_a_refusal_names_a_slot_that_is_free_in_the_plan() -> None:
    """bob holds GPUs 0-2 from 10:00 to 12:00 UTC, GPUs 0,1 again from 15:00 and GPU 3 all day; a
    later request of his takes GPU 2 from 16:00. alice's two GPUs at 10:00 for 2 h are refused; the
    slot named is from 12:00 on the lowest two free then (0 and 1, to 15:00), and nothing accepted
    in the plan (placed before or after her) overlaps it there."""
    result = run(booking("bob-a", user="bob", gpus=3, start=10, created=utc(2026, 11, 1)),
                 booking("bob-b", user="bob", gpus=2, start=15, hours=3, created=utc(2026, 11, 1)),
                 booking("carol", user="bob", indices=(3,), start=6, hours=16, created=utc(2026, 11, 1)),
                 booking("alice", gpus=2, start=10, created=utc(2026, 11, 2)),
                 booking("late", user="bob", indices=(2,), start=16, hours=1, created=utc(2026, 11, 3)))
    reason = {r.id: r.reason for r in result.rejected}["alice"]
    assert reason.startswith("none of the 2 GPUs asked for is free at that time: GPU 0 is booked by bob")
    named = slots_named(reason, day=datetime(2026, 11, 24))
    assert named, reason
    gpus, start, end = named[0]
    assert len(gpus) == 2 and end is not None and end - start >= timedelta(hours=2)
    for item in result.accepted:
        overlap = item.booking.start < end and start < item.booking.end
        assert not (overlap and set(item.gpus) & set(gpus)), (item, reason)
    assert reason.endswith("; GPUs 0,1 are free from 13:00 to 16:00 tomorrow; tomorrow from 19:00 (CET)")


def test_only_a_conflict_names_free_slots() -> None:
    result = run(booking("a", user="bob", gpus=4, start=10), booking("wrong", template="cuda-1", start=10),
                 booking("greedy", gpus=3, start=10))
    reasons = {r.id: r.reason for r in result.rejected}
    assert reasons["wrong"].startswith("there is no template 'cuda-1'") and "free" not in reasons["wrong"]
    assert reasons["greedy"].startswith("alice may book at most 2 GPUs") and "free" not in reasons["greedy"]


def test_a_refusal_with_no_free_slot_in_the_window_says_so() -> None:
    result = run(booking("all", user="bob", gpus=4, start=0, hours=72), booking("more", user="bob", gpus=4, start=72,
                 hours=72), booking("third", user="bob", gpus=4, start=144, hours=72), booking("x", start=10))
    assert {r.id: r.reason for r in result.rejected}["x"].endswith(
        "; no such slot is free in the 7 days ahead that gpubook reads")


def test_a_cluster_refusal_names_nodes_not_gpu_indices() -> None:
    def four(booking_id: str, *, start: int = 10, hours: float = 2) -> Booking:
        return replace(booking(booking_id, user="bob", gpus=4, start=start, hours=hours), calendar_url=CALENDAR)

    config = replace(CONFIG, backend=replace(CONFIG.backend, kind="slurm"))
    nodes = {"node1": (0, 1, 2, 3), "node2": (0, 1, 2, 3)}
    result = plan([four("x1"), four("x2", start=9, hours=5), four("z-late")], inventory=nodes, config=config,
                  templates=TEMPLATES, now=NOW, topology=CLUSTER)
    reason = {r.id: r.reason for r in result.rejected}["z-late"]
    assert reason.endswith("; 4 GPUs on node1 are free tomorrow from 13:00 (CET)"), reason


def test_a_refusals_slots_read_the_same_on_the_next_passes() -> None:
    """The write-back rewrites an event whose sentence changed: the slots named must not move with
    the clock between passes (candidate starts are block ends, never "now")."""
    items = (booking("bob-a", user="bob", gpus=4, start=10, created=utc(2026, 11, 1)),
             booking("alice", gpus=2, start=10, created=utc(2026, 11, 2)),
             booking("carol", user="bob", indices=(3,), start=30, hours=2, created=utc(2026, 11, 3)),
             booking("full", user="bob", gpus=4, start=30, hours=1, created=utc(2026, 11, 4)))
    sentences = {now: {r.id: r.reason for r in plan(items, inventory=(0, 1, 2, 3), config=CONFIG,
                                                    templates=TEMPLATES, now=now).rejected}
                 for now in (NOW, NOW + timedelta(minutes=1), NOW + timedelta(hours=3, minutes=7))}
    assert len({repr(found) for found in sentences.values()}) == 1, sentences
    assert sentences[NOW]["alice"].endswith("; GPUs 0,1 are free tomorrow from 13:00 (CET)")
    assert sentences[NOW]["full"].endswith("; GPUs 0,1,2,3 are free Wed 25 Nov from 09:00 (CET)")


def test_a_refusal_names_no_slot_further_ahead_than_its_booker_may_book() -> None:
    """alice may book 2 days ahead: bob's week-long hold on every GPU leaves a slot only after it,
    which she could not book; bob (no such limit) is told of it."""
    config = policy_config({"max_days_ahead": 2}, bob={"max_days_ahead": 0})
    early = utc(2026, 11, 1)
    items = [replace(policy_booking("hold", user="bob", day=24, start=0, hours=72, gpus=4), created=early),
             replace(policy_booking("hold2", user="bob", day=27, start=0, hours=24, gpus=4), created=early),
             policy_booking("alice", day=24, start=10), policy_booking("bob", user="bob", day=24, start=10)]
    result = plan(items, inventory=(0, 1, 2, 3), config=config, templates=TEMPLATES, now=NOW)
    reasons = {r.id: r.reason for r in result.rejected}
    assert reasons["alice"].endswith("; no such slot is free in the 7 days ahead that gpubook reads"), reasons
    assert reasons["bob"].endswith("; GPU 0 is free Sat 28 Nov from 01:00 (CET)"), reasons


@st.composite
def busy_lanes(draw: st.DrawFn) -> dict[str, dict[int, free.Busy]]:
    blocks = []
    for number in range(draw(st.integers(0, 20))):
        start = utc(2026, 11, 24) + timedelta(minutes=30 * draw(st.integers(0, 4 * 48)))
        gpus = tuple(sorted(draw(st.sets(st.integers(0, 3), min_size=1, max_size=3))))
        blocks.append(free.Block(host=LOCAL, gpus=gpus, start=start,
                                 end=start + timedelta(minutes=30 * draw(st.integers(1, 24))), booking=f"b{number}",
                                 user="bob"))
    return free.lanes(blocks)


def busy_at(lanes: dict[str, dict[int, free.Busy]], gpu: int, start: datetime, end: datetime) -> bool:
    lane = lanes.get(LOCAL, {}).get(gpu)
    return lane is not None and any(s < end and start < e for s, e in zip(lane.starts, lane.ends, strict=True))


@given(lanes=busy_lanes(), count=st.integers(1, 4), hours=st.sampled_from([0.5, 1, 3, 8]),
       after=st.integers(0, 4 * 24))
@pytest.mark.slow  # a second or more: out of the fast lane
@settings(max_examples=300, deadline=None)
def test_each_slot_is_free_and_none_earlier_fits(lanes: dict[str, dict[int, free.Busy]], count: int, hours: float,
                                                  after: int) -> None:
    """Against brute force on the half-hour grid the blocks lie on: each slot's GPUs are free for
    the whole duration and to its end, its end is where one of them is booked again, and no
    earlier start (after the search's start, or between the slots) fits the request."""
    start_at = utc(2026, 11, 24) + timedelta(minutes=30 * after)
    horizon = utc(2026, 11, 28)
    duration = timedelta(hours=hours)
    found = free.next_slots(lanes, request((0, 1, 2, 3), count, hours), after=start_at, horizon=horizon, limit=3)

    def fits(moment: datetime) -> bool:
        return sum(not busy_at(lanes, gpu, moment, moment + duration) for gpu in range(4)) >= count

    steps = int((horizon - start_at) / timedelta(minutes=30))
    grid = [start_at + timedelta(minutes=30 * step) for step in range(steps)]
    begin = start_at
    for slot in found:
        (host, gpus), = slot.placement
        assert len(gpus) == count
        end = slot.end or horizon
        assert end - slot.start >= duration
        assert not any(busy_at(lanes, gpu, slot.start, end) for gpu in gpus)
        assert slot.end is None or any(busy_at(lanes, gpu, end, end + timedelta(minutes=1)) for gpu in gpus)
        assert not any(fits(moment) for moment in grid if begin <= moment < slot.start)
        begin = end
    if len(found) < 3 and (not found or found[-1].end is not None):
        assert not any(fits(moment) for moment in grid if begin <= moment and moment + duration <= horizon)
