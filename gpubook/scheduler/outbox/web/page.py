"""What the page shows one viewer, from the last `Status`: plain JSON-able data, the same for the
HTML page and its JSON endpoint.

Two rules are kept here, in one place, for every view:
- a running booking's SSH port (and so its ssh line) goes to its own booker only, when the
  page knows who asks (auth basic or header): another user, or anyone with auth none, gets
  neither the line nor the port;
- free text (problems, reasons) is shown with every URL cut to its scheme and host: a calendar
  URL may carry a password or a secret token in its user part, path or query;
- a booking is named by its event's title (SUMMARY: `title`, shortened and with control characters
  escaped, timeline.short_title), its id (the UID) kept beside it for the hover. The title is as
  private as the booker's name, and shown exactly where the name is. It comes from a hostile
  calendar: the template escapes it (Jinja's autoescape), and the data embedded for app.js goes
  through `tojson`, which writes <, >, & and ' as \\u escapes (no `</script>` can close the tag).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict
from datetime import UTC, datetime, timedelta
from typing import Any

from gpubook.runtime.booking import ssh
from gpubook.scheduler.core.plan import LOCAL
from gpubook.scheduler.outbox.status import HostStatus, RunningBooking, Status
from gpubook.scheduler.outbox.timeline import short_title
from gpubook.scheduler.outbox.web.live import LiveGpus
from gpubook.scheduler.sources.errors import redact_urls

# Each URL cut to scheme://host/… (shared with /metrics' calendar labels).
redacted = redact_urls


def ssh_line(running: RunningBooking, *, viewer: str | None, host_name: str) -> str | None:
    """`ssh -p PORT user@host` for the booking's own booker; None for anybody else."""
    if viewer is None or viewer != running.user or running.port is None:
        return None
    return f"ssh -p {running.port} {running.user}@{host_name}"


def _running(running: RunningBooking, *, viewer: str | None, host_name: str) -> dict[str, Any]:
    line = ssh_line(running, viewer=viewer, host_name=host_name)
    return {"booking": running.booking, "title": short_title(running.title), "user": running.user,
            "template": running.template,
            "gpus": list(running.gpus), "start": running.start, "end": running.end,
            "state": redacted(running.state), "ssh": line, "port": running.port if line else None}


def _host(host: HostStatus, *, viewer: str | None, host_name: str, live: LiveGpus | None) -> dict[str, Any]:
    timeline = [{"gpu": lane.gpu, "segments": [
        {**asdict(segment), "note": redacted(segment.note), "title": short_title(segment.title)}
        for segment in lane.segments]} for lane in host.timeline]
    if not timeline:  # no pass yet: each GPU with nothing on it
        timeline = [{"gpu": gpu, "segments": []} for gpu in host.gpus.gpu_indices]
    return {
        "name": host_name if host.name == LOCAL else host.name,  # what leaves the daemon: its [host] name
        "gpus": {"source": host.gpus.source, "count": host.gpus.count, "driver": host.gpus.driver,
                 "note": redacted(host.gpus.note or "")},
        "live": _live(live),
        "running": [_running(r, viewer=viewer, host_name=host_name) for r in host.running],
        "held": _held(host),
        "next": [asdict(n) | {"gpus": list(n.gpus), "title": short_title(n.title)} for n in host.next],
        "timeline": timeline,
    }


def _held(host: HostStatus) -> list[dict[str, Any]]:
    """The bookings that should run and do not (decide's holds), once each, with why."""
    held: dict[str, dict[str, Any]] = {}
    for lane in host.timeline:
        for segment in lane.segments:
            if segment.kind == "held":
                row = held.setdefault(segment.booking, {
                    "booking": segment.booking, "title": short_title(segment.title), "user": segment.user,
                    "gpus": [], "start": segment.start,
                    "end": segment.end, "reason": redacted(segment.note)})
                row["gpus"].append(lane.gpu)
    return list(held.values())


def _live(live: LiveGpus | None) -> dict[str, Any] | None:
    if live is None:
        return None
    return {"gpus": [asdict(g) for g in live.gpus], "problem": live.problem,
            "read_at": datetime.fromtimestamp(live.read_at, UTC).isoformat() if live.read_at else None}


def _summary(counts: Mapping[str, int]) -> str:
    return (f"{counts.get('now', 0)} booking(s) now, {counts.get('upcoming', 0)} upcoming, "
            f"{counts.get('rejected', 0)} refused")


def page_data(status: Status | None, *, viewer: str | None, host_name: str, now: datetime,
              live: Mapping[str, LiveGpus] | None = None, stale_after: timedelta = timedelta(minutes=5)
              ) -> dict[str, Any]:
    """The page's data for `viewer` (None: nobody logged in). `live`: host → its NVML reading."""
    live = live or {}
    if status is None:
        return {"now": now.isoformat(), "viewer": viewer, "hosts": [], "rejected": [], "problems": [],
                "stale": "the daemon has written no status yet (it writes one after each pass)",
                "updated": None, "last_poll": None, "last_poll_ok": None, "outage": None, "counts": {},
                "summary": "no status yet", "sftp": None}
    stale = None
    if status.updated and now - datetime.fromisoformat(status.updated) > stale_after:
        stale = (f"the status is from {status.updated} (UTC): the daemon has not finished a pass since; "
                 f"is it running?")
    return {
        "now": now.isoformat(), "viewer": viewer, "stale": stale, "summary": _summary(status.counts),
        "updated": status.updated, "last_poll": status.last_poll, "last_poll_ok": status.last_poll_ok,
        "outage": redacted(status.outage) if status.outage else None, "outage_since": status.outage_since,
        "counts": dict(status.counts),
        "problems": [redacted(p) for p in (*status.problems, *status.findings)],
        "hosts": [_host(h, viewer=viewer, host_name=host_name, live=live.get(h.name)) for h in status.hosts],
        "rejected": [asdict(r) | {"reason": redacted(r.reason)} for r in status.rejected],
        "sftp": _sftp(status.sftp, host_name=host_name),
    }


def _sftp(sftp: Mapping[str, Any] | None, *, host_name: str) -> dict[str, Any] | None:
    """The SFTP service's port and its known_hosts line (a public key: the same for every viewer),
    so that a booker's first transfer checks the host key; None while it is off or has no key."""
    if not sftp or not sftp.get("host_key") or not isinstance(sftp.get("port"), int):
        return None
    return {"port": sftp["port"], "running": bool(sftp.get("running")),
            "known_hosts": ssh.known_hosts_line(host=host_name, port=sftp["port"], host_key=str(sftp["host_key"]))}
