"""One daemon per account and host, whatever its state folder: a second `gpubook run` as the same
account with another state_dir is refused with a sentence naming the first's pid and folder (two
would fight over the gpubook-sftp container and the booking ports)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpubook.scheduler.daemon import AlreadyRunning, hold_account_lock, hold_lock

ROOT = Path(__file__).resolve().parent.parent
HOLD = ("import sys, pathlib\nfrom gpubook.scheduler.daemon import hold_account_lock, hold_lock\n"
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
