"""Prometheus's own check of a scrape: `promtool check metrics` (Debian's prometheus package, unpacked
by quickstart's test path to /opt/gpubook/promtool; $GPUBOOK_PROMTOOL or PATH elsewhere). It reads the
text format as Prometheus's scraper does and lints the names, types, units and help lines."""

from __future__ import annotations

import os
import shutil
import subprocess

QUICKSTART_PATH = "/opt/gpubook/promtool/promtool"


def binary() -> str:
    found = os.environ.get("GPUBOOK_PROMTOOL") or shutil.which("promtool") or \
        (QUICKSTART_PATH if os.access(QUICKSTART_PATH, os.X_OK) else None)
    assert found, f"promtool is missing: `./quickstart test` puts it at {QUICKSTART_PATH}"
    return found


def problems(text: str) -> str:
    """What `promtool check metrics` says about `text` (empty when it passes: exit 0 and no line)."""
    done = subprocess.run([binary(), "check", "metrics"], input=text, capture_output=True, text=True,
                          timeout=60, check=False)
    said = (done.stdout + done.stderr).strip()
    return said if done.returncode != 0 or said else ""
