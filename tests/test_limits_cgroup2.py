"""Rootless limits proven on a cgroup v2 host (the GPU host; this machine has cgroups v1): run as the
daemon's unprivileged account, in a leaf of the subtree that `cgroups.make_delegated_subtree` made
(docs/guides/limits.md says how), or under a user systemd manager that delegates memory and pids.

A booking's container reads the limits asked for (memory.max, pids.max) inside; its cgroup is in
the delegated subtree; a memory hog in one booking is OOM-killed while the other booking, both
containers and podman go on (tests/kits/limits_kit.py)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from gpubook.runtime import cgroups
from gpubook.runtime.engines import Engine
from tests.kits import engine_suite, limits_kit
from tests.kits.engine_suite import Bookings


def _skip_reason() -> str | None:
    if shutil.which("podman") is None:
        return "podman is not installed"
    if os.geteuid() == 0:
        return "proves rootless limits: run it as the daemon's unprivileged account (docs/guides/limits.md)"
    placed = cgroups.placement(euid=os.geteuid(), env=os.environ)
    return None if placed.enforced else f"rootless limits cannot hold here: {placed.how}"


pytestmark = [pytest.mark.podman, pytest.mark.skipif(_skip_reason() is not None, reason=_skip_reason() or "")]


@pytest.fixture(scope="session")
def engine_args() -> dict:
    # runc and overlay as the other podman suites; a host whose podman has other defaults names them.
    return {**engine_suite.PODMAN, "runtime": os.environ.get("GPUBOOK_TEST_RUNTIME", "runc"),
            "pids_limit": limits_kit.PIDS, **limits_kit.HOST_FACTS}


def test_doctor_says_the_limits_hold(engine: Engine) -> None:
    check = engine.limits_check()  # type: ignore[attr-defined]
    assert check.ok and "enforced" in check.detail and "pids 300" in check.detail, check


def test_the_container_reads_its_limits_and_lives_in_the_delegated_subtree(bookings: Bookings) -> None:
    booking = bookings.start()
    assert limits_kit.limits_inside(bookings.engine, booking) == limits_kit.Limits(
        memory=limits_kit.EXPECTED_MEMORY, pids=limits_kit.PIDS)
    info = bookings.engine.inspect(booking.spec.name)
    assert info is not None and info.pid
    where = cgroups.own_cgroup(Path(f"/proc/{info.pid}/cgroup"))
    placed = bookings.engine.placement()  # type: ignore[attr-defined]
    if placed.parent is not None:  # cgroupfs in the delegated subtree: PARENT/libpod-ID
        assert where.startswith(placed.parent + "/libpod-"), where
    else:  # the user systemd manager: a libpod-ID.scope under user@UID.service
        assert f"user@{os.geteuid()}.service" in where and "libpod-" in where, where


def test_a_hog_is_killed_in_its_own_booking_and_the_other_runs_on(bookings: Bookings) -> None:
    limits_kit.hog_dies_alone(bookings)
