"""The code passes its own linters, as configured in pyproject.toml."""

from __future__ import annotations

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


def test_mypy() -> None:
    # The tree may be read-only for the test user: no cache.
    done = run(sys.executable, "-m", "mypy", "--cache-dir", "/dev/null")
    assert done.returncode == 0, done.stdout + done.stderr


def test_import_contracts() -> None:
    """The layers written down in docs/ARCHITECTURE.md hold (.importlinter)."""
    done = run(str(BIN / "lint-imports"), "--no-cache")
    assert done.returncode == 0, done.stdout + done.stderr
