"""[directory] source = "file" (and no [directory]) leaves the [users.NAME] tables as they were."""

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
