"""Reconcile cases as data: tests/cases/*.toml hold bookings + containers in, actions out.

Each case also checks that decide is level-triggered: the actions are applied to the case's world
(containers started and stopped, warnings and deaths remembered) and decide, asked again at the
same moment, has nothing left to do but holds and rechecks; and asking twice gives the same list.

Case format (times ISO 8601):

    now = "..."
    may_start = true                      # optional
    [policy]                              # optional: notice_seconds, restart_limit, backoff_seconds
    [[booking]]  id, user, gpus, start, end, warn_at (optional: end - 15 min, not before start)
    [[container]] booking, state ("running"), gpus, end, user (optional), template (optional)
    [memory] known = [...]
    [[memory.warned]] booking, at, end (omit: the booking is gone), stop_at
    [[memory.runs]] booking, restarts, running, last_stopped, last_reason
    [[expect]] action, booking, and any of reason (a substring), gpus, attempt, stop_at, at
"""

from __future__ import annotations

import tomllib
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from gpubook.runtime.engines import ContainerInfo, container_name
from gpubook.scheduler.core.bookings import Booking
from gpubook.scheduler.core.decide import (
    Action,
    Clear,
    Hold,
    Memory,
    Policy,
    Recheck,
    Runs,
    Start,
    Stop,
    Warn,
    Warned,
    decide,
)
from gpubook.scheduler.core.plan import Accepted, Plan

CASES = sorted((Path(__file__).parent / "cases").glob("*.toml"))


def _time(text: str | datetime) -> datetime:
    moment = text if isinstance(text, datetime) else datetime.fromisoformat(text)
    return moment.astimezone(UTC)


def _booking(table: dict[str, Any]) -> Accepted:
    start, end = _time(table["start"]), _time(table["end"])
    gpus = tuple(table.get("gpus", [0]))
    booking = Booking(id=table["id"], uid=table["id"].split("@")[0], user=table.get("user", "alice"),
                      template=table.get("template", "debian-ssh"), gpu_count=len(gpus), gpu_indices=gpus,
                      start=start, end=end, created=None, dtstamp=None,
                      calendar_url="http://127.0.0.1/cal/", href=f"http://127.0.0.1/cal/{table['id']}.ics")
    warn_at = _time(table["warn_at"]) if "warn_at" in table else max(start, end - timedelta(minutes=15))
    return Accepted(booking, gpus, warn_at)


def _container(table: dict[str, Any]) -> ContainerInfo:
    return ContainerInfo(name=container_name(table["booking"]), id="c-" + table["booking"],
                         state=table.get("state", "running"), image="localhost/gpubook/debian-ssh:12",
                         booking_id=table["booking"], user=table.get("user", "alice"),
                         gpus=tuple(table.get("gpus", [0])),
                         end=_time(table["end"]) if "end" in table else None, spec_hash="h",
                         port=table.get("port", 2200), template=table.get("template", "debian-ssh"))


def _memory(table: dict[str, Any]) -> Memory:
    warned = {w["booking"]: Warned(at=_time(w["at"]), end=_time(w["end"]) if "end" in w else None,
                                   stop_at=_time(w["stop_at"])) for w in table.get("warned", [])}
    runs = {r["booking"]: Runs(restarts=r.get("restarts", 0), running=r.get("running", False),
                               last_stopped=_time(r["last_stopped"]) if "last_stopped" in r else None,
                               last_reason=r.get("last_reason")) for r in table.get("runs", [])}
    return Memory(known=frozenset(table.get("known", [])), warned=warned, runs=runs)


def _policy(table: dict[str, Any]) -> Policy:
    return Policy(notice=timedelta(seconds=table.get("notice_seconds", 300)),
                  restart_limit=table.get("restart_limit", 3),
                  restart_backoff=timedelta(seconds=table.get("backoff_seconds", 10)))


def render(action: Action) -> dict[str, Any]:
    if isinstance(action, Clear):
        return {"action": "clear", "booking": action.booking_id, "reason": action.reason}
    if isinstance(action, Stop):
        return {"action": "stop", "booking": action.booking_id, "reason": action.reason}
    if isinstance(action, Start):
        return {"action": "start", "booking": action.accepted.booking.id, "gpus": list(action.accepted.gpus),
                "attempt": action.attempt}
    if isinstance(action, Warn):
        return {"action": "warn", "booking": action.booking_id, "reason": action.reason,
                "stop_at": action.stop_at}
    if isinstance(action, Hold):
        return {"action": "hold", "booking": action.booking_id, "reason": action.reason}
    return {"action": "recheck", "at": action.at, "reason": action.reason}


def matches(expected: dict[str, Any], got: dict[str, Any]) -> bool:
    for key, value in expected.items():
        if key == "reason":
            if value not in got.get("reason", ""):
                return False
        elif key in ("stop_at", "at"):
            if _time(value) != got.get(key):
                return False
        elif got.get(key) != value:
            return False
    return True


def apply(actions: list[Action], actual: list[ContainerInfo], memory: Memory, now: datetime
          ) -> tuple[list[ContainerInfo], Memory]:
    """What the executor does to the world, on plain data."""
    containers = {c.booking_id: c for c in actual}
    warned, runs = dict(memory.warned), dict(memory.runs)
    known = set(memory.known)
    for action in actions:
        if isinstance(action, Clear | Stop):
            containers.pop(action.booking_id, None)
            old = runs.get(action.booking_id, Runs())
            runs[action.booking_id] = replace(old, running=False, last_stopped=now, last_reason=action.reason)
        elif isinstance(action, Start):
            booking = action.accepted.booking
            containers[booking.id] = ContainerInfo(
                name=container_name(booking.id), id="new", state="running", image="i", booking_id=booking.id,
                user=booking.user, gpus=action.accepted.gpus, end=booking.end, spec_hash="h", port=2200,
                template=booking.template)
            old = runs.get(booking.id)
            runs[booking.id] = Runs(restarts=old.restarts + 1 if old else 0, running=True)
            known.add(booking.id)
        elif isinstance(action, Warn):
            warned[action.booking_id] = Warned(at=now, end=action.end, stop_at=action.stop_at)
    return list(containers.values()), Memory(known=frozenset(known), warned=warned, runs=runs)


@pytest.mark.parametrize("path", CASES, ids=[p.stem for p in CASES])
def test_case(path: Path) -> None:
    case = tomllib.loads(path.read_text())
    now = _time(case["now"])
    plan = Plan(tuple(_booking(b) for b in case.get("booking", [])), (), None)
    actual = [_container(c) for c in case.get("container", [])]
    memory, policy = _memory(case.get("memory", {})), _policy(case.get("policy", {}))
    may_start = case.get("may_start", True)

    actions = decide(plan, actual, now=now, memory=memory, policy=policy, may_start=may_start)
    got = [render(a) for a in actions]
    expected = case.get("expect", [])
    assert len(got) == len(expected), f"{path.name}: got {got}"
    for want, have in zip(expected, got, strict=True):
        assert matches(want, have), f"{path.name}: expected {want}, got {have} (all: {got})"

    assert decide(plan, actual, now=now, memory=memory, policy=policy, may_start=may_start) == actions
    world, remembered = apply(actions, actual, memory, now)
    again = decide(plan, world, now=now, memory=remembered, policy=policy, may_start=may_start)
    assert [a for a in again if not isinstance(a, Hold | Recheck | Clear)] == [], \
        f"{path.name}: not level-triggered, second pass: {[render(a) for a in again]}"


def test_there_are_cases() -> None:
    assert len(CASES) >= 12
