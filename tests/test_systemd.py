"""gpubook/systemd/gpubook.service passes `systemd-analyze verify --user` and says what the daemon needs.

No user manager runs here (CI runs the suite under runuser), so the verification gets its own
HOME and XDG_RUNTIME_DIR; the ExecStart binary it checks for (%h/.local/share/gpubook/venv/bin/gpubook)
is a stand-in script in that temporary HOME. The unit file verified is the one in the tree.
"""

from __future__ import annotations

import configparser
import shutil
import subprocess
from pathlib import Path

import pytest

UNIT = Path(__file__).resolve().parent.parent / "gpubook" / "systemd" / "gpubook.service"
EXEC = Path(".local/share/gpubook/venv/bin/gpubook")
# Notes about the checkout's file modes (umask of a CI clone), not about the unit's content.
MODE_NOTES = ("is marked executable", "is marked world-writable", "is marked world-inaccessible")

pytestmark = pytest.mark.skipif(shutil.which("systemd-analyze") is None,
                                reason="systemd-analyze is not installed (package systemd)")


def _verify(unit: Path, home: Path) -> subprocess.CompletedProcess[str]:
    runtime = home / "runtime"
    runtime.mkdir(mode=0o700, exist_ok=True)
    binary = home / EXEC
    binary.parent.mkdir(parents=True, exist_ok=True)
    binary.write_text("#!/bin/sh\nexit 0\n")
    binary.chmod(0o755)
    env = {"HOME": str(home), "XDG_RUNTIME_DIR": str(runtime), "PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}
    return subprocess.run(["systemd-analyze", "verify", "--user", str(unit)], env=env,
                          capture_output=True, text=True, timeout=60, check=False)


def _problems(result: subprocess.CompletedProcess[str]) -> list[str]:
    lines = (result.stdout + result.stderr).splitlines()
    return [line for line in lines if line.strip() and not any(note in line for note in MODE_NOTES)]


def test_unit_verifies_cleanly(tmp_path: Path) -> None:
    result = _verify(UNIT, tmp_path)
    assert result.returncode == 0 and _problems(result) == [], result.stdout + result.stderr


def test_verification_catches_a_broken_unit(tmp_path: Path) -> None:
    """The check above can fail: a misspelt key and a missing binary are both reported."""
    broken = tmp_path / "gpubook.service"
    broken.write_text(UNIT.read_text().replace("WatchdogSec=", "WatchdogSecs=")
                      .replace("venv/bin/gpubook run", "venv/bin/gpubook-missing run"))
    result = _verify(broken, tmp_path)
    report = "\n".join(_problems(result))
    assert "Unknown key" in report and "WatchdogSecs" in report
    assert result.returncode != 0 and "gpubook-missing" in report


def test_unit_has_what_the_daemon_relies_on() -> None:
    parser = configparser.ConfigParser(strict=False, interpolation=None, comment_prefixes=("#", ";"))
    parser.optionxform = str  # type: ignore[assignment,method-assign]  # systemd keys are case-sensitive
    parser.read_string(UNIT.read_text())
    service = parser["Service"]
    assert service["Type"] == "notify"
    assert int(service["WatchdogSec"]) > 0
    assert service["Restart"] == "on-failure"
    assert service["KillMode"] == "process"  # containers outlive a daemon restart
    assert "NoNewPrivileges" not in service  # would break newuidmap for rootless podman
    assert service["ExecStart"].split()[1:] == ["run", "--config", "%E/gpubook/gpubook.toml"]
    assert parser["Install"]["WantedBy"] == "default.target"
