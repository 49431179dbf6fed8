"""Limits proven with Docker here: dockerd is root, so cgroups v1 enforces them. A booking's container
gets the default memory share and the pids limit, and a memory hog in one booking is OOM-killed while
another booking runs on (tests/kits/limits_kit.py)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.kits import engine_suite, limits_kit
from tests.kits.engine_suite import DOCKER, DOCKERD, Bookings

pytestmark = [
    pytest.mark.docker,
    pytest.mark.skipif(not (os.path.exists(DOCKERD) and os.path.exists(DOCKER)),
                       reason="Debian's docker.io is not installed"),
    pytest.mark.skipif(os.geteuid() != 0, reason="starts dockerd, which needs root"),
]


@pytest.fixture(scope="session")
def dockerd() -> Iterator[str]:
    with engine_suite.private_dockerd() as address:
        yield address


@pytest.fixture(scope="session")
def engine_args(dockerd: str) -> dict:
    return {"name": "docker", "binary": DOCKER, "global_args": ("-H", dockerd), "network": "host",
            "pids_limit": limits_kit.PIDS, **limits_kit.HOST_FACTS}


def test_a_hog_is_killed_in_its_own_booking_and_the_other_runs_on(bookings: Bookings) -> None:
    limits_kit.hog_dies_alone(bookings)


def test_doctor_says_dockerd_enforces_them(bookings: Bookings) -> None:
    check = bookings.engine.limits_check()  # type: ignore[attr-defined]
    assert check.ok and "enforced by dockerd" in check.detail and "pids 300" in check.detail, check
