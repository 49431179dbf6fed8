"""What the status page tests and its benchmark share: bookings and plans as plain data, a week of
many generated bookings, the page served by the real waitress server on a free loopback port."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from scheduler.config import Config, parse
from scheduler.core.bookings import Booking, Rejection
from scheduler.core.plan import LOCAL, Accepted, Plan
from scheduler.outbox import status, timeline
from scheduler.outbox.web import serve

CALENDAR = "http://127.0.0.1:5232/lab/devbox1/"


def booking(booking_id: str, *, user: str, start: datetime, end: datetime, template: str = "debian-ssh",
            gpus: int = 1) -> Booking:
    return Booking(id=booking_id, uid=booking_id, user=user, template=template, gpu_count=gpus, gpu_indices=None,
                   start=start, end=end, created=None, dtstamp=None, calendar_url=CALENDAR,
                   href=f"{CALENDAR}{booking_id}.ics")


def accepted(item: Booking, *gpus: int) -> Accepted:
    return Accepted(booking=item, gpus=tuple(gpus), warn_at=item.end - timedelta(minutes=15))


def rejection(booking_id: str, *, user: str, start: datetime, reason: str) -> Rejection:
    return Rejection(id=booking_id, uid=booking_id, start=start, end=start + timedelta(hours=1), reason=reason,
                     user=user, calendar_url=CALENDAR, href=f"{CALENDAR}{booking_id}.ics")


def generated_plan(now: datetime, *, bookings: int = 1000, gpus: int = 8, rejected: int = 50) -> Plan:
    """`bookings` one-GPU bookings back to back from a week back to a week ahead, round the GPUs,
    with `rejected` refusals: a busy lab's fortnight."""
    first = now.replace(minute=0, second=0, microsecond=0) - timedelta(days=7)
    per_gpu = -(-bookings // gpus)
    length = timedelta(days=14) / per_gpu
    users = ("alice", "bob", "carol", "dave", "erin")
    made = [accepted(booking(f"gen{n:04d}@lab", user=users[n % len(users)], start=first + (n // gpus) * length,
                             end=first + (n // gpus + 1) * length), n % gpus) for n in range(bookings)]
    refused = tuple(rejection(f"refused{n:03d}@lab", user=users[n % len(users)], start=now + timedelta(hours=n),
                              reason=f"GPU {n % gpus} is taken by gen{n:04d}@lab at that time")
                    for n in range(rejected))
    return Plan(accepted=tuple(made), rejected=refused, next_wakeup=None)


def status_of(plan: Plan, *, now: datetime, gpus: int = 8, **kwargs: Any) -> status.Status:
    """The Status the daemon writes after a pass with this plan (`kwargs`: hosts_status's others)."""
    summary = status.GpuSummary(source="config", count=gpus, note="no NVIDIA driver here (test)")
    return status.Status(hosts=status.hosts_status({LOCAL: summary}, plan=plan, now=now, **kwargs),
                         updated=now.isoformat(), last_poll=now.isoformat(), last_poll_ok=now.isoformat(),
                         counts=status.counts(plan, now=now), rejected=timeline.rejected_bookings(plan))


def write_status(folder: Path, report: status.Status) -> Path:
    path = folder / "daemon-status.json"
    path.write_text(json.dumps(report.to_json(), indent=2))
    return path


def web_config(folder: Path, **web: object) -> Config:
    """A config whose [web] is `web` (listen on a free loopback port unless given)."""
    return parse({"host": {"name": "devbox1", "timezone": "UTC"}, "calendar": [{"url": CALENDAR}],
                  "users": {"alice": {"uid": 2001}, "bob": {"uid": 2002}},
                  "daemon": {"state_dir": str(folder / "state")},
                  "web": {"listen": "127.0.0.1:0", **web}}, folder / "gpubook.toml")


@contextmanager
def served(config: Config, report: status.Status | None, *,
           mounts: Mapping[str, Any] | None = None) -> Iterator[str]:
    """The page served by waitress as the daemon serves it; yields its base URL."""
    server = serve.start(config, status=lambda: report, mounts=mounts)
    try:
        yield f"http://{server.address}"
    finally:
        server.stop()


def now_utc() -> datetime:
    return datetime.now(UTC).replace(microsecond=0)
