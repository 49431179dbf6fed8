"""Armed containers (run ahead of their booking's start, SSH closed until it) in decide(), pure,
and the ahead lane's choice of which bookings to arm (back-to-back ones are not)."""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime, timedelta
from pathlib import Path

from gpubook.runtime.engines import ContainerInfo, booker_digest, container_name
from gpubook.runtime.templates.catalog import load_all
from gpubook.scheduler.apply.ahead import Preparation
from gpubook.scheduler.core.bookings import Booking
from gpubook.scheduler.core.decide import Disarm, Memory, Recheck, Runs, Start, Stop, Warn, decide
from gpubook.scheduler.core.plan import LOCAL, Plan, plan
from tests.kits.booking_kit import TEMPLATES, booking, make_config, utc

CONFIG = make_config()
START = utc(2026, 11, 24, 10)  # booking("a") runs 10:00-12:00


def armed(b: Booking, gpus: tuple[int, ...] = (0,), *, start: datetime | None = None, state: str = "running",
          template: str = "debian-ssh") -> ContainerInfo:
    return ContainerInfo(name=container_name(b.id), id="c", state=state, image="i", booking_id=b.id, user=b.user,
                         gpus=gpus, end=b.end, spec_hash="h", port=2201, template=template,
                         start=start or b.start)


def planned(*items: Booking, now: datetime) -> Plan:
    return plan(items, inventory=(0, 1), config=CONFIG, templates=TEMPLATES, now=now)


def test_an_armed_container_is_left_alone_until_its_start() -> None:
    a = booking("a", indices=(0,))
    now = START - timedelta(seconds=20)
    actions = decide(planned(a, now=now), [armed(a)], now=now, memory=Memory(armed=frozenset({"a"})))
    assert actions == [Recheck(START, "start of a")]


def test_an_armed_container_gets_a_start_on_its_port_at_its_start() -> None:
    a = booking("a", indices=(0,))
    result = planned(a, now=START)
    actions = decide(result, [armed(a)], now=START, memory=Memory(armed=frozenset({"a"})))
    assert actions == [Start(result.accepted[0], port=2201, armed="h")]


def test_a_recorded_start_makes_it_an_ordinary_running_container() -> None:
    a = booking("a", indices=(0,))
    memory = Memory(known=frozenset({"a"}), runs={"a": Runs(running=True)}, armed=frozenset({"a"}))
    assert decide(planned(a, now=START), [armed(a)], now=START, memory=memory) == []


def test_an_armed_container_whose_booking_is_deleted_is_removed_at_once() -> None:
    a = booking("a", indices=(0,))
    now = START - timedelta(seconds=20)
    for memory in (Memory(armed=frozenset({"a"})), Memory()):  # its note lost (a restart): its label says armed
        for complete in (True, False):
            actions = decide(planned(now=now), [armed(a)], now=now, memory=memory, complete=complete)
            assert actions == [Disarm(container_name("a"), "a", "its booking is gone before its start")]
            assert not any(isinstance(x, Warn | Stop) for x in actions)  # nobody can be logged in: no notice


def test_an_armed_container_whose_booking_moved_or_changed_is_removed_and_the_booking_starts_normally() -> None:
    a = booking("a", indices=(0,))
    now = START - timedelta(seconds=20)
    moved = replace(a, start=a.start + timedelta(minutes=5))
    actions = decide(planned(moved, now=now), [armed(a)], now=now, memory=Memory(armed=frozenset({"a"})))
    assert [type(x) for x in actions] == [Disarm] and "moved" in actions[0].reason  # type: ignore[union-attr]
    earlier = replace(a, start=now - timedelta(seconds=5))  # moved to now: removed, then started anew
    result = planned(earlier, now=now)
    actions = decide(result, [armed(a)], now=now, memory=Memory(armed=frozenset({"a"})))
    assert actions == [Disarm(container_name("a"), "a", "its booking was moved to another start"),
                       Start(result.accepted[0])]
    regpu = replace(a, gpu_indices=(1,))
    actions = decide(planned(regpu, now=now), [armed(a)], now=now, memory=Memory(armed=frozenset({"a"})))
    assert [type(x) for x in actions] == [Disarm]
    other_template = replace(a, template="tensorflow-cuda9")
    actions = decide(planned(other_template, now=now), [armed(a)], now=now, memory=Memory(armed=frozenset({"a"})))
    assert [type(x) for x in actions] == [Disarm]


def test_an_armed_container_that_exited_is_no_death_and_the_booking_starts_normally() -> None:
    a = booking("a", indices=(0,))
    result = planned(a, now=START)
    actions = decide(result, [armed(a, state="exited")], now=START, memory=Memory(armed=frozenset({"a"})))
    assert [type(x) for x in actions] == [Disarm, Start]


def test_stale_calendar_removes_the_armed_container_before_its_start() -> None:
    a = booking("a", indices=(0,))
    early = START - timedelta(seconds=20)
    actions = decide(planned(a, now=early), [armed(a)], now=early, memory=Memory(armed=frozenset({"a"})),
                     stale_calendars={a.calendar_url: "the calendar data is 40 s old"})
    assert [type(x) for x in actions] == [Disarm]
    actions = decide(planned(a, now=START), [armed(a)], now=START, memory=Memory(armed=frozenset({"a"})),
                     may_start=False, stale_reason="old")
    assert [type(x).__name__ for x in actions][0] == "Disarm"
    assert not any(isinstance(x, Start) for x in actions)


class _Host:
    """A host that records what it is asked to arm (the ahead lane's choice, not the engine, is tested)."""

    name = LOCAL
    gpus = (0, 1)
    driver_version = None

    def __init__(self) -> None:
        self.armed: list[str] = []

    def prepare(self, ahead: object) -> None:
        pass

    def arm(self, request: object) -> None:
        self.armed.append(request.booking_id)  # type: ignore[attr-defined]

    def stop(self, name: str, grace: float) -> None:
        pass


def test_back_to_back_bookings_on_the_same_gpu_are_not_armed(tmp_path: Path) -> None:
    from gpubook.scheduler.state import State

    templates = load_all(Path(__file__).resolve().parents[1] / "gpubook" / "templates")
    first = booking("first", indices=(0,), start=9, hours=1)  # 09:00-10:00 on GPU 0, runs now
    second = booking("second", indices=(0,))  # 10:00 on GPU 0: right after it
    free = booking("free", indices=(1,))  # 10:00 on GPU 1: nothing before it
    now = START - timedelta(seconds=30)
    # The first runs on GPU 0; or it is not running (its start failed, or is held): its GPU is still its own.
    for containers in ([replace(armed(first), start=first.start)], []):
        host = _Host()
        with State(tmp_path / f"state-{len(containers)}.sqlite") as state:
            ahead = Preparation(CONFIG, hosts={LOCAL: host}, state=state)  # type: ignore[dict-item]
            try:
                ahead(planned(first, second, free, now=now), running={c.booking_id for c in containers}, now=now,
                      containers=containers, templates=templates)
            finally:
                ahead.close()
            assert host.armed == ["free"]
            assert set(state.notes("armed")) == {"free"} and "free" in state.ports()


def test_status_shows_an_armed_container_as_armed_not_running() -> None:
    from datetime import UTC

    from gpubook.scheduler.outbox.status import running_booking

    a = booking("a", indices=(0,))
    later = datetime.now(UTC) + timedelta(minutes=1)
    assert running_booking(armed(a, start=later), ports={}).state.startswith("armed: SSH opens at")
    assert running_booking(armed(a, start=datetime.now(UTC) - timedelta(seconds=1)), ports={}).state == "running"


def test_an_armed_container_whose_user_or_keys_changed_is_removed_before_its_start() -> None:
    """Hostile (issue 22, finding 17): the booking's user, or that user's SSH keys, change while its
    container is armed. It is removed before the start (before, it opened at the start for the old
    booker, whose keys let them in until the start replaced it)."""
    a = booking("a", indices=(0,))
    now = START - timedelta(seconds=20)
    alice = booker_digest("alice", 1000, 1000, ("ssh-ed25519 AAAAold alice",))
    container = replace(armed(a), booker=alice)
    memory = Memory(armed=frozenset({"a"}))
    assert decide(planned(a, now=now), [container], now=now, memory=memory,
                  bookers={"a": alice}) == [Recheck(START, "start of a")]
    changed = "its booking's user or SSH keys changed before its start"
    new_keys = booker_digest("alice", 1000, 1000, ("ssh-ed25519 AAAAnew alice",))
    assert decide(planned(a, now=now), [container], now=now, memory=memory, bookers={"a": new_keys}) == \
        [Disarm(container_name("a"), "a", changed)]
    bob = replace(a, user="bob")
    assert decide(planned(bob, now=now), [container], now=now, memory=memory) == \
        [Disarm(container_name("a"), "a", changed)]
    unlabelled = replace(container, booker="")  # armed by a gpubook before this label: not trusted
    assert [type(x) for x in decide(planned(a, now=now), [unlabelled], now=now, memory=memory,
                                    bookers={"a": alice})] == [Disarm]
    # At the start too: never a Start on the old booker's container.
    result = planned(a, now=START)
    assert decide(result, [container], now=START, memory=memory, bookers={"a": new_keys}) == \
        [Disarm(container_name("a"), "a", changed), Start(result.accepted[0])]
