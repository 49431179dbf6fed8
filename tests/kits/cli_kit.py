"""`gpubook` run as a process, as an admin runs it, on a small config (tests/test_cli_admin.py,
tests/test_ports_taken.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def gpubook(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`gpubook ARGS` as a process, with only the environment given (and what Python needs)."""
    base = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(ROOT), "PYTHONDONTWRITEBYTECODE": "1"}
    return subprocess.run([sys.executable, "-m", "gpubook", *args], capture_output=True, text=True, timeout=120,
                          cwd=ROOT, env=base | (env or {}), check=False)


def write_config(path: Path, *, state_dir: Path, extra: str = "") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text('[host]\ntimezone = "UTC"\n[[calendar]]\nurl = "http://127.0.0.1:9/cal/"\n[gpus]\ncount = 1\n'
                    f'[users.alice]\nuid = 2001\n[daemon]\nstate_dir = "{state_dir}"\n{extra}')
    return path
