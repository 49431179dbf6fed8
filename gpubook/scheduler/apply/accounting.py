"""What a pass records besides its actions' outcomes, in one owned step (`Bookkeeping`): the
bookings it accepted (where, on which GPUs) and the ones it rejected (why), for `gpubook report`
and the GPU-hour counters; when each occurrence was first seen and the slot it asks for (the
plan's priority); and the SSH ports no booking holds any more.

Bookkeeping, never the pass's business: a state database that cannot be written costs a warning
and is tried again by the next pass (the last pass's priorities stand meanwhile), and a plan the
same as the last one recorded writes nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping, Sequence
from datetime import datetime

from gpubook.scheduler.core import plan as plan_module
from gpubook.scheduler.core.bookings import Booking, Rejection
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
                      gpus=a.gpus, start=a.booking.start, end=a.booking.end, project=a.booking.project or "")
            for a in plan.accepted]


def rejected(plan: Plan) -> list[RejectedRow]:
    return [RejectedRow(booking_id=r.id, user=r.user, reason=r.reason, start=r.start, end=r.end)
            for r in plan.rejected]


class Bookkeeping:
    """The pass's one recording step outside the handlers: accounting, priority, idle ports."""

    def __init__(self, state: State) -> None:
        self.state = state
        self.accounting = Accounting(state)
        self.seen: Mapping[plan_module.SeenKey, datetime] = {}  # first-seen times, as the last pass read them
        self.slots: Mapping[plan_module.SeenKey, plan_module.Slot] = {}  # the priority, as the last pass read it

    def release_idle_ports(self, keep: Collection[str]) -> None:
        """Ports are held only by running containers (armed ones too) and starts (or arms) in progress."""
        try:
            self.state.release_ports_except(set(keep))
        except StateError as error:
            log.warning("the SSH ports of stopped bookings stay held until a later pass: %s", error)

    def first_seen(self, occurrences: Sequence[Booking | Rejection], *, now: datetime
                   ) -> Mapping[plan_module.SeenKey, datetime]:
        """Record what is new and read when gpubook first saw each occurrence (the plan's priority).
        When State cannot be written, the last pass's times stand (what is new counts as seen last)."""
        try:
            keys = [*map(plan_module.seen_key, occurrences), *map(plan_module.place_key, occurrences)]
            self.seen = self.state.first_seen(keys, now=now, forget_before=now - plan_module.FIRST_SEEN_KEPT)
        except StateError as error:
            log.warning("first-seen times are not recorded this pass; the last pass's stand: %s", error)
        return self.seen

    def asked(self, occurrences: Sequence[Booking | Rejection], *, now: datetime
              ) -> Mapping[plan_module.SeenKey, plan_module.Slot]:
        """Record the slot each booking asks for and read its priority there (a move starts it
        afresh). When State cannot be written, the last pass's records stand (what is new, or
        moved, has none: it comes after every booking accepted before)."""
        asked = {plan_module.seen_key(item): plan_module.slot_of(item)
                 for item in occurrences if isinstance(item, Booking)}
        try:
            rows = self.state.slots_asked(asked, now=now, forget_before=now - plan_module.FIRST_SEEN_KEPT)
        except StateError as error:
            log.warning("the bookings' slots are not recorded this pass; the last pass's stand: %s", error)
            return self.slots
        self.slots = {key: plan_module.Slot(seen_at=row.seen_at, accepted_at=row.accepted_at, rank=row.rank,
                                            placement=row.placement) for key, row in rows.items()}
        return self.slots

    def decided(self, plan: Plan, *, now: datetime) -> None:
        """Priority is earned by acceptance: the accepted keep it (or get it now), the refused lose it."""
        try:
            self.state.slots_decided([(plan_module.seen_key(a.booking), a.rank, a.placement) for a in plan.accepted],
                                     [plan_module.seen_key(r) for r in plan.rejected], now=now)
        except StateError as error:  # recorded by a later pass; until then the new ones hold no priority
            log.warning("the plan's acceptances are not recorded this pass: %s", error)
