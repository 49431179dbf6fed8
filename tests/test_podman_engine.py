"""The engine behaviour against real rootless podman (runc, overlay), run as an ordinary user."""

from __future__ import annotations

import os
import shutil

import pytest

from tests import engine_suite
from tests.engine_suite import Bookings, EngineBehaviour, owner_for_podman

pytestmark = [
    pytest.mark.podman,
    pytest.mark.skipif(shutil.which("podman") is None, reason="podman is not installed"),
]
bookings, engine, image = engine_suite.bookings, engine_suite.engine, engine_suite.image  # shared fixtures
PODMAN = {"name": "podman", "runtime": "runc", "storage_driver": "overlay"}


@pytest.fixture(scope="session")
def engine_args() -> dict:
    return dict(PODMAN)


@pytest.fixture
def expected_owner():
    return owner_for_podman


class TestPodman(EngineBehaviour):
    pass


def test_own_user_namespace(bookings: Bookings) -> None:
    """Podman gives each container its own user namespace (Docker shares dockerd's)."""
    booking = bookings.start()
    inside = bookings.engine.exec(
        booking.spec.name, ["readlink", "/proc/self/ns/user"]
    ).stdout.strip()
    assert inside.startswith("user:[") and inside != os.readlink("/proc/self/ns/user")
