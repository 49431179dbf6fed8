"""A closed pipe (`gpubook config example | head -1`, the reader gone before gpubook writes): no
traceback, exit 1 (issue 41)."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.kits.daemon_kit import ROOT


def test_a_reader_that_left_gets_no_traceback() -> None:
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first line
    try:
        done = subprocess.run([sys.executable, "-m", "gpubook.scheduler.commands.cli", "config", "example"],
                              stdout=write, stderr=subprocess.PIPE, text=True, timeout=60, cwd="/",
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
    finally:
        os.close(write)
    assert "Traceback" not in done.stderr and "BrokenPipeError" not in done.stderr, done.stderr
    assert done.returncode == 1
