"""The quota tests' config and bookings (tests/test_policy.py, tests/test_reclaim.py)."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

from gpubook.scheduler.config import Config, parse
from gpubook.scheduler.core.bookings import Booking
from tests.kits.booking_kit import CALENDAR, utc


def config(policy_table: dict[str, Any] | None = None, **users: dict[str, Any]) -> Config:
    people: dict[str, dict[str, Any]] = {"alice": {"uid": 1000}, "bob": {"uid": 1001}}
    for name, extra in users.items():
        people[name] = {**people.get(name, {"uid": 1002}), **extra}
    return parse({
        "host": {"name": "devbox1", "timezone": "Europe/Berlin"},
        "calendar": [{"url": CALENDAR, "gpus": "all"}],
        "defaults": {"max_hours": 72},
        "users": people,
        "policy": policy_table or {},
    }, Path("/etc/gpubook/gpubook.toml"))


def booking(id: str, *, user: str = "alice", day: int = 24, start: int = 10, hours: float = 2,
            gpus: int = 1) -> Booking:
    """A booking starting at `start` o'clock UTC on `day` November 2026."""
    begin = utc(2026, 11, day, start)
    return Booking(id=id, uid=id, user=user, template="debian-ssh", gpu_count=gpus, gpu_indices=None,
                   start=begin, end=begin + timedelta(hours=hours), created=None, dtstamp=None,
                   calendar_url=CALENDAR, href=f"{CALENDAR}{id}.ics")
