"""What can be done before a booking's start is done before it, so that its start is the SSH probe alone.

Measured (bench/parallel_start.py): the second between a booking's start and its container's
`run` went to the booker's data folders and its SSH host key, each given to the container's ids by
a `podman unshare chown` (rootless), several podman processes per booking; with 8 bookings
starting together those queued on 2 cores for seconds. A host that can make them ahead (its
`prepare`) gets each accepted booking starting within `LEAD` from the pass, in a lane of its own
(never a pass's or a start's time); the start then finds them made and only checks them. A booking
that went away before its start gets `unprepare` (its host key removed).

Then the container itself is run ahead ("armed", a host's `arm`): with exactly the spec its start
builds (the same function, hosts/start.py `spec`), so at the start the pass finds it listed with
the same spec hash and only the SSH probe is left (no engine call). Its entrypoint makes the
account and keys and then waits for the booking's start (GPUBOOK_NOT_BEFORE) before sshd,
JupyterLab or the template's command run: nobody logs in and nothing of the booker's runs before
the start. Measured (BENCHMARKS.md, run 5, 2-core VM, rootless podman): `podman run` to SSH alone
costs 0.37-0.41 s there, more than the single-start target (0.35 s), and 8 of them at once queue
on the cores; armed, the daemon's probe answered 0.08-0.10 s after a single booking's start
(booker's login 0.15 s median) and 0.13-0.20 s for 8 together (last booker's login 0.42 s).
Creating it ahead instead (`podman create` then `start` at the start) was measured and not kept:
the `start` took as long as a `run` (bench/results/parallel-2026-11-22/create-ahead.txt).

A booking is armed only when its start is at least `ARM_MARGIN` away, its template exists (and
suits the driver), its image is ready, and its GPUs are free: held by no running container and
booked by no earlier booking that has not ended. Back-to-back bookings on the same GPUs are
therefore not armed (the one before still holds them): they start the normal way at their start.
A failed arm is logged, its port given back and nothing left; the booking starts the normal way.
decide() leaves an armed container alone until its start, starts it then, and removes it at once
(`Disarm`) when its booking goes, moves or changes. The ARMED State note survives a restart.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from functools import partial

from gpubook.runtime.engines import ContainerInfo, booking_id_problem, container_name
from gpubook.runtime.errors import GpubookError, Preparing
from gpubook.runtime.templates.catalog import TemplateSet
from gpubook.scheduler.core import plan as plan_module
from gpubook.scheduler.hosts import Ahead, Arms, Booker, Host, PreparesAhead, StartRequest, start
from gpubook.scheduler.settings import Config
from gpubook.scheduler.state import State, StateError, notes

log = logging.getLogger(__name__)

LEAD = timedelta(seconds=60)  # how long before its start a booking's folders, host key and container are made
ARM_MARGIN = timedelta(seconds=2)  # closer to its start than this, a booking is started, not armed
ARM_WAIT = 60.0  # seconds a pass waits at most for an arm still at work when its booking's start came
ARM_RETRY = timedelta(seconds=2)  # a booking whose image is not ready yet is tried again this soon


@dataclass(frozen=True)
class _Arm:
    """A booking to arm, with the start request its start would build."""

    request: StartRequest
    user: str


class Preparation:
    """Bookings prepared (and armed) ahead, by host; a small lane of threads does the work."""

    def __init__(self, config: Config, *, hosts: Mapping[str, Host], state: State | None = None) -> None:
        self.config = config
        self.hosts = hosts
        self.state = state  # None: nothing is armed (no ports to allocate)
        self.prepared: dict[str, str] = {}  # booking id → its host, prepared (or being prepared)
        self.arming: dict[str, tuple[datetime, Future[None]]] = {}  # booking id → its start, its arm at work
        self.tried: set[str] = set()  # bookings armed, or whose arm failed (not tried again)
        self.waiting: dict[str, datetime] = {}  # booking id → its start, its image not ready when last tried
        self.lane = ThreadPoolExecutor(max_workers=2, thread_name_prefix="gpubook-prepare")
        self.on_armed: Callable[[], None] | None = None  # told when a booking's container was armed

    def __call__(self, plan: plan_module.Plan, *, running: set[str], now: datetime,
                 containers: Sequence[ContainerInfo] = (), templates: TemplateSet | None = None,
                 may_start: bool = True, stale: frozenset[str] = frozenset()) -> datetime | None:
        """Prepare (and arm) what starts within LEAD, forget what went away; give when to come back
        (the next booking's start minus LEAD, or soon while an image to arm with is being prepared)."""
        wanted = {a.booking.id for a in plan.accepted}
        for booking_id in [b for b in self.prepared if b not in wanted and b not in running]:
            self.tried.discard(booking_id)
            self.waiting.pop(booking_id, None)
            self.lane.submit(self._unprepare, self.prepared.pop(booking_id), booking_id)
        later: list[datetime] = []
        present = {info.booking_id for info in containers}
        for accepted in plan.accepted:
            booking = accepted.booking
            if booking.start <= now or booking.id in running:
                continue
            if booking.start - now > LEAD:
                later.append(booking.start - LEAD)
                continue
            user = self.config.users.get(booking.user)
            host = self.hosts.get(accepted.host)
            if user is None or host is None:
                continue
            arm = None
            armable = may_start and booking.calendar_url not in stale
            if armable and templates is not None and booking.id not in present and booking.id not in self.tried \
                    and booking.id not in self.arming and booking.start - now >= ARM_MARGIN:
                arm = self._armable(accepted, plan, containers, templates=templates, host=host, now=now)
            first = booking.id not in self.prepared and isinstance(host, PreparesAhead)
            if not first and arm is None:
                continue
            self.prepared.setdefault(booking.id, accepted.host)
            ahead = Ahead(booking_id=booking.id, booker=Booker(user.name, user.uid, user.gid, user.ssh_keys))
            future = self.lane.submit(self._prepare, host, ahead if first else None, arm, now)
            if arm is not None:
                self.arming[booking.id] = (booking.start, future)
                future.add_done_callback(partial(self._armed, booking.id))
        # An arm at work may end waiting for its image (the lane learns it after this pass): come
        # back soon to try it again, while there is time before its start.
        unsettled = {**dict(self.waiting), **{b: start for b, (start, _) in dict(self.arming).items()}}
        later += [now + ARM_RETRY for start in unsettled.values() if start - now > ARM_MARGIN + ARM_RETRY]
        return min(later, default=None)

    def _armed(self, booking_id: str, future: Future[None]) -> None:
        entry = self.arming.get(booking_id)
        if entry is not None and entry[1] is future:
            del self.arming[booking_id]

    def at_work(self) -> set[str]:
        """Bookings whose arm is at work: their port is held though no container lists it yet."""
        return set(dict(self.arming))

    def settle(self, now: datetime) -> None:
        """Wait for the arms of bookings whose start has come (rare: an arm ends ARM_MARGIN before
        its start), so that the pass finds their containers and starts them, never a second one."""
        due = [future for start, future in dict(self.arming).values() if start <= now]
        if due:
            wait_futures(due, timeout=ARM_WAIT)

    def _armable(self, accepted: plan_module.Accepted, plan: plan_module.Plan, containers: Sequence[ContainerInfo],
                 *, templates: TemplateSet, host: Host, now: datetime) -> _Arm | None:
        """The booking's arm, or None while it may not be armed (checked again by the next pass)."""
        booking = accepted.booking
        if self.state is None or not isinstance(host, Arms) or booking_id_problem(booking.id):
            return None
        template, _ = start.usable_template(templates, booking.template, driver_version=host.driver_version)
        user = self.config.users[booking.user]
        if template is None:
            return None  # its start refuses it, with the reason in its event
        gpus = set(accepted.gpus)
        held = any(info.running and info.booking_id != booking.id and (info.host or plan_module.LOCAL) == accepted.host
                   and gpus & set(info.gpus) for info in containers)
        before = any(other.host == accepted.host and other.booking.id != booking.id
                     and other.booking.start < booking.start and other.booking.end > now
                     and gpus & set(other.gpus) for other in plan.accepted)
        if held or before:
            return None  # the GPUs are someone else's until then (back-to-back bookings start at their start)
        return _Arm(request=start.request(booking, user, template=template, gpus=accepted.gpus, port=0),
                    user=user.name)

    def _prepare(self, host: Host, ahead: Ahead | None, arm: _Arm | None, now: datetime) -> None:
        if ahead is not None and isinstance(host, PreparesAhead):
            try:
                host.prepare(ahead)
            except (GpubookError, OSError) as error:  # its start makes them again and says what fails
                log.warning("booking %s: its folders and host key are not made ahead: %s", ahead.booking_id, error)
            except Exception:  # a defect: logged, and the lane goes on
                log.exception("booking %s: preparing it ahead failed unexpectedly", ahead.booking_id)
        if arm is not None:
            self._arm(host, arm, now)

    def _arm(self, host: Host, arm: _Arm, now: datetime) -> None:
        """Run the booking's container ahead of its start; on any failure give its port back and
        leave nothing (the booking then starts the normal way)."""
        assert self.state is not None  # noqa: S101 - _armable gives no arm without State
        booking_id = arm.request.booking_id
        self.waiting.pop(booking_id, None)
        try:
            port = start.port_for(self.config, self.state, booking_id, now=now)
            notes.ARMED.write(self.state, booking_id, port, at=now)  # before the run: a restart still knows
        except (GpubookError, OSError) as error:
            log.info("booking %s: not armed ahead (%s); it starts at its start", booking_id, error)
            return
        request = replace(arm.request, port=port)
        assert isinstance(host, Arms)  # noqa: S101 - _armable gives no arm for a host without the door
        try:
            host.arm(request)
        except Preparing as waiting:  # its image: tried again by a later pass
            if arm.request.start is not None:
                self.waiting[booking_id] = arm.request.start
            self._give_back(host, booking_id, remove=False)
            log.info("booking %s: not armed yet: %s", booking_id, waiting)
            return
        except (GpubookError, OSError) as error:
            self.tried.add(booking_id)
            self._give_back(host, booking_id, remove=True)
            log.warning("booking %s: its container could not be run ahead of its start (%s); it starts at "
                        "its start", booking_id, str(error).splitlines()[0] if str(error) else type(error).__name__)
            return
        except Exception:  # a defect: logged, and the lane goes on
            self.tried.add(booking_id)
            self._give_back(host, booking_id, remove=True)
            log.exception("booking %s: arming it failed unexpectedly", booking_id)
            return
        self.tried.add(booking_id)
        log.info("booking %s: its container runs ahead of its start on port %d; SSH opens at %s",
                 booking_id, port, arm.request.start.isoformat() if arm.request.start else "-")
        if self.on_armed is not None:  # a pass soon writes its ssh line into the event, before the start
            self.on_armed()

    def _give_back(self, host: Host, booking_id: str, *, remove: bool) -> None:
        try:
            if remove:
                host.stop(container_name(booking_id), 0)
            assert self.state is not None  # noqa: S101
            self.state.release_port(booking_id)
            notes.ARMED.clear(self.state, booking_id)
        except (GpubookError, OSError, StateError) as error:  # the pass frees idle ports; decide disarms
            log.warning("booking %s: what its failed arm took is given back by a later pass: %s", booking_id, error)

    def _unprepare(self, host_name: str, booking_id: str) -> None:
        host = self.hosts.get(host_name)
        if not isinstance(host, PreparesAhead):
            return
        try:
            host.unprepare(booking_id)
        except (GpubookError, OSError) as error:
            log.warning("booking %s: what was made ahead for it stays: %s", booking_id, error)
        except Exception:  # a defect: logged, and the lane goes on
            log.exception("booking %s: unpreparing it failed unexpectedly", booking_id)

    def close(self) -> None:
        self.lane.shutdown(wait=True, cancel_futures=True)
