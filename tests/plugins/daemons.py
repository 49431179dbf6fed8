"""What the daemon tests share: bookers' SSH keys, daemons and containers removed after each test."""

from __future__ import annotations

from collections.abc import Iterator

import paramiko
import pytest

from gpubook.runtime.engines import Engine, container_name
from tests.kits import daemon_kit
from tests.kits.daemon_kit import DaemonProcess


@pytest.fixture(autouse=True)
def no_daemon_outlives_its_test(request: pytest.FixtureRequest) -> Iterator[None]:
    """A daemon the test started and did not stop (its assertion failed first) is stopped after it:
    a daemon left running holds the account's lock, and every later daemon test would fail on it.
    Daemons of a module's or session's fixture, started before this fixture, are theirs to stop.
    A test that started one carries the `daemon` marker (the flake hunt's `-m daemon` finds it)."""
    before = len(daemon_kit.STARTED)
    yield
    started = daemon_kit.STARTED[before:]
    for daemon in started:
        if daemon.process is not None and daemon.process.poll() is None:
            daemon.stop()
    del daemon_kit.STARTED[before:]
    if started and request.node.get_closest_marker("daemon") is None:
        pytest.fail("this test starts `gpubook run` and carries no `daemon` marker (daemon_kit.DAEMON_MODULE "
                    "or daemon_test): `-m daemon` would miss it", pytrace=False)


@pytest.fixture
def keys() -> dict[str, paramiko.PKey]:
    return {"alice": paramiko.ECDSAKey.generate(bits=256), "bob": paramiko.ECDSAKey.generate(bits=256)}


@pytest.fixture
def cleanup(engine: Engine) -> Iterator[list[str]]:
    """Booking ids whose containers are removed after the test, pass or fail."""
    booking_ids: list[str] = []
    yield booking_ids
    for booking_id in booking_ids:
        engine.stop(container_name(booking_id), 0)


@pytest.fixture
def daemons() -> Iterator[list[DaemonProcess]]:
    """Daemons stopped after the test, pass or fail."""
    started: list[DaemonProcess] = []
    yield started
    for daemon in started:
        daemon.stop()
