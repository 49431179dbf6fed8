"""Calendar write-back: each booking's recorded outcome, written into its event.

After a pass, the outcome of every booking in the window is read from what was recorded (the
plan, the containers the pass saw or started, State's start/stop records, the pass's notes) and
written through the calendar's writer where its source has one (CalDAV yes, ICS feeds no). A
write whose content and event ETag match the last one recorded is skipped, so calling this on
every pass costs nothing while nothing changes. A source that cannot write (an ICS feed) gives
no writer, and its bookings are only planned.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, date, datetime

from runtime import ssh
from runtime.engines import ContainerInfo
from runtime.errors import GpubookError
from scheduler.config import Config
from scheduler.core import decide
from scheduler.core.bookings import Booking, Rejection
from scheduler.core.plan import Accepted, Plan
from scheduler.sources import EventRef, Writer, block, open_writer
from scheduler.state import ContainerRecord, State

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Remarks:
    """What the apply stage has to say about bookings beyond State's records."""

    refused: Mapping[str, str]  # booking id → why it can never start
    failures: Mapping[str, str]  # booking id → why its start failed (for a note once it is due)
    notes: Mapping[str, str]  # booking id → a sentence for its event


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

    def __init__(self, config: Config, state: State) -> None:
        self.config = config
        self.state = state
        self.writers: dict[str, Writer] = {}

    def write(self, plan: Plan, *, running: Mapping[str, ContainerInfo],
              records: Mapping[str, Sequence[ContainerRecord]], remarks: Remarks, now: datetime,
              etags: Mapping[str, str | None]) -> None:
        items: list[tuple[Booking | Rejection, block.Outcome]] = []
        for rejection in plan.rejected:
            if rejection.end > now:
                items.append((rejection, block.rejected(rejection.reason)))
        for accepted in plan.accepted:
            outcome = self.outcome(accepted, running.get(accepted.booking.id), records.get(accepted.booking.id),
                                   remarks=remarks, now=now)
            if outcome is not None:
                items.append((accepted.booking, outcome))
        for item, outcome in items:
            self._write(item, outcome, etag=etags.get(item.href), now=now)

    def outcome(self, accepted: Accepted, info: ContainerInfo | None, records: Sequence[ContainerRecord] | None,
                *, remarks: Remarks, now: datetime) -> block.Outcome | None:
        booking = accepted.booking
        zone = self.config.host.timezone
        outcome: block.Outcome
        if booking.id in remarks.refused:
            return block.rejected(remarks.refused[booking.id])
        if info is None and records and records[-1].stopped_at is None:
            # Its container is gone but its stop is not recorded yet (an admin's `gpubook stop` in
            # another process, or a death this pass handles): say nothing rather than something stale.
            return None
        if info is not None and info.port is not None:
            host = self.config.host.name
            known = ssh.known_hosts_line(host=host, port=info.port, host_key=info.host_key) if info.host_key else ""
            outcome = block.running(port=info.port, user=booking.user, host=host, end=booking.end, timezone=zone,
                                    known_hosts=known)
        elif records and all(r.stopped_at is not None for r in records) and (
                now >= booking.end or (records[-1].exit_reason or "") == decide.ADMIN_STOP):
            hours = sum(r.gpu_hours(now) for r in records)
            root = self.config.storage.data_root
            outputs = f"{self.config.host.name}:{root / booking.user / 'output'}" if root else None
            outcome = block.ended(gpu_hours=hours, outputs=outputs, at=records[-1].stopped_at or now, timezone=zone)
            if records[-1].exit_reason == decide.ADMIN_STOP:
                outcome = outcome.with_note("stopped early by an admin")
        elif now < booking.end:
            outcome = block.accepted(gpus=accepted.gpus, template=booking.template, start=booking.start,
                                     end=booking.end, timezone=zone)
            failed = remarks.failures.get(booking.id)
            if failed is not None and now >= booking.start:
                outcome = outcome.with_note(f"could not start yet: {failed}")
        else:
            return None
        note = remarks.notes.get(booking.id)
        return outcome.with_note(note) if note else outcome

    def _write(self, item: Booking | Rejection, outcome: block.Outcome, *, etag: str | None, now: datetime) -> None:
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

    def close(self) -> None:
        for writer in self.writers.values():
            writer.close()
