"""Shared fixtures: real Radicale and Xandikos servers, started once per test session."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import caldav
import pytest

from tests.kits import servers

RADICALE_USER = servers.RADICALE_USER


@pytest.fixture(scope="session")
def radicale_server() -> Iterator[servers.CalendarServer]:
    with servers.running(servers.radicale) as server:
        yield server


@pytest.fixture(scope="session")
def xandikos_server() -> Iterator[servers.CalendarServer]:
    with servers.running(servers.xandikos) as server:
        yield server


@pytest.fixture(scope="session")
def radicale_auth_server() -> Iterator[servers.CalendarServer]:
    """Radicale asking for a password (htpasswd); its first user is RADICALE_USER."""
    with servers.running(servers.radicale, htpasswd=dict([RADICALE_USER])) as server:
        yield server


@pytest.fixture
def radicale(tmp_path: Path) -> Iterator[servers.CalendarServer]:
    """A Radicale of this test alone: some tests stop and start it."""
    storage = tmp_path / "radicale"
    storage.mkdir()
    server = servers.radicale(storage).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(params=["radicale", "xandikos"])
def caldav_server(request: pytest.FixtureRequest) -> servers.CalendarServer:
    """Each test using this runs once against Radicale and once against Xandikos."""
    return request.getfixturevalue(f"{request.param}_server")


@pytest.fixture
def new_calendar(caldav_server: servers.CalendarServer) -> caldav.Calendar:
    """A fresh, empty calendar on the server of `caldav_server`."""
    return caldav_server.new_calendar()


@pytest.fixture
def feed_server() -> Iterator[servers.FeedServer]:
    server = servers.FeedServer().start()
    yield server
    server.stop()


# The fast lane (`pytest --fast`, README "Development"): unit and pure tests only, under two minutes on
# a 2-core machine; what needs servers, engines, a cluster, a browser, a GPU or an install waits for CI.
SLOW_LANE_MARKERS = ("caldav", "podman", "docker", "slurm", "browser", "gpu", "slow", "install", "systemd",
                     "rootful")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--fast", action="store_true",
                     help="run only the fast lane: tests without the markers " + ", ".join(SLOW_LANE_MARKERS))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not config.getoption("--fast"):
        return
    kept, dropped = [], []
    for item in items:
        (dropped if any(item.get_closest_marker(name) for name in SLOW_LANE_MARKERS) else kept).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept
