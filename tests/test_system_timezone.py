"""[host] timezone's default, the host's own zone, as tzlocal reads it: $TZ first (issue 41)."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.kits.daemon_kit import ROOT

ASK = "from gpubook.scheduler.config import system_timezone; print(system_timezone())"


def _zone(**env: str) -> str:
    done = subprocess.run([sys.executable, "-c", ASK], capture_output=True, text=True, timeout=60, check=True,
                          env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(ROOT), **env})
    return done.stdout.strip()


def test_the_default_zone_honours_tz() -> None:
    assert _zone(TZ="Europe/Paris") == "Europe/Paris"
    assert _zone(TZ="America/Argentina/Buenos_Aires") == "America/Argentina/Buenos_Aires"
    # A $TZ no zone has: the host's own zone, as with none (never an error at start-up).
    assert _zone(TZ="Not/AZone") == _zone()
