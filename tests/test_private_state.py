"""The state folder, its database and status file, and the probe key are the daemon's own: made
0700/0600 whatever the umask, a planted symlink is never written through, and a probe key others
can read is refused (finding 15 of issue 9)."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import paramiko
import pytest

from gpubook.runtime.booking import ssh
from gpubook.runtime.private import UnsafePath
from gpubook.scheduler.outbox.status_file import STATUS_FILE
from gpubook.scheduler.state import State
from tests.kits.daemon_kit import in_process_daemon


def mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


@pytest.fixture
def umask_000() -> Iterator[None]:
    """The most careless start: every file the umask alone would leave open to everyone."""
    old = os.umask(0)
    try:
        yield
    finally:
        os.umask(old)


def test_a_fresh_state_folder_database_status_and_probe_key_are_private_under_umask_000(
        tmp_path: Path, umask_000: None) -> None:
    daemon = in_process_daemon(tmp_path)
    daemon.state.log_event("a line, so the write-ahead log exists", level="info")
    daemon.poll()  # the calendar is unreachable: one pass all the same, and the status file
    try:
        folder = tmp_path / "state"
        assert mode(folder) == 0o700
        made = sorted(p.name for p in folder.iterdir())
        assert {"state.sqlite", "state.sqlite-wal", "state.sqlite-shm", "probe-key", STATUS_FILE} <= set(made), made
        assert {name: mode(folder / name) for name in made} == dict.fromkeys(made, 0o600)
    finally:
        daemon.passes.close()
        daemon.state.close()


def test_an_existing_state_folder_readable_by_others_is_made_private(tmp_path: Path) -> None:
    folder = tmp_path / "state"
    folder.mkdir(mode=0o755)
    folder.chmod(0o755)
    (folder / "state.sqlite").touch(mode=0o644)
    (folder / "state.sqlite").chmod(0o644)
    State(folder / "state.sqlite").close()
    assert (mode(folder), mode(folder / "state.sqlite")) == (0o700, 0o600)


def test_a_state_folder_others_can_write_to_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "state"
    folder.mkdir()
    folder.chmod(0o777)
    with pytest.raises(UnsafePath) as refused:
        State(folder / "state.sqlite")
    assert f"chmod 700 {folder}" in str(refused.value)
    assert not (folder / "state.sqlite").exists()


def test_a_symlink_planted_as_the_database_is_not_followed(tmp_path: Path) -> None:
    folder = tmp_path / "state"
    folder.mkdir(mode=0o700)
    elsewhere = tmp_path / "elsewhere.sqlite"
    (folder / "state.sqlite").symlink_to(elsewhere)
    with pytest.raises(UnsafePath, match="is a symbolic link"):
        State(folder / "state.sqlite")
    assert not elsewhere.exists()


def test_a_symlink_planted_at_the_probe_keys_temporary_name_is_not_followed(tmp_path: Path,
                                                                           umask_000: None) -> None:
    """Whatever temporary name the key is written through (the old `.partial` one or today's), a
    symlink planted there is not written through: the file it points to stays as it was."""
    folder = tmp_path / "state"
    folder.mkdir(mode=0o700)
    target = tmp_path / "victim"
    target.write_text("not a key\n")
    for name in ("probe-key.partial", f".probe-key.{os.getpid()}"):
        (folder / name).symlink_to(target)
    key = ssh.load_probe_key(folder / "probe-key")
    assert target.read_text() == "not a key\n"
    assert not (folder / "probe-key").is_symlink() and mode(folder / "probe-key") == 0o600
    assert paramiko.ECDSAKey.from_private_key_file(str(folder / "probe-key")).get_base64() == key.get_base64()


def test_a_probe_key_others_can_read_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "probe-key"
    ssh.load_probe_key(path)
    path.chmod(0o644)
    with pytest.raises(UnsafePath) as refused:
        ssh.load_probe_key(path)
    assert f"chmod 600 {path}" in str(refused.value)
    path.chmod(0o600)
    ssh.load_probe_key(path)  # fixed as the sentence says: accepted


def test_a_probe_key_that_is_a_symlink_is_refused(tmp_path: Path) -> None:
    real = tmp_path / "somewhere-key"
    ssh.load_probe_key(real)
    (tmp_path / "state").mkdir(mode=0o700)
    (tmp_path / "state" / "probe-key").symlink_to(real)
    with pytest.raises(UnsafePath, match="symbolic link"):
        ssh.load_probe_key(tmp_path / "state" / "probe-key")


def test_the_cache_folder_is_made_private_and_one_others_can_write_to_or_own_is_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """issue 22, finding 12: ~/.cache/gpubook holds the entrypoint every container runs as root, the
    NVIDIA link folders and the host keys; whoever may write there could have swapped any of them."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    cache = tmp_path / "cache" / "gpubook"
    cache.mkdir(parents=True)
    cache.chmod(0o777)
    with pytest.raises(UnsafePath, match=f"{cache} is writable by its group or others"):
        in_process_daemon(tmp_path)
    cache.chmod(0o755)
    daemon = in_process_daemon(tmp_path)
    daemon.state.close()
    assert mode(cache) == 0o700
    if os.geteuid() == 0:  # only root can give the folder away
        os.chown(cache, 65534, 65534)
        with pytest.raises(UnsafePath, match=f"{cache} belongs to uid 65534"):
            in_process_daemon(tmp_path)
