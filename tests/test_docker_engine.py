"""The same engine behaviour against Debian's dockerd, started here as root on a private socket.

dockerd runs with `--iptables=false --bridge=none` (host network only: these machines have no
iptables rules to spare) and its data under a temporary folder, and is stopped after the tests.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from runtime import ssh
from runtime.engines import Engine, engine_from
from runtime.templates import get_template
from tests import engine_suite
from tests.engine_suite import CACHE_DIR, EngineBehaviour

DOCKERD = "/usr/sbin/dockerd"
DOCKER = "/usr/bin/docker"  # Debian's client, matching Debian's dockerd

pytestmark = [
    pytest.mark.docker,
    pytest.mark.skipif(
        not (os.path.exists(DOCKERD) and os.path.exists(DOCKER)),
        reason="Debian's docker.io is not installed",
    ),
    pytest.mark.skipif(os.geteuid() != 0, reason="starts dockerd, which needs root"),
]
bookings = engine_suite.bookings  # the shared fixture


@pytest.fixture(scope="session")
def dockerd() -> Iterator[str]:
    """A private dockerd; gives its socket address. Stopped and its data removed afterwards."""
    # Short path: containerd's socket under exec-root must fit in 108 bytes.
    home = Path(tempfile.mkdtemp(prefix="gpubook-dockerd-", dir="/tmp"))
    socket_path = home / "docker.sock"
    log = (home / "dockerd.log").open("wb")
    daemon = subprocess.Popen(
        [
            DOCKERD,
            "--iptables=false",
            "--bridge=none",
            "--host",
            f"unix://{socket_path}",
            "--data-root",
            str(home / "data"),
            "--exec-root",
            str(home / "exec"),
            "--pidfile",
            str(home / "dockerd.pid"),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
    )
    address = f"unix://{socket_path}"
    try:
        _wait_for(address, daemon, home / "dockerd.log")
        yield address
    finally:
        daemon.terminate()
        try:
            daemon.wait(timeout=30)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait()
        log.close()
        shutil.rmtree(home, ignore_errors=True)


def _wait_for(address: str, daemon: subprocess.Popen[bytes], log_path: Path) -> None:
    for _ in range(600):
        if daemon.poll() is not None:
            raise RuntimeError(f"dockerd exited: {log_path.read_text()[-2000:]}")
        done = subprocess.run([DOCKER, "-H", address, "info"], capture_output=True, check=False)
        if done.returncode == 0:
            return
        time.sleep(0.1)
    raise RuntimeError(f"dockerd did not answer within 60 s: {log_path.read_text()[-2000:]}")


@pytest.fixture(scope="session")
def engine_args(dockerd: str) -> dict:
    return {"name": "docker", "binary": DOCKER, "global_args": ("-H", dockerd)}


@pytest.fixture(scope="session")
def engine(engine_args: dict) -> Engine:
    return engine_from(**engine_args)


@pytest.fixture(scope="session")
def image(engine: Engine) -> str:
    return ssh.build_rootfs_image(engine, get_template("debian-ssh"), cache_dir=CACHE_DIR)


@pytest.fixture
def expected_owner():
    # No user namespace under Docker: the booker's uid inside is the same number on the host.
    return lambda uid: uid


class TestDocker(EngineBehaviour):
    pass
