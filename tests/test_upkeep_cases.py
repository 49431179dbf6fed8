"""Upkeep cases as data (gpubook/scheduler/core/upkeep.py): adopt, extend, remind, decided purely
from the plan, the containers and what State remembers; then through their handlers into a real
State, whose notes (gpubook/scheduler/state/notes.py) the next decision reads.

Like tests/test_reconcile_cases.py, each case also checks that the decision is level-triggered:
once its actions are recorded, the same decision at the same moment has nothing left to do.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from gpubook.runtime.engines import ContainerInfo, container_name
from gpubook.scheduler.apply.handlers import AdoptHandler, ExtendHandler, RemindHandler
from gpubook.scheduler.apply.memory import Journal
from gpubook.scheduler.config import Config, parse
from gpubook.scheduler.core import upkeep
from gpubook.scheduler.core.bookings import Booking
from gpubook.scheduler.core.plan import Accepted, Plan
from gpubook.scheduler.outbox import reminders
from gpubook.scheduler.state import State, notes

NOW = datetime(2030, 11, 25, 8, 0, tzinfo=UTC)


def _booking(booking_id: str, *, start: datetime, hours: float = 2, user: str = "alice") -> Booking:
    return Booking(id=booking_id, uid=booking_id, user=user, template="debian-ssh", gpu_count=1, gpu_indices=(0,),
                   start=start, end=start + timedelta(hours=hours), created=None, dtstamp=None,
                   calendar_url="http://127.0.0.1:9/cal/", href=f"{booking_id}.ics", summary=f"{booking_id} run")


def _plan(*bookings: Booking) -> Plan:
    return Plan(accepted=tuple(Accepted(booking=b, gpus=(0,), warn_at=b.end) for b in bookings), rejected=(),
                next_wakeup=None)


def _container(booking_id: str, *, running: bool = True, start: datetime | None = None,
               port: int | None = 2200) -> ContainerInfo:
    return ContainerInfo(name=container_name(booking_id), id="c-" + booking_id,
                         state="running" if running else "exited", image="localhost/gpubook/debian-ssh:12",
                         booking_id=booking_id, user="alice", gpus=(0, 1), end=NOW + timedelta(hours=2),
                         spec_hash="h", port=port, template="debian-ssh", start=start)


# -- adopt -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AdoptCase:
    name: str
    bookings: tuple[str, ...]  # accepted, started an hour ago
    containers: tuple[ContainerInfo, ...]
    expect: tuple[str, ...]  # the bookings adopted
    recorded: frozenset[str] = frozenset()  # container names State has a record of
    busy: frozenset[str] = frozenset()  # starts at work, armed


ADOPT = [
    AdoptCase("a lost database: the running container is adopted", ("a",), (_container("a"),), ("a",)),
    AdoptCase("recorded already: nothing", ("a",), (_container("a"),), (), recorded=frozenset({container_name("a")})),
    AdoptCase("its start at work: the start records it", ("a",), (_container("a"),), (), busy=frozenset({"a"})),
    AdoptCase("armed, its note lost: left until its start", ("a",),
              (_container("a", start=NOW + timedelta(minutes=1)),), ()),
    AdoptCase("exited: a death for decide, not an adoption", ("a",), (_container("a", running=False),), ()),
    AdoptCase("no booking here: not ours to adopt", (), (_container("a"),), ()),
    AdoptCase("two at once, one recorded", ("a", "b"), (_container("a"), _container("b")), ("b",),
              recorded=frozenset({container_name("a")})),
]


@pytest.mark.parametrize("case", ADOPT, ids=[c.name for c in ADOPT])
def test_adopt_case(case: AdoptCase) -> None:
    plan = _plan(*(_booking(b, start=NOW - timedelta(hours=1)) for b in case.bookings))
    found = upkeep.adoptions(plan, case.containers, recorded=case.recorded, busy=case.busy, now=NOW)
    assert tuple(a.booking_id for a in found) == case.expect
    for action in found:
        assert action.name == container_name(action.booking_id) and action.gpu_count == 2 and action.port == 2200
    again = upkeep.adoptions(plan, case.containers, recorded=case.recorded | {a.name for a in found},
                             busy=case.busy, now=NOW)
    assert again == []


# -- extend ------------------------------------------------------------------------------------


def test_extend_cases() -> None:
    later, more = NOW + timedelta(hours=3), NOW + timedelta(hours=4)
    assert upkeep.extensions({}) == []
    assert upkeep.extensions({"b": more, "a": later}) == [upkeep.Extend("a", later), upkeep.Extend("b", more)]


# -- remind ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RemindCase:
    name: str
    now: datetime
    start: datetime
    minutes: float
    expect: bool  # reminded now
    next_at: datetime | None  # when the next one is due
    reminded: Mapping[str, datetime] = field(default_factory=dict)


START = NOW + timedelta(hours=1)
REMIND = [
    RemindCase("an hour before, 15 min wanted: the boundary", NOW, START, 15, False, START - timedelta(minutes=15)),
    RemindCase("due now", START - timedelta(minutes=15), START, 15, True, None),
    RemindCase("due a minute ago (a late pass)", START - timedelta(minutes=14), START, 15, True, None),
    RemindCase("reminded of this start already", START - timedelta(minutes=10), START, 15, False, None,
               {"r": START}),
    RemindCase("reminded of another start: moved, reminded again", START - timedelta(minutes=10), START, 15, True,
               None, {"r": START - timedelta(days=1)}),
    RemindCase("its start came: never sent", START, START, 15, False, None),
    RemindCase("off for this booker", START - timedelta(minutes=10), START, 0, False, None),
]


@pytest.mark.parametrize("case", REMIND, ids=[c.name for c in REMIND])
def test_remind_case(case: RemindCase) -> None:
    plan = _plan(_booking("r", start=case.start))
    due, next_at = upkeep.reminders(plan, reminded=case.reminded, minutes=lambda user: case.minutes, now=case.now)
    assert [a.booking_id for a in due] == (["r"] if case.expect else [])
    assert next_at == case.next_at
    recorded = {**case.reminded, **{a.booking_id: a.accepted.booking.start for a in due}}
    assert upkeep.reminders(plan, reminded=recorded, minutes=lambda user: case.minutes, now=case.now)[0] == []


def test_remind_minutes_are_the_bookers() -> None:
    plan = _plan(_booking("a", start=START), _booking("b", start=START, user="bob"))
    minutes = {"alice": 90.0, "bob": 15.0}
    due, next_at = upkeep.reminders(plan, reminded={}, minutes=minutes.__getitem__, now=NOW)
    assert [a.booking_id for a in due] == ["a"] and next_at == START - timedelta(minutes=15)


# -- through the handlers into State, read back as the next pass reads it -----------------------


def _config(*, notify: bool = True) -> Config:
    data: dict[str, Any] = {"host": {"name": "devbox1", "timezone": "UTC"},
                            "calendar": [{"url": "http://127.0.0.1:9/cal/"}], "gpus": {"count": 2},
                            "users": {"alice": {"uid": 2001}}, "policy": {"remind_minutes": 15}}
    if notify:
        data["notify"] = {"webhook": {"enabled": True, "url": "http://127.0.0.1:9/hook"}}
    return parse(data, Path("/etc/gpubook/gpubook.toml"))


def test_the_handlers_record_what_the_next_decision_reads(tmp_path: Path) -> None:
    config = _config()
    with State(tmp_path / "state.sqlite") as state:
        journal = Journal(state)
        plan = _plan(_booking("a", start=NOW - timedelta(hours=1)), _booking("r", start=START))
        actual = [_container("a", port=2242)]
        (adopt,) = upkeep.adoptions(plan, actual, recorded=(), busy=(), now=NOW)
        change = AdoptHandler(state=state, journal=journal)(adopt, now=NOW)
        assert [r.name for r in change.records] == [container_name("a")] and state.ports() == {"a": 2242}
        recorded = {r.name for r in state.containers()}
        assert upkeep.adoptions(plan, actual, recorded=recorded, busy=(), now=NOW) == []

        later = NOW + timedelta(hours=3)
        for action in upkeep.extensions({"a": later}):
            ExtendHandler(state=state, journal=journal)(action, now=NOW)

        when = START - timedelta(minutes=15)
        quiet = reminders.minutes_of(_config(notify=False))  # no channel sends reminders: none is decided
        assert upkeep.reminders(plan, reminded={}, minutes=quiet, now=when) == ([], None)
        (remind,), _ = upkeep.reminders(plan, reminded={}, minutes=reminders.minutes_of(config), now=when)
        RemindHandler(config, state=state, journal=journal)(remind, now=when)
        (notice,) = state.pending_notices()
        assert notice.kind == "reminder" and notice.booking_id == "r" and "2030-11-25 09:00" in notice.text

        known = notes.read(state)
        assert known.agreed_end == {"a": later} and known.reminded == {"r": START}
        assert upkeep.reminders(plan, reminded=known.reminded, minutes=lambda user: 15, now=when)[0] == []
        assert any("adopted the running container" in e.message for e in state.events(booking_id="a"))
        assert any("the end moved later" in e.message for e in state.events(booking_id="a"))


def test_notes_are_read_typed_in_one_go_and_an_unreadable_one_is_left_out(tmp_path: Path) -> None:
    with State(tmp_path / "state.sqlite") as state:
        notes.ARMED.write(state, "a", 2201, at=NOW)
        notes.WARNED.write(state, "a", notes.Warned(NOW, None, NOW + timedelta(minutes=5)), at=NOW)
        notes.IDLE_TOLD.write(state, "b", frozenset({(1, NOW), (0, NOW)}), at=NOW)
        notes.RUNNING_LINES.write(state, "b", ("jupyter: ssh -N -L 8888:...",), at=NOW)
        state.set_note("c", notes.AGREED_END.key, "not a time", at=NOW)  # another version's, or a hand's
        known = notes.read(state)
        assert known.armed == {"a": 2201}
        assert known.warned == {"a": notes.Warned(NOW, None, NOW + timedelta(minutes=5))}
        assert known.idle_told == {"b": frozenset({(0, NOW), (1, NOW)})}
        assert known.running_lines == {"b": ("jupyter: ssh -N -L 8888:...",)}
        assert known.agreed_end == {} and known.reminded == {}
        notes.ARMED.clear(state, "a")
        assert notes.read(state).armed == {}
