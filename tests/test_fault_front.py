"""The fault front (tests/kits/front.py's FaultFront) in front of real Radicale: each calendar fault
is seen by a caldav client as the failure a real server gives, lift() lets go of every held
connection at once, and the next request goes through."""

from __future__ import annotations

import http.client
import socket
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import caldav
import niquests
import pytest
from caldav.lib import error as dav_error
from caldav.lib.http_sync import HTTPBasicAuth

from tests.kits import servers
from tests.kits.daemon_kit import event_text, wait_for
from tests.kits.front import FaultFront

pytestmark = [pytest.mark.caldav]

CLIENT_TIMEOUT = 2.0  # the caldav client's timeout: how long a hang or a partition is waited on


@pytest.fixture
def front(radicale_server: servers.CalendarServer) -> Iterator[FaultFront]:
    front = FaultFront(radicale_server.base_url).start()
    yield front
    front.stop()


@pytest.fixture
def calendar(radicale_server: servers.CalendarServer) -> caldav.Calendar:
    return radicale_server.new_calendar()


def through(front: FaultFront, calendar: caldav.Calendar) -> caldav.Calendar:
    """The calendar as a caldav client reaches it through the front."""
    url = front.base_url + str(calendar.url.path)
    client = caldav.get_davclient(url=url, username="test", password="any", auth=HTTPBasicAuth("test", "any"),
                                  check_config_file=False, environment=False, timeout=CLIENT_TIMEOUT)
    return client.calendar(url=url)


def booking(uid: str) -> str:
    start = datetime.now(UTC).replace(microsecond=0) + timedelta(hours=1)
    return event_text(uid, user="alice", start=start, end=start + timedelta(hours=1))


def raw_request(front: FaultFront, path: str = "/") -> socket.socket:
    """A connection with one GET sent on it, not read."""
    connection = socket.create_connection(("127.0.0.1", port_of(front)), timeout=CLIENT_TIMEOUT)
    connection.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    return connection


def port_of(front: FaultFront) -> int:
    return int(front.base_url.rsplit(":", 1)[1])


def read_all(connection: socket.socket) -> bytes:
    """What comes on the connection until it is closed (socket.timeout if it stays open)."""
    received = b""
    while chunk := connection.recv(65536):
        received += chunk
    return received


def assert_lift_lets_go(front: FaultFront, remote: caldav.Calendar) -> None:
    front.lift()
    assert front.holding == 0
    assert front.kind is None
    remote.save_event(booking("after-lift"))  # the same client, its dropped connection made anew
    assert [e.icalendar_component["UID"] for e in remote.events()] == ["after-lift"]


def test_error_answers_every_request_500_and_passes_none_on(front: FaultFront, calendar: caldav.Calendar) -> None:
    remote = through(front, calendar)
    front.fault("error")
    with pytest.raises(dav_error.DAVError, match="500"):
        remote.events()
    with pytest.raises(dav_error.DAVError, match="500"):
        remote.save_event(booking("during-error"))
    assert calendar.events() == []  # the PUT never reached Radicale
    assert {h[1] for h in front.hits()} == {"error"}
    assert any(h[2].startswith("PUT ") for h in front.hits())
    assert_lift_lets_go(front, remote)


def test_hang_passes_the_request_on_then_stalls_mid_answer(front: FaultFront, calendar: caldav.Calendar) -> None:
    remote = through(front, calendar)
    front.fault("hang")
    with pytest.raises(niquests.exceptions.ConnectionError, match="timed out"):
        remote.save_event(booking("stored-unanswered"))
    # The server did the work: the booking is stored though its client never heard so.
    assert [e.icalendar_component["UID"] for e in calendar.events()] == ["stored-unanswered"]
    connection = raw_request(front, str(calendar.url.path))
    head = connection.recv(65536)
    assert head.startswith(b"HTTP/1.1 200") and b"Transfer-Encoding: chunked" in head
    with pytest.raises(TimeoutError):
        connection.recv(65536) and connection.recv(65536)  # half the body at most, then nothing
    front.lift()
    connection.settimeout(10)
    assert not read_all(connection).endswith(b"0\r\n\r\n")  # dropped: the answer's end never came
    connection.close()
    calendar.event_by_uid("stored-unanswered").delete()
    assert_lift_lets_go(front, remote)


def test_refuse_closes_the_port_and_lift_listens_on_the_same_one(front: FaultFront,
                                                                 calendar: caldav.Calendar) -> None:
    remote = through(front, calendar)
    kept = http.client.HTTPConnection("127.0.0.1", port_of(front), timeout=CLIENT_TIMEOUT)
    kept.request("OPTIONS", "/")
    assert kept.getresponse().read() is not None
    front.fault("refuse")
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port_of(front)), timeout=CLIENT_TIMEOUT)
    with pytest.raises(niquests.exceptions.ConnectionError) as raised:
        remote.events()
    assert "refused" in str(raised.value).lower()
    with pytest.raises((http.client.HTTPException, ConnectionError)):  # the open connection was dropped
        kept.request("OPTIONS", "/")
        kept.getresponse()
    kept.close()
    assert_lift_lets_go(front, remote)


def test_partition_answers_nothing_not_even_on_open_connections(front: FaultFront,
                                                                calendar: caldav.Calendar) -> None:
    remote = through(front, calendar)
    kept = http.client.HTTPConnection("127.0.0.1", port_of(front), timeout=CLIENT_TIMEOUT)
    kept.request("OPTIONS", "/")
    kept.getresponse().read()
    front.fault("partition")
    kept.request("OPTIONS", "/")  # the keep-alive connection is still accepted into, and goes silent
    with pytest.raises(TimeoutError):
        kept.getresponse()
    with pytest.raises(niquests.exceptions.ReadTimeout):
        remote.events()
    fresh = raw_request(front)  # a new connection is accepted, its request read, never answered
    with pytest.raises(TimeoutError):
        fresh.recv(65536)
    wait_for("the partition to hold the fresh connection", lambda: front.holding >= 2, timeout=10)
    started = time.monotonic()
    front.lift()
    fresh.settimeout(10)
    assert read_all(fresh) == b""  # dropped at lift, unanswered
    assert time.monotonic() - started < 5  # held threads are let go at once, not at a timeout
    fresh.close()
    kept.close()
    assert_lift_lets_go(front, remote)


@pytest.mark.parametrize("kind", ["hang", "partition"])
def test_a_client_giving_up_frees_its_held_connection(front: FaultFront, kind: str) -> None:
    front.fault(kind)
    connection = raw_request(front)
    wait_for("the request to be held", lambda: front.holding == 1, timeout=10)
    connection.close()
    wait_for("the held connection to be let go", lambda: front.holding == 0, timeout=10)
    assert front.kind == kind  # still faulted: only that client gave up


def test_an_answer_coming_back_after_a_partition_began_is_held(radicale_server: servers.CalendarServer,
                                                               calendar: caldav.Calendar) -> None:
    front = FaultFront(radicale_server.base_url, delay=1.0).start()  # each request 1 s at the server
    try:
        connection = raw_request(front, str(calendar.url.path))
        wait_for("the request to reach the front", lambda: front.requests(), timeout=10)
        front.fault("partition")
        with pytest.raises(TimeoutError):
            connection.recv(65536)  # the server answered after 1 s; the partition kept it
        front.lift()
        connection.settimeout(10)
        assert read_all(connection) == b""
    finally:
        front.stop()


def test_a_second_fault_lifts_the_first_and_an_unknown_one_is_refused(front: FaultFront) -> None:
    front.fault("partition")
    connection = raw_request(front)
    wait_for("the request to be held", lambda: front.holding == 1, timeout=10)
    front.fault("error")
    assert front.holding == 0 and front.kind == "error"
    connection.close()
    with pytest.raises(ValueError, match="'slow' is not one of error, hang, refuse, partition"):
        front.fault("slow")
