"""The daemon's time, told by the test (gpubook/scheduler/clock.py): a booking's end, a warning, a
no-show or an idle release comes when the test says so, not when the wall clock gets there.

`ToldClock(folder).env()` goes into the daemon's environment (`GPUBOOK_CLOCK_FILE`); `advance(seconds,
daemon)` moves the daemon's clock forward (the offset written whole, then SIGUSR1: the daemon looks at
its bookings at once). Containers, podman, the calendar server and SSH keep the real clock: only the
waiting goes. `now()` is the daemon's time, for the events a test books.
"""

from __future__ import annotations

import os
import signal
from datetime import UTC, datetime, timedelta
from pathlib import Path

from gpubook.scheduler.clock import CLOCK_FILE_ENV
from tests.kits.daemon_kit import DaemonProcess


class ToldClock:
    def __init__(self, folder: Path) -> None:
        self.path = folder / "told-clock"
        self.offset = 0.0
        self._write()

    def env(self) -> dict[str, str]:
        return {CLOCK_FILE_ENV: str(self.path)}

    def now(self) -> datetime:
        return datetime.now(UTC) + timedelta(seconds=self.offset)

    def soon(self, seconds: float) -> datetime:
        """A whole second `seconds` from the daemon's now (calendar times have no fractions)."""
        return (self.now() + timedelta(seconds=seconds + 1)).replace(microsecond=0)

    def advance(self, seconds: float, daemon: DaemonProcess | None = None) -> datetime:
        """The daemon's clock `seconds` later; the daemon told at once. Returns its new now."""
        self.offset += seconds
        self._write()
        if daemon is not None:
            daemon.signal(signal.SIGUSR1)
        return self.now()

    def advance_to(self, moment: datetime, daemon: DaemonProcess | None = None) -> datetime:
        """The daemon's clock at `moment` (never back)."""
        return self.advance(max(0.0, (moment - self.now()).total_seconds()), daemon)

    def _write(self) -> None:
        partial = self.path.with_suffix(".partial")
        partial.write_text(f"{self.offset:.6f}\n")
        os.replace(partial, self.path)
