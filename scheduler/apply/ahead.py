"""What can be done before a booking's start is done before it, so that its start is the container alone.

Measured (bench/parallel_start.py): the second between a booking's start and its container's
`run` went to the booker's data folders and its SSH host key, each given to the container's ids by
a `podman unshare chown` (rootless), several podman processes per booking; with 8 bookings
starting together those queued on 2 cores for seconds. A host that can make them ahead (its
`prepare`) gets each accepted booking starting within `LEAD` from the pass, in a lane of its own
(one thread: never a pass's or a start's time); the start then finds them made and only checks
them. A booking that went away before its start gets `unprepare` (its host key removed).

Creating the container itself ahead (`podman create`, then `start` at the start) was measured
too and not kept: the start of a created container took as long as a `run` (bench/results/
parallel-2026-11-22/create-ahead.txt).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timedelta

from runtime.errors import GpubookError
from scheduler.config import Config
from scheduler.core import plan as plan_module
from scheduler.hosts import Ahead, Booker, Host

log = logging.getLogger(__name__)

LEAD = timedelta(seconds=60)  # how long before its start a booking's folders and host key are made


class Preparation:
    """Bookings prepared ahead, by host; one lane (thread) does the work."""

    def __init__(self, config: Config, *, hosts: Mapping[str, Host]) -> None:
        self.config = config
        self.hosts = hosts
        self.prepared: dict[str, str] = {}  # booking id → its host, prepared (or being prepared)
        self.lane = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gpubook-prepare")

    def __call__(self, plan: plan_module.Plan, *, running: set[str], now: datetime) -> datetime | None:
        """Prepare what starts within LEAD, forget what went away; give when to come back (the
        next booking's start minus LEAD)."""
        wanted = {a.booking.id for a in plan.accepted}
        for booking_id in [b for b in self.prepared if b not in wanted and b not in running]:
            self.lane.submit(self._unprepare, self.prepared.pop(booking_id), booking_id)
        later = []
        for accepted in plan.accepted:
            booking = accepted.booking
            if booking.start <= now or booking.id in self.prepared or booking.id in running:
                continue
            if booking.start - now > LEAD:
                later.append(booking.start - LEAD)
                continue
            user = self.config.users.get(booking.user)
            host = self.hosts.get(accepted.host)
            if user is None or host is None or getattr(host, "prepare", None) is None:
                continue
            self.prepared[booking.id] = accepted.host
            ahead = Ahead(booking_id=booking.id, booker=Booker(user.name, user.uid, user.gid, user.ssh_keys))
            self.lane.submit(self._prepare, host, ahead)
        return min(later, default=None)

    def _prepare(self, host: Host, ahead: Ahead) -> None:
        try:
            host.prepare(ahead)  # type: ignore[attr-defined]
        except (GpubookError, OSError) as error:  # its start makes them again and says what fails
            log.warning("booking %s: its folders and host key are not made ahead: %s", ahead.booking_id, error)
        except Exception:  # a defect: logged, and the lane goes on
            log.exception("booking %s: preparing it ahead failed unexpectedly", ahead.booking_id)

    def _unprepare(self, host_name: str, booking_id: str) -> None:
        host = self.hosts.get(host_name)
        unprepare = getattr(host, "unprepare", None)
        if unprepare is None:
            return
        try:
            unprepare(booking_id)
        except (GpubookError, OSError) as error:
            log.warning("booking %s: what was made ahead for it stays: %s", booking_id, error)
        except Exception:  # a defect: logged, and the lane goes on
            log.exception("booking %s: unpreparing it failed unexpectedly", booking_id)

    def close(self) -> None:
        self.lane.shutdown(wait=True, cancel_futures=True)
