"""Changes while a booking runs (issue section 5), through the real plan: pin_running keeps a running
booking's GPUs and template; plan_with_extensions lets an end move later only into free time."""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime, timedelta

from gpubook.runtime.engines import ContainerInfo, container_name
from gpubook.scheduler.core.bookings import Booking
from gpubook.scheduler.core.decide import (
    Memory,
    Recheck,
    Runs,
    Start,
    Stop,
    Warned,
    decide,
    pin_running,
    plan_with_extensions,
)
from gpubook.scheduler.core.plan import plan
from tests.kits.booking_kit import TEMPLATES, booking, make_config, utc

CONFIG = make_config()
NOW = utc(2026, 11, 24, 11)  # "a" runs 10:00-12:00 on GPU 0


def running(b: Booking, gpus: tuple[int, ...], *, end: datetime | None = None, template: str = "debian-ssh"
            ) -> ContainerInfo:
    return ContainerInfo(name=container_name(b.id), id="c", state="running", image="i", booking_id=b.id,
                         user=b.user, gpus=gpus, end=end or b.end, spec_hash="old", port=2200, template=template)


def planner(actual: list[ContainerInfo]):  # type: ignore[no-untyped-def]
    pinned_running = {i.booking_id: i.gpus for i in actual}
    return lambda items: plan(items, inventory=(0, 1), config=CONFIG, templates=TEMPLATES, now=NOW,
                              running=pinned_running)


def test_gpus_and_template_edited_while_running_take_effect_next_time() -> None:
    a = booking("a", indices=(0,))
    actual = [running(a, (0,))]
    edited = replace(a, gpu_indices=(1,), template="tensorflow-cuda9")
    pinned = pin_running([edited], actual)
    assert pinned.occurrences == (a,)  # planned as it runs
    assert "takes effect at the next booking" in pinned.notes["a"]
    assert "GPUs and template" in pinned.notes["a"]
    result = planner(actual)(pinned.occurrences)
    assert [(x.booking.id, x.gpus) for x in result.accepted] == [("a", (0,))]
    # The container is matched by booking id, not by spec hash: nothing is restarted.
    assert [x for x in decide(result, actual, now=NOW, memory=Memory(known=frozenset({"a"})))
            if isinstance(x, Start | Stop)] == []


def test_end_moved_later_into_free_time_is_followed() -> None:
    a = booking("a", indices=(0,))
    moved = replace(a, end=a.end + timedelta(hours=1))
    actual = [running(a, (0,))]
    result, granted, notes = plan_with_extensions([moved], agreed_ends={"a": a.end}, plan=planner(actual))
    assert granted == {"a": moved.end} and notes == {}
    assert result.accepted[0].booking.end == moved.end


def test_end_moved_later_into_someone_elses_booking_keeps_the_old_end() -> None:
    a = booking("a", indices=(0,))
    bob = booking("b", user="bob", indices=(0,), start=12, hours=2)  # right after a, on GPU 0
    moved = replace(a, end=a.end + timedelta(hours=1))
    actual = [running(a, (0,))]
    result, granted, notes = plan_with_extensions([moved, bob], agreed_ends={"a": a.end}, plan=planner(actual))
    assert granted == {}
    assert "the end was not moved" in notes["a"] and "b" in notes["a"]
    assert {x.booking.id: x.booking.end for x in result.accepted} == {"a": a.end, "b": bob.end}
    assert result.rejected == ()


def test_end_moved_earlier_warns_then_stops_after_the_notice() -> None:
    a = booking("a", indices=(0,))
    earlier = replace(a, end=NOW - timedelta(minutes=10))
    actual = [running(a, (0,))]
    result = planner(actual)(pin_running([earlier], actual).occurrences)
    actions = decide(result, actual, now=NOW, memory=Memory(known=frozenset({"a"})))
    assert [type(x).__name__ for x in actions] == ["Warn", "Recheck"]
    assert actions[0].stop_at == NOW + timedelta(minutes=5)  # type: ignore[union-attr]


def test_a_running_booking_moved_days_later_ends_now_and_frees_its_gpu() -> None:
    """Hostile (issue 9, finding 6): a running 10:00-12:00 booking edited to the same hours six days
    later kept its container for six days and held the next booker's 13:00 booking on its GPU."""
    a = booking("a", indices=(0,))  # runs 10:00-12:00 on GPU 0
    moved = replace(a, start=a.start + timedelta(days=6), end=a.end + timedelta(days=6))
    bob = booking("b", user="bob", indices=(0,), start=13, hours=2)
    actual = [running(a, (0,))]
    pinned = pin_running([moved, bob], actual, now=NOW)
    assert pinned.running == {}  # the moved booking does not run in its (new) time
    result, granted, _ = plan_with_extensions(
        pinned.occurrences, agreed_ends={i: e for i, e in {"a": a.end}.items() if i in pinned.running},
        plan=lambda items: plan(items, inventory=(0, 1), config=CONFIG, templates=TEMPLATES, now=NOW,
                                running=pinned.running))
    assert granted == {}
    assert {x.booking.id: (x.booking.start, x.gpus) for x in result.accepted} == {
        "a": (moved.start, (0,)), "b": (bob.start, (0,))}
    memory = Memory(known=frozenset({"a"}), runs={"a": Runs(running=True)})
    actions = decide(result, actual, now=NOW, memory=memory)
    assert [(type(x).__name__, getattr(x, "reason", "")) for x in actions] == [
        ("Warn", "moved"), ("Recheck", "stop of a")]
    stop_at = NOW + timedelta(minutes=5)
    assert actions[0].stop_at == stop_at  # type: ignore[union-attr]
    warned = replace(memory, warned={"a": Warned(at=NOW, end=moved.end, stop_at=stop_at)})
    stops = decide(result, actual, now=stop_at, memory=warned)
    assert [type(x).__name__ for x in stops] == ["Stop"]
    # Stopped at 11:05: bob's 13:00 booking starts on GPU 0 on time; "a" starts at its new time.
    stopped = replace(memory, runs={"a": Runs(last_stopped=stop_at, last_reason=stops[0].reason)})  # type: ignore[union-attr]
    at_one = decide(result, [], now=bob.start, memory=stopped)
    assert [(type(x).__name__, x.accepted.booking.id) for x in at_one if isinstance(x, Start)] == [("Start", "b")]
    later = decide(result, [], now=moved.start, memory=stopped)
    assert [(x.accepted.booking.id, x.attempt) for x in later if isinstance(x, Start)] == [("a", 0)]


def test_a_stale_calendar_holds_only_its_own_bookings() -> None:
    a = booking("a", indices=(0,), start=11)
    other = booking("o", indices=(1,), start=11, calendar_url="http://127.0.0.1/other/")
    result = plan([a], inventory=(0, 1), config=CONFIG, templates=TEMPLATES, now=NOW)
    both = replace(result, accepted=(*result.accepted, replace(result.accepted[0], booking=other, gpus=(1,))))
    actions = decide(both, [], now=NOW, stale_calendars={"http://127.0.0.1/other/": "its calendar's data is old"})
    assert [(type(x).__name__, getattr(x, "reason", "")) for x in actions] == [
        ("Start", ""), ("Hold", "its calendar's data is old")]


def test_a_running_booking_in_no_calendar_is_not_stopped_while_a_calendar_was_never_read() -> None:
    a = booking("a", indices=(0,))
    actual = [running(a, (0,))]
    empty = plan([], inventory=(0, 1), config=CONFIG, templates=TEMPLATES, now=NOW)
    memory = Memory(known=frozenset({"a"}))
    assert [type(x).__name__ for x in decide(empty, actual, now=NOW, memory=memory)] == ["Warn", "Recheck"]
    kept = decide(empty, actual, now=NOW, memory=memory, complete=False)
    assert [(type(x).__name__, getattr(x, "at", None)) for x in kept] == [("Recheck", a.end)]


def test_a_booking_stopped_at_an_end_that_has_not_come_starts_again() -> None:
    """The wall clock stepped 5 minutes ahead past a running booking's end (it was stopped, "ended"),
    then back: its time is not over, so it starts again. Before the fix an "ended" stop counted as
    a stop on purpose and the booking never ran again (tests/kits/faults_kit.py's clock fault)."""
    a = booking("a", indices=(0,))  # 10:00-12:00
    result = planner([])([a])
    stopped = Memory(known=frozenset({"a"}), runs={"a": Runs(last_stopped=a.end + timedelta(minutes=4),
                                                             last_reason="ended")})
    assert [(x.accepted.booking.id, x.attempt) for x in decide(result, [], now=a.end - timedelta(minutes=1),
                                                               memory=stopped) if isinstance(x, Start)] == [("a", 0)]
    assert decide(result, [], now=a.end + timedelta(seconds=1), memory=stopped) == []  # its end: stays stopped
    admin = Memory(known=frozenset({"a"}), runs={"a": Runs(last_stopped=NOW, last_reason="stopped by an admin")})
    assert not [x for x in decide(result, [], now=NOW, memory=admin) if isinstance(x, Start)]


def test_a_clock_stepped_back_before_a_running_bookings_start_keeps_it_running() -> None:
    """The wall clock stepped back to before the start its container was started for: the booking did
    not move, so it is neither warned of a move nor stopped, and keeps its GPU (before the fix: a
    warning "moved to a later time", then a stop after the notice)."""
    a = booking("a", indices=(0,))  # 10:00-12:00
    actual = [replace(running(a, (0,)), start=a.start)]
    behind = a.start - timedelta(minutes=5)
    pinned = pin_running([a], actual, now=behind)
    assert pinned.running == {"a": (0,)}
    result = plan(pinned.occurrences, inventory=(0, 1), config=CONFIG, templates=TEMPLATES, now=behind,
                  running=pinned.running)
    memory = Memory(known=frozenset({"a"}), runs={"a": Runs(running=True)})
    assert [x for x in decide(result, actual, now=behind, memory=memory) if not isinstance(x, Recheck)] == []
    moved = replace(a, start=a.start + timedelta(days=1), end=a.end + timedelta(days=1))  # a real move still stops
    moved_result = plan(pin_running([moved], actual, now=NOW).occurrences, inventory=(0, 1), config=CONFIG,
                        templates=TEMPLATES, now=NOW, running={})
    assert [type(x).__name__ for x in decide(moved_result, actual, now=NOW, memory=memory)][:1] == ["Warn"]
