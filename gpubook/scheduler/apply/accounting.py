"""What a pass tells the accounting: the bookings it accepted (where, on which GPUs) and the ones it
rejected (why), for `gpubook report` and the GPU-hour counters.

Bookkeeping, never the pass's business: a state database that cannot be written costs a warning
and is tried again by the next pass, and a plan the same as the last one recorded writes nothing.
"""

from __future__ import annotations

import logging
from datetime import datetime

from gpubook.scheduler.core.plan import Plan
from gpubook.scheduler.state import BookedRow, RejectedRow, State, StateError

log = logging.getLogger(__name__)


class Accounting:
    def __init__(self, state: State) -> None:
        self.state = state
        self._last: tuple[tuple[BookedRow, ...], tuple[RejectedRow, ...]] | None = None

    def record(self, plan: Plan, *, now: datetime, complete: bool) -> None:
        """Record the plan's verdicts (see `State.record_bookings`); log, never raise, a failure."""
        verdicts = (tuple(booked(plan)), tuple(rejected(plan)))
        if complete and verdicts == self._last:
            return
        try:
            self.state.record_bookings(accepted=verdicts[0], rejected=verdicts[1], now=now, complete=complete)
        except StateError as error:
            log.warning("the accounting misses this pass's bookings (the next pass records them): %s", error)
            self._last = None
            return
        self._last = verdicts if complete else None


def booked(plan: Plan) -> list[BookedRow]:
    return [BookedRow(booking_id=a.booking.id, user=a.booking.user, template=a.booking.template, host=a.host,
                      gpus=a.gpus, start=a.booking.start, end=a.booking.end) for a in plan.accepted]


def rejected(plan: Plan) -> list[RejectedRow]:
    return [RejectedRow(booking_id=r.id, user=r.user, reason=r.reason, start=r.start, end=r.end)
            for r in plan.rejected]
