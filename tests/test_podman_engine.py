"""The engine behaviour against real rootless podman (runc, overlay), run as an ordinary user."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from runtime.engines import engine_from
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


def test_preflight_finds_a_store_made_with_another_driver(tmp_path: Path) -> None:
    """On the GPU host podman's store was made with another driver than the one gpubook forced,
    so every podman call failed and no booking could start; doctor must say so, with the fix."""
    runroot = tempfile.mkdtemp(prefix="gpb-run-", dir="/tmp")  # podman wants it under 50 characters
    try:
        check_store(("--root", str(tmp_path / "root"), "--runroot", runroot))
    finally:
        shutil.rmtree(runroot, ignore_errors=True)


def check_store(store: tuple[str, ...]) -> None:
    made = engine_from("podman", storage_driver="vfs", global_args=store).preflight()
    assert [c.ok for c in made] == [True, True], made
    assert made[1].detail.startswith("driver vfs")
    checks = engine_from("podman", storage_driver="overlay", global_args=store).preflight()
    storage = checks[-1]
    assert storage.name == "engine storage" and not storage.ok, checks
    assert 'made with "vfs" but gpubook asks for "overlay"' in storage.detail
    assert storage.fix is not None and "remove [engine] storage_driver" in storage.fix
    assert '"vfs"' in storage.fix and "podman system reset" in storage.fix
    # The default follows the store, whatever driver made it.
    follows = engine_from("podman", global_args=store).preflight()
    assert all(c.ok for c in follows) and follows[-1].detail.startswith("driver vfs"), follows
