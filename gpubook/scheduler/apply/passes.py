"""One pass, as a short story: read the hosts and State once (its notes too, typed), plan, keep
State in step (adopt, extend, remind: decided actions like the others), decide, apply each action
through the handler for its kind, fold each recorded outcome into the pass's view, then let the
outbox read what was recorded (calendar write-back, notices).

No booking waits on another booking's slow step: each booking's actions run in order in a
bounded pool of threads, different bookings in parallel (lanes.py, hands.py: a start whose sshd is
slow, a notice a booker's terminal holds up). A start waits only for the stops that free its GPUs.
The pass waits `patience` seconds for its bookings, then leaves the slow ones to finish on their
own (`on_settled` tells the daemon, which runs a pass for their write-back); a booking at work
when a later pass reads the world is left alone by that pass (its view of it may be torn: a start
recorded between the hosts' listing and State's read, a container listed before its record): no
actions, no write-back while its start is at work (the start writes its own), and its port stays
held. The outbox delivers after the pass, one
lane per calendar (gpubook/scheduler/outbox/writeback.py); a start's lane only records the start
and wakes its calendar's deliverer as soon as its SSH answered (or it failed), so a booker never
waits for the bookings starting beside theirs. What can be made before a start (folders, host key)
is made ahead (ahead.py). Notices are delivered in a lane of their own (delivery.py).

Each booking's failure is caught, logged and retried on a later pass (hands.py); it never stops
the other bookings, and neither does a state database that cannot be written (a `StateError` is
one booking's failure, or one lost event-log line). One `run` at a time (the daemon holds a lock);
the pool's threads share State (a connection per thread) and the World (behind its lock).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from functools import partial
from zoneinfo import ZoneInfo

from gpubook.runtime.engines import ContainerInfo, booker_digest
from gpubook.runtime.errors import ConfigError
from gpubook.runtime.templates.catalog import Template, TemplateSet
from gpubook.scheduler.apply import reclaim as reclaim_apply
from gpubook.scheduler.apply.accounting import Bookkeeping
from gpubook.scheduler.apply.ahead import Preparation
from gpubook.scheduler.apply.delivery import Delivery
from gpubook.scheduler.apply.handlers import Change
from gpubook.scheduler.apply.hands import Hands
from gpubook.scheduler.apply.memory import Recall, decide_memory
from gpubook.scheduler.core import decide, reclaim, upkeep
from gpubook.scheduler.core import plan as plan_module
from gpubook.scheduler.core import policy as policy_module
from gpubook.scheduler.core.bookings import Booking, Rejection
from gpubook.scheduler.hosts import HasImages, Host, doors, required_problem
from gpubook.scheduler.hosts.backend import Backend
from gpubook.scheduler.outbox import notices as notices_module
from gpubook.scheduler.outbox import reminders
from gpubook.scheduler.outbox.metrics import Metrics
from gpubook.scheduler.outbox.writeback import WriteBack, reportable
from gpubook.scheduler.settings import Config
from gpubook.scheduler.state import ContainerRecord, State, StateError, notes
from gpubook.scheduler.state.notes import Notes
from gpubook.scheduler.state.notes import read as read_notes

log = logging.getLogger(__name__)

PATIENCE = 3.0  # seconds a pass waits for its bookings' actions before leaving slow ones to finish alone


@dataclass
class World:
    """The pass's view: what each host runs and what State recorded (its notes too), read once and
    kept up to date from the handlers' changes."""

    containers: dict[str, ContainerInfo]  # by container name
    records: dict[int, ContainerRecord]  # by record id, in id order
    releases: dict[str, reclaim.Released] = field(default_factory=dict)  # by booking id: no-shows released
    notes: Notes = field(default_factory=Notes)  # as read at the pass's start
    ported: frozenset[str] = frozenset()  # the bookings holding a port in State (gpubook started them)
    # The bookings whose lane was at work when this was read: this view of them may be torn (a start
    # recorded between the hosts' listing and State's read, a container listed before its record).
    busy: frozenset[str] = frozenset()
    starting: frozenset[str] = frozenset()  # of those, the ones with a start at work
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)  # bookings fold in parallel

    @classmethod
    def read(cls, hosts: Sequence[Host], state: State, *, releases_after: datetime | None = None) -> World:
        """`releases_after`: read the releases of bookings ending after it (None: none)."""
        containers = {info.name: info for host in hosts for info in host.list()}
        releases = reclaim_apply.read_releases(state, after=releases_after) if releases_after is not None else {}
        found = read_notes(state)  # after the hosts: a note written meanwhile is of a container listed next pass
        return cls(containers=containers, records={r.id: r for r in state.containers()}, releases=releases,
                   notes=found, ported=frozenset(state.ports()))

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

    def armed(self) -> frozenset[str]:
        return frozenset(self.notes.armed)


@dataclass
class PassResult:
    plan: plan_module.Plan
    actions: list[decide.Action]
    failures: dict[str, str] = field(default_factory=dict)  # booking id → why it failed this pass
    wake_at: datetime | None = None  # the earliest moment something is due (plan, rechecks, retries)
    world: World | None = None


@dataclass(frozen=True)
class Told:
    """What the daemon tells a pass about its calendars' data."""

    may_start: bool = True
    stale_reason: str = ""  # why nothing starts ("": it may)
    stale: Mapping[str, str] = field(default_factory=dict)  # calendar url → why its bookings do not start now
    complete: bool = True  # every calendar was read at least once
    etags: Mapping[str, str | None] = field(default_factory=dict)  # event href → its ETag as read


def checked_hosts(hosts: Mapping[str, Host], *, known: Mapping[str, Host] | None = None) -> Mapping[str, Host]:
    """The backend's hosts, each one not `known` as that very object checked for the required doors
    (else a ConfigError in one sentence); the optional doors a host of a new name lacks are logged
    once, one sentence each. A pass's refresh finds the same objects: nothing is checked again."""
    known = known or {}
    for name, host in hosts.items():
        if known.get(name) is not host and (problem := required_problem(name, host)) is not None:
            raise ConfigError(problem)
    for sentence in doors({name: host for name, host in hosts.items() if name not in known}):
        log.info("%s", sentence)
    return hosts


class Pass:
    """The daemon's hands and memory for one `run` per pass: the handlers and their lanes (`hands`),
    what is made ahead (`ahead`), the pass's own records (`books`), the outbox (`delivery`)."""

    def __init__(self, config: Config, *, backend: Backend, state: State, templates: TemplateSet,
                 notices: Callable[[notices_module.Message], None] | None = None,
                 metrics: Metrics | None = None, logged_in: Callable[[ContainerInfo], bool] | None = None) -> None:
        """`backend`: where bookings run, its hosts read again each pass and the plan's placements
        reserved there; `metrics`: the daemon's, told of each start's SSH latency and each failed
        start; `logged_in`: a last look for the booker's login in a container's log before a release."""
        self.backend = backend
        self.config = config
        self.hosts = dict(checked_hosts(backend.hosts))  # the handlers share this dict: `refresh_hosts` updates it
        self.state = state
        self.templates = templates
        self.hands = Hands(config, hosts=self.hosts, state=state, templates=templates, metrics=metrics,
                           logged_in=logged_in, address=backend.address)
        self.books = Bookkeeping(state)  # accounting, priority, idle ports
        # the calendar write-back and the notices
        self.delivery = Delivery(config, state, notices, address=backend.address)
        self.ahead = Preparation(config, hosts=self.hosts, state=state)  # folders, host keys, containers ahead
        self.ahead.on_armed = self._settled_late  # its ssh line goes into the event before the start
        self.patience = PATIENCE
        self._policy_lines: dict[str, str] = {}  # booking id → its release or idle line, as this pass judged
        self.on_settled: Callable[[], None] | None = None  # told when a booking's work outlasted its pass

    @property
    def recall(self) -> Recall:
        return self.hands.recall

    @property
    def handlers(self) -> dict[type, Callable[..., Change]]:
        return self.hands.handlers

    @property
    def writeback(self) -> WriteBack:
        return self.delivery.writeback

    @property
    def busy(self) -> dict[str, Future[None]]:
        """Booking id → its actions at work (in this pass or left from an earlier one)."""
        return self.hands.lanes.busy

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
        silent = self.refresh_hosts()
        told = Told(may_start=may_start and not silent, stale_reason=silent or stale_reason,
                    stale=stale_calendars or {}, complete=complete, etags=etags or {})
        at_work = self.hands.lanes.at_work() | self.ahead.at_work()  # before the hosts are read: it keeps its port
        world = self._read(now=now, at_work=at_work)
        plan, extended = self._plan(occurrences, world.actual(), now=now, releases=world.releases, known=world.notes)
        self.books.accounting.record(plan, now=now, complete=complete)
        remind_at = self._keep(plan, world, extended, now=now, at_work=at_work)
        self._prepare_images(plan, world, now=now)
        held = self._reserve(plan, now=now) if told.may_start else {}
        actions = self._decide(plan, world, occurrences, now=now, told=told, held=held)
        self._tell(plan, world, actions, now=now, at_work=at_work)
        result = PassResult(plan=plan, actions=actions, world=world)
        written = partial(self._wake_writeback, world=world, now=now, etags=told.etags) if write_back else None
        self._apply(result, world, now=now, written=written)
        result.wake_at = self._wake_at(result, world, now=now, told=told, also=remind_at)
        if write_back:
            self.write_back(plan, world, now=now, etags=told.etags)
        self.delivery.notices_after(now)
        return result

    # -- around the bookings' work -------------------------------------------------------------

    def refresh_hosts(self) -> str:
        """The backend's hosts read again, this pass's ("" or why they could not be read: nothing
        starts). `gpubook stop` reads them the same way (wiring.py's Stopping)."""
        problem = self.backend.refresh()
        for name, host in checked_hosts(self.backend.hosts, known=self.hosts).items():
            self.hosts[name] = host
        return problem

    def _reserve(self, plan: plan_module.Plan, *, now: datetime) -> dict[str, str]:
        """The plan's placements reserved by the backend; the bookings that must not start, and why."""
        reserved = self.backend.reserve(plan.accepted, now=now)
        if reserved.problem:
            return {a.booking.id: reserved.problem for a in plan.accepted}
        return dict(reserved.refused)

    def _read(self, *, now: datetime, at_work: set[str]) -> World:
        """The hosts and State read once (the releases still in reach too); the ports no running
        container and no start at work holds are given back."""
        lanes = self.hands.lanes
        busy, starting = frozenset(lanes.at_work()), frozenset(lanes.starts_at_work())  # before the hosts are read
        world = World.read(list(self.hosts.values()), self.state,
                           releases_after=now - policy_module.reach_back(self.config))
        world.busy, world.starting = busy, starting
        self.books.release_idle_ports(set(world.running()) | at_work)
        return world

    def _apply(self, result: PassResult, world: World, *, now: datetime,
               written: Callable[[decide.Start], None] | None) -> None:
        """The actions in their bookings' lanes; the pass waits `patience` seconds for them, a slower
        one tells `on_settled` when it is done. A booking at work when `world` was read waits for the
        next pass, even if its work ended since (lanes.py)."""
        pending = self.hands.dispatch(result.actions, world, now=now, failures=result.failures, done=written,
                                      stale=world.busy)
        self.hands.lanes.wait_patiently(pending, patience=self.patience, on_late=self._settled_late)

    def _settled_late(self, future: Future[None] | None = None) -> None:
        if self.on_settled is not None:
            self.on_settled()

    def _decide(self, plan: plan_module.Plan, world: World, occurrences: Sequence[Booking | Rejection], *,
                now: datetime, told: Told, held: Mapping[str, str]) -> list[decide.Action]:
        """decide() on the plan and what runs, with State's memory and the judge's verdicts."""
        wanted = {a.booking.id for a in plan.accepted}
        self.recall.preparing = {k: t for k, t in dict(self.recall.preparing).items() if k in wanted}
        self.recall.failures = {k: f for k, f in dict(self.recall.failures).items() if k in wanted}
        released = reclaim.released_ids(occurrences, world.releases)
        memory = decide_memory(world.records.values(), world.notes, released=released, ported=world.ported)
        verdicts = reclaim_apply.judge_running(self.config, self.state, plan=plan, running=world.running(),
                                               records=world.records_by_booking(), now=now)
        self._policy_lines = reclaim_apply.event_lines(
            verdicts, {k: v for k, v in world.releases.items() if k in released}, config=self.config)
        return decide.decide(plan, world.actual(), now=now, memory=memory,
                             policy=self.policy(), may_start=told.may_start, stale_reason=told.stale_reason,
                             stale_calendars=told.stale, complete=told.complete, verdicts=verdicts,
                             held=held, bookers=self._bookers(plan))

    def _tell(self, plan: plan_module.Plan, world: World, actions: Sequence[decide.Action], *, now: datetime,
              at_work: set[str]) -> None:
        """The outcome notes this pass owns, written where they changed (state/notes.py): each booking's
        release or idle line; a hold, a refusal or a failure cleared once the booking is held no more
        (and not waiting for its image) or has left the plan. A booking at work keeps its notes: its
        lane may be writing them. Why a held booking waits is its HoldHandler's to write."""
        keep = {a.booking.id for a in plan.accepted} | at_work
        held = {a.booking_id for a in actions if isinstance(a, decide.Hold)} | set(self.recall.preparing) | at_work
        found = world.notes
        try:
            notes.POLICY.sync(self.state, self._policy_lines, found.policy, at=now)
            notes.HELD.sync(self.state, {}, found.held, keep=held)
            notes.REFUSED.sync(self.state, {}, found.refused, keep=keep)
            notes.FAILED.sync(self.state, {}, found.failed, keep=keep)
        except StateError as error:
            log.warning("the bookings' events keep their notes until a later pass: %s", error)

    def _wake_at(self, result: PassResult, world: World, *, now: datetime, told: Told,
                 also: datetime | None) -> datetime | None:
        """The arms made ahead (their next boundary), and the earliest moment something is due."""
        ahead = self.ahead(result.plan, running=set(world.running()) | self.hands.lanes.at_work(), now=now,
                           containers=world.actual(), templates=self.templates, may_start=told.may_start,
                           stale=frozenset(told.stale))
        rechecks = [a.at for a in result.actions if isinstance(a, decide.Recheck) and a.at > now]
        retries = [t for t in self.recall.retries() if t > now]  # one due now was tried by this pass
        return min([t for t in (result.plan.next_wakeup, ahead, also, *rechecks, *retries) if t is not None],
                   default=None)

    def _prepare_images(self, plan: plan_module.Plan, world: World, *, now: datetime) -> None:
        """Hand each host's preparer the bookings starting within [images] prepare_hours (it only
        queues: the pulls and builds run in its own workers, never in the pass). An armed booking
        is still wanted: its start checks its image again."""
        horizon = now + timedelta(hours=self.config.images.prepare_hours)
        running = reportable(world.actual(), world.records_by_booking(), world.armed(), now=now)
        wanted: dict[str, dict[str, Template]] = {}
        for accepted in plan.accepted:
            booking = accepted.booking
            template = self.templates.templates.get(booking.template)
            if template is not None and booking.start <= horizon and booking.end > now and booking.id not in running:
                wanted.setdefault(accepted.host, {})[booking.id] = template
        for name, host in self.hosts.items():
            if isinstance(host, HasImages):  # hosts without the door start with the images as they are
                host.images.want(wanted.get(name, {}), now=now)

    def plan(self, occurrences: Sequence[Booking | Rejection], actual: Sequence[ContainerInfo], *,
             now: datetime, releases: Mapping[str, reclaim.Released] | None = None) -> plan_module.Plan:
        """The plan around what runs (`gpubook stop`'s write-back: State's notes read here), its
        extensions agreed."""
        result, extended = self._plan(occurrences, actual, now=now, releases=releases, known=read_notes(self.state))
        for action in extended:
            self.handlers[upkeep.Extend](action, now=now)
        return result

    def _plan(self, occurrences: Sequence[Booking | Rejection], actual: Sequence[ContainerInfo], *,
              now: datetime, releases: Mapping[str, reclaim.Released] | None, known: Notes
              ) -> tuple[plan_module.Plan, list[upkeep.Extend]]:
        """The plan around what runs: running bookings keep their GPUs, template and (unless later
        is free) their end; released ones (no-shows) end at their release. Returns it with the
        later ends it grants (to be agreed)."""
        occurrences = reclaim.apply_releases(occurrences, releases or {})
        pinned = decide.pin_running(occurrences, actual, now=now)
        running = dict(pinned.running)
        ends = {i.booking_id: known.agreed_end.get(i.booking_id, i.end)
                for i in actual if i.booking_id in running and i.end is not None}
        first_seen = self.books.first_seen(occurrences, now=now)
        slots = self.books.asked(occurrences, now=now)
        templates = frozenset(self.templates.templates) | frozenset(self.templates.errors)
        zone = ZoneInfo(self.config.host.timezone)
        inventory = self.inventory
        placed = {i.booking_id: ((i.host or plan_module.LOCAL, i.gpus), *i.others)
                  for i in actual if i.booking_id in running and i.host}
        result, granted, refused = decide.plan_with_extensions(
            pinned.occurrences, agreed_ends=ends,  # type: ignore[arg-type]
            plan=lambda items: plan_module.plan(items, inventory=inventory, config=self.config,
                                                templates=templates, now=now, running=running,
                                                first_seen=first_seen, placed=placed, slots=slots,
                                                topology=self.backend.topology),
            describe=lambda t: t.astimezone(zone).strftime("%Y-%m-%d %H:%M %z"))
        self.books.decided(result, now=now)
        self._note({**pinned.notes, **refused}, known.note, now=now)
        self._standbys(result, known.standby, now=now)
        return result, upkeep.extensions(granted)

    def _standbys(self, result: plan_module.Plan, waiting: Mapping[str, datetime], *, now: datetime) -> None:
        """Standbys (`standby: yes`) recorded as they begin to wait, and as they are accepted: a
        promotion, said in the journal and counted (gpubook_standby_promotions_total)."""
        wait = {r.id for r in result.rejected if r.standby}
        accepted = {a.booking.id for a in result.accepted}
        try:
            for booking_id in wait - set(waiting):
                notes.STANDBY.write(self.state, booking_id, now, at=now)
            for booking_id in set(waiting) - wait:
                notes.STANDBY.clear(self.state, booking_id)
                if booking_id in accepted:
                    notes.PROMOTED.write(self.state, booking_id, now, at=now)
                    self.hands.journal.say(booking_id, f"promoted from standby (waiting since "
                                           f"{waiting[booking_id]:%Y-%m-%d %H:%M} UTC): its GPUs freed up", now=now)
                    if self.hands.metrics is not None:
                        self.hands.metrics.promoted()
        except StateError as error:
            log.warning("the standbys are recorded in a later pass: %s", error)

    def _note(self, wanted: Mapping[str, str], had: Mapping[str, str], *, now: datetime) -> None:
        """The plan's sentence for each booking's event, written and logged where it changed."""
        try:
            changed = notes.NOTE.sync(self.state, wanted, had, at=now)
        except StateError as error:
            log.warning("the bookings' events keep their notes until a later pass: %s", error)
            return
        for booking_id in changed:
            self.hands.journal.say(booking_id, wanted[booking_id], now=now)

    def _bookers(self, plan: plan_module.Plan) -> dict[str, str]:
        """Who each accepted booking's container would let in now: an armed one must match."""
        users = self.config.users
        return {a.booking.id: booker_digest(user.name, user.uid, user.gid, user.ssh_keys)
                for a in plan.accepted if (user := users.get(a.booking.user)) is not None}

    def _keep(self, plan: plan_module.Plan, world: World, extended: Sequence[upkeep.Extend], *, now: datetime,
              at_work: set[str]) -> datetime | None:
        """The upkeep before decide(), decided (core/upkeep.py) and recorded by its handlers: the later
        ends granted, the running containers State has no record of, the reminders due. Returns
        when the next reminder is due."""
        adopted = upkeep.adoptions(plan, world.actual(), recorded={r.name for r in world.records.values()},
                                   busy=at_work | world.armed(), now=now)
        reminded, remind_at = upkeep.reminders(plan, reminded=world.notes.reminded,
                                               minutes=reminders.minutes_of(self.config), now=now)
        self.hands.keep([*extended, *adopted, *reminded], world, now=now)
        return remind_at

    # -- the outbox ----------------------------------------------------------------------------

    def _wake_writeback(self, action: decide.Start, *, world: World, now: datetime,
                        etags: Mapping[str, str | None]) -> None:
        """A start's outcome (its ssh line, or why it failed) is recorded: its calendar's deliverer
        reads it from State and writes it at once, so a booker never waits for the bookings starting
        beside theirs."""
        self.writeback.wake(action.accepted, containers=world.actual(), etag=etags.get(action.accepted.booking.href),
                            now=now)

    def write_back(self, plan: plan_module.Plan, world: World, *, now: datetime,
                   etags: Mapping[str, str | None]) -> None:
        """The image lines noted, then every booking's outcome written but those of the starts at work
        when `world` was read or still at work now: their starts' own write-back says those
        (`_wake_writeback`)."""
        # Before the containers are taken below: a start of this pass done by now has folded its container.
        leave = world.starting | self.hands.lanes.starts_at_work()
        images = {booking: line for host in self.hosts.values()
                  if isinstance(host, HasImages) for booking, line in host.images.lines().items()}
        try:
            notes.IMAGE.sync(self.state, images, world.notes.image, at=now)
        except StateError as error:
            log.warning("the image lines wait for a later pass: %s", error)
        self.writeback.write(plan, containers=world.actual(), now=now, etags=etags, leave=leave)

    def close(self) -> None:
        """Wait for the bookings at work (queued ones are dropped), the write-back and the notices."""
        self.hands.close()
        self.ahead.close()
        self.delivery.close()

