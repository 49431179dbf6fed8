"""Data folders: made on first use, names and paths checked, nothing made on bad input."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from runtime import storage
from runtime.errors import StorageError


def test_folders_are_made_once_and_bound_as_asked(tmp_path: Path) -> None:
    folders = storage.prepare(tmp_path, "alice", uid=os.getuid(), gid=os.getgid(), home=True)
    assert folders.input == tmp_path.resolve() / "alice" / "input" and folders.input.is_dir()
    mounts = {mount.target: mount for mount in folders.mounts()}
    assert mounts["/data/input"].read_only and not mounts["/data/output"].read_only
    assert mounts["/home/alice"].source == tmp_path.resolve() / "alice" / "home"
    (folders.output / "kept").write_text("x")
    assert (
        storage.prepare(tmp_path, "alice", uid=os.getuid(), gid=os.getgid()).output
        == folders.output
    )
    assert (folders.output / "kept").read_text() == "x"


@pytest.mark.parametrize(
    "name", ["../../etc", "alice/../bob", "Alice", "", "a" * 33, ".hidden", "al ice", "alice\n"]
)
def test_bad_user_names_make_nothing(tmp_path: Path, name: str) -> None:
    with pytest.raises(StorageError, match="not allowed"):
        storage.prepare(tmp_path, name, uid=os.getuid(), gid=os.getgid())
    assert list(tmp_path.iterdir()) == []


def test_missing_root(tmp_path: Path) -> None:
    with pytest.raises(StorageError, match="does not exist"):
        storage.prepare(tmp_path / "nowhere", "alice", uid=1, gid=1)
    assert not (tmp_path / "nowhere").exists()


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere")
def test_root_not_writable(tmp_path: Path) -> None:
    root = tmp_path / "locked"
    root.mkdir(mode=0o555)
    with pytest.raises(StorageError, match="not writable"):
        storage.prepare(root, "alice", uid=1, gid=1)
    assert list(root.iterdir()) == []


def test_symlinks_out_of_the_root_are_refused(tmp_path: Path) -> None:
    root = tmp_path / "root"
    outside = tmp_path / "elsewhere"
    root.mkdir()
    outside.mkdir()
    (root / "alice").symlink_to(outside)
    with pytest.raises(StorageError, match="not a plain folder"):
        storage.prepare(root, "alice", uid=1, gid=1)
    (root / "alice").unlink()
    (root / "alice").mkdir()
    (root / "alice" / "output").symlink_to("/etc")
    with pytest.raises(StorageError, match="not a plain folder"):
        storage.prepare(root, "alice", uid=os.getuid(), gid=os.getgid())
    assert list(outside.iterdir()) == []
