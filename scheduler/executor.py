"""Applying reconcile's actions: the engine, State, templates, data folders, SSH readiness, write-back.

`Reconciler.run(occurrences, now=...)` is one pass: list what runs, plan around it, decide, apply,
write the outcome back into the calendar. Each booking's failure is caught, logged as a sentence
naming the booking, and retried on a later pass (temporary errors at once, permanent ones after
`PERMANENT_RETRY`); it never stops the other bookings.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta
from pathlib import Path
from zoneinfo import ZoneInfo

import paramiko

from runtime import cuda, ssh, storage
from runtime.engines import ContainerInfo, Engine, container_name
from runtime.errors import GpubookError
from runtime.templates import Template, TemplateSet
from scheduler.config import Config
from scheduler.core import decide as reconcile
from scheduler.core import plan as plan_module
from scheduler.core.bookings import Booking, Rejection
from scheduler.outbox import notices
from scheduler.sources import EventRef, Writer, open_writer
from scheduler.sources import block as notify
from scheduler.state import State

log = logging.getLogger(__name__)

PERMANENT_RETRY = timedelta(minutes=5)
WARNED, AGREED_END = "warned", "agreed-end"
# A constant script; the message is its $1, never part of the script (nothing from a calendar
# reaches a shell as code). It leaves the notice in /run/gpubook for sessions that log in later.
NOTICE_SCRIPT = ('msg=$1; printf "%s\\n" "$msg" > /run/gpubook/notice 2>/dev/null; '
                 'for t in /dev/pts/[0-9]*; do [ -c "$t" ] && printf "\\r\\n%s\\r\\n" "$msg" > "$t" 2>/dev/null; '
                 'done; exit 0')


def notice_argv(message: str) -> list[str]:
    return ["/bin/sh", "-c", NOTICE_SCRIPT, "gpubook-notice", " ".join(message.split())]


class _NoFolders(storage.DataFolders):
    """No [storage] data_root: bookings get no input/output folders."""

    def mounts(self) -> tuple:  # type: ignore[override]
        return ()


@dataclass
class PassResult:
    plan: plan_module.Plan
    actions: list[reconcile.Action]
    failures: dict[str, str] = field(default_factory=dict)  # booking id → why it failed this pass
    wake_at: datetime | None = None  # the earliest moment something is due (plan or rechecks)


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


class Reconciler:
    """One daemon's hands: applies decide()'s actions and reports back. Not thread-safe: one pass at a time."""

    def __init__(self, config: Config, *, engine: Engine, state: State, templates: TemplateSet,
                 probe_key: paramiko.PKey, cache_dir: Path, inventory: Sequence[int],
                 driver_version: str | None = None, probe_host: str = "127.0.0.1",
                 send_notice: Callable[[notices.Message], None] | None = None) -> None:
        self.config = config
        self.engine = engine
        self.state = state
        self.templates = templates
        self.probe_key = probe_key
        self.cache_dir = cache_dir
        self.inventory = tuple(inventory)
        self.driver_version = driver_version
        self.probe_host = probe_host
        self.send_notice = send_notice
        self.writers: dict[str, Writer] = {}
        self._held: dict[str, str] = {}
        self._failed: dict[str, tuple[str, datetime, bool]] = {}  # id → (reason, when, permanent)
        self._refused: dict[str, str] = {}  # id → why it can never start (CUDA, template)
        self._notes: dict[str, str] = {}

    # -- one pass ------------------------------------------------------------------------------

    def policy(self) -> reconcile.Policy:
        daemon = self.config.daemon
        return reconcile.Policy(notice=timedelta(seconds=daemon.notice_seconds),
                                stop_grace=self.config.engine.stop_grace_seconds,
                                restart_limit=daemon.restart_limit,
                                restart_backoff=timedelta(seconds=daemon.restart_backoff_seconds),
                                warn_before=timedelta(minutes=self.config.defaults.warn_minutes))

    def run(self, occurrences: Sequence[Booking | Rejection], *, now: datetime, may_start: bool = True,
            stale_reason: str = "", etags: Mapping[str, str | None] | None = None,
            write_back: bool = True) -> PassResult:
        actual = self.engine.list()
        result = self.plan(occurrences, actual, now=now)
        self._adopt(result, actual, now=now)
        memory = self.memory()
        actions = reconcile.decide(result, actual, now=now, memory=memory, policy=self.policy(),
                                   may_start=may_start, stale_reason=stale_reason)
        outcome = PassResult(plan=result, actions=actions)
        for action in actions:
            self._apply(action, now=now, outcome=outcome)
        rechecks = [a.at for a in actions if isinstance(a, reconcile.Recheck) and a.at > now]
        retries = [when + PERMANENT_RETRY for _, when, permanent in self._failed.values() if permanent]
        outcome.wake_at = min([t for t in (result.next_wakeup, *rechecks, *retries) if t is not None],
                              default=None)
        if write_back:
            self.write_back(result, now=now, etags=etags or {})
        return outcome

    def plan(self, occurrences: Sequence[Booking | Rejection], actual: Sequence[ContainerInfo], *,
             now: datetime) -> plan_module.Plan:
        pinned = reconcile.pin_running(occurrences, actual)
        running = {i.booking_id: i.gpus for i in actual if i.running and i.booking_id}
        agreed = self.state.notes(AGREED_END)
        ends = {i.booking_id: datetime.fromisoformat(agreed[i.booking_id]) if i.booking_id in agreed else i.end
                for i in actual if i.running and i.booking_id and i.end is not None}
        templates = frozenset(self.templates.templates) | frozenset(self.templates.errors)
        zone = ZoneInfo(self.config.host.timezone)
        result, granted, refused = reconcile.plan_with_extensions(
            pinned.occurrences, agreed_ends=ends,  # type: ignore[arg-type]
            plan=lambda items: plan_module.plan(items, inventory=self.inventory, config=self.config,
                                                templates=templates, now=now, running=running),
            describe=lambda t: t.astimezone(zone).strftime("%Y-%m-%d %H:%M %z"))
        for booking_id, end in granted.items():
            self.state.set_note(booking_id, AGREED_END, end.isoformat(), at=now)
            self.state.log_event(f"the end moved later, to {end.isoformat()}; the booking keeps running",
                                 booking_id=booking_id, at=now)
        self._notes = {**pinned.notes, **refused}
        for booking_id, note in self._notes.items():
            self._say_once(booking_id, note, now=now, level="info")
        return result

    def memory(self) -> reconcile.Memory:
        records = self.state.containers()
        runs: dict[str, reconcile.Runs] = {}
        for record in records:  # in id order: the last record of a booking is its latest run
            before = runs.get(record.booking_id)
            runs[record.booking_id] = reconcile.Runs(
                restarts=0 if before is None else before.restarts + 1, running=record.stopped_at is None,
                last_stopped=record.stopped_at, last_reason=record.exit_reason)
        warned = {}
        for booking_id, text in self.state.notes(WARNED).items():
            data = json.loads(text)
            warned[booking_id] = reconcile.Warned(
                at=datetime.fromisoformat(data["at"]),
                end=datetime.fromisoformat(data["end"]) if data["end"] else None,
                stop_at=datetime.fromisoformat(data["stop_at"]))
        return reconcile.Memory(known=frozenset(runs), warned=warned, runs=runs)

    def _adopt(self, result: plan_module.Plan, actual: Sequence[ContainerInfo], *, now: datetime) -> None:
        """Running containers of accepted bookings that State does not know (a lost database): adopt them."""
        wanted = {a.booking.id for a in result.accepted}
        open_names = {r.name for r in self.state.containers(running_only=True)}
        for info in actual:
            if info.running and info.booking_id in wanted and info.name not in open_names:
                self.state.container_started(info.booking_id, info.name, user=info.user,
                                             gpu_count=len(info.gpus), at=now)
                if info.port is not None:
                    self.state.adopt_port(info.booking_id, info.port, now=now)
                self.state.log_event(f"adopted the running container {info.name}", booking_id=info.booking_id,
                                     at=now)
                log.info("booking %s: adopted the running container %s", info.booking_id, info.name)

    # -- the actions ---------------------------------------------------------------------------

    def _apply(self, action: reconcile.Action, *, now: datetime, outcome: PassResult) -> None:
        booking_id = getattr(action, "booking_id", None) or (
            action.accepted.booking.id if isinstance(action, reconcile.Start) else None)
        try:
            if isinstance(action, reconcile.Start):
                self._start(action, now=now)
            elif isinstance(action, reconcile.Stop):
                self._stop(action, now=now)
            elif isinstance(action, reconcile.Clear):
                self._clear(action, now=now)
            elif isinstance(action, reconcile.Warn):
                self._warn(action, now=now)
            elif isinstance(action, reconcile.Hold):
                if self._held.get(action.booking_id) != action.reason:
                    self._held[action.booking_id] = action.reason
                    self._say(action.booking_id, f"not started: {action.reason}", now=now, level="warning")
        except (GpubookError, OSError, paramiko.SSHException) as error:
            what = type(action).__name__.lower()
            permanent = getattr(error, "temporary", True) is False
            reason = str(error).splitlines()[0] if str(error) else type(error).__name__
            outcome.failures[booking_id or "?"] = reason
            if booking_id:
                self._failed[booking_id] = (reason, now, permanent)
            retry = f"retry in {PERMANENT_RETRY.seconds // 60} min" if permanent else "retry on the next pass"
            self._say(booking_id, f"{what} failed: {reason}; {retry}", now=now, level="error",
                      detail=str(error))

    def _start(self, action: reconcile.Start, *, now: datetime) -> None:
        accepted = action.accepted
        booking = accepted.booking
        if booking.id in self._refused:
            return
        failed = self._failed.get(booking.id)
        if failed is not None and failed[2] and now < failed[1] + PERMANENT_RETRY:
            return
        template = self._template(booking)
        if template is None:
            return
        user = self.config.users[booking.user]
        port = self.state.port_for(booking.id, port_min=self.config.ssh.port_min,
                                   port_max=self.config.ssh.port_max, now=now)
        folders = self._folders(user.name, user.uid, user.gid)
        gpu = None
        if self.driver_version is not None and accepted.gpus:
            from runtime import nvidia  # only hosts with a driver need it

            gpu = nvidia.injection(accepted.gpus, extra_roots=self.config.nvidia.driver_roots,
                                   cache_dir=self.cache_dir)
        if not template.has_sshd:
            ssh.build_overlay(self.engine, template)
        spec = ssh.booking_spec(template, booking_id=booking.id, user=user.name, uid=user.uid, gid=user.gid,
                                ssh_keys=user.ssh_keys, probe_key=self.probe_key, port=port, end=booking.end,
                                folders=folders, cache_dir=self.cache_dir, gpus=accepted.gpus, gpu=gpu)
        ready = ssh.start_booking(self.engine, spec, probe_key=self.probe_key, host=self.probe_host)
        self.state.container_started(booking.id, spec.name, user=user.name, gpu_count=len(accepted.gpus), at=now)
        self._failed.pop(booking.id, None)
        self._held.pop(booking.id, None)
        again = f" (restart {action.attempt} after it died)" if action.attempt else ""
        self._say(booking.id, f"started{again} on GPU {','.join(map(str, accepted.gpus)) or '-'}, "
                  f"ssh -p {port} {user.name}@{self.config.host.name}, SSH answered after "
                  f"{ready.seconds:.2f} s", now=now)

    def _template(self, booking: Booking) -> Template | None:
        template = self.templates.templates.get(booking.template)
        if template is None:
            problem = self.templates.errors.get(booking.template, f"there is no template {booking.template!r}")
            self._refuse(booking.id, f"the template {booking.template} cannot be used: {problem.splitlines()[0]}")
            return None
        if self.driver_version is not None and template.cuda:
            reason = cuda.check_cuda(template.cuda, self.driver_version)
            if reason:
                self._refuse(booking.id, reason)
                return None
        return template

    def _refuse(self, booking_id: str, reason: str) -> None:
        self._refused[booking_id] = reason
        self._say(booking_id, f"rejected at its start: {reason}", now=None, level="warning")

    def _folders(self, user: str, uid: int, gid: int) -> storage.DataFolders:
        root = self.config.storage.data_root
        if root is None:
            return _NoFolders(user=user, input=Path("/nonexistent"), output=Path("/nonexistent"), home=None)
        owner_uid, owner_gid = self.engine.host_owner(uid, gid)
        return storage.prepare(root, user, uid=owner_uid, gid=owner_gid, home=self.config.storage.persistent_home)

    def _stop(self, action: reconcile.Stop, *, now: datetime, recorded: bool = False) -> None:
        self.engine.stop(action.name, action.grace)
        if not recorded:
            self._closed(action.name, action.booking_id, action.reason, now=now)
        self.state.release_port(action.booking_id)
        self._say(action.booking_id, f"stopped ({action.reason})", now=now)
        if self.send_notice is not None:
            record = next(iter(self.state.containers(booking_id=action.booking_id)[-1:]), None)
            user = record.user if record is not None else ""
            self.send_notice(notices.Message(
                kind="ended", booking_id=action.booking_id, user=user, subject="gpubook: your booking ended",
                text=f"gpubook: booking {action.booking_id} ended ({action.reason}); files in /data/output are kept.",
                fields={"reason": action.reason}))

    def _clear(self, action: reconcile.Clear, *, now: datetime) -> None:
        self.engine.stop(action.name, 0)  # removes the exited leftover; nothing if it is gone
        self._closed(action.name, action.booking_id, action.reason, now=now)
        self._say(action.booking_id, action.reason, now=now, level="warning")

    def _closed(self, name: str, booking_id: str, reason: str, *, now: datetime) -> None:
        if self.state.container_stopped(name, reason=reason, at=now) is None:
            # Never recorded (a lost database): record the run so restarts stay bounded.
            self.state.container_started(booking_id, name, user="", gpu_count=0, at=now)
            self.state.container_stopped(name, reason=reason, at=now)

    def _warn(self, action: reconcile.Warn, *, now: datetime) -> None:
        zone = ZoneInfo(self.config.host.timezone)
        stop = action.stop_at.astimezone(zone).strftime("%H:%M:%S %Z")
        minutes = max(0, round((action.stop_at - now).total_seconds() / 60))
        text = {
            "end-near": f"gpubook: this booking ends at {stop} (in {minutes} min); the container stops then. "
                        f"Save your work to /data/output.",
            "end-moved": f"gpubook: the end of this booking was moved earlier; the container stops at {stop} "
                         f"(in {minutes} min). Save your work to /data/output.",
            "gone": f"gpubook: this booking was removed from the calendar; the container stops at {stop} "
                    f"(in {minutes} min). Save your work to /data/output.",
        }[action.reason]
        self.state.set_note(action.booking_id, WARNED, json.dumps({
            "at": now.isoformat(), "end": action.end.isoformat() if action.end else None,
            "stop_at": action.stop_at.isoformat()}), at=now)
        self._say(action.booking_id, f"warned: {text}", now=now)
        done = self.engine.exec(action.name, notice_argv(text))
        if done.returncode != 0:
            log.warning("booking %s: the notice inside the container failed: %s", action.booking_id,
                        done.stderr.strip()[:200])
        if self.send_notice is not None:
            self.send_notice(notices.Message(kind="warning", booking_id=action.booking_id, user=action.user,
                                            subject="gpubook: your booking ends soon", text=text,
                                            fields={"stop_at": action.stop_at.isoformat()}))

    def stop_now(self, booking_id: str, *, now: datetime) -> bool:
        """`gpubook stop`: stop a booking's container at once; it is not started again."""
        name = container_name(booking_id)
        if self.engine.inspect(name) is None:
            return False
        # Recorded before the container goes: a pass of the running daemon in between then sees an
        # admin's stop (not started again), never a death (which it would restart).
        self._closed(name, booking_id, reconcile.ADMIN_STOP, now=now)
        self._stop(reconcile.Stop(name, booking_id, reconcile.ADMIN_STOP, self.config.engine.stop_grace_seconds),
                   now=now, recorded=True)
        return True

    # -- telling the booker --------------------------------------------------------------------

    def write_back(self, result: plan_module.Plan, *, now: datetime, etags: Mapping[str, str | None]) -> None:
        running = {i.booking_id: i for i in self.engine.list() if i.running}
        records: dict[str, list] = {}
        for record in self.state.containers():
            records.setdefault(record.booking_id, []).append(record)
        items: list[tuple[Booking | Rejection, notify.Outcome]] = []
        for rejection in result.rejected:
            if rejection.end > now:
                items.append((rejection, notify.rejected(rejection.reason)))
        for accepted in result.accepted:
            outcome = self._outcome(accepted, running.get(accepted.booking.id), records.get(accepted.booking.id),
                                    now=now)
            if outcome is not None:
                items.append((accepted.booking, outcome))
        for item, outcome in items:
            self._write(item, outcome, etag=etags.get(item.href), now=now)

    def _outcome(self, accepted: plan_module.Accepted, info: ContainerInfo | None, records: list | None, *,
                 now: datetime) -> notify.Outcome | None:
        booking = accepted.booking
        zone = self.config.host.timezone
        outcome: notify.Outcome | None
        if booking.id in self._refused:
            return notify.rejected(self._refused[booking.id])
        if info is None and records and records[-1].stopped_at is None:
            # Its container is gone but its stop is not recorded yet (an admin's `gpubook stop` in
            # another process, or a death this pass handles): say nothing rather than something stale.
            return None
        if info is not None and info.port is not None:
            outcome = notify.running(port=info.port, user=booking.user, host=self.config.host.name,
                                     end=booking.end, timezone=zone)
        elif records and all(r.stopped_at is not None for r in records) and (
                now >= booking.end or (records[-1].exit_reason or "") == reconcile.ADMIN_STOP):
            hours = sum(r.gpu_hours(now) for r in records)
            root = self.config.storage.data_root
            outputs = f"{self.config.host.name}:{root / booking.user / 'output'}" if root else None
            outcome = notify.ended(gpu_hours=hours, outputs=outputs, at=records[-1].stopped_at or now, timezone=zone)
            if records[-1].exit_reason == reconcile.ADMIN_STOP:
                outcome = outcome.with_note("stopped early by an admin")
        elif now < booking.end:
            outcome = notify.accepted(gpus=accepted.gpus, template=booking.template, start=booking.start,
                                      end=booking.end, timezone=zone)
            failed = self._failed.get(booking.id)
            if failed is not None and now >= booking.start:
                outcome = outcome.with_note(f"could not start yet: {failed[0]}")
        else:
            return None
        note = self._notes.get(booking.id)
        return outcome.with_note(note) if note else outcome

    def _write(self, item: Booking | Rejection, outcome: notify.Outcome, *, etag: str | None, now: datetime) -> None:
        calendar = next((c for c in self.config.calendars if c.url == item.calendar_url), None)
        if calendar is None:
            return
        digest = hashlib.sha256("\n".join(outcome.lines).encode()).hexdigest()[:12]
        key = f"{outcome.status} {digest}"
        done = self.state.write_back(item.id)
        if done is not None and done.status == key and (etag is None or done.etag == etag):
            return
        writer = self.writers.get(calendar.url) or open_writer(calendar, timezone=self.config.host.timezone)
        if writer is None:  # a read-only source (an ICS feed)
            return
        self.writers[calendar.url] = writer
        try:
            result = writer.write(event_ref(item), outcome)
        except GpubookError as error:
            log.warning("booking %s: %s", item.id, error)
            return
        if result.reason in ("written", "unchanged"):
            self.state.write_back_done(item.id, status=key, etag=result.etag, at=now)
        if result.written:
            self.state.log_event(f"wrote {outcome.status} into the calendar event", booking_id=item.id, at=now)

    # -- logging -------------------------------------------------------------------------------

    def _say(self, booking_id: str | None, message: str, *, now: datetime | None, level: str = "info",
             detail: str | None = None) -> None:
        getattr(log, level)("booking %s: %s", booking_id or "-", message)
        self.state.log_event(detail or message, booking_id=booking_id, level=level, at=now)

    def _say_once(self, booking_id: str, message: str, *, now: datetime, level: str) -> None:
        if self._held.get("note:" + booking_id) != message:
            self._held["note:" + booking_id] = message
            self._say(booking_id, message, now=now, level=level)

    def close(self) -> None:
        for writer in self.writers.values():
            writer.close()
