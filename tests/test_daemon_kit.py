"""The test kit's promise that one failed daemon test fails alone: a daemon a test started is
stopped after the test even when the test failed before it could stop it or hand it to the
`daemons` fixture (CI on 2026-11-27: test_kill_9_then_restart_adopts_the_same_container failed
before it listed its first daemon; that daemon held the account's lock, and the later daemon tests
failed on "another gpubook daemon already runs")."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.kits.daemon_kit import alive

ROOT = Path(__file__).resolve().parent.parent

INNER = '''
import time
from pathlib import Path

from tests.kits.daemon_kit import DaemonProcess

CONFIG = """[host]\\ntimezone = "UTC"\\n[[calendar]]\\nurl = "http://127.0.0.1:9/cal/"\\n[gpus]\\ncount = 1
[users.alice]\\nuid = 2001\\n[daemon]\\nstate_dir = "{state}"\\n"""


def test_fails_with_its_daemon_running(tmp_path):
    config = tmp_path / "gpubook.toml"
    config.write_text(CONFIG.format(state=tmp_path / "state"))
    daemon = DaemonProcess(config).start()
    Path("{pid_file}").write_text(str(daemon.process.pid))
    time.sleep(1)
    assert daemon.process.poll() is None, daemon.tail()
    assert False, "the test fails before it stops its daemon"
'''


@pytest.mark.podman
def test_a_daemon_left_running_by_a_failed_test_is_stopped_after_it(tmp_path: Path) -> None:
    pid_file = tmp_path / "daemon.pid"
    inner = tmp_path / "test_inner.py"
    inner.write_text(INNER.replace("{pid_file}", str(pid_file)))
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "-p", "tests.plugins.daemons", "--rootdir", str(tmp_path), str(inner)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    pid = int(pid_file.read_text())
    try:
        assert "1 failed" in done.stdout, done.stdout + done.stderr
        assert "the test fails before it stops its daemon" in done.stdout
        assert not alive(pid), "the failed test's daemon still runs after its session"
    finally:
        if alive(pid):
            os.kill(pid, 9)


PAUSE_INNER = '''
import os
import signal
from pathlib import Path

import pytest


def _end_pause():
    pid = int((Path(os.environ["XDG_RUNTIME_DIR"]) / "libpod" / "tmp" / "pause.pid").read_text())
    os.kill(pid, signal.SIGKILL)


def test_leaves_it():
    pass


@pytest.mark.ends_pause
def test_ends_it_on_purpose():
    _end_pause()


def test_ends_it():
    _end_pause()
'''


@pytest.mark.podman
def test_a_test_that_ends_podmans_pause_process_fails_itself_not_the_later_ones(tmp_path: Path) -> None:
    """CI on 2026-11-27: 49 failed and 50 errors after podman's pause process ended while a container
    was recorded running, and the log could not say in which test it ended. tests/plugins/pause.py
    fails the test in which it ends (here a pause process of a podman of its own, not the account's)."""
    runtime = Path(tempfile.mkdtemp(prefix="gpubook-pause-"))  # podman wants a run folder of 50 characters at most
    env = {**os.environ, "XDG_RUNTIME_DIR": str(runtime), "PYTHONPATH": str(ROOT)}
    store = ["podman", "--root", str(tmp_path / "store"), "--runroot", str(runtime / "run")]
    inner = tmp_path / "test_inner.py"
    inner.write_text(PAUSE_INNER)
    outcomes = {}
    try:
        for name in ("test_leaves_it", "test_ends_it_on_purpose", "test_ends_it"):
            subprocess.run([*store, "unshare", "true"], env=env, check=True, capture_output=True, timeout=120)
            done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                   "-p", "tests.plugins.pause", "--rootdir", str(tmp_path), f"{inner}::{name}"],
                                  cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False, env=env)
            outcomes[name] = done.stdout.strip().splitlines()[-1]
            if name == "test_ends_it":
                assert "podman's pause process" in done.stdout and "ended during this test" in done.stdout, done.stdout
    finally:
        subprocess.run([*store, "unshare", "rm", "-rf", str(tmp_path / "store")], env=env, capture_output=True,
                       timeout=120, check=False)
        pid_file = runtime / "libpod" / "tmp" / "pause.pid"
        if pid_file.exists() and alive(int(pid_file.read_text())):
            os.kill(int(pid_file.read_text()), 9)
        shutil.rmtree(runtime, ignore_errors=True)
    assert ["passed" in outcomes["test_leaves_it"], "passed" in outcomes["test_ends_it_on_purpose"],
            "error" in outcomes["test_ends_it"]] == [True, True, True], outcomes
