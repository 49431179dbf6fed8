"""The daemon's wall clock, one seam for all it does by the time of day, and how it watches that clock.

- `now()`: the time of day for the daemon, its passes, the scheduler's jobs, the sampler, the reclaim
  judge, the reminders and the state's records. It is the host's clock, unless the daemon was started
  with `GPUBOOK_CLOCK_FILE` (tests and benchmarks only; never a config key, read once at start): then
  it is the host's clock plus the offset that file holds, in seconds. A test moves the daemon's time
  forward by writing a larger offset and sending SIGUSR1 (tests/kits/told_clock.py): a booking's end,
  a warning, a no-show or an idle release comes at once, while containers and SSH stay real.
- `real(moment)`: the host's time at which this clock reads `moment`: APScheduler keeps its jobs on
  the host's clock.
- `ClockWatch`: the wall clock stepping back (NTP, `date -s`) would leave APScheduler's next poll in
  the future by the size of the step: the daemon's main loop hands both clocks' readings to a
  `ClockWatch` every few seconds (and at once on SIGUSR1) and, on a step back, polls at once and
  every poll interval from there; on a step forward, it runs a pass at once.
"""

from __future__ import annotations

import os
from datetime import UTC, datetime, timedelta
from pathlib import Path

CLOCK_FILE_ENV = "GPUBOOK_CLOCK_FILE"


class Clock:
    """The host's clock plus an offset read from `told` (a number of seconds), when given."""

    def __init__(self, told: Path | None = None) -> None:
        self.told = told
        self._offset = timedelta(0)

    def offset(self) -> timedelta:
        """The told offset, read at each call (a few bytes; only where a test tells the time)."""
        if self.told is not None:
            try:
                self._offset = timedelta(seconds=float(self.told.read_text()))
            except (OSError, ValueError):
                pass  # not there yet, or half-written: the last offset read stands
        return self._offset

    def now(self) -> datetime:
        return datetime.now(UTC) + self.offset()

    def real(self, moment: datetime) -> datetime:
        return moment - self.offset()


def _from_environment() -> Clock:
    told = os.environ.get(CLOCK_FILE_ENV)
    return Clock(Path(told) if told else None)


CLOCK = _from_environment()


def now() -> datetime:
    """The time of day for everything the daemon does (see the module's docstring)."""
    return CLOCK.now()


def real(moment: datetime) -> datetime:
    """The host's time at which the daemon's clock reads `moment`."""
    return CLOCK.real(moment)


class ClockWatch:
    """Notices the wall clock stepping back between two readings: the monotonic clock says how much
    time passed; the wall clock passing less than that (by more than `tolerance` seconds, beyond
    NTP's slewing) is a step back, given as its size."""

    def __init__(self, *, tolerance: float = 1.0) -> None:
        self.tolerance = timedelta(seconds=tolerance)
        self._last: tuple[datetime, float] | None = None
        self.forward: timedelta | None = None  # the last reading's step forward, if it was one

    def stepped_back(self, *, wall: datetime, monotonic: float) -> timedelta | None:
        last, self._last = self._last, (wall, monotonic)
        self.forward = None
        if last is None:
            return None
        behind = timedelta(seconds=monotonic - last[1]) - (wall - last[0])
        if -behind > self.tolerance:
            self.forward = -behind
        return behind if behind > self.tolerance else None
