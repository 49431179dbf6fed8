"""One daemon per account and host, whatever its state folder: a second `gpubook run` as the same
account with another state_dir is refused with a sentence naming the first's pid and folder (two
would fight over the gpubook-sftp container and the booking ports)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpubook.scheduler.locks import AlreadyRunning, hold_account_lock, hold_lock

ROOT = Path(__file__).resolve().parent.parent
HOLD = ("import sys, pathlib\nfrom gpubook.scheduler.locks import hold_account_lock, hold_lock\n"
        "folder = pathlib.Path(sys.argv[1])\nhold_lock(folder)\nhold_account_lock(folder)\n"
        "print('held', flush=True)\nsys.stdin.read()\n")


def test_a_second_daemon_of_the_account_with_another_state_folder_is_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    runtime = tmp_path / "runtime"
    runtime.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))  # the account's runtime folder, as systemd makes it
    first, second = tmp_path / "state-a", tmp_path / "state-b"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(first)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        hold_lock(second)  # its own state folder is free ...
        with pytest.raises(AlreadyRunning) as refused:  # ... the account's lock is not
            hold_account_lock(second)
        assert f"pid {holder.pid}, state folder {first})" in str(refused.value), refused.value
        assert "already runs as this account on this host" in str(refused.value)
    finally:
        holder.communicate("", timeout=30)
    fd = hold_account_lock(second)  # free again once the first ended
    os.close(fd)


def test_the_state_folders_message_no_longer_suggests_another_state_folder(tmp_path: Path) -> None:
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path / "s")], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, cwd=ROOT,
                              env={**os.environ, "PYTHONPATH": str(ROOT), "XDG_RUNTIME_DIR": str(tmp_path)}, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        with pytest.raises(AlreadyRunning) as refused:
            hold_lock(tmp_path / "s")
        assert "state_dir" not in str(refused.value) and f"pid {holder.pid}" in str(refused.value)
    finally:
        holder.communicate("", timeout=30)


CONFIG = ('[host]\ntimezone = "UTC"\n[[calendar]]\nurl = "http://127.0.0.1:9/cal/"\n[gpus]\ncount = 1\n'
          '[users.alice]\nuid = 2001\n[daemon]\nstate_dir = "{state}"\n')


@pytest.mark.slow  # a second or more: out of the fast lane
def test_a_second_gpubook_run_of_the_account_is_refused_naming_the_first(tmp_path: Path) -> None:
    """The real `gpubook run` twice, two state folders, one account."""
    runtime = tmp_path / "runtime"
    runtime.mkdir(mode=0o700)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "XDG_RUNTIME_DIR": str(runtime)}
    configs = {}
    for name in ("a", "b"):
        configs[name] = tmp_path / f"{name}.toml"
        configs[name].write_text(CONFIG.format(state=tmp_path / f"state-{name}"))
    first = subprocess.Popen([sys.executable, "-m", "gpubook", "run", "--config", str(configs["a"])], cwd=ROOT,
                             env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        lock = runtime / "gpubook-daemon.lock"
        deadline = time.monotonic() + 60
        while not (lock.exists() and lock.read_text().startswith(f"{first.pid} ")):
            assert first.poll() is None and time.monotonic() < deadline, "the first daemon did not take the lock"
            time.sleep(0.1)
        second = subprocess.run([sys.executable, "-m", "gpubook", "run", "--config", str(configs["b"])], cwd=ROOT,
                                env=env, capture_output=True, text=True, timeout=60, check=False)
        assert second.returncode != 0
        assert f"another gpubook daemon (pid {first.pid}, state folder {tmp_path / 'state-a'}) already runs as this " \
               f"account on this host" in second.stderr, second.stderr
    finally:
        first.terminate()
        first.wait(timeout=60)
