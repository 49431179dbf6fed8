"""The same engine behaviour against Debian's dockerd, started here as root on a private socket.

dockerd runs with `--iptables=false --bridge=none` (host network only: these machines have no
iptables rules to spare) and its data under a temporary folder, and is stopped after the tests.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from gpubook.runtime.data import storage
from gpubook.runtime.engines import Engine
from gpubook.runtime.errors import EngineError
from gpubook.runtime.mounts import Mount, missing_mount_flags
from gpubook.runtime.nvidia.model import GpuInjection
from tests.kits import engine_suite, safe_data
from tests.kits.engine_suite import DOCKER, DOCKERD, Bookings, EngineBehaviour, new_key, run_as_someone_else

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


def test_a_booker_cannot_swap_output_for_another_bookers_folder(engine: Engine) -> None:
    """Docker binds host paths as root: a booker who owned `<root>/<user>` could swap `output` for a
    symlink to `../bob/output` between gpubook's check and `docker run`, and get bob's folder. The
    per-user folder belongs to root (taken back from a booker who owns it from an older gpubook)."""
    with safe_data.data_root() as root:
        root.chmod(0o755)  # as an admin's data_root is: every booker may walk it
        (root / "alice").mkdir()
        os.chown(root / "alice", 2001, 2001)  # what gpubook made before
        storage.prepare(root, "bob", uid=2002, gid=2002, chown=engine.chown)
        alice = storage.prepare(root, "alice", uid=2001, gid=2001, chown=engine.chown)
        swap = f"cd {root / 'alice'} && mv output old && ln -s ../bob/output output"
        done = subprocess.run(["/bin/sh", "-c", swap], user=2001, group=2001, extra_groups=[],
                              capture_output=True, text=True, check=False)
        assert done.returncode != 0, "alice renamed entries of her per-user folder"
        assert not (root / "alice" / "output").is_symlink() and alice.output.is_dir()
        assert (root / "alice").stat().st_uid == 0
        assert alice.output.stat().st_uid == 2001  # only what is inside is hers


def test_the_mps_pipe_folder_gives_a_docker_booking_no_host_root(bookings: Bookings) -> None:
    """issue 22, finding 4: MPS's pipe folder is a host folder (/tmp/nvidia-mps by default, on a
    mount without nosuid) bound writable. Under Docker root inside is host root: a setuid copy of
    `id` left there runs as root for any host login. A Docker booking with it must not start."""
    folder = Path(tempfile.mkdtemp(prefix="gpubook-mps-", dir="/tmp"))  # noqa: S108 - where MPS puts it
    try:
        assert missing_mount_flags(folder), "this host's /tmp is nosuid: the attack cannot be staged"
        os.mkfifo(folder / "control")  # what a running nvidia-cuda-mps-control leaves there
        mps = Mount(folder, "/tmp/nvidia-mps", read_only=False)  # noqa: S108
        injection = GpuInjection(driver_version="0", gpus=(0,), devices=(), binds=(mps,), soname_links=(),
                                 library_dir="/usr/lib/x86_64-linux-gnu", environment=(), hidden_proc_paths=())
        spec, _ = bookings.spec(key=new_key())
        spec = replace(spec, gpu=injection)
        try:
            bookings.engine.start(spec)
        except EngineError as error:
            assert "root on the host" in str(error)
            assert bookings.engine.inspect(spec.name) is None
            return
        made = bookings.engine.exec(spec.name, ["sh", "-c", "cp /usr/bin/id /tmp/nvidia-mps/id && "
                                                            "chmod 4755 /tmp/nvidia-mps/id"])
        assert made.returncode == 0, made.stderr
        pytest.fail(f"a Docker booking started with the MPS pipe folder writable; a setuid `id` it left "
                    f"there, run by nobody on the host, says: {run_as_someone_else(folder / 'id').strip()}")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
