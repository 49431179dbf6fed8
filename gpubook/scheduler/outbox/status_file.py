"""The daemon's status after each pass: assembled from the pass, what is known of the calendars
and State, then written to `daemon-status.json` in the state folder (what `gpubook status`, the
web page and /metrics read)."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from gpubook.runtime.engines import ContainerInfo, EngineSettings
from gpubook.runtime.private import write_private
from gpubook.scheduler.calendars import Freshness
from gpubook.scheduler.core import decide
from gpubook.scheduler.core.plan import Plan
from gpubook.scheduler.outbox import foreign, status, timeline
from gpubook.scheduler.state import ContainerRecord, State, StateError

STATUS_FILE = "daemon-status.json"

log = logging.getLogger(__name__)


def assemble(*, plan: Plan, actions: Sequence[decide.Action], failures: Mapping[str, str],
             containers: Sequence[ContainerInfo], gpus: Mapping[str, status.GpuSummary], state: State,
             calendar: Freshness, engine: EngineSettings, now: datetime, previous: status.Status | None = None,
             sftp: dict[str, Any] | None = None, images: dict[str, Any] | None = None) -> status.Status:
    """One pass's status: `gpus` each host's GPUs, `previous` the last pass's status (its ended runs),
    `sftp` and `images` the services' own snapshots."""
    held = {**_waiting_for_images(plan, images, now=now), **timeline.held_reasons(actions)}
    return status.Status(
        hosts=status.hosts_status(gpus, plan=plan, now=now, containers=containers, ports=_ports(state),
                                  held=held, records=_records(state), previous=previous),
        updated=now.isoformat(), pid=os.getpid(), last_poll=status.iso(calendar.last_poll),
        last_poll_ok=status.iso(calendar.last_ok), outage=calendar.outage,
        outage_since=status.iso(calendar.outage_since),
        problems=(*calendar.problems, *(f"{k}: {v}" for k, v in failures.items())),
        counts=status.counts(plan, now=now), findings=status.setup_findings(engine), sftp=sftp, images=images,
        rejected=timeline.rejected_bookings(plan), foreign=_foreign_items(state))


def _waiting_for_images(plan: Plan, images: Mapping[str, Any] | None, *, now: datetime) -> dict[str, str]:
    """The bookings whose start came while their image is being made, with its live sentence
    ("preparing image pytorch: 4.1 of 9.3 GB, ready about 10:42"): held, on the page too."""
    started = {accepted.booking.id for accepted in plan.accepted if accepted.booking.start <= now}
    return {booking: row["sentence"] for row in (images or {}).get("preparations") or ()
            if row.get("sentence") for booking in row.get("bookings") or () if booking in started}


def write(report: status.Status, folder: Path) -> bool:
    """Write the status file; a disk that refuses it (full, read-only) costs this pass's file, not
    the pass: a warning, and False (the next pass writes it again)."""
    path = folder / STATUS_FILE
    try:
        write_private(path, json.dumps(report.to_json(), indent=2).encode())
    except OSError as error:
        log.warning("the status file %s was not written this pass: %s", path, error.strerror or error)
        return False
    return True


def _ports(state: State) -> dict[str, int]:
    try:
        return state.ports()
    except StateError:
        return {}  # the status file shows no ports this time; the next pass writes them


def _records(state: State) -> list[ContainerRecord]:
    try:
        return state.containers()
    except StateError:
        return []  # the timelines show no ended runs this time


def _foreign_items(state: State) -> tuple[dict[str, object], ...]:
    try:
        return foreign.status_items(state.foreign())
    except StateError:
        return ()  # the status file shows none this time; the next pass reads them again
