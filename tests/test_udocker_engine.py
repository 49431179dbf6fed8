"""The engine behaviour against udocker (R1: the host's runc in an unprivileged user namespace), run
as the tests' unprivileged user, with what differs said test by test: one id (the booker's, the
daemon's own on the host), so no root and no sudo inside, and the host's network."""

from __future__ import annotations

import os

import pytest

from tests.kits.engine_suite import EngineBehaviour

pytestmark = [pytest.mark.udocker, pytest.mark.skipif(os.geteuid() == 0, reason="udocker runs as a user")]


@pytest.fixture(scope="session")
def engine_args() -> dict:
    return {"name": "udocker", "network": "host"}


@pytest.fixture
def expected_owner():
    # One id: every file a booking writes is the daemon's user's on the host.
    return lambda uid: os.getuid()


class TestUdocker(EngineBehaviour):
    root_inside = False
