"""Rootful podman publishes a booking's port on both address families (issue 22, finding 19): before,
`--publish PORT:PORT` made conmon hold 0.0.0.0:PORT only, and any local account could bind
[::]:PORT (IPV6_V6ONLY) for the booking's IPv6 clients to meet. Real rootful podman, as root."""

from __future__ import annotations

import os
import shutil
import socket

import pytest

from tests.kits.engine_suite import BOOKER, Bookings, connect, run

pytestmark = [
    pytest.mark.rootful,
    pytest.mark.skipif(shutil.which("podman") is None, reason="podman is not installed"),
    pytest.mark.skipif(os.geteuid() != 0, reason="rootful podman: run as root"),
]


@pytest.fixture(scope="session")
def engine_args() -> dict:
    return {"name": "podman", "runtime": "runc", "network": "private"}  # root's own storage driver


def test_a_booking_port_leaves_no_address_family_to_a_squatter(bookings: Bookings) -> None:
    booking = bookings.start()
    port = booking.spec.port
    for family, address in ((socket.AF_INET6, "::"), (socket.AF_INET, "0.0.0.0")):  # noqa: S104 - the squatter
        with socket.socket(family, socket.SOCK_STREAM) as squatter:
            if family == socket.AF_INET6:
                squatter.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            with pytest.raises(OSError):
                squatter.bind((address, port))
    with connect(port, BOOKER, booking.key) as client:  # and the booking itself still answers
        assert run(client, "id -un")[1].strip() == BOOKER

