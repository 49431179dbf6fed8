"""Calendar write-back: each booking's recorded outcome, written into its event.

After a pass, the outcome of every booking in the window is read from what was recorded (the
plan, the containers the pass saw or started, State's start/stop records and its outcome notes:
gpubook/scheduler/state/notes.py) and written through the calendar's writer where its source has one
(CalDAV yes, ICS feeds no). The write-back's inputs are State and a plain list of containers: it
never calls back into the apply stage, and a restart loses nothing the booker was told. A
write whose content and event ETag match the last one recorded is skipped, so calling this on
every pass costs nothing while nothing changes. A source that cannot write (an ICS feed) gives
no writer, and its bookings are only planned.

Writes leave the pass: each calendar has a lane of its own (one thread, so one DAV client is never
shared) where its events are written one after another, each bounded by the writer's network
timeout. A hung calendar server therefore holds only its own calendar's write-backs, never a
pass, a start, or another calendar's events. A booking with a write still queued gets only its
newest outcome written. A start does not wait for its pass either: its lane records the start and
wakes its calendar's deliverer (`wake`), which reads the recorded outcome in its own thread at once,
so a booker never waits for the other bookings that start with theirs. `gpubook stop` writes in its
own thread (`inline`): one event, and no thread pool for it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field, replace
from datetime import UTC, date, datetime
from functools import partial
from zoneinfo import ZoneInfo

from gpubook.runtime.booking import jupyter, ssh
from gpubook.runtime.engines import ContainerInfo
from gpubook.runtime.errors import PREPARING_IMAGE, GpubookError
from gpubook.runtime.nvidia import cuda
from gpubook.runtime.slurm.step import HOSTFILE
from gpubook.runtime.templates.catalog import Template
from gpubook.scheduler.core import decide
from gpubook.scheduler.core.bookings import Booking, Rejection
from gpubook.scheduler.core.plan import Accepted, Plan
from gpubook.scheduler.outbox import foreign
from gpubook.scheduler.outbox.notices import Answers
from gpubook.scheduler.settings import CalendarConfig, Config
from gpubook.scheduler.sources import EventRef, Writer, block, open_writer
from gpubook.scheduler.sources.alarm import Reminder
from gpubook.scheduler.sources.attendee import Resource
from gpubook.scheduler.state import ContainerRecord, State, StateError
from gpubook.scheduler.state.notes import Notes
from gpubook.scheduler.state.notes import read as read_notes

log = logging.getLogger(__name__)
READING = "reading"  # `sending`'s mark while a woken start's outcome is read


@dataclass(frozen=True)
class Remarks:
    """What State's notes say about bookings beyond their records (`remarks_of`), as `outcome` reads it."""

    refused: Mapping[str, str]  # booking id → why it can never start
    failures: Mapping[str, str]  # booking id → why its start failed (for a note once it is due)
    notes: Mapping[str, str]  # booking id → a sentence for its event
    images: Mapping[str, str] = field(default_factory=dict)  # booking id → "image: ready" or why not
    # booking id → its container run ahead of its start (armed): its port is fixed already, so the
    # event gives the ssh line before the start and the booker need not wait for the start's write.
    armed: Mapping[str, ContainerInfo] = field(default_factory=dict)
    policy: Mapping[str, str] = field(default_factory=dict)  # booking id → its release or idle line (no-shows)
    lines: Mapping[str, Sequence[str]] = field(default_factory=dict)  # booking id → what its start added
    ended: Mapping[str, Sequence[str]] = field(default_factory=dict)  # booking id → what its stop added (provenance)


def reportable(containers: Sequence[ContainerInfo], records: Mapping[str, Sequence[ContainerRecord]],
               armed: Collection[str], *, now: datetime) -> dict[str, ContainerInfo]:
    """The running containers a booker may be sent to, by booking id: an armed one (run ahead of its
    start) counts only once its start recorded it (its SSH probe answered)."""
    open_runs = {booking_id for booking_id, runs in records.items() if any(r.stopped_at is None for r in runs)}
    return {info.booking_id: info for info in containers if info.running and info.booking_id
            and (info.booking_id in open_runs
                 or not ((info.start is not None and info.start > now) or info.booking_id in armed))}


def remarks_of(found: Notes, containers: Sequence[ContainerInfo], reported: Mapping[str, ContainerInfo], *,
               now: datetime) -> Remarks:
    """The remarks State's notes make; `reported`: the running containers a booker may be sent to
    (`reportable`): the others still before their start are armed, and their ssh lines go into the
    accepted block."""
    waiting = {info.booking_id: info for info in containers if info.running and info.booking_id
               and info.booking_id not in reported and info.start is not None and info.start > now}
    return Remarks(refused=dict(found.refused), failures={k: f.reason for k, f in found.failed.items()},
                   notes={**found.note, **found.held}, images=dict(found.image), armed=waiting,
                   policy=dict(found.policy), lines=dict(found.running_lines), ended=dict(found.ended_lines))


def by_booking(records: Iterable[ContainerRecord]) -> dict[str, list[ContainerRecord]]:
    """Each booking's runs, in id order."""
    grouped: dict[str, list[ContainerRecord]] = {}
    for record in sorted(records, key=lambda r: r.id):
        grouped.setdefault(record.booking_id, []).append(record)
    return grouped


def start_lines(template: Template, lab: jupyter.Availability | None, *, driver_version: str | None, port: int,
                user: str, host: str) -> list[str]:
    """What a start adds to the booking's running block: how to reach its JupyterLab (or why there is
    none), and the limits of a CUDA version run through minor version compatibility. The token is
    not among them: the calendar is read by the whole lab (gpubook/runtime/booking/jupyter.py)."""
    lines = []
    if template.jupyter and lab is not None and lab.started:
        lines.append(f"jupyter: {jupyter.forward_line(port=port, user=user, host=host)}")
        lines.append(f"jupyter url: {jupyter.url_hint(port=port, user=user, host=host)}")
    elif template.jupyter:
        lines.append(f"jupyter: {lab.reason if lab is not None else jupyter.NOT_AVAILABLE}")
    limit = cuda.limitation(template.cuda, driver_version) if template.cuda and driver_version else None
    if limit:
        lines.append(f"cuda {template.cuda}: {limit}")
    return lines


@dataclass(frozen=True)
class _Job:
    item: Booking | Rejection
    outcome: block.Outcome | None  # None: read by the deliverer (`read`)
    key: str  # status and digest, as recorded once written
    now: datetime
    read: Callable[[], block.Outcome | None] | None = None  # a woken start's outcome, read from State when delivered
    etag: str | None = None
    behind_read: bool = False  # queued while a woken start's outcome was read: not sent if that read wrote it


def event_ref(item: Booking | Rejection) -> EventRef:
    """Which event (and occurrence) a booking id points at: UID, or UID@original start."""
    occurrence: datetime | date | None = None
    if item.id != item.uid and item.id.startswith(item.uid + "@"):
        suffix = item.id[len(item.uid) + 1:]
        try:
            occurrence = datetime.strptime(suffix, "%Y%m%dT%H%M%SZ").replace(tzinfo=UTC)
        except ValueError:
            occurrence = datetime.strptime(suffix, "%Y%m%d").date()  # noqa: DTZ007 - a date
    return EventRef(calendar_url=item.calendar_url, href=item.href, uid=item.uid, occurrence=occurrence)


class WriteBack:
    """Writes outcomes into the configured calendars; one writer per writable calendar, reused."""

    def __init__(self, config: Config, state: State, *, address: Callable[[str], str] | None = None,
                 inline: bool = False) -> None:
        """`address`: where a booker logs in to a container on a host (the backend's; None: this
        server, `[host] name`); `inline`: each write in the caller's thread (`gpubook stop`), no lanes."""
        self.config = config
        self.inline = inline
        self.address = address or (lambda host: config.host.name)
        self.state = state
        self.writers: dict[str, Writer] = {}  # by calendar URL; each used only in its lane
        self.lanes: dict[str, ThreadPoolExecutor] = {}  # by calendar URL
        self.queued: dict[str, _Job] = {}  # booking id → the newest outcome not yet written
        self.sending: dict[str, str] = {}  # booking id → the outcome's key being written now
        self._lock = threading.Lock()
        # The SFTP service's public host key line ("" while there is none yet): the daemon sets it.
        self.sftp_host_key: Callable[[], str] = lambda: ""
        self.answers = Answers(config, state)  # each answer's notice, once

    def write(self, plan: Plan, *, containers: Sequence[ContainerInfo], now: datetime,
              etags: Mapping[str, str | None], leave: Collection[str] = ()) -> None:
        """Every booking's outcome, from State and `containers` (what the hosts run, as the pass saw it
        and its actions changed it). `leave`: bookings whose start is at work; their start's own
        write-back (`wake`) says what they are, from the record it made."""
        try:
            records, found = by_booking(self.state.containers()), read_notes(self.state)
        except StateError as error:
            log.warning("the write-back waits for a later pass: %s", error)
            return
        running = reportable(containers, records, found.armed, now=now)
        remarks = remarks_of(found, containers, running, now=now)
        items: list[tuple[Booking | Rejection, block.Outcome]] = []
        seen = self._foreign_lines([a.booking.id for a in plan.accepted])
        for rejection in plan.rejected:
            if rejection.end > now:
                items.append((rejection, replace(block.rejected(rejection.reason, standby=rejection.standby),
                                                 resource=self._resource())))
        for accepted in plan.accepted:
            if accepted.booking.id in leave:
                continue
            outcome = self.outcome(accepted, running.get(accepted.booking.id), records.get(accepted.booking.id),
                                   remarks=remarks, now=now, foreign=seen)
            if outcome is not None:
                items.append((accepted.booking, outcome))
        self.answers(items, now=now)  # before the writes: a notice is not held up by a slow calendar
        for item, outcome in items:
            self._write(item, outcome, etag=etags.get(item.href), now=now)

    def wake(self, accepted: Accepted, *, containers: Sequence[ContainerInfo], etag: str | None,
             now: datetime) -> None:
        """A start's outcome is recorded (its SSH answered, or it failed): its calendar's deliverer
        reads it from State (with `containers`, what the hosts run now) and writes it at once, not
        after its pass waited for its slower siblings. The pass's write afterwards finds the same
        outcome and skips it."""
        booking = accepted.booking
        calendar = self._calendar(booking)
        if calendar is not None:
            read = partial(self._recorded, accepted, list(containers), now=now)
            self._queue(calendar, _Job(item=booking, outcome=None, key="", now=now, read=read, etag=etag))

    def _recorded(self, accepted: Accepted, containers: Sequence[ContainerInfo], *,
                  now: datetime) -> block.Outcome | None:
        """One booking's outcome as State records it now, with the processes seen on its GPUs."""
        booking_id = accepted.booking.id
        try:
            records, found = by_booking(self.state.containers(booking_id=booking_id)), read_notes(self.state)
        except StateError as error:
            raise GpubookError(str(error)) from None
        running = reportable(containers, records, found.armed, now=now)
        return self.outcome(accepted, running.get(booking_id), records.get(booking_id),
                            remarks=remarks_of(found, containers, running, now=now), now=now,
                            foreign=self._foreign_lines([booking_id]))

    def outcome(self, accepted: Accepted, info: ContainerInfo | None, records: Sequence[ContainerRecord] | None,
                *, remarks: Remarks, now: datetime, extra: Mapping[str, str] | None = None,
                foreign: Mapping[str, Sequence[str]] | None = None) -> block.Outcome | None:
        booking = accepted.booking
        zone = self.config.host.timezone
        outcome: block.Outcome
        if booking.id in remarks.refused:
            return replace(block.rejected(remarks.refused[booking.id]), resource=self._resource())
        if info is None and records and records[-1].stopped_at is None:
            # Its container is gone but its stop is not recorded yet (an admin's `gpubook stop` in
            # another process, or a death this pass handles): say nothing rather than something stale.
            return None
        if info is not None and info.port is not None:
            lines = json.loads(extra[booking.id]) if extra and booking.id in extra else \
                remarks.lines.get(booking.id, ())
            outcome = block.running(port=info.port, user=booking.user, host=self._where(info), end=booking.end,
                                    timezone=zone, known_hosts=self._known_hosts(info),
                                    extra=[*self._other_nodes(info, booking.user), *lines])
            if again := self._started_again(records or (), zone):
                outcome = outcome.with_note(again)
        elif records and all(r.stopped_at is not None for r in records) and (
                now >= booking.end or (records[-1].exit_reason or "") == decide.ADMIN_STOP):
            hours = sum(r.gpu_hours(now) for r in records)
            root = self.config.storage.data_root
            outputs = f"{self.config.host.name}:{root / booking.user / 'output'}" if root else None
            outcome = self._sftp_known_hosts(block.ended(
                gpu_hours=hours, outputs=outputs, at=records[-1].stopped_at or now, timezone=zone,
                download=self._sftp(booking.user)))
            if records[-1].exit_reason == decide.ADMIN_STOP:
                outcome = outcome.with_note("stopped early by an admin")
            for provenance_line in remarks.ended.get(booking.id, ()):  # the provenance card's two lines
                outcome = outcome.with_note(provenance_line)
        elif now < booking.end:
            outcome = self._sftp_known_hosts(block.accepted(
                gpus=accepted.gpus, template=booking.template, start=booking.start, end=booking.end, timezone=zone,
                upload=self._sftp(booking.user)))
            failed = remarks.failures.get(booking.id)
            if failed is not None and now >= booking.start:
                outcome = outcome.with_note(f"could not start yet: {failed}")
            image = remarks.images.get(booking.id)
            if image is not None:
                outcome = outcome.with_note(image)
            armed = remarks.armed.get(booking.id)
            if armed is not None and armed.port is not None:
                outcome = self._armed_lines(outcome, booking, armed)
        else:
            return None
        note = remarks.notes.get(booking.id)
        if note and note.startswith(PREPARING_IMAGE) and remarks.images.get(booking.id, "").startswith(PREPARING_IMAGE):
            note = None  # the image line says it, and is the newer of the two
        outcome = outcome.with_note(note) if note else outcome
        line = remarks.policy.get(booking.id)
        outcome = outcome.with_note(line) if line else outcome
        for line in (foreign or {}).get(booking.id, ()):  # processes seen on its GPUs outside its container
            outcome = outcome.with_note(line)
        # Held: its start came and it does not run (its GPUs still used, its image not ready, its
        # start failed and is tried again): the host's attendee says TENTATIVE until it runs.
        held = outcome.status == block.Status.ACCEPTED and now >= booking.start
        return replace(outcome, reminder=self._reminder(accepted, info or remarks.armed.get(booking.id)),
                       resource=self._resource(accepted.gpus), held=held)

    def _resource(self, gpus: Sequence[int] = ()) -> Resource:
        """The booked host (and its GPUs) as the event's resource attendee."""
        return Resource(self.config.host.name, tuple(gpus))

    def _armed_lines(self, outcome: block.Outcome, booking: Booking, info: ContainerInfo) -> block.Outcome:
        """The ssh line (and known_hosts line) of a container armed for its start: it answers from the start."""
        assert info.port is not None
        line = block.ssh_line(port=info.port, user=booking.user, host=self._where(info))
        outcome = outcome.with_note(f"ssh from the start: {line}")
        known = self._known_hosts(info)
        return outcome.with_note(f"known_hosts: {known}") if known else outcome

    def _known_hosts(self, info: ContainerInfo) -> str:
        """The booking's `[host]:port ssh-ed25519 AAAA...` line ("" without a host key label)."""
        if not info.host_key or info.port is None:
            return ""
        return ssh.known_hosts_line(host=self._where(info), port=info.port, host_key=info.host_key)

    @staticmethod
    def _started_again(records: Sequence[ContainerRecord], zone: str) -> str:
        """Why this run is not the first: its container died (or its node failed) and it started
        again, on the line the booker reads next to the new ssh line ("": the first run)."""
        if len(records) < 2 or not (records[-2].exit_reason or "").startswith(decide.DIED):
            return ""
        at = records[-1].started_at.astimezone(ZoneInfo(zone)).strftime("%H:%M:%S %Z")
        return f"started again at {at} after its container died ({records[-2].exit_reason})"

    def _where(self, info: ContainerInfo) -> str:
        """Where the booker logs in: this server, or the cluster node the booking runs on."""
        return self.address(info.host)

    def _other_nodes(self, info: ContainerInfo, user: str) -> list[str]:
        """A multi-node booking: an ssh line for each of its other nodes and where the hostfile is."""
        if not info.others or info.port is None:
            return []
        return [*(f"also on {node}: {block.ssh_line(port=info.port, user=user, host=self.address(node))}"
                  for node, _ in info.others),
                f"hostfile: {HOSTFILE} (one line per node, for mpirun or torchrun)"]

    def _reminder(self, accepted: Accepted, info: ContainerInfo | None) -> Reminder | None:
        """gpubook's alarm for an accepted booking's event (`[policy] remind_minutes`; 0: none)."""
        booking = accepted.booking
        minutes = self.config.policy_for(booking.user).remind_minutes
        if minutes <= 0:
            return None
        count = f"{len(accepted.gpus)} GPU{'s' if len(accepted.gpus) != 1 else ''}"
        name = block.one_line(booking.summary) or booking.id
        text = f'gpubook: "{name}" starts in {minutes:g} min on {self.config.host.name} ({count})'
        if info is not None and info.port is not None:
            detail = f"log in with {block.ssh_line(port=info.port, user=booking.user, host=self.config.host.name)}"
        else:
            detail = "the event shows the ssh line at the start"
        return Reminder(minutes=minutes, text=text, detail=detail)

    def _foreign_lines(self, booking_ids: Sequence[str]) -> dict[str, list[str]]:
        """Each booking's foreign lines (processes seen on its GPUs outside its container), read once per write."""
        try:
            rows = self.state.foreign(current=False, booking_ids=booking_ids)
        except StateError as error:
            log.warning("processes seen outside the bookings wait for a later write: %s", error)
            return {}
        return foreign.event_lines(rows, timezone=self.config.host.timezone)

    def _sftp(self, user: str) -> str | None:
        """The booker's SFTP line where the SFTP service runs (their data at any time), else None."""
        if not self.config.sftp.enabled or self.config.storage.data_root is None:
            return None
        return block.sftp_line(port=self.config.sftp.port, user=user, host=self.config.host.name)

    def _sftp_known_hosts(self, outcome: block.Outcome) -> block.Outcome:
        """The SFTP line's known_hosts line after it: the booker's first transfer checks the service's
        host key instead of trusting whatever answers on the port first."""
        key = self.sftp_host_key() if self.config.sftp.enabled and self.config.storage.data_root else ""
        if not key:
            return outcome
        line = ssh.known_hosts_line(host=self.config.host.name, port=self.config.sftp.port, host_key=key)
        return outcome.with_note(f"sftp known_hosts: {line}")

    def _calendar(self, item: Booking | Rejection) -> CalendarConfig | None:
        return next((c for c in self.config.calendars if c.url == item.calendar_url), None)

    @staticmethod
    def _key(outcome: block.Outcome) -> str:
        reminder = outcome.reminder
        remind = [f"reminder {reminder.minutes:g} {reminder.text} {reminder.detail}"] if reminder else []
        resource = outcome.resource
        answer = [f"attendee {resource.address} {resource.name} {outcome.answer}"] if resource else []
        digest = hashlib.sha256("\n".join([*outcome.lines, *remind, *answer]).encode()).hexdigest()[:12]
        return f"{outcome.status} {digest}"

    def _written(self, item: Booking | Rejection, key: str, etag: str | None) -> bool | None:
        """Whether this outcome is what the event holds already (None: State cannot tell now)."""
        try:
            done = self.state.write_back(item.id)
        except StateError as error:
            log.warning("booking %s: its write-back waits for a later pass: %s", item.id, error)
            return None
        return done is not None and done.status == key and (etag is None or done.etag == etag)

    def _write(self, item: Booking | Rejection, outcome: block.Outcome, *, etag: str | None, now: datetime) -> None:
        calendar = self._calendar(item)
        if calendar is None:
            return
        key = self._key(outcome)
        if self._written(item, key, etag) is not False:
            return
        with self._lock:  # the same outcome already queued or being written (by its start's own write)
            queued, sending = self.queued.get(item.id), self.sending.get(item.id)
            if sending == key or (queued is not None and queued.key == key):
                return
        # A woken start's read at work may have read State before this pass noted what it says now
        # (a held booking's newer image line): this outcome follows it, unless the read wrote the same.
        self._queue(calendar, _Job(item=item, outcome=outcome, key=key, now=now, behind_read=sending == READING))

    def _queue(self, calendar: CalendarConfig, job: _Job) -> None:
        with self._lock:
            waiting = job.item.id in self.queued
            self.queued[job.item.id] = job
            if waiting:  # the lane's task for it takes this newer outcome
                return
            if self.inline:
                lane = None
            elif (lane := self.lanes.get(calendar.url)) is None:
                lane = self.lanes[calendar.url] = ThreadPoolExecutor(max_workers=1,
                                                                      thread_name_prefix="gpubook-writeback")
        if lane is None:
            self._deliver(calendar, job.item.id)
        else:
            lane.submit(self._deliver, calendar, job.item.id)

    def _deliver(self, calendar: CalendarConfig, booking_id: str) -> None:
        with self._lock:
            job = self.queued.pop(booking_id, None)
            if job is None:
                return
            self.sending[booking_id] = job.key if job.read is None else READING
        try:
            if job.behind_read and self._written(job.item, job.key, None):
                return
            ready = self._ready(job) if job.read is not None else job
            if ready is not None:
                self._send(calendar, ready)
        except Exception:  # a defect: logged, and the lane goes on with the next event
            log.exception("booking %s: writing its outcome back failed unexpectedly", booking_id)
        finally:
            with self._lock:
                self.sending.pop(booking_id, None)

    def _ready(self, job: _Job) -> _Job | None:
        """A woken start's job with its outcome read now (None: nothing to write, or written already)."""
        assert job.read is not None  # noqa: S101 - only woken jobs are read
        try:
            outcome = job.read()
        except GpubookError as error:  # the pass's own write-back tries again
            log.warning("booking %s: its write-back waits for the pass: %s", job.item.id, error)
            return None
        if outcome is None:
            return None
        self.answers([(job.item, outcome)], now=job.now)
        key = self._key(outcome)
        with self._lock:
            self.sending[job.item.id] = key
        if self._written(job.item, key, job.etag) is not False:
            return None
        return replace(job, outcome=outcome, key=key, read=None)

    def _send(self, calendar: CalendarConfig, job: _Job) -> None:
        item, outcome = job.item, job.outcome
        assert outcome is not None  # noqa: S101 - read before it is sent
        writer = self.writers.get(calendar.url) or open_writer(calendar, timezone=self.config.host.timezone)
        if writer is None:  # a read-only source (an ICS feed)
            return
        self.writers[calendar.url] = writer
        try:
            result = writer.write(event_ref(item), outcome)
            if result.reason in ("written", "unchanged"):
                self.state.write_back_done(item.id, status=job.key, etag=result.etag, at=job.now)
            if result.written:
                self.state.log_event(f"wrote {outcome.status} into the calendar event", booking_id=item.id,
                                     at=job.now)
        except GpubookError as error:
            log.warning("booking %s: %s", item.id, error)

    def settle(self, timeout: float | None = None) -> bool:
        """Wait until every write queued so far is done (tests, `gpubook stop`); False on timeout."""
        with self._lock:
            lanes = list(self.lanes.values())
        marks = [lane.submit(lambda: None) for lane in lanes]
        _, late = wait(marks, timeout=timeout)
        return not late

    def close(self) -> None:
        with self._lock:
            lanes = list(self.lanes.values())
        for lane in lanes:
            lane.shutdown(wait=True)
        for writer in self.writers.values():
            writer.close()
