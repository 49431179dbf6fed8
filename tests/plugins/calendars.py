"""Calendar servers for the tests: real Radicale and Xandikos, started once per test session, and
an iCalendar feed served over HTTP."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import caldav
import pytest

from tests.kits import servers


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
    """Radicale asking for a password (htpasswd); its first user is servers.RADICALE_USER."""
    with servers.running(servers.radicale, htpasswd=dict([servers.RADICALE_USER])) as server:
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
