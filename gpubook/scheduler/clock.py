"""The wall clock stepping back (NTP, `date -s`) would leave APScheduler's next poll in the future
by the size of the step: the daemon's main loop hands both clocks' readings to a `ClockWatch`
every few seconds and, on a step back, polls at once and every poll interval from there."""

from __future__ import annotations

from datetime import datetime, timedelta


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
