"""The same engine behaviour against Debian's dockerd, started here as root on a private socket.

dockerd runs with `--iptables=false --bridge=none` (host network only: these machines have no
iptables rules to spare) and its data under a temporary folder, and is stopped after the tests.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests import engine_suite
from tests.engine_suite import DOCKER, DOCKERD, EngineBehaviour

pytestmark = [
    pytest.mark.docker,
    pytest.mark.skipif(
        not (os.path.exists(DOCKERD) and os.path.exists(DOCKER)),
        reason="Debian's docker.io is not installed",
    ),
    pytest.mark.skipif(os.geteuid() != 0, reason="starts dockerd, which needs root"),
]
bookings, engine, image = engine_suite.bookings, engine_suite.engine, engine_suite.image  # shared fixtures


@pytest.fixture(scope="session")
def dockerd() -> Iterator[str]:
    with engine_suite.private_dockerd() as address:
        yield address


@pytest.fixture(scope="session")
def engine_args(dockerd: str) -> dict:
    # Host network: this dockerd has no bridge (`--bridge=none`), so Docker's "private" network
    # (a bridge with the port published) cannot run here; its argv is checked in test_engine_args.
    return {"name": "docker", "binary": DOCKER, "global_args": ("-H", dockerd), "network": "host"}


@pytest.fixture
def expected_owner():
    # No user namespace under Docker: the booker's uid inside is the same number on the host.
    return lambda uid: uid


class TestDocker(EngineBehaviour):
    pass
