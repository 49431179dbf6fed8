"""Quotas ([policy] and [users.NAME]): the plan rejects what goes over, with the numbers.

Every expected figure is computed by hand in the comment beside it."""

from __future__ import annotations

from datetime import datetime, timedelta

import pytest

from gpubook.runtime.errors import ConfigError
from gpubook.scheduler.config import Config
from gpubook.scheduler.core import policy
from gpubook.scheduler.core.bookings import Booking
from gpubook.scheduler.core.plan import Plan, Slot, plan, seen_key
from tests.kits.booking_kit import TEMPLATES, make_config, raw, read, utc, vcalendar, vevent
from tests.kits.policy_kit import booking, config

NOW = utc(2026, 11, 23, 8)  # a Monday


def run(*items: Booking, cfg: Config, now: datetime = NOW, seen: dict[str, datetime] | None = None,
        running: dict[str, tuple[int, ...]] | None = None) -> Plan:
    """`seen`: booking id → when gpubook first saw it; unlisted ones were seen in this order, last."""
    order = {item.id: NOW - timedelta(days=30) + timedelta(minutes=n) for n, item in enumerate(items)}
    first_seen = {seen_key(item): {**order, **(seen or {})}[item.id] for item in items}
    slots = {key: Slot(seen_at=at, accepted_at=at) for key, at in first_seen.items()}
    return plan(items, inventory=(0, 1, 2, 3), config=cfg, templates=TEMPLATES, now=now,
                running=running or {}, first_seen=first_seen, slots=slots)


def accepted(result: Plan) -> list[str]:
    return [a.booking.id for a in result.accepted]


def reasons(result: Plan) -> dict[str, str]:
    return {r.id: r.reason for r in result.rejected}


# -- the config --------------------------------------------------------------------------------


def test_every_quota_is_off_by_default() -> None:
    assert policy.limits(make_config(), "bob") == policy.Limits()
    assert policy.limits(make_config(), "alice") == policy.Limits(max_gpus=2)  # her own [users.alice] max_gpus
    assert policy.reach_back(make_config()) == timedelta(hours=72)


def test_a_user_overrides_the_policy_and_zero_means_no_limit() -> None:
    cfg = config({"week_gpu_hours": 40, "max_days_ahead": 7, "max_future_bookings": 3},
                 bob={"week_gpu_hours": 80}, carol={"week_gpu_hours": 0, "max_future_bookings": 10})
    assert policy.limits(cfg, "alice") == policy.Limits(40, 7, 3)
    assert policy.limits(cfg, "bob") == policy.Limits(80, 7, 3)
    assert policy.limits(cfg, "carol") == policy.Limits(None, 7, 10)
    # The daemon reads two weeks more of the past to count the weeks (72 h: the longest booking).
    assert policy.reach_back(cfg) == timedelta(days=14, hours=72)


def test_each_users_policy_is_resolved_once_when_the_config_is_made() -> None:
    from dataclasses import fields, replace

    from gpubook.scheduler.settings import PolicyConfig, UserConfig, UserPolicy

    # Every setting a user may hold over the policy is resolved: none is left to resolve elsewhere.
    shared = {f.name for f in fields(UserConfig)} & {f.name for f in fields(PolicyConfig)}
    assert {f.name for f in fields(UserPolicy)} == shared

    cfg = config({"remind_minutes": 10, "idle_minutes": 60, "week_gpu_hours": 40},
                 bob={"remind_minutes": 0, "idle_minutes": 15}, carol={"week_gpu_hours": 0})
    assert cfg.policy_for("alice") == UserPolicy(week_gpu_hours=40, remind_minutes=10, idle_minutes=60)
    assert cfg.policy_for("bob") == UserPolicy(week_gpu_hours=40, remind_minutes=0, idle_minutes=15)
    assert cfg.policy_for("carol") == UserPolicy(week_gpu_hours=0, remind_minutes=10, idle_minutes=60)
    assert cfg.policy_for("nobody") == cfg.policy_for("alice")  # not in [users]: the policy's
    # A config made from another (dataclasses.replace) resolves again: nothing stale is kept.
    changed = replace(cfg, policy=replace(cfg.policy, remind_minutes=5))
    assert (changed.policy_for("alice").remind_minutes, changed.policy_for("bob").remind_minutes) == (5, 0)


def test_a_negative_quota_is_named() -> None:
    with pytest.raises(ConfigError) as error:
        config({"week_gpu_hours": -1}, bob={"max_future_bookings": -2})
    assert "policy.week_gpu_hours: must be 0 or more" in str(error.value)
    assert "users.bob.max_future_bookings: must be 0 or more" in str(error.value)


# -- GPU-hours per rolling week ------------------------------------------------------------------


def test_the_booking_over_the_week_quota_is_rejected_with_the_numbers() -> None:
    cfg = config({"week_gpu_hours": 40})
    result = run(booking("mon", day=24, hours=17, gpus=2),  # 34 GPU-hours
                 booking("tue", day=25, hours=4),  # 4: 38 in all
                 booking("wed", day=26, hours=6),  # 6 more would be 44
                 booking("bob", user="bob", day=26, hours=30, gpus=2), cfg=cfg)  # bob's own 60 > 40
    assert accepted(result) == ["mon", "tue"]
    assert reasons(result) == {
        "wed": "alice has 38 of 40 GPU-hours in the week before this booking ends; this booking needs 6",
        "bob": "bob has 0 of 40 GPU-hours in the week before this booking ends; this booking needs 60"}


def test_exactly_the_quota_fits_and_the_week_is_the_168_hours_before_the_end() -> None:
    cfg = config({"week_gpu_hours": 40})
    a = booking("a", day=24, start=0, hours=20, gpus=2)  # 24 Nov 00:00-20:00 UTC: exactly 40
    # b: 30 Nov 20:00-21:00; its week, from 23 Nov 21:00, holds all of a: 40 + 1.
    assert reasons(run(a, booking("b", day=30, start=20, hours=1), cfg=cfg))["b"] == (
        "alice has 40 of 40 GPU-hours in the week before this booking ends; this booking needs 1")
    # e: 30 Nov 21:00 to 1 Dec 01:00; its week, from 24 Nov 01:00, holds 19 of a's hours on 2 GPUs.
    assert reasons(run(a, booking("e", day=30, start=21, hours=4), cfg=cfg))["e"] == (
        "alice has 38 of 40 GPU-hours in the week before this booking ends; this booking needs 4")
    # f: 1 Dec 20:00-21:00; its week starts 24 Nov 21:00, after a ended: it fits.
    f = Booking(**{**booking("f", hours=1).__dict__, "start": utc(2026, 12, 1, 20), "end": utc(2026, 12, 1, 21)})
    assert accepted(run(a, f, cfg=cfg)) == ["a", "f"]


def test_a_booking_seen_later_may_not_overfill_the_week_of_an_accepted_later_booking() -> None:
    cfg = config({"week_gpu_hours": 40})
    # Seen first: 36 GPU-hours on Friday 27 November 00:00-18:00, 2 GPUs.
    friday = booking("fri", day=27, start=0, hours=18, gpus=2)
    # Seen second, earlier in time: Wednesday 26 November 10:00-16:00. Its own week holds nothing
    # else (friday ends after it), but friday's week (20 Nov 18:00 to 27 Nov 18:00) would hold 36 + 6.
    wednesday = booking("wed", day=26, hours=6)
    result = run(friday, wednesday, cfg=cfg)
    assert accepted(result) == ["fri"]
    assert reasons(result)["wed"] == (
        "alice has 36 of 40 GPU-hours in the week before 2026-11-27 19:00 (CET) (the end of another "
        "booking of theirs); this booking needs 6")


def test_a_running_booking_is_never_rejected_by_a_quota_and_counts() -> None:
    # The admin lowered the quota to 10 while alice's 12 GPU-hour booking runs: it keeps running,
    # first in the order; her later booking, seen before it, is rejected: 12 already in its week.
    cfg = config({"week_gpu_hours": 10})
    now = utc(2026, 11, 24, 12)
    running = booking("now", day=24, start=10, hours=6, gpus=2)  # 12 GPU-hours, started 10:00
    later = booking("later", day=25, hours=2)
    result = run(running, later, cfg=cfg, now=now, running={"now": (0, 1)},
                 seen={"later": NOW - timedelta(days=40)})
    assert accepted(result) == ["now"]
    assert reasons(result)["later"] == ("alice has 12 of 10 GPU-hours in the week before this booking ends; "
                                        "this booking needs 2")
    # Not running (its container gone), the same booking is judged like any other: over the quota.
    assert "now" in reasons(run(running, cfg=cfg, now=now))


def test_per_user_override_of_the_week_quota() -> None:
    cfg = config({"week_gpu_hours": 10}, bob={"week_gpu_hours": 80}, alice={"week_gpu_hours": 0})
    result = run(booking("a", day=24, hours=30, gpus=2),  # 60: alice has no limit
                 booking("b", user="bob", day=25, hours=30, gpus=2),  # 60 of bob's 80
                 booking("c", user="bob", day=27, hours=12, gpus=2), cfg=cfg)  # 60 + 24 > 80
    assert accepted(result) == ["a", "b"]
    assert reasons(result)["c"] == ("bob has 60 of 80 GPU-hours in the week before this booking ends; "
                                    "this booking needs 24")


def expanded(event: str, *, cfg: Config, start: datetime, end: datetime) -> list[Booking]:
    """The event's occurrences in [start, end) as the reader makes them."""
    expansion = read(raw(vcalendar(event)), config=cfg, start=start, end=end)
    return [item for item in expansion.occurrences if isinstance(item, Booking)]


def test_recurring_occurrences_count_one_by_one() -> None:
    cfg = config({"week_gpu_hours": 20})
    # Daily 10:00-14:00 Berlin (09:00-13:00 UTC) on 2 GPUs: 8 GPU-hours each day.
    event = vevent("daily", "DTSTART;TZID=Europe/Berlin:20261124T100000",
                   "DTEND;TZID=Europe/Berlin:20261124T140000", "RRULE:FREQ=DAILY;COUNT=8",
                   "SUMMARY:alice gpus=2")
    occurrences = expanded(event, cfg=cfg, start=utc(2026, 11, 23), end=utc(2026, 12, 3))
    assert [o.gpu_count for o in occurrences] == [2] * 8
    result = plan(occurrences, inventory=(0, 1, 2, 3), config=cfg, templates=TEMPLATES, now=NOW)
    days = {a.booking.start.day for a in result.accepted}
    # 24 and 25 November: 16; the 26th would make 24 > 20, and so would each day up to the 30th
    # (its week holds the 24th's and 25th's 16). 1 December: its week (24 Nov 13:00 UTC to 1 Dec
    # 13:00) no longer holds the 24th (ended 13:00, the edge): 8 + 8 = 16 fits.
    assert days == {24, 25, 1}
    rejected = {r.start.day: r.reason for r in result.rejected}
    assert set(rejected) == {26, 27, 28, 29, 30}
    assert rejected[26] == "alice has 16 of 20 GPU-hours in the week before this booking ends; this booking needs 8"


def test_hours_across_the_end_of_summer_time_are_real_hours() -> None:
    cfg = config({"week_gpu_hours": 8.5})
    # Saturday 22:00 to Sunday 06:00 in Berlin, weekly: 8 real hours, but 9 in the night of 24/25
    # October 2026, when clocks go back from 03:00 to 02:00.
    event = vevent("night", "DTSTART;TZID=Europe/Berlin:20261017T220000",
                   "DTEND;TZID=Europe/Berlin:20261018T060000", "RRULE:FREQ=WEEKLY;COUNT=3",
                   "SUMMARY:alice")
    occurrences = expanded(event, cfg=cfg, start=utc(2026, 10, 10), end=utc(2026, 11, 10))
    assert [(o.end - o.start) / timedelta(hours=1) for o in occurrences] == [8, 9, 8]
    result = plan(occurrences, inventory=(0,), config=cfg, templates=TEMPLATES, now=utc(2026, 10, 1))
    assert [a.booking.start for a in result.accepted] == [utc(2026, 10, 17, 20), utc(2026, 10, 31, 21)]
    assert [r.reason for r in result.rejected] == [
        "alice has 0 of 8.5 GPU-hours in the week before this booking ends; this booking needs 9"]


# -- how far ahead, how many ahead ---------------------------------------------------------------


def test_a_booking_made_too_far_ahead_is_rejected() -> None:
    cfg = config({"max_days_ahead": 3})
    far = booking("far", day=28)  # 28 Nov 10:00; first seen 23 Nov 08:00: 5 days 2 hours ahead
    near = booking("near", day=26, start=8)  # first seen 23 Nov 08:00: exactly 3 days
    result = run(far, near, cfg=cfg, seen={"far": NOW, "near": NOW})
    assert accepted(result) == ["near"]
    assert reasons(result)["far"] == ("alice may book at most 3 days ahead; this booking starts 5.08 days "
                                      "after gpubook first saw it at this time")
    # Seen within 3 days of its start it passes (the time gpubook saw it, not the calendar's CREATED).
    later = utc(2026, 11, 26)
    assert accepted(run(far, cfg=cfg, now=later, seen={"far": later})) == ["far"]


def test_too_many_bookings_not_started_yet() -> None:
    cfg = config({"max_future_bookings": 2}, bob={"max_future_bookings": 0})
    now = utc(2026, 11, 24, 11)
    result = run(booking("started", day=24, start=10),  # started: no longer counts
                 booking("one", day=25), booking("two", day=26), booking("three", day=27),
                 *(booking(f"bob{n}", user="bob", day=25 + n) for n in range(3)), cfg=cfg, now=now)
    assert accepted(result) == ["started", "bob0", "one", "bob1", "two", "bob2"]
    assert reasons(result) == {
        "three": "alice may hold at most 2 bookings that have not started; 2 are held already"}
    one = run(booking("one", day=25), booking("two", day=26), cfg=config({"max_future_bookings": 1}), now=now)
    assert reasons(one) == {"two": "alice may hold at most 1 booking that have not started; 1 is held already"}


def test_no_quota_changes_nothing() -> None:
    items = [booking(f"b{n}", day=24 + n % 5, start=n % 20, hours=30, gpus=1 + n % 2) for n in range(12)]
    assert run(*items, cfg=config()) == run(*items, cfg=config({"week_gpu_hours": 0, "max_days_ahead": 0,
                                                                "max_future_bookings": 0}))
