"""Between two modules, the lane checks that it is still fit to run the next: a module that leaves it
broken fails (an error at its last test's teardown, saying what is broken) and the lane stops there,
instead of failing every later test for a reason that is not theirs.

What is checked, after each module that is not in the fast lane (it carries a marker declared in
pyproject.toml):
- **podman**: the account's rootless podman still answers `podman ps` (a lost pause process or network
  namespace makes every later podman command fail); only as an unprivileged account, after a module
  marked `podman` or `udocker`;
- **the data mounts**: the test data tmpfs (`GPUBOOK_TEST_DATA_ROOT`) and the fault tests' small one
  (`GPUBOOK_TEST_FULL_ROOT`) are still mounted nosuid,nodev wherever they were at the start, and
  writable by the lane;
- **the lane's ports**: nothing listens on the lane's block of booking ports (`GPUBOOK_TEST_PORTS`,
  given by tools/lanes.py) once the module's fixtures are gone: a container or daemon left behind.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
import time
from collections.abc import Generator
from pathlib import Path

import pytest

from tests.kits import disk_full, safe_data
from tests.kits.daemon_kit import lane_ports
from tests.plugins.lanes import declared_markers

PORTS_GRACE_SECONDS = 30.0  # a container stopped at the module's end may hold its port a moment longer
PODMAN_SECONDS = 120.0


class LaneBroken(Exception):
    """The lane is not fit for its next module: what is broken, in a sentence."""


def mounts() -> dict[str, set[str]]:
    """Mount points and their options (/proc/self/mountinfo)."""
    found: dict[str, set[str]] = {}
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        found[fields[4].replace("\\040", " ")] = set(fields[5].split(","))
    return found


def listening(low: int, high: int) -> list[int]:
    """The TCP ports in low..high that something listens on (any address, IPv4 or IPv6)."""
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            port = int(fields[1].rsplit(":", 1)[1], 16)
            if fields[3] == "0A" and low <= port <= high:  # 0A: LISTEN
                ports.add(port)
    return sorted(ports)


def _check_mount(path: Path) -> str | None:
    options = mounts().get(str(path))
    if options is None:
        return f"{path} is no longer a mount"
    if not {"nosuid", "nodev"} <= options:
        return f"{path} is mounted without nosuid,nodev ({','.join(sorted(options))})"
    try:
        with tempfile.NamedTemporaryFile(dir=path, prefix=".lane-health-"):
            pass
    except OSError as error:
        return f"{path} cannot be written: {error}"
    return None


def _check_podman() -> str | None:
    try:
        done = subprocess.run(["podman", "ps", "--all", "--quiet"], capture_output=True, text=True,
                              timeout=PODMAN_SECONDS, check=False, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return f"`podman ps` did not answer in {PODMAN_SECONDS:g} s"
    if done.returncode != 0:
        return f"`podman ps` failed (exit {done.returncode}): {done.stderr.strip()[-600:]}"
    return None


def _check_ports() -> str | None:
    low, high = lane_ports()
    deadline = time.monotonic() + PORTS_GRACE_SECONDS
    while True:
        taken = listening(low, high)
        if not taken or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    if taken:
        ports = ", ".join(map(str, taken))
        return (f"port(s) {ports} of the lane's block {low}-{high} still listened on {PORTS_GRACE_SECONDS:g} s "
                "after the module's end (a container or daemon left behind)")
    return None


class Health:
    def __init__(self, config: pytest.Config) -> None:
        self.slow = declared_markers(config) if config.inipath is not None and config.inipath.name == "pyproject.toml" \
            else ()
        self.mounts = [path for path in (safe_data.MOUNT, disk_full.FULL_MOUNT) if str(path) in mounts()]
        self.lane = os.environ.get("GPUBOOK_TEST_LANE")

    def check(self, item: pytest.Item) -> list[str]:
        marked = {name for name in self.slow if item.get_closest_marker(name)}
        if not marked:
            return []
        problems = [_check_mount(path) for path in self.mounts]
        if os.geteuid() != 0 and marked & {"podman", "udocker"}:
            problems.append(_check_podman())
        if self.lane is not None:
            problems.append(_check_ports())
        return [problem for problem in problems if problem]


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    config.stash[HEALTH] = Health(config)


HEALTH = pytest.StashKey[Health]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, None, None]:
    """After the last test of a module, its module fixtures torn down (failed or not), check the lane."""
    try:
        return (yield)
    finally:
        if nextitem is None or nextitem.path != item.path:
            health = item.config.stash[HEALTH]
            problems = health.check(item)
            if problems:
                where = f"lane {health.lane}" if health.lane else "this run"
                item.session.shouldstop = (f"{where} stopped: {item.path.name} left it broken "
                                           f"({'; '.join(problems)}); the later modules would fail for it")
                raise LaneBroken(f"{item.path.name} left {where} unfit for the next module: {'; '.join(problems)}")
