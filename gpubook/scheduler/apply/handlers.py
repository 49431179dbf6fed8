"""One handler per action kind, each with only the collaborators it needs.

A handler does its action, records the outcome in State once (a container started or stopped, a
warning given, a notice queued in the outbox) and returns a `Change` that the pass folds into its
view of the world. Nothing here writes to a calendar or sends a notice: the outbox consumers do
that after the pass, from what was recorded.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any
from zoneinfo import ZoneInfo

from gpubook.runtime.booking import provenance
from gpubook.runtime.engines import ContainerInfo, container_name
from gpubook.runtime.errors import GpubookError, Preparing
from gpubook.runtime.templates.catalog import TemplateSet
from gpubook.scheduler.apply.memory import Journal, Recall, failure
from gpubook.scheduler.core import decide, upkeep
from gpubook.scheduler.hosts import Host, KeepsProvenance, MovesEnd, start
from gpubook.scheduler.outbox import reminders
from gpubook.scheduler.outbox.metrics import Metrics
from gpubook.scheduler.outbox.writeback import start_lines
from gpubook.scheduler.settings import Config
from gpubook.scheduler.state import ContainerRecord, State, StateError, notes

# A constant script; the message is its $1, never part of the script (nothing from a calendar
# reaches a shell as code). It leaves the notice in /run/gpubook for sessions that log in later.
# Each terminal is written without blocking (a booker's Ctrl-S stops a terminal's output, and a
# plain write to it would wait for Ctrl-Q) and with 2 s at most; the exec itself has NOTICE_TIMEOUT.
NOTICE_SCRIPT = ('msg=$1; printf "%s\\n" "$msg" > /run/gpubook/notice 2>/dev/null; '
                 'for t in /dev/pts/[0-9]*; do [ -c "$t" ] || continue; '
                 'printf "\\r\\n%s\\r\\n" "$msg" | timeout -s KILL 2 dd of="$t" oflag=nonblock 2>/dev/null; '
                 'done; exit 0')
NOTICE_TIMEOUT = 10.0  # seconds the notice inside a container may take; the booker's container may hang it


def notice_argv(message: str) -> list[str]:
    return ["/bin/sh", "-c", NOTICE_SCRIPT, "gpubook-notice", " ".join(message.split())]


def tell_terminals(host: Host, name: str, text: str, *, booking_id: str, journal: Journal, what: str) -> None:
    """`text` on the booker's terminals inside the container; a failure (a hung or stopped terminal)
    is logged and no more: the event and the mail or webhook notice still tell."""
    try:
        done = host.exec(name, notice_argv(text), timeout=NOTICE_TIMEOUT)
    except GpubookError as error:
        journal.log.warning("booking %s: the %s inside the container failed: %s", booking_id, what, error)
        return
    if done.returncode != 0:
        journal.log.warning("booking %s: the %s inside the container failed: %s", booking_id, what,
                            done.stderr.strip()[:200])


@dataclass(frozen=True)
class Change:
    """What an action changed, for the pass's view: a container now running, one gone, records written."""

    running: ContainerInfo | None = None
    gone: str | None = None  # container name
    records: tuple[ContainerRecord, ...] = ()
    # What a start adds to its running block (JupyterLab, CUDA limits) and a stop to its ended block (the
    # provenance lines), as the handler noted them in State for the write-back (state/notes.py).
    lines: tuple[str, ...] = ()
    ended: tuple[str, ...] = ()


NOTHING = Change()


def record_stop(state: State, *, name: str, booking_id: str, reason: str, now: datetime) -> ContainerRecord:
    """Close the container's open record; one never recorded (a lost database) is recorded first,
    so that restarts stay bounded. A record already closed (by `gpubook stop`) stays as it is."""
    closed = state.container_stopped(name, reason=reason, at=now)
    if closed is None:
        earlier = [r for r in state.containers(booking_id=booking_id) if r.name == name]
        if earlier:
            return earlier[-1]
        state.container_started(booking_id, name, user="", gpu_count=0, at=now)
        closed = state.container_stopped(name, reason=reason, at=now)
    assert closed is not None  # noqa: S101 - just opened above
    return closed


class StartHandler:
    def __init__(self, config: Config, *, hosts: Mapping[str, Host], state: State, templates: TemplateSet,
                 recall: Recall, journal: Journal, metrics: Metrics | None = None,
                 address: Callable[[str], str] | None = None) -> None:
        """`address`: where a booker logs in to a booking on a host (the backend's; None: this
        server, `[host] name`)."""
        self.config, self.hosts, self.state, self.templates = config, hosts, state, templates
        self.recall, self.journal, self.metrics = recall, journal, metrics
        self.address = address or (lambda host: config.host.name)

    def __call__(self, action: decide.Start, *, now: datetime) -> Change:
        accepted = action.accepted
        booking = accepted.booking
        last = self.recall.failures.get(booking.id)
        if last is not None and last.waiting(now):  # failed or refused: its retry is not due
            return NOTHING
        host = self.hosts[accepted.host]
        # An armed container (run ahead of the start) already publishes its port: the same spec needs it.
        prepared = start.prepare(self.config, self.state, self.templates, booking, gpus=accepted.gpus,
                                 driver_version=host.driver_version, port=action.port, now=now)
        if isinstance(prepared, str):  # refused before anything was taken for it (a port)
            self._refuse(booking.id, prepared, now=now)
            return NOTHING
        # The port is held only while this start is in progress and then by the running container:
        # a start that fails in any way gives it back.
        template, user, port = prepared.template, self.config.users[booking.user], prepared.port
        where = self.address(accepted.host)
        try:
            started = host.start(replace(prepared, armed=action.armed, address=where,
                                         placement=accepted.placement if accepted.others else ()))
        except Preparing:
            if not action.armed:  # an armed container keeps running (and holding its port) meanwhile
                self._release_port(booking.id)
            raise
        except BaseException:
            if action.armed:  # nothing half-done: its armed container goes too, and it starts anew
                host.stop(container_name(booking.id), 0)
            self._release_port(booking.id)
            self._forget_armed(booking.id)
            raise
        self._forget_armed(booking.id)
        if self.metrics is not None:
            self.metrics.started(seconds_to_ssh=started.seconds_to_ssh)
        gpus = [gpu for _, on_node in accepted.placement for gpu in on_node]
        record = self.state.container_started(booking.id, started.info.name, user=user.name,
                                              gpu_count=len(gpus), at=now)
        lines = tuple(start_lines(template, started.jupyter, driver_version=host.driver_version, port=port,
                                  user=user.name, host=where))
        self._note_lines(booking.id, lines, now=now)
        self._note_provenance(booking.id, started.provenance, now=now)
        self.recall.failures.pop(booking.id, None)
        self.recall.preparing.pop(booking.id, None)
        self._told_started(booking.id)
        again = f" (restart {action.attempt} after it died)" if action.attempt else ""
        nodes = f" (and {', '.join(name for name, _ in accepted.others)})" if accepted.others else ""
        self.journal.say(booking.id, f"started{again} on GPU {','.join(map(str, accepted.gpus)) or '-'}{nodes}, "
                         f"ssh -p {port} {user.name}@{where}, SSH answered after "
                         f"{started.seconds_to_ssh:.2f} s", now=now)
        return Change(running=started.info, records=(record,), lines=lines)

    def _forget_armed(self, booking_id: str) -> None:
        """Its start is recorded (or failed, and its container is gone): it is armed no more."""
        try:
            notes.ARMED.clear(self.state, booking_id)
        except StateError as error:  # an open record outweighs the note (decide); a failed start clears again
            self.journal.log.warning("booking %s: its armed note stays: %s", booking_id, error)

    def _told_started(self, booking_id: str) -> None:
        """It runs: why it was refused, failed or held is history (its event says "running")."""
        try:
            for kind in (notes.REFUSED, notes.FAILED, notes.HELD):
                kind.clear(self.state, booking_id)
        except StateError as error:  # the pass clears a held note of a booking no longer held
            self.journal.log.warning("booking %s: its notes of before its start stay: %s", booking_id, error)

    def _note_lines(self, booking_id: str, lines: tuple[str, ...], *, now: datetime) -> None:
        """Keep what the start adds to the running block (JupyterLab, CUDA limits) for the write-back;
        a locked database costs those lines, never the started booking."""
        if not lines:
            return
        try:
            notes.RUNNING_LINES.write(self.state, booking_id, lines, at=now)
        except StateError as error:
            self.journal.log.warning("booking %s: its JupyterLab and CUDA lines are not kept: %s", booking_id, error)

    def _note_provenance(self, booking_id: str, card: Mapping[str, Any] | None, *, now: datetime) -> None:
        """Keep the provenance card its start knew, for its end to complete (a host that keeps none: nothing);
        a locked database costs the card, never the started booking."""
        if card is None:
            return
        try:
            notes.PROVENANCE.write(self.state, booking_id, dict(card), at=now)
        except StateError as error:
            self.journal.log.warning("booking %s: its provenance card is not kept: %s", booking_id, error)

    def _release_port(self, booking_id: str) -> None:
        try:
            self.state.release_port(booking_id)
        except StateError as error:  # the next pass frees it (ports of bookings not running)
            self.journal.log.warning("booking %s: its port stays held until the next pass: %s", booking_id, error)

    def _refuse(self, booking_id: str, reason: str, *, now: datetime) -> None:
        """Refused at its start: its event says why (a State note, kept across a restart); it is tried
        again after PERMANENT_RETRY (an admin may mend its template meanwhile), told and counted once."""
        self.recall.failures[booking_id] = failure(reason, now=now, permanent=True, backoff=False)
        told = self.journal.tell(notes.REFUSED, booking_id, reason, f"rejected at its start: {reason}", now=now,
                                 level="warning")
        if told and self.metrics is not None:
            self.metrics.start_failed(reason="refused")


def finish_provenance(state: State, host: Host, booking_id: str, *, now: datetime, timezone: str,
                      journal: Journal) -> tuple[str, ...]:
    """A stopped booking's provenance card, completed with its end: written into the booker's
    output folder where its host keeps one (`write_provenance`), and its two lines for the ended
    block (none where its start kept no card). A card that cannot be read or written is logged and
    costs the booker that card only, never the end of the booking."""
    try:
        found = notes.PROVENANCE.read({notes.PROVENANCE.key: state.notes(notes.PROVENANCE.key)})
    except StateError as error:
        journal.log.warning("booking %s: its provenance card cannot be read: %s", booking_id, error)
        return ()
    if booking_id not in found:
        return ()
    try:
        card = provenance.Card.from_json(found[booking_id]).ended_at(now)
    except (KeyError, TypeError, ValueError) as error:
        journal.log.warning("booking %s: its provenance card cannot be read: %s", booking_id, error)
        return ()
    kept = False
    if isinstance(host, KeepsProvenance):
        try:
            kept = bool(host.write_provenance(card.user, card))
        except (GpubookError, OSError, ValueError) as error:
            journal.log.warning("booking %s: its provenance.json is not written: %s", booking_id, error)
    return provenance.lines(card, zone=ZoneInfo(timezone), kept=kept)


def note_ended(state: State, booking_id: str, lines: tuple[str, ...], *, now: datetime, journal: Journal) -> None:
    """The ended block's provenance lines, kept (after the stop cleared the booking's notes)."""
    if not lines:
        return
    try:
        notes.ENDED_LINES.write(state, booking_id, lines, at=now)
    except StateError as error:
        journal.log.warning("booking %s: its provenance lines are not kept for its event: %s", booking_id, error)


class DisarmHandler:
    """A container run ahead of its booking's start that must not open: removed at once (its SSH
    never opened, so nobody is warned), its port and armed note given back. Nothing is recorded as
    a run: the booking, if it still stands, starts the normal way."""

    def __init__(self, *, hosts: Mapping[str, Host], state: State, journal: Journal) -> None:
        self.hosts, self.state, self.journal = hosts, state, journal

    def __call__(self, action: decide.Disarm, *, now: datetime) -> Change:
        self.hosts[action.host].stop(action.name, 0)
        self.state.release_port(action.booking_id)
        notes.ARMED.clear(self.state, action.booking_id)
        self.journal.say(action.booking_id, f"removed its container run ahead of its start: {action.reason}", now=now)
        return Change(gone=action.name)


class StopHandler:
    def __init__(self, *, hosts: Mapping[str, Host], state: State, journal: Journal, timezone: str = "UTC") -> None:
        """`timezone`: the zone of the times in the booker's provenance card and its lines."""
        self.hosts, self.state, self.journal, self.timezone = hosts, state, journal, timezone

    def __call__(self, action: decide.Stop, *, now: datetime) -> Change:
        """An admin's stop (`gpubook stop`) is recorded before the container goes: a pass of the
        running daemon in between then sees an admin's stop (not started again), never a death
        (which it would restart). Any other stop is recorded once its container is gone."""
        admin = action.reason == decide.ADMIN_STOP
        if admin:
            recorded = record_stop(self.state, name=action.name, booking_id=action.booking_id, reason=action.reason,
                                   now=now)
        self.hosts[action.host].stop(action.name, action.grace)
        if not admin:
            recorded = record_stop(self.state, name=action.name, booking_id=action.booking_id,
                                   reason=action.reason, now=now)
        ended = finish_provenance(self.state, self.hosts[action.host], action.booking_id, now=now,
                                  timezone=self.timezone, journal=self.journal)
        self.state.release_port(action.booking_id)
        notes.clear_history(self.state, action.booking_id)  # stopped for good: its warning and extension
        note_ended(self.state, action.booking_id, ended, now=now, journal=self.journal)
        self.journal.say(action.booking_id, f"stopped ({action.reason})", now=now)
        self.state.queue_notice(
            kind="ended", booking_id=action.booking_id, user=recorded.user,
            subject="gpubook: your booking ended",
            text=f"gpubook: booking {action.booking_id} ended ({action.reason}); files in /data/output are kept.",
            fields={"reason": action.reason}, at=now)
        return Change(gone=action.name, records=(recorded,), ended=ended)


class ClearHandler:
    def __init__(self, *, hosts: Mapping[str, Host], state: State, journal: Journal) -> None:
        self.hosts, self.state, self.journal = hosts, state, journal

    def __call__(self, action: decide.Clear, *, now: datetime) -> Change:
        self.hosts[action.host].stop(action.name, 0)  # removes the exited leftover; nothing if it is gone
        record = record_stop(self.state, name=action.name, booking_id=action.booking_id, reason=action.reason,
                             now=now)
        self.journal.say(action.booking_id, action.reason, now=now, level="warning")
        return Change(gone=action.name, records=(record,))


class WarnHandler:
    def __init__(self, *, hosts: Mapping[str, Host], state: State, journal: Journal, timezone: str) -> None:
        self.hosts, self.state, self.journal = hosts, state, journal
        self.zone = ZoneInfo(timezone)

    def __call__(self, action: decide.Warn, *, now: datetime) -> Change:
        stop = action.stop_at.astimezone(self.zone).strftime("%H:%M:%S %Z")
        minutes = max(0, round((action.stop_at - now).total_seconds() / 60))
        text = {
            "end-near": f"gpubook: this booking ends at {stop} (in {minutes} min); the container stops then. "
                        f"Save your work to /data/output.",
            "end-moved": f"gpubook: the end of this booking was moved earlier; the container stops at {stop} "
                         f"(in {minutes} min). Save your work to /data/output.",
            "gone": f"gpubook: this booking was removed from the calendar; the container stops at {stop} "
                    f"(in {minutes} min). Save your work to /data/output.",
            "moved": f"gpubook: this booking was moved to a later time; this container stops at {stop} "
                     f"(in {minutes} min) and a new one starts at the new time. Save your work to /data/output.",
        }[action.reason]
        notes.WARNED.write(self.state, action.booking_id, notes.Warned(now, action.end, action.stop_at), at=now)
        # The stop it announces is the end inside too (moved earlier, gone or moved away: sooner).
        tell_inside((self.hosts[action.host],), action.booking_id, action.stop_at, journal=self.journal)
        self.journal.say(action.booking_id, f"warned: {text}", now=now)
        tell_terminals(self.hosts[action.host], action.name, text, booking_id=action.booking_id,
                       journal=self.journal, what="notice")
        self.state.queue_notice(kind="warning", booking_id=action.booking_id, user=action.user,
                                subject="gpubook: your booking ends soon", text=text,
                                fields={"stop_at": action.stop_at.isoformat()}, at=now)
        return NOTHING


class HoldHandler:
    def __init__(self, *, journal: Journal) -> None:
        self.journal = journal

    def __call__(self, action: decide.Hold, *, now: datetime) -> Change:
        """Why it waits goes into its event (its host answers "tentative"), written and logged once."""
        self.journal.tell(notes.HELD, action.booking_id, action.reason, f"not started: {action.reason}", now=now,
                          level="warning")
        return NOTHING


# -- upkeep: what a pass keeps in step before decide() (gpubook/scheduler/core/upkeep.py) ---------


class AdoptHandler:
    """A running container State has no record of (a lost database): its run and its port recorded.
    A database that cannot be written leaves it to a later pass (no failure of the booking's)."""

    def __init__(self, *, state: State, journal: Journal) -> None:
        self.state, self.journal = state, journal

    def __call__(self, action: upkeep.Adopt, *, now: datetime) -> Change:
        records: tuple[ContainerRecord, ...] = ()
        try:
            records = (self.state.container_started(action.booking_id, action.name, user=action.user,
                                                    gpu_count=action.gpu_count, at=now),)
            if action.port is not None:
                self.state.adopt_port(action.booking_id, action.port, now=now)
        except StateError as error:  # adopted by a later pass
            self.journal.log.warning("booking %s: its running container is not adopted yet: %s",
                                     action.booking_id, error)
            return Change(records=records)
        self.journal.say(action.booking_id, f"adopted the running container {action.name}", now=now)
        return Change(records=records)


class ExtendHandler:
    """A running booking's later end, agreed: the next passes plan with it, and the booking.json
    inside its container says it (on a host that keeps one: `move_end`)."""

    def __init__(self, *, state: State, journal: Journal, hosts: Mapping[str, Host] | None = None) -> None:
        self.state, self.journal, self.hosts = state, journal, hosts or {}

    def __call__(self, action: upkeep.Extend, *, now: datetime) -> Change:
        try:
            notes.AGREED_END.write(self.state, action.booking_id, action.end, at=now)
        except StateError as error:  # granted again by the next pass
            self.journal.log.warning("booking %s: its later end is not recorded yet: %s", action.booking_id, error)
            return NOTHING
        self.journal.say(action.booking_id,
                         f"the end moved later, to {action.end.isoformat()}; the booking keeps running", now=now)
        tell_inside(self.hosts.values(), action.booking_id, action.end, journal=self.journal)
        return NOTHING


def tell_inside(hosts: Iterable[Host], booking_id: str, end: datetime, *, journal: Journal) -> None:
    """The booking's new end into its booking.json, on whichever host keeps one (`move_end`); a
    failed write costs the booker that file's news (logged), never the end itself."""
    for host in hosts:
        if not isinstance(host, MovesEnd):
            continue
        try:
            if host.move_end(booking_id, end):
                return
        except (GpubookError, OSError, ValueError) as error:
            journal.log.warning("booking %s: its booking.json does not show its end %s: %s", booking_id,
                                end.isoformat(), error)
            return


class RemindHandler:
    """A reminder notice queued in the outbox (its wording: gpubook/scheduler/outbox/reminders.py)."""

    def __init__(self, config: Config, *, state: State, journal: Journal) -> None:
        self.config, self.state, self.journal = config, state, journal

    def __call__(self, action: upkeep.Remind, *, now: datetime) -> Change:
        try:
            reminders.queue(self.state, action, config=self.config, now=now)
        except StateError as error:
            self.journal.log.warning("booking %s: its reminder waits for a later pass: %s", action.booking_id, error)
        return NOTHING
