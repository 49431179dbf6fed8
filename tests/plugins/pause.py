"""A test that ends rootless podman's pause process fails itself, not the tests after it.

The pause process holds the user and mount namespaces every container of the account was made in;
each container's network namespace is a mount there. Killed while a container is recorded running,
every later podman command of the account fails ("invalid internal status … podman system migrate",
or, once a new pause process made new namespaces, "joining network namespace of container …: unknown
FS magic"), and with it every later test that runs a container: CI once showed 49 failures and 50
errors after one. This fixture reads the pause process before and after each test; a test that
started with one alive and ended without it (or with another) fails with what the new one was
started from. A test that ends it on purpose carries the `ends_pause` marker.
"""

from __future__ import annotations

import os
import pwd
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.kits.daemon_kit import alive
from tests.kits.slurm_kit import DEFAULT_USER


def _account(request: pytest.FixtureRequest) -> tuple[int, Path] | None:
    """The account whose podman the test runs, and its runtime folder: root's tests run rootless podman
    only in the Slurm tests, as the Slurm kit's account (root's other lane, running beside them, has
    none of its own to check)."""
    if os.geteuid() != 0:
        return os.getuid(), Path(os.environ.get("XDG_RUNTIME_DIR") or f"/run/user/{os.getuid()}")
    if request.node.get_closest_marker("slurm") is None:
        return None
    try:
        uid = pwd.getpwnam(DEFAULT_USER).pw_uid
    except KeyError:
        return None
    return uid, Path(f"/run/user/{uid}")


def pause_process(uid: int, runtime: Path) -> int | None:
    """The pid of the account's live pause process, None when there is none (or it is dying: a
    SIGKILL sent at the end of a test may not have ended it yet)."""
    try:
        pid = int((runtime / "libpod" / "tmp" / "pause.pid").read_text().strip())
        proc = Path(f"/proc/{pid}")
        if proc.stat().st_uid != uid or not alive(pid):
            return None
        pending = {k: v for k, v in (line.split(":", 1) for line in (proc / "status").read_text().splitlines()
                                     if line.startswith(("SigPnd:", "ShdPnd:")))}
    except (OSError, ValueError, IndexError):
        return None
    return None if any(int(mask, 16) & 1 << (signal.SIGKILL - 1) for mask in pending.values()) else pid


def _started_from(pid: int) -> str:
    """What of a pause process's environment tells which command started it."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return ""
    told = [v for v in environ if v.split("=", 1)[0].startswith(("SLURM_", "GPUBOOK_", "PWD"))]
    return f" (started with {' '.join(sorted(told))})" if told else ""


@pytest.fixture(autouse=True)
def podman_keeps_its_pause_process(request: pytest.FixtureRequest) -> Iterator[None]:
    account = _account(request)
    before = pause_process(*account) if account else None
    yield
    if account is None or before is None or request.node.get_closest_marker("ends_pause"):
        return
    after = pause_process(*account)
    if after != before:
        now = f"; pause process {after} now{_started_from(after)}" if after else ""
        pytest.fail(f"podman's pause process {before} ended during this test{now}: the namespaces of the "
                    "account's containers went with it, and a container recorded running makes every later "
                    "podman command fail (end it only with its containers, or mark the test ends_pause)",
                    pytrace=False)
