"""The engine behaviour under Docker with gpubook's default network: a bridge, only the booking's
SSH port published. dockerd runs here as root with its own docker0 bridge and no iptables rules
(docker-proxy forwards the published port), and the bridge is deleted afterwards."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.kits import engine_suite
from tests.kits.engine_suite import DOCKER, DOCKERD, EngineBehaviour

pytestmark = [
    pytest.mark.docker,
    pytest.mark.skipif(
        not (os.path.exists(DOCKERD) and os.path.exists(DOCKER)),
        reason="Debian's docker.io is not installed",
    ),
    pytest.mark.skipif(os.geteuid() != 0, reason="starts dockerd, which needs root"),
]


@pytest.fixture(scope="session")
def dockerd() -> Iterator[str]:
    with engine_suite.private_dockerd(bridge=True) as address:
        yield address


@pytest.fixture(scope="session")
def engine_args(dockerd: str) -> dict:
    return {"name": "docker", "binary": DOCKER, "global_args": ("-H", dockerd), "network": "private"}


@pytest.fixture
def expected_owner():
    return lambda uid: uid


class TestDockerBridge(EngineBehaviour):
    pass
