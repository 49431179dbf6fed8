"""One pass, as a short story: read the hosts and State once, plan, decide, apply each action
through the handler for its kind, fold each recorded outcome into the pass's view, then let the
outbox read what was recorded (calendar write-back, notices).

No booking waits on another booking's slow step: each booking's actions run in order in a
bounded pool of threads, different bookings in parallel (lanes.py: a start whose sshd is slow, a
notice a booker's terminal holds up). A start waits only for the stops that free its GPUs. The pass waits
`patience` seconds for its bookings, then leaves the slow ones to finish on their own (`on_settled`
tells the daemon, which runs a pass for their write-back); a booking still at work is skipped by
later passes, and its port stays held. The write-back runs after the pass, one lane per calendar
(gpubook/scheduler/outbox/writeback.py); a start's own outcome is queued there by its lane as soon as its SSH
answered (or it failed), so a booker never waits for the bookings starting beside theirs. What can
be made before a start (folders, host key) is made ahead (ahead.py). Notices are delivered in a
lane of their own.

Each booking's failure is caught, logged as a sentence naming the booking, and retried on a later
pass (temporary errors after a growing delay, permanent ones after `PERMANENT_RETRY`); it never
stops the other bookings, and neither does a state database that cannot be written (a
`StateError` is one booking's failure, or one lost event-log line). One `run` at a time (the
daemon holds a lock); the pool's threads share State (a connection per thread) and the World
(behind its lock).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from functools import partial
from typing import Protocol
from zoneinfo import ZoneInfo

import paramiko

from gpubook.runtime.engines import ContainerInfo, booker_digest, container_name
from gpubook.runtime.errors import GpubookError, Preparing
from gpubook.runtime.templates import Template, TemplateSet
from gpubook.scheduler.apply import reclaim as reclaim_apply
from gpubook.scheduler.apply.accounting import Accounting
from gpubook.scheduler.apply.ahead import Preparation
from gpubook.scheduler.apply.handlers import (
    Change,
    ClearHandler,
    DisarmHandler,
    HoldHandler,
    StartHandler,
    StopHandler,
    WarnHandler,
    record_stop,
)
from gpubook.scheduler.apply.lanes import BookingLanes, booking_of
from gpubook.scheduler.apply.memory import (
    AGREED_END,
    ARMED,
    PERMANENT_RETRY,
    PREPARING_RECHECK,
    WARNED,
    Journal,
    Recall,
    decide_memory,
    failure,
)
from gpubook.scheduler.core import decide, reclaim
from gpubook.scheduler.core import plan as plan_module
from gpubook.scheduler.core import policy as policy_module
from gpubook.scheduler.core.bookings import Booking, Rejection
from gpubook.scheduler.hosts import Host
from gpubook.scheduler.hosts.images import ImagePreparer
from gpubook.scheduler.outbox import notices as notices_module
from gpubook.scheduler.outbox import reminders
from gpubook.scheduler.outbox.metrics import Metrics, start_failure_reason
from gpubook.scheduler.outbox.writeback import Remarks, WriteBack
from gpubook.scheduler.settings import Config
from gpubook.scheduler.state import ContainerRecord, State, StateError

log = logging.getLogger(__name__)

PATIENCE = 3.0  # seconds a pass waits for its bookings' actions before leaving slow ones to finish alone


@dataclass
class World:
    """The pass's view: what each host runs and what State recorded, read once and kept up to date
    from the handlers' changes."""

    containers: dict[str, ContainerInfo]  # by container name
    records: dict[int, ContainerRecord]  # by record id, in id order
    releases: dict[str, reclaim.Released] = field(default_factory=dict)  # by booking id: no-shows released
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)  # bookings fold in parallel

    @classmethod
    def read(cls, hosts: Sequence[Host], state: State, *, releases_after: datetime | None = None) -> World:
        """`releases_after`: read the releases of bookings ending after it (None: none)."""
        containers = {info.name: info for host in hosts for info in host.list()}
        releases = reclaim_apply.read_releases(state, after=releases_after) if releases_after is not None else {}
        return cls(containers=containers, records={r.id: r for r in state.containers()}, releases=releases)

    def fold(self, change: Change) -> None:
        with self.lock:
            if change.gone is not None:
                self.containers.pop(change.gone, None)
            if change.running is not None:
                self.containers[change.running.name] = change.running
            for record in change.records:
                self.records[record.id] = record

    def actual(self) -> list[ContainerInfo]:
        with self.lock:
            return list(self.containers.values())

    def gpus_of(self, name: str) -> frozenset[int]:
        """The GPUs a container holds (empty: unknown)."""
        with self.lock:
            info = self.containers.get(name)
        return frozenset(info.gpus) if info is not None else frozenset()

    def running(self) -> dict[str, ContainerInfo]:
        return {i.booking_id: i for i in self.actual() if i.running and i.booking_id}

    def records_by_booking(self) -> dict[str, list[ContainerRecord]]:
        with self.lock:
            records = sorted(self.records.values(), key=lambda r: r.id)
        grouped: dict[str, list[ContainerRecord]] = {}
        for record in records:
            grouped.setdefault(record.booking_id, []).append(record)
        return grouped


@dataclass
class PassResult:
    plan: plan_module.Plan
    actions: list[decide.Action]
    failures: dict[str, str] = field(default_factory=dict)  # booking id → why it failed this pass
    wake_at: datetime | None = None  # the earliest moment something is due (plan, rechecks, retries)
    world: World | None = None


class Cluster(Protocol):
    """A cluster backend (gpubook/scheduler/hosts/slurm/backend.py), as a pass uses it."""

    @property
    def hosts(self) -> Mapping[str, Host]: ...

    def refresh(self) -> str: ...

    def sync(self, accepted: Sequence[plan_module.Accepted], *, now: datetime) -> Reserved: ...


class Reserved(Protocol):
    @property
    def refused(self) -> Mapping[str, str]: ...

    @property
    def problem(self) -> str: ...


class Pass:
    """The daemon's hands: one `run` per pass, with the handlers built once."""

    def __init__(self, config: Config, *, hosts: Mapping[str, Host], state: State, templates: TemplateSet,
                 notices: Callable[[notices_module.Message], None] | None = None,
                 metrics: Metrics | None = None, logged_in: Callable[[ContainerInfo], bool] | None = None,
                 cluster: Cluster | None = None) -> None:
        """`metrics`: the daemon's, told of each start's SSH latency and each failed start;
        `logged_in`: a last look for the booker's login in a container's log before a release;
        `cluster`: a cluster backend whose nodes are the hosts (read again each pass) and whose
        reservations follow the plan."""
        self.cluster = cluster
        self.config = config
        self.metrics = metrics
        self.hosts = dict(hosts)  # the handlers share this dict: a cluster's refresh updates it in place
        self.state = state
        self.templates = templates
        self.notices = notices
        self.recall = Recall()
        self.seen: Mapping[plan_module.SeenKey, datetime] = {}  # first-seen times, as the last pass read them
        self.slots: Mapping[plan_module.SeenKey, plan_module.Slot] = {}  # the priority, as the last pass read it
        self.journal = Journal(state, self.recall)
        self.writeback = WriteBack(config, state)
        hosts_, journal = self.hosts, self.journal
        self.stop = StopHandler(hosts=hosts_, state=state, journal=journal)
        self.handlers: dict[type, Callable[..., Change]] = {
            decide.Start: StartHandler(config, hosts=hosts_, state=state, templates=templates, recall=self.recall,
                                       journal=journal, metrics=metrics),
            decide.Stop: self.stop,
            decide.Clear: ClearHandler(hosts=hosts_, state=state, journal=journal),
            decide.Disarm: DisarmHandler(hosts=hosts_, state=state, journal=journal),
            decide.Warn: WarnHandler(hosts=hosts_, state=state, journal=journal, timezone=config.host.timezone),
            decide.Hold: HoldHandler(recall=self.recall, journal=journal),
            reclaim.Release: reclaim_apply.ReleaseHandler(hosts=hosts_, state=state, journal=journal,
                                                          timezone=config.host.timezone, logged_in=logged_in,
                                                          metrics=metrics),
            reclaim.IdleNotice: reclaim_apply.IdleHandler(hosts=hosts_, state=state, journal=journal),
        }
        self.policy_lines: dict[str, str] = {}  # booking id → its release or idle line, for its event
        self.patience = PATIENCE
        self.on_settled: Callable[[], None] | None = None  # told when a booking's work outlasted its pass
        self.lanes = BookingLanes()
        self.accounting = Accounting(state)  # the bookings each pass accepted and rejected, for reports
        self.ahead = Preparation(config, hosts=self.hosts, state=state)  # folders, host keys, containers ahead
        self.ahead.on_armed = self._settled_late  # its ssh line goes into the event before the start
        self.outbox = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gpubook-notices")
        self._delivery: Future[None] | None = None

    @property
    def busy(self) -> dict[str, Future[None]]:
        """Booking id → its actions at work (in this pass or left from an earlier one)."""
        return self.lanes.busy

    @property
    def inventory(self) -> dict[str, tuple[int, ...]]:
        return {name: host.gpus for name, host in self.hosts.items()}

    def policy(self) -> decide.Policy:
        daemon = self.config.daemon
        return decide.Policy(notice=timedelta(seconds=daemon.notice_seconds),
                             stop_grace=self.config.engine.stop_grace_seconds,
                             restart_limit=daemon.restart_limit,
                             restart_backoff=timedelta(seconds=daemon.restart_backoff_seconds),
                             warn_before=timedelta(minutes=self.config.defaults.warn_minutes),
                             idle_percent=self.config.policy.idle_percent, timezone=self.config.host.timezone)

    def run(self, occurrences: Sequence[Booking | Rejection], *, now: datetime, may_start: bool = True,
            stale_reason: str = "", etags: Mapping[str, str | None] | None = None,
            write_back: bool = True, stale_calendars: Mapping[str, str] | None = None,
            complete: bool = True) -> PassResult:
        self.ahead.settle(now)  # an arm still at work for a booking whose start came: its container first
        silent = self.refresh_cluster() if self.cluster is not None else ""
        if silent:
            may_start, stale_reason = False, silent
        # Before the hosts are read: a start (or arm) ending in between keeps its port.
        at_work = self.lanes.at_work() | self.ahead.at_work()
        world = World.read(list(self.hosts.values()), self.state,
                           releases_after=now - policy_module.reach_back(self.config))
        self._release_idle_ports(world, at_work)
        released = reclaim.released_ids(occurrences, world.releases)
        plan = self.plan(occurrences, world.actual(), now=now, releases=world.releases)
        self.accounting.record(plan, now=now, complete=complete)
        wanted = {a.booking.id for a in plan.accepted}
        self.recall.preparing = {k: t for k, t in dict(self.recall.preparing).items() if k in wanted}
        armed = frozenset(self.state.notes(ARMED))
        self._adopt(plan, world, now=now, at_work=at_work, armed=armed)
        self._prepare_images(plan, world, now=now, armed=armed)
        held = self._reserve(plan, now=now) if self.cluster is not None and may_start else {}
        memory = replace(decide_memory(world.records.values(), self.state.notes(WARNED), armed), released=released,
                         idle_told=reclaim_apply.told_stretches(self.state.notes(reclaim_apply.IDLE_TOLD)))
        verdicts = reclaim_apply.judge_running(self.config, self.state, plan=plan, running=world.running(),
                                               records=world.records_by_booking(), now=now)
        self.policy_lines = reclaim_apply.event_lines(
            verdicts, {k: v for k, v in world.releases.items() if k in released}, config=self.config)
        actions = decide.decide(plan, world.actual(), now=now, memory=memory, policy=self.policy(),
                                may_start=may_start, stale_reason=stale_reason,
                                stale_calendars=stale_calendars or {}, complete=complete, verdicts=verdicts,
                                held=held, bookers=self._bookers(plan))
        for action in actions:  # the cluster's reasons go into the held bookings' events
            if isinstance(action, decide.Hold) and (action.booking_id in held or silent):
                self.recall.notes[action.booking_id] = action.reason
        result = PassResult(plan=plan, actions=actions, world=world)
        handled = [a for a in actions if type(a) in self.handlers]  # Recheck only informs the wake-up time
        written = partial(self._write_start, world=world, now=now, etags=etags or {}, armed=armed) if write_back \
            else None
        pending = self.lanes.dispatch(handled, apply=partial(self._apply, world=world, now=now, result=result,
                                                             written=written),
                                      gpus_of=world.gpus_of)
        self.lanes.wait_patiently(pending, patience=self.patience, on_late=self._settled_late)
        ahead = self.ahead(plan, running=set(world.running()) | self.lanes.at_work(), now=now,
                           containers=world.actual(), templates=self.templates, may_start=may_start,
                           stale=frozenset((stale_calendars or {}).keys()))
        rechecks = [a.at for a in actions if isinstance(a, decide.Recheck) and a.at > now]
        retries = [t for t in self.recall.retries() if t > now]  # one due now was tried by this pass
        remind = reminders.queue_due(plan, config=self.config, state=self.state, now=now)
        result.wake_at = min([t for t in (plan.next_wakeup, ahead, remind, *rechecks, *retries) if t is not None],
                             default=None)
        if write_back:
            self.write_back(plan, world, now=now, etags=etags or {}, armed=armed)
        self._deliver_notices(now)
        return result

    # -- around the bookings' work -------------------------------------------------------------

    def refresh_cluster(self) -> str:
        """The cluster's nodes and jobs read again, its hosts this pass's ("" or why they could not
        be read: nothing starts). Also for `gpubook stop`, which reads the hosts as a pass does."""
        assert self.cluster is not None
        problem = self.cluster.refresh()
        for name, host in self.cluster.hosts.items():
            self.hosts[name] = host
        return problem

    def _reserve(self, plan: plan_module.Plan, *, now: datetime) -> dict[str, str]:
        """The plan's reservations made on the cluster; the bookings that must not start, and why."""
        assert self.cluster is not None
        reserved = self.cluster.sync(plan.accepted, now=now)
        if reserved.problem:
            return {a.booking.id: reserved.problem for a in plan.accepted}
        return dict(reserved.refused)

    def _settled_late(self, future: Future[None] | None = None) -> None:
        if self.on_settled is not None:
            self.on_settled()

    def _prepare_images(self, plan: plan_module.Plan, world: World, *, now: datetime,
                        armed: frozenset[str] = frozenset()) -> None:
        """Hand each host's preparer the bookings starting within [images] prepare_hours (it only
        queues: the pulls and builds run in its own workers, never in the pass). An armed booking
        is still wanted: its start checks its image again."""
        horizon = now + timedelta(hours=self.config.images.prepare_hours)
        running = self._reportable(world, armed, now=now)
        wanted: dict[str, dict[str, Template]] = {}
        for accepted in plan.accepted:
            booking = accepted.booking
            template = self.templates.templates.get(booking.template)
            if template is not None and booking.start <= horizon and booking.end > now and booking.id not in running:
                wanted.setdefault(accepted.host, {})[booking.id] = template
        for name, host in self.hosts.items():
            preparer = getattr(host, "images", None)  # a capability: hosts without one start as they are
            if isinstance(preparer, ImagePreparer):
                preparer.want(wanted.get(name, {}), now=now)

    def _release_idle_ports(self, world: World, at_work: set[str]) -> None:
        """Ports are held only by running containers (armed ones too) and starts (or arms) in progress."""
        try:
            self.state.release_ports_except(set(world.running()) | at_work)
        except StateError as error:
            log.warning("the SSH ports of stopped bookings stay held until a later pass: %s", error)

    def _deliver_notices(self, now: datetime) -> None:
        """In a lane of their own: a slow mail server holds no pass."""
        if self._delivery is not None and not self._delivery.done():
            return
        self._delivery = self.outbox.submit(self._deliver, now)

    def _deliver(self, now: datetime) -> None:
        try:
            notices_module.deliver_pending(self.state, self.notices, now=now)
        except GpubookError as error:
            log.warning("notices wait for a later pass: %s", error)

    def plan(self, occurrences: Sequence[Booking | Rejection], actual: Sequence[ContainerInfo], *,
             now: datetime, releases: Mapping[str, reclaim.Released] | None = None) -> plan_module.Plan:
        """The plan around what runs: running bookings keep their GPUs, template and (unless later
        is free) their end; released ones (no-shows) end at their release."""
        occurrences = reclaim.apply_releases(occurrences, releases or {})
        pinned = decide.pin_running(occurrences, actual, now=now)
        running = dict(pinned.running)
        agreed = self.state.notes(AGREED_END)
        ends = {i.booking_id: datetime.fromisoformat(agreed[i.booking_id]) if i.booking_id in agreed else i.end
                for i in actual if i.booking_id in running and i.end is not None}
        first_seen = self._first_seen(occurrences, now=now)
        slots = self._slots(occurrences, now=now)
        templates = frozenset(self.templates.templates) | frozenset(self.templates.errors)
        zone = ZoneInfo(self.config.host.timezone)
        inventory = self.inventory
        placed = {i.booking_id: ((i.host or plan_module.LOCAL, i.gpus), *i.others)
                  for i in actual if i.booking_id in running and i.host}
        result, granted, refused = decide.plan_with_extensions(
            pinned.occurrences, agreed_ends=ends,  # type: ignore[arg-type]
            plan=lambda items: plan_module.plan(items, inventory=inventory, config=self.config,
                                                templates=templates, now=now, running=running,
                                                first_seen=first_seen, placed=placed, slots=slots),
            describe=lambda t: t.astimezone(zone).strftime("%Y-%m-%d %H:%M %z"))
        self._slots_decided(result, now=now)
        for booking_id, end in granted.items():
            try:
                self.state.set_note(booking_id, AGREED_END, end.isoformat(), at=now)
            except StateError as error:  # granted again by the next pass
                log.warning("booking %s: its later end is not recorded yet: %s", booking_id, error)
                continue
            self.journal.say(booking_id, f"the end moved later, to {end.isoformat()}; the booking keeps running",
                             now=now)
        self.recall.notes = {**pinned.notes, **refused}
        for booking_id, note in self.recall.notes.items():
            self.journal.note(booking_id, note, now=now)
        return result

    def _first_seen(self, occurrences: Sequence[Booking | Rejection], *, now: datetime
                    ) -> Mapping[plan_module.SeenKey, datetime]:
        """Record what is new and read when gpubook first saw each occurrence (the plan's priority).
        When State cannot be written, the last pass's times stand (what is new counts as seen last)."""
        try:
            self.seen = self.state.first_seen(map(plan_module.seen_key, occurrences), now=now,
                                              forget_before=now - plan_module.FIRST_SEEN_KEPT)
        except StateError as error:
            log.warning("first-seen times are not recorded this pass; the last pass's stand: %s", error)
        return self.seen

    def _bookers(self, plan: plan_module.Plan) -> dict[str, str]:
        """Who each accepted booking's container would let in now: an armed one must match."""
        users = self.config.users
        return {a.booking.id: booker_digest(user.name, user.uid, user.gid, user.ssh_keys)
                for a in plan.accepted if (user := users.get(a.booking.user)) is not None}

    def _slots(self, occurrences: Sequence[Booking | Rejection], *, now: datetime
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

    def _slots_decided(self, plan: plan_module.Plan, *, now: datetime) -> None:
        """Priority is earned by acceptance: the accepted keep it (or get it now), the refused lose it."""
        try:
            self.state.slots_decided([(plan_module.seen_key(a.booking), a.rank, a.placement) for a in plan.accepted],
                                     [plan_module.seen_key(r) for r in plan.rejected], now=now)
        except StateError as error:  # recorded by a later pass; until then the new ones hold no priority
            log.warning("the plan's acceptances are not recorded this pass: %s", error)

    def _adopt(self, plan: plan_module.Plan, world: World, *, now: datetime, at_work: set[str],
               armed: frozenset[str]) -> None:
        """Running containers of accepted bookings that State has no record of (a lost database): adopt them.

        A container whose record is closed is not adopted: it is being stopped (an admin's `gpubook
        stop` records the stop before the container goes), and adopting it would turn that stop
        into a death and a restart. Nor is one whose start is still at work in the pool (its probe
        has not answered yet): the start records it when it succeeds, and a failed start is no death.
        Nor is an armed one (run ahead of its start): its start probes its SSH and records it."""
        wanted = {a.booking.id for a in plan.accepted} - at_work - armed
        recorded = {r.name for r in world.records.values()}
        for info in world.actual():
            if info.start is not None and info.start > now:
                continue  # armed, its note lost: decide leaves it until its start
            if info.running and info.booking_id in wanted and info.name not in recorded:
                try:
                    record = self.state.container_started(info.booking_id, info.name, user=info.user,
                                                          gpu_count=len(info.gpus), at=now)
                    world.fold(Change(records=(record,)))
                    if info.port is not None:
                        self.state.adopt_port(info.booking_id, info.port, now=now)
                except StateError as error:  # adopted by a later pass
                    log.warning("booking %s: its running container is not adopted yet: %s", info.booking_id, error)
                    continue
                self.journal.say(info.booking_id, f"adopted the running container {info.name}", now=now)

    def _apply(self, action: decide.Action, world: World, *, now: datetime, result: PassResult,
               written: Callable[[decide.Start], None] | None = None) -> None:
        handler = self.handlers.get(type(action))
        if handler is None:  # Recheck: only informs the wake-up time
            return
        try:
            self._handle(handler, action, world, now=now, result=result)
        finally:
            if written is not None and isinstance(action, decide.Start):
                written(action)

    def _write_start(self, action: decide.Start, *, world: World, now: datetime,
                     etags: Mapping[str, str | None], armed: frozenset[str]) -> None:
        """A start's outcome (its ssh line, or why it failed) queued for write-back from its own
        lane as soon as it is known: a booker never waits for the bookings starting beside theirs."""
        booking = action.accepted.booking
        reportable = self._reportable(world, armed, now=now)
        try:
            self.writeback.write_one(action.accepted, info=reportable.get(booking.id),
                                     records=world.records_by_booking().get(booking.id),
                                     remarks=self._remarks(world, reportable, now=now),
                                     now=now, etag=etags.get(booking.href))
        except GpubookError as error:  # the pass's own write-back tries again
            log.warning("booking %s: its write-back waits for the pass: %s", booking.id, error)

    def _handle(self, handler: Callable[..., Change], action: decide.Action, world: World, *, now: datetime,
                result: PassResult) -> None:
        booking_id = booking_of(action)
        try:
            world.fold(handler(action, now=now))
        except Preparing as waiting:  # not a failure: held with a note until its image is ready
            if booking_id:
                self.recall.preparing[booking_id] = now + PREPARING_RECHECK
                self.recall.notes[booking_id] = str(waiting)
                self.journal.note(booking_id, str(waiting), now=now)
        except (GpubookError, OSError, paramiko.SSHException) as error:
            what = type(action).__name__.lower()
            permanent = getattr(error, "temporary", True) is False
            reason = str(error).splitlines()[0] if str(error) else type(error).__name__
            result.failures[booking_id or "?"] = reason
            if isinstance(action, decide.Start) and self.metrics is not None:
                self.metrics.start_failed(reason=start_failure_reason(error))
            retry = f"retry in {PERMANENT_RETRY.seconds // 60} min" if permanent else "retry on the next pass"
            if booking_id:
                self.recall.preparing.pop(booking_id, None)
                before = self.recall.failures.get(booking_id)
                backoff = isinstance(action, decide.Start)
                failed = (before.after(reason, now=now, permanent=permanent, backoff=backoff) if before
                          else failure(reason, now=now, permanent=permanent, backoff=backoff))
                self.recall.failures[booking_id] = failed
                if failed.delay:
                    retry = f"retry in {int(failed.delay.total_seconds())} s"
            self.journal.say(booking_id, f"{what} failed: {reason}; {retry}", now=now, level="error",
                             detail=str(error))

    def write_back(self, plan: plan_module.Plan, world: World, *, now: datetime,
                   etags: Mapping[str, str | None], armed: frozenset[str] = frozenset()) -> None:
        reportable = self._reportable(world, armed, now=now)
        self.writeback.write(plan, running=reportable, records=world.records_by_booking(),
                             remarks=self._remarks(world, reportable, now=now), now=now, etags=etags)

    @staticmethod
    def _reportable(world: World, armed: frozenset[str], *, now: datetime) -> dict[str, ContainerInfo]:
        """The running containers a booker may be sent to: an armed one (run ahead of its start)
        counts only once its start recorded it (its SSH probe answered)."""
        # Through the World's lock: starts beside this one fold their records meanwhile.
        open_runs = {booking_id for booking_id, records in world.records_by_booking().items()
                     if any(r.stopped_at is None for r in records)}
        return {booking_id: info for booking_id, info in world.running().items()
                if booking_id in open_runs
                or not ((info.start is not None and info.start > now) or booking_id in armed)}

    def _remarks(self, world: World, reportable: Mapping[str, ContainerInfo], *, now: datetime) -> Remarks:
        """`reportable`: the running containers a booker may be sent to (`_reportable`); the others
        still before their start are armed, and their ssh lines go into the accepted block."""
        images = {booking: line for host in self.hosts.values()
                  if isinstance(preparer := getattr(host, "images", None), ImagePreparer)
                  for booking, line in preparer.lines().items()}
        waiting = {booking_id: info for booking_id, info in world.running().items()
                   if booking_id not in reportable and info.start is not None and info.start > now}
        return Remarks(refused=dict(self.recall.refused),
                       failures={k: f.reason for k, f in dict(self.recall.failures).items()},
                       notes=dict(self.recall.notes), images=images, armed=waiting,
                       policy=dict(self.policy_lines))

    def stop_now(self, booking_id: str, *, now: datetime) -> bool:
        """`gpubook stop`: stop a booking's container at once; it is not started again."""
        name = container_name(booking_id)
        host = next((h for h in self.hosts.values() if h.inspect(name) is not None), None)
        if host is None:
            return False
        # Recorded before the container goes: a pass of the running daemon in between then sees an
        # admin's stop (not started again), never a death (which it would restart).
        closed = record_stop(self.state, name=name, booking_id=booking_id, reason=decide.ADMIN_STOP, now=now)
        self.stop(decide.Stop(name, booking_id, decide.ADMIN_STOP, self.config.engine.stop_grace_seconds, host.name),
                  now=now, recorded=closed)
        notices_module.deliver_pending(self.state, self.notices, now=now)
        return True

    def close(self) -> None:
        """Wait for the bookings at work (queued ones are dropped), the write-back and the notices."""
        self.lanes.close()
        self.ahead.close()
        self.outbox.shutdown(wait=True)
        self.writeback.close()

