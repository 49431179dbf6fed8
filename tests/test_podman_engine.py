"""The engine behaviour against real rootless podman (runc, overlay), run as an ordinary user."""

from __future__ import annotations

import os
import shutil

import pytest

from runtime import ssh
from runtime.engines import Engine, engine_from
from runtime.templates import get_template
from tests import engine_suite
from tests.engine_suite import CACHE_DIR, Bookings, EngineBehaviour, owner_for_podman

pytestmark = [
    pytest.mark.podman,
    pytest.mark.skipif(shutil.which("podman") is None, reason="podman is not installed"),
]
bookings = engine_suite.bookings  # the shared fixture
PODMAN = {"name": "podman", "runtime": "runc", "storage_driver": "overlay"}


@pytest.fixture(scope="session")
def engine_args() -> dict:
    return dict(PODMAN)


@pytest.fixture(scope="session")
def engine(engine_args: dict) -> Engine:
    return engine_from(**engine_args)


@pytest.fixture(scope="session")
def image(engine: Engine) -> str:
    """The debian-ssh image, built once with mmdebstrap (tarball cached in ~/.cache/gpubook)."""
    return ssh.build_rootfs_image(engine, get_template("debian-ssh"), cache_dir=CACHE_DIR)


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
