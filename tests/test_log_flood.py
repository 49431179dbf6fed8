"""issue 22, finding 6: a booker floods the container log while the daemon's login sampler reads it
(real rootless podman). The log on disk stays under the engine's cap, and the sampler's memory
stays flat: it keeps only the log's last LOG_READ_LIMIT bytes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from gpubook.runtime.engines.cli_engine import LOG_READ_LIMIT
from tests.kits import engine_suite, log_flood_kit
from tests.kits.engine_suite import Bookings

pytestmark = [
    pytest.mark.podman,
    pytest.mark.skipif(shutil.which("podman") is None, reason="podman is not installed"),
]
REPO = Path(__file__).resolve().parents[1]
FLOOD_BYTES = 300_000_000  # 30 times the log cap, 300 times what `logs` keeps
LOG_CAP = 10_000_000  # cli_engine.LOG_MAX_SIZE
RSS_GROWTH_KIB = 48 * 1024  # the sampler's peak over its RSS before reading: a few reads of 1 MiB, no more


@pytest.fixture(scope="session")
def engine_args() -> dict:
    return dict(engine_suite.PODMAN)


def test_a_log_flood_is_capped_on_disk_and_never_fills_the_samplers_memory(bookings: Bookings) -> None:
    booking = bookings.start(command=log_flood_kit.flood_command(FLOOD_BYTES, "/data/output/flooded"))
    marker = booking.folders.output / "flooded"
    result = log_flood_kit.run_sampler(booking.spec.name, marker, code=REPO, timeout=600)
    assert result["flood_done"], f"the flood did not end within the sampler's time: {result}"
    raw = bookings.engine._inspect_raw([booking.spec.name])[0]  # noqa: SLF001 - where the log file is
    log_path = Path((raw.get("HostConfig") or {}).get("LogConfig", {}).get("Path") or raw["LogPath"])
    size = _size(log_path)
    assert size <= LOG_CAP + 1_000_000, f"the container log grew to {size} bytes ({json.dumps(result)})"
    assert result["longest_log_chars"] <= 2 * LOG_READ_LIMIT, result
    growth = result["peak_rss_kib"] - result["baseline_rss_kib"]
    assert growth <= RSS_GROWTH_KIB, f"the sampler's RSS grew by {growth} KiB while the log was flooded: {result}"


def _size(path: Path) -> int:
    """A file in podman's store: its container folder belongs to a subordinate id, rootless."""
    if os.geteuid() == 0:
        return path.stat().st_size
    done = subprocess.run(["podman", "unshare", "stat", "--format", "%s", str(path)], capture_output=True,
                          text=True, check=True)
    return int(done.stdout)


def test_logs_keep_the_end(bookings: Bookings) -> None:
    """The bounded read keeps the log's last bytes (where a recent login line is), not its first."""
    booking = bookings.start(command=("/bin/sh", "-c", "yes early | head -c 3000000; echo the-last-line; "
                                      "touch /data/output/written; exec sleep 3600"))
    for _ in range(600):
        if (booking.folders.output / "written").exists():
            break
        time.sleep(0.1)
    text = bookings.engine.logs(booking.spec.name)
    assert len(text) <= 2 * LOG_READ_LIMIT and "the-last-line" in text
