"""The code passes its own linters, as configured in pyproject.toml."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=600, check=False)


def test_ruff() -> None:
    done = run(str(BIN / "ruff"), "check", "--no-cache", ".")
    assert done.returncode == 0, done.stdout + done.stderr


def mypy_cache() -> Path:
    """mypy's cache, kept between runs (a second run checks only what changed): the tree's own, or, in a
    tree this user cannot write (the test lanes' copy), one in the user's cache folder."""
    own = REPO / ".mypy_cache"
    if os.access(own if own.exists() else REPO, os.W_OK):
        return own
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "gpubook" / "mypy"


def test_mypy() -> None:
    done = run(sys.executable, "-m", "mypy", "--cache-dir", str(mypy_cache()))
    assert done.returncode == 0, done.stdout + done.stderr


def test_import_contracts() -> None:
    """The layers written down in docs/explanation/architecture.md hold (.importlinter)."""
    done = run(str(BIN / "lint-imports"), "--no-cache")
    assert done.returncode == 0, done.stdout + done.stderr
