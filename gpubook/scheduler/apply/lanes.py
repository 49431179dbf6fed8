"""Each booking's actions in order, different bookings in parallel, in a bounded pool of threads.

No booking waits on another booking's slow step (a start whose sshd is slow, a notice a booker's
terminal holds up). A start waits only for the stops and clears that free its GPUs on its host;
stops and clears are submitted first, so that a start waiting for one never waits for a task
queued behind it. A booking still at work from an earlier pass is skipped (its port stays held),
and so is a start on the GPUs that booking's skipped stop would free, or that another booking's
start at work takes (never two bookings on one GPU).
The pass (passes.py) waits `patience` seconds for its bookings, then leaves the slow ones to
finish on their own and is told when each does.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeGuard

from gpubook.scheduler.core import decide, reclaim

log = logging.getLogger(__name__)

WORKERS = 8  # bookings whose actions run at the same time

_Apply = Callable[[decide.Action], None]


@dataclass(frozen=True)
class _Freeing:
    """A booking's stop or clear at work: a start on the same host and GPUs waits for it."""

    host: str
    gpus: frozenset[int]  # empty: unknown, so every start on the host waits
    future: Future[None]


@dataclass(frozen=True)
class _Starting:
    """A booking's start at work: the (host, GPU) places it takes, which no other start may take meanwhile."""

    places: frozenset[tuple[str, int]]
    future: Future[None]



class BookingLanes:
    """One lane per booking: its actions run in order in one task of the pool."""

    def __init__(self, *, workers: int = WORKERS) -> None:
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="gpubook-booking")
        self._lock = threading.RLock()
        self.busy: dict[str, Future[None]] = {}  # booking id → its actions at work
        self.freeing: dict[str, _Freeing] = {}  # booking id → its stop or clear at work
        self.starting: dict[str, _Starting] = {}  # booking id → its start at work (`starts_at_work`)

    def dispatch(self, actions: Sequence[decide.Action], *, apply: _Apply,
                 gpus_of: Callable[[str], frozenset[int]], stale: Collection[str] = ()) -> list[Future[None]]:
        """Each booking's actions, in order, as one task of the pool; stops and clears first, so
        that a start waiting for one never waits for a task queued behind it. `apply` runs one
        action; `gpus_of` gives the GPUs a container holds (empty: unknown); `stale`: the bookings
        at work when the pass read the world, whose actions wait for the next pass even if their
        work ended meanwhile (`_submit`)."""
        groups: dict[str, list[decide.Action]] = {}
        for action in actions:
            groups.setdefault(booking_of(action) or f"?{id(action)}", []).append(action)
        ordered = sorted(groups.items(), key=lambda item: not any(_frees(a) for a in item[1]))
        submitted = []
        deferred: list[tuple[str, str, frozenset[int]]] = []  # stops left to the next pass: booking, host, GPUs
        for booking_id, group in ordered:
            starting = self._starting_on(_places(group), besides=booking_id)
            if starting is not None:
                # Another booking's start at work takes these GPUs (it began in an earlier pass, its booking
                # since deleted or moved, so this pass's plan gave them away): its container is not listed
                # yet, and starting now would put two bookings on one GPU. The next pass sees it, and its stop.
                log.info("booking %s: its start waits for booking %s's start at work on its GPUs, for the next "
                         "pass", booking_id, starting)
                continue
            waits_on = next((other for other, host, gpus in deferred for s in group
                             if isinstance(s, decide.Start) and _holds(s, host, gpus)), None)
            if waits_on is not None:
                # Its GPUs are still held by a booking whose stop waits for the next pass: starting now
                # would put two bookings on one GPU until then. It starts in that pass, after the stop.
                log.info("booking %s: its start waits for booking %s to stop, in the next pass", booking_id, waits_on)
                continue
            future = self._submit(booking_id, group, apply=apply, gpus_of=gpus_of, stale=booking_id in stale)
            if future is not None:
                submitted.append(future)
            elif freed := _freed(group, gpus_of):
                deferred.append((booking_id, *freed))
        return submitted

    def _submit(self, booking_id: str, group: list[decide.Action], *, apply: _Apply,
                gpus_of: Callable[[str], frozenset[int]], stale: bool) -> Future[None] | None:
        with self._lock:
            earlier = self.busy.get(booking_id)
            if earlier is not None and not earlier.done():
                log.info("booking %s: still at work from an earlier pass; its actions wait for that", booking_id)
                return None
            if stale:
                # Its work ended after the pass began: a start recorded between the hosts' listing and
                # State's read looks vanished (open record, no container) and would be cleared. Its
                # lane told the daemon (on_settled), whose next pass reads it afresh.
                log.info("booking %s: its work from an earlier pass ended during this pass; its actions "
                         "wait for the next pass", booking_id)
                return None
            starts = [a for a in group if isinstance(a, decide.Start)]
            needs = [f.future for f in self.freeing.values() if any(_waits_for(s, f) for s in starts)]
            future = self.pool.submit(self._run_group, group, needs, apply)
            self.busy[booking_id] = future
            if starts:
                self.starting[booking_id] = _Starting(places=_places(starts), future=future)
            if freed := _freed(group, gpus_of):
                self.freeing[booking_id] = _Freeing(host=freed[0], gpus=freed[1], future=future)
        future.add_done_callback(partial(self._forget, booking_id))
        return future

    def _run_group(self, group: Sequence[decide.Action], needs: Sequence[Future[None]], apply: _Apply) -> None:
        wait(needs)
        for action in group:
            try:
                apply(action)
            except Exception:  # a defect, not a booking's failure: logged, and the pool goes on
                log.exception("booking %s: %s failed unexpectedly", booking_of(action) or "-",
                              type(action).__name__.lower())

    def _forget(self, booking_id: str, future: Future[None]) -> None:
        with self._lock:
            if self.busy.get(booking_id) is future:
                del self.busy[booking_id]
            starting = self.starting.get(booking_id)
            if starting is not None and starting.future is future:
                del self.starting[booking_id]
            freeing = self.freeing.get(booking_id)
            if freeing is not None and freeing.future is future:
                del self.freeing[booking_id]

    def _starting_on(self, places: frozenset[tuple[str, int]], *, besides: str) -> str | None:
        """Another booking whose start at work takes any of `places`, if one does."""
        if not places:
            return None
        with self._lock:
            return next((other for other, start in self.starting.items()
                         if other != besides and start.places & places and not start.future.done()), None)

    def wait_patiently(self, pending: Sequence[Future[None]], *, patience: float,
             on_late: Callable[[Future[None]], None]) -> None:
        """Wait `patience` seconds for the pass's bookings; `on_late` is told when a slower one ends."""
        _, late = wait(pending, timeout=patience)
        for future in late:
            future.add_done_callback(on_late)

    def at_work(self) -> set[str]:
        with self._lock:
            return {booking_id for booking_id, future in self.busy.items() if not future.done()}

    def starts_at_work(self) -> set[str]:
        """The bookings whose start is at work: until it is recorded, only its own write-back
        (woken by its lane) knows what to say; a pass's world has its container without its record."""
        with self._lock:
            return {booking_id for booking_id, start in self.starting.items() if not start.future.done()}

    def close(self) -> None:
        """Wait for the bookings at work; queued ones are dropped."""
        self.pool.shutdown(wait=True, cancel_futures=True)


def _frees(action: Any) -> TypeGuard[decide.Stop | decide.Clear | decide.Disarm | reclaim.Release]:
    """Whether the action takes a container away (its GPUs free once it is done)."""
    return isinstance(action, (decide.Stop, decide.Clear, decide.Disarm, reclaim.Release))


def _freed(group: Sequence[Any], gpus_of: Callable[[str], frozenset[int]]) -> tuple[str, frozenset[int]] | None:
    """The host and GPUs a booking's actions take a container away from (no GPUs: unknown), if any."""
    freeing = [a for a in group if _frees(a)]
    if not freeing:
        return None
    return freeing[0].host, frozenset[int]().union(*(gpus_of(a.name) for a in freeing))


def _waits_for(start: decide.Start, freeing: _Freeing) -> bool:
    return not freeing.future.done() and _holds(start, freeing.host, freeing.gpus)


def _places(group: Sequence[Any]) -> frozenset[tuple[str, int]]:
    """Every (host, GPU) the group's starts take, on each node of a multi-node booking."""
    return frozenset((host, gpu) for a in group if isinstance(a, decide.Start)
                     for host, gpus in a.accepted.placement for gpu in gpus)


def _holds(start: decide.Start, host: str, gpus: frozenset[int]) -> bool:
    """Whether a container on `host` holding `gpus` (empty: unknown, so any) stands in `start`'s way."""
    return host == start.accepted.host and (not gpus or bool(gpus & frozenset(start.accepted.gpus)))


def booking_of(action: Any) -> str | None:
    if isinstance(action, decide.Start):
        return action.accepted.booking.id
    return getattr(action, "booking_id", None)
