"""[directory] source = "file" (and no [directory]) leaves the [users.NAME] tables as they were; beside a
directory's users, a table with a uid stays a user of the file."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpubook.runtime.errors import ConfigError
from gpubook.scheduler import config

TEXT = """
[[calendar]]
url = "http://127.0.0.1:5232/lab/devbox1/"

[users.alice]
uid = 2001
email = ["alice@lab.example"]
"""


@pytest.mark.parametrize("directory", ["", '[directory]\nsource = "file"\n'])
def test_file_source_is_todays(tmp_path: Path, directory: str) -> None:
    path = tmp_path / "gpubook.toml"
    path.write_text(TEXT + directory)
    loaded = config.load(path)
    assert list(loaded.users) == ["alice"] and loaded.users["alice"].uid == 2001
    assert loaded.directory is not None and loaded.directory.source == "file"
    assert loaded.directory_users == frozenset() and loaded.user_overrides == {}


def test_file_source_still_needs_uid(tmp_path: Path) -> None:
    path = tmp_path / "gpubook.toml"
    path.write_text(TEXT + "[users.bob]\nmax_gpus = 1\n")
    with pytest.raises(ConfigError, match="users.bob"):
        config.load(path)


def test_a_departed_member_with_a_table_of_their_own_is_that_file_user_not_departed(tmp_path: Path) -> None:
    """bob left the directory's group, but [users.bob] gives a uid: he books as the file's bob (before,
    he was marked departed too, and every booking of his that was not running was refused)."""
    from datetime import UTC, datetime

    from gpubook.scheduler import directory

    path = tmp_path / "gpubook.toml"
    path.write_text(TEXT.replace("[users.alice]", '[directory]\nsource = "ldap"\nurl = "ldaps://ldap.lab.example"\n'
                                 'base = "dc=lab,dc=example"\n\n[users.bob]\nuid = 3000\n\n[users.alice]'))
    parsed = config.load(path, directory="none")
    since = datetime(2026, 11, 29, 9, tzinfo=UTC)
    carol = directory.DirectoryUser(name="carol", uid=2003, gid=2003, emails=("carol@lab.example",), ssh_keys=())
    bob = directory.DirectoryUser(name="bob", uid=2002, gid=2002, emails=("bob@lab.example",), ssh_keys=())
    merged = directory.with_users(parsed, directory.Snapshot(
        [], [], "directory", departed={"bob": (bob, since), "carol": (carol, since)}))
    assert merged.users["bob"].uid == 3000 and merged.departed_users == {"carol": since}
