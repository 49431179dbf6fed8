"""No-shows and idle GPUs: the pure judge (gpubook/scheduler/core/reclaim.py), the actions decide makes of
its verdicts, the plan around a release, and State's records of them. Plain data; the daemon test
is tests/test_daemon_reclaim.py."""

from __future__ import annotations

from datetime import datetime, timedelta
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import pytest

from gpubook.runtime.engines import ContainerInfo, container_name
from gpubook.scheduler.core import reclaim
from gpubook.scheduler.core.bookings import Booking
from gpubook.scheduler.core.decide import Memory, Policy, Runs, Stop, Warn, decide
from gpubook.scheduler.core.plan import Plan, Slot, plan, seen_key
from gpubook.scheduler.core.reclaim import Evidence, GpuUse, Idle, IdleNotice, NoShow, Release, Rules, judge
from gpubook.scheduler.state import Sample, State
from tests.kits.booking_kit import TEMPLATES, utc
from tests.kits.policy_kit import booking, config

START = utc(2026, 11, 24, 10)
MIN = timedelta(minutes=1)
NO_SHOW = Rules(no_show=30 * MIN)
IDLE = Rules(idle=60 * MIN)


def evidence(*gpus: int, logged_in: datetime | None = None, since: datetime = START, **use: GpuUse) -> Evidence:
    return Evidence(since=since, gpus=gpus, logged_in=logged_in,
                    use={int(name.removeprefix("gpu")): value for name, value in use.items()})


def idle_samples(until: datetime, *, since: datetime = START, busy: datetime | None = None) -> GpuUse:
    return GpuUse(first=since, last=until, last_busy=busy)


# -- no-shows ----------------------------------------------------------------------------------


def test_a_booking_nobody_used_is_a_no_show_exactly_at_no_show_minutes() -> None:
    seen = evidence(0, gpu0=idle_samples(START + 29 * MIN))
    early = judge(seen, NO_SHOW, now=START + 30 * MIN - timedelta(seconds=1))
    assert early.no_show is None and early.due == START + 30 * MIN  # the daemon looks again then
    verdict = judge(seen, NO_SHOW, now=START + 30 * MIN)
    assert verdict.no_show == NoShow("nobody logged in and GPU 0 stayed under 5 % for 30 min after the start")


def test_no_samples_at_all_are_no_evidence_of_use() -> None:
    verdict = judge(evidence(0, 1), NO_SHOW, now=START + 31 * MIN)
    assert verdict.no_show == NoShow("nobody logged in and no use of GPUs 0, 1 was seen for 31 min after the start")


def test_a_login_or_one_busy_sample_of_any_gpu_is_no_no_show() -> None:
    now = START + 45 * MIN
    assert judge(evidence(0, logged_in=START + 44 * MIN), NO_SHOW, now=now) == reclaim.NOTHING
    busy_on_one = evidence(0, 1, gpu0=idle_samples(now), gpu1=idle_samples(now, busy=START + 2 * MIN))
    assert judge(busy_on_one, NO_SHOW, now=now) == reclaim.NOTHING


def test_the_clock_starts_when_the_container_started_not_at_the_booking_start() -> None:
    late = evidence(0, since=START + 20 * MIN)  # its image was pulled late
    assert judge(late, NO_SHOW, now=START + 40 * MIN).no_show is None
    assert judge(late, NO_SHOW, now=START + 50 * MIN).no_show is not None


def test_rules_off_judge_nothing() -> None:
    assert judge(evidence(0), Rules(), now=START + timedelta(days=1)) == reclaim.NOTHING


# -- idle GPUs ---------------------------------------------------------------------------------


def test_a_gpu_idle_for_idle_minutes_of_samples_is_idle_since_its_last_busy_sample() -> None:
    busy = START + 10 * MIN
    last = busy + 60 * MIN
    seen = evidence(0, 1, gpu0=idle_samples(last, busy=busy), gpu1=idle_samples(last, busy=last))
    verdict = judge(seen, IDLE, now=busy + 61 * MIN)
    assert verdict.idle == Idle(((0, busy),), least=60 * MIN)  # GPU 1 was busy at the last sample
    assert verdict.due == busy + 120 * MIN  # GPU 1's stretch, if it stays idle from here
    line = reclaim.idle_line(verdict.idle, percent=5, zone=ZoneInfo("Europe/Berlin"), now=busy + 61 * MIN)
    assert line == "idle: GPU 0 under 5 % since 11:10 (61 min)"
    assert reclaim.idle_line(verdict.idle, percent=5, zone=ZoneInfo("UTC")) == \
        "idle: GPU 0 under 5 % since 10:10 (60 min or more)"


def test_idleness_needs_samples_that_cover_the_stretch() -> None:
    # The sampler stopped after 20 minutes: the clock alone does not make a GPU idle.
    stopped = evidence(0, gpu0=idle_samples(START + 20 * MIN))
    verdict = judge(stopped, IDLE, now=START + 3 * 60 * MIN)
    assert verdict.idle is None and verdict.due == START + 60 * MIN
    assert judge(evidence(0), IDLE, now=START + 3 * 60 * MIN) == reclaim.NOTHING  # no samples: no evidence


def test_idle_release_only_when_every_gpu_is_idle_and_the_admin_chose_it() -> None:
    rules = Rules(idle=60 * MIN, release_idle=True)
    end = START + 90 * MIN
    one_busy = evidence(0, 1, gpu0=idle_samples(end), gpu1=idle_samples(end, busy=end))
    assert judge(one_busy, rules, now=end).idle.release == ""  # type: ignore[union-attr]
    both = evidence(0, 1, gpu0=idle_samples(end), gpu1=idle_samples(end))
    assert judge(both, rules, now=end).idle.release == "GPUs 0, 1 stayed under 5 % for 90 min"  # type: ignore[union-attr]
    assert judge(both, IDLE, now=end).idle.release == ""  # type: ignore[union-attr]


def test_each_user_may_have_their_own_minutes_and_0_switches_them_off() -> None:
    cfg = config({"no_show_minutes": 30, "idle_minutes": 60, "idle_percent": 10},
                 bob={"no_show_minutes": 0, "idle_minutes": 15})
    assert reclaim.rules(cfg, "alice") == Rules(no_show=30 * MIN, idle=60 * MIN, idle_percent=10)
    assert reclaim.rules(cfg, "bob") == Rules(no_show=None, idle=15 * MIN, idle_percent=10)
    assert not reclaim.any_rules(config()) and reclaim.rules(config(), "alice") == Rules()


# -- decide: verdicts into actions ---------------------------------------------------------------


def running(b: Booking, gpus: tuple[int, ...] = (0,)) -> ContainerInfo:
    return ContainerInfo(name=container_name(b.id), id="c", state="running", image="i", booking_id=b.id, user=b.user,
                         gpus=gpus, end=b.end, spec_hash="h", port=2222, template=b.template, start=b.start)


def planned(*items: Booking, now: datetime, **extra: Any) -> Plan:
    return plan(items, inventory=(0, 1, 2, 3), config=config(), templates=TEMPLATES, now=now, **extra)


STARTED = Memory(known=frozenset({"a"}), runs={"a": Runs(running=True)})


def test_a_no_show_verdict_releases_its_running_booking() -> None:
    a = booking("a", start=10, hours=8)
    now = START + 30 * MIN
    verdict = reclaim.Verdict(no_show=NoShow("nobody logged in"))
    actions = decide(planned(a, now=now, running={"a": (0,)}), [running(a)], now=now, memory=STARTED,
                     verdicts={"a": verdict})
    assert actions == [Release(container_name("a"), "a", "alice", "nobody logged in", a.start, a.end, 10.0)]


def test_a_release_replaces_the_end_warning_and_is_recorded_to_stop_a_container_left_running() -> None:
    a = booking("a", start=10, hours=1)
    now = a.end - timedelta(minutes=5)  # inside the warning time
    verdict = reclaim.Verdict(no_show=NoShow("nobody logged in"))
    actions = decide(planned(a, now=now, running={"a": (0,)}), [running(a)], now=now, memory=STARTED,
                     verdicts={"a": verdict})
    assert Release in {type(x) for x in actions} and Warn not in {type(x) for x in actions}  # no end to warn of
    released = Memory(known=STARTED.known, runs=STARTED.runs, released=frozenset({"a"}))
    again = decide(planned(a, now=now, running={"a": (0,)}), [running(a)], now=now, memory=released)
    assert again == [Stop(container_name("a"), "a", "released as a no-show", 10.0)]


def test_an_armed_or_not_yet_started_container_is_never_released() -> None:
    a = booking("a", start=10, hours=8)
    now = START - MIN
    verdict = reclaim.Verdict(no_show=NoShow("nobody logged in"))
    actions = decide(planned(a, now=now), [running(a)], now=now, memory=Memory(armed=frozenset({"a"})),
                     verdicts={"a": verdict})
    assert not any(isinstance(x, Release) for x in actions)


def test_a_booker_is_told_once_per_idle_stretch() -> None:
    a = booking("a", start=10, hours=8)
    now = START + 2 * 60 * MIN
    stretch = ((0, START + 10 * MIN),)
    verdict = reclaim.Verdict(idle=Idle(stretch, least=60 * MIN))
    pl = planned(a, now=now, running={"a": (0,)})
    first = decide(pl, [running(a)], now=now, memory=STARTED, verdicts={"a": verdict},
                   policy=Policy(timezone="Europe/Berlin"))
    assert first == [IdleNotice(container_name("a"), "a", "alice", stretch,
                                "idle: GPU 0 under 5 % since 11:10 (110 min)")]
    told = Memory(known=STARTED.known, runs=STARTED.runs, idle_told={"a": frozenset(stretch)})
    assert decide(pl, [running(a)], now=now, memory=told, verdicts={"a": verdict}) == []
    later = reclaim.Verdict(idle=Idle(((0, START + 80 * MIN),), least=60 * MIN))  # busy in between: a new stretch
    assert [type(x) for x in decide(pl, [running(a)], now=now, memory=told, verdicts={"a": later})] == [IdleNotice]


# -- the plan around a release ----------------------------------------------------------------


def test_a_released_booking_frees_the_rest_of_its_slot_and_never_starts_again() -> None:
    a = booking("a", start=10, hours=8)  # 10:00-18:00 on GPU 0 of a one-GPU calendar
    b = booking("b", user="bob", start=11, hours=2)
    at = START + 30 * MIN
    released = {"a": reclaim.Released("a", a.start, a.end, at, "nobody logged in")}
    now = START + 60 * MIN
    seen = {seen_key(a): Slot(START - timedelta(days=1), START - timedelta(days=1)),
            seen_key(b): Slot(now)}  # bob's booking made after alice's was accepted
    one_gpu = {"one": (0,)}
    before = plan([a, b], inventory=one_gpu, config=config(), templates=TEMPLATES, now=now, slots=seen)
    assert [x.booking.id for x in before.accepted] == ["a"]  # without the release, alice's slot is hers
    after = plan(reclaim.apply_releases([a, b], released), inventory=one_gpu, config=config(),
                 templates=TEMPLATES, now=now, slots=seen)
    assert {x.booking.id: x.booking.end for x in after.accepted} == {"a": at, "b": b.end}
    memory = Memory(known=frozenset({"a"}), runs={"a": Runs(running=False, last_stopped=at, last_reason="released")},
                    released=frozenset({"a"}))
    actions = decide(after, [], now=now, memory=memory)
    assert [(type(x).__name__, getattr(getattr(x, "accepted", None), "booking", None)) for x in actions] == \
        [("Start", after.accepted[1].booking)]  # bob starts at once, alice never again
    assert reclaim.release_sentence(released["a"], zone=ZoneInfo("Europe/Berlin")) == \
        "released: nobody logged in; the GPUs went back to the pool until 19:00"


def test_a_release_holds_only_for_the_time_it_was_made_in() -> None:
    a = booking("a", start=10, hours=8)
    released = {"a": reclaim.Released("a", a.start, a.end, START + 30 * MIN, "nobody logged in")}
    moved = booking("a", day=25, start=10, hours=8)  # the booker moved it to the next day
    assert reclaim.apply_releases([moved], released) == [moved]
    assert reclaim.released_ids([moved], released) == frozenset()


# -- State --------------------------------------------------------------------------------------


def test_state_keeps_releases_and_finds_each_gpus_first_last_and_last_busy_sample(tmp_path: Path) -> None:
    with State(tmp_path / "state.sqlite") as state:
        state.record_release("a", start=START, end=START + 8 * 60 * MIN, at=START + 30 * MIN, reason="nobody came")
        assert state.releases(ending_after=START)["a"].reason == "nobody came"
        assert state.releases(ending_after=START + 9 * 60 * MIN) == {}

        def sample(minute: int, gpu: int, utilisation: float | None, booking: str = "a") -> Sample:
            return Sample(at=START + minute * MIN, host="h", gpu=gpu, booking_id=booking, utilisation=utilisation,
                          memory_used_mib=0, memory_total_mib=1, seconds=60)

        state.record_samples([sample(-5, 0, 90), sample(1, 0, 2), sample(2, 0, 40), sample(3, 0, 1), sample(4, 0, None),
                              sample(3, 1, 0), sample(3, 0, 99, booking="other")])
        by_gpu = {s.gpu: s for s in state.gpu_samples_of("a", (0, 1, 2), since=START, busy_percent=5)}
        assert (by_gpu[0].first, by_gpu[0].last, by_gpu[0].last_busy) == \
            (START + MIN, START + 3 * MIN, START + 2 * MIN)  # the sample before `since` and the NULL one do not count
        assert (by_gpu[1].first, by_gpu[1].last_busy) == (START + 3 * MIN, None)
        assert by_gpu[2].first is None


@pytest.mark.parametrize("value", [0, 101, -1])
def test_idle_percent_outside_0_to_100_is_refused(value: float) -> None:
    from gpubook.runtime.errors import ConfigError
    with pytest.raises(ConfigError, match="idle_percent"):
        config({"idle_percent": value})


def test_idle_action_release_releases_as_a_no_show_would() -> None:
    a = booking("a", start=10, hours=8)
    now = START + 2 * 60 * MIN
    verdict = reclaim.Verdict(idle=Idle(((0, START),), least=60 * MIN, release="GPU 0 stayed under 5 % for 120 min"))
    actions = decide(planned(a, now=now, running={"a": (0,)}), [running(a)], now=now, memory=STARTED,
                     verdicts={"a": verdict})
    assert actions == [Release(container_name("a"), "a", "alice", "GPU 0 stayed under 5 % for 120 min", a.start,
                               a.end, 10.0)]


def test_the_previous_bookings_use_in_the_first_seconds_is_not_the_next_bookers(tmp_path: Path) -> None:
    """On an H100 the previous booking's process still held the GPU at 99 % 1.6 s after the next
    booking's start on it: that sample is not the next booker's use, and nobody came."""
    from gpubook.scheduler.apply.reclaim import judge_running
    from gpubook.scheduler.state import ContainerRecord

    a = booking("a", start=10, hours=8)
    rules = config({"no_show_minutes": 30})
    now = START + 31 * MIN
    record = ContainerRecord(id=1, booking_id="a", name=container_name("a"), user="alice", gpu_count=1,
                             started_at=START, stopped_at=None, exit_reason=None, restarts=0)

    def sample(at: datetime, utilisation: float) -> Sample:
        return Sample(at=at, host="devbox1", gpu=0, booking_id="a", utilisation=utilisation, memory_used_mib=0,
                      memory_total_mib=1, seconds=2)

    with State(tmp_path / "state.sqlite") as state:
        state.record_samples([sample(START + timedelta(seconds=1.6), 99),
                              *(sample(START + timedelta(seconds=2 * n), 0) for n in range(2, 31 * 30))])
        verdicts = judge_running(rules, state, plan=planned(a, now=now, running={"a": (0,)}),
                                 running={"a": running(a)}, records={"a": [record]}, now=now)
        assert verdicts["a"].no_show == NoShow("nobody logged in and GPU 0 stayed under 5 % for 31 min after the start")
        # The booker's own use, past the first seconds, is use.
        state.record_samples([sample(START + 20 * MIN + timedelta(seconds=1), 80)])
        verdicts = judge_running(rules, state, plan=planned(a, now=now, running={"a": (0,)}),
                                 running={"a": running(a)}, records={"a": [record]}, now=now)
        assert verdicts["a"].no_show is None
