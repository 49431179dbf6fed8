"""One status model, per host: its GPUs, the bookings running (with ports and ends), the next
bookings, the last poll and the problems. The daemon builds it after each pass and writes it as
`daemon-status.json` and as its sd_notify STATUS line; `gpubook status` reads that file, adds what
runs now (the engine is the truth) and prints it; a web page or metrics read the same model.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime
from typing import Any
from zoneinfo import ZoneInfo

from gpubook.runtime.engines import HOST_NETWORK_RISK, ContainerInfo, EngineSettings
from gpubook.runtime.nvidia import gpus as gpu_inventory
from gpubook.scheduler import clock
from gpubook.scheduler.core.plan import LOCAL, Plan
from gpubook.scheduler.outbox.foreign import status_lines as foreign_lines
from gpubook.scheduler.outbox.timeline import (
    GpuTimeline,
    RejectedBooking,
    gpu_timelines,
    gpus_of,
    kept_title,
    short_title,
)
from gpubook.scheduler.sources.errors import printable
from gpubook.scheduler.state.records import ContainerRecord

NEXT_SHOWN = 20  # upcoming bookings kept per host


@dataclass(frozen=True)
class GpuSummary:
    source: str  # "nvml", "config" ([gpus] count) or "none"
    count: int
    driver: str | None = None
    note: str | None = None  # why there is no live GPU data, one line
    indices: tuple[int, ...] = ()  # the GPUs' indices (empty: 0 to count - 1)

    @classmethod
    def of(cls, inventory: gpu_inventory.Inventory) -> GpuSummary:
        return cls(source=inventory.source, count=inventory.count, driver=inventory.driver_version,
                   note=None if inventory.source == "nvml" else gpu_inventory.no_gpu_line(inventory),
                   indices=tuple(gpu.index for gpu in inventory.gpus))

    @property
    def gpu_indices(self) -> tuple[int, ...]:
        return self.indices or tuple(range(self.count))


@dataclass(frozen=True)
class RunningBooking:
    booking: str
    user: str
    gpus: tuple[int, ...]
    state: str
    port: int | None
    end: str | None  # ISO 8601
    container: str
    template: str = ""
    start: str | None = None  # ISO 8601: its booking's start
    title: str = ""  # the event's SUMMARY (timeline.kept_title); "" where unknown


@dataclass(frozen=True)
class NextBooking:
    id: str
    user: str
    gpus: tuple[int, ...]
    start: str  # ISO 8601
    end: str
    title: str = ""


@dataclass(frozen=True)
class HostStatus:
    name: str
    gpus: GpuSummary
    running: tuple[RunningBooking, ...] = ()
    next: tuple[NextBooking, ...] = ()
    timeline: tuple[GpuTimeline, ...] = ()  # each GPU's week back and week ahead (outbox/timeline.py)


@dataclass(frozen=True)
class Status:
    hosts: tuple[HostStatus, ...]
    updated: str | None = None
    pid: int | None = None
    last_poll: str | None = None
    last_poll_ok: str | None = None
    outage: str | None = None
    outage_since: str | None = None
    problems: tuple[str, ...] = ()
    recent_warnings: tuple[str, ...] = ()
    findings: tuple[str, ...] = ()  # how the site is set up that weakens tenants' isolation (setup_findings)
    counts: Mapping[str, int] = field(default_factory=dict)  # "now", "upcoming", "rejected" at the last pass
    sftp: Mapping[str, Any] | None = None  # the SFTP service (hosts/sftp.py SftpStatus.to_json); None: off
    images: Mapping[str, Any] | None = None  # images prepared ahead (hosts/images.py ImagePreparer.snapshot)
    rejected: tuple[RejectedBooking, ...] = ()  # refused bookings with their reasons (outbox/timeline.py)
    foreign: tuple[Mapping[str, Any], ...] = ()  # processes on GPUs outside bookings (outbox/foreign.py)
    engine: str | None = None  # the engine and its mode ("udocker R1, the host's runc ..."): `gpubook status` sets it

    @property
    def main(self) -> HostStatus:
        """The local host (the single-host view that `gpus`, `running` and `next` show at the top level)."""
        return next((h for h in self.hosts if h.name == LOCAL), self.hosts[0])

    def line(self) -> str:
        """The one-line summary: systemd's STATUS, the first line of `gpubook status`."""
        if not self.last_poll:
            return "no poll yet"
        text = (f"{self.counts.get('now', 0)} booking(s) now, {self.counts.get('upcoming', 0)} upcoming, "
                f"{self.counts.get('rejected', 0)} rejected; last poll {_clock(self.last_poll)}")
        if self.outage:
            text += f"; calendar unreachable since {_clock(self.outage_since)}"
        return text

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        main = asdict(self.main)
        data.update(status=self.line(), gpus=main["gpus"], running=main["running"], next=main["next"])
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Status:
        hosts = tuple(HostStatus(name=h["name"], gpus=GpuSummary(**{**h["gpus"], "indices": tuple(
                                     h["gpus"].get("indices", ()))}),
                                 running=tuple(RunningBooking(**{**r, "gpus": tuple(r["gpus"])}) for r in h["running"]),
                                 next=tuple(NextBooking(**{**n, "gpus": tuple(n["gpus"])}) for n in h["next"]),
                                 timeline=tuple(GpuTimeline.from_json(t) for t in h.get("timeline", ())))
                      for h in data.get("hosts", ()))
        known = {k: data.get(k) for k in ("updated", "pid", "last_poll", "last_poll_ok", "outage", "outage_since")}
        return cls(hosts=hosts, problems=tuple(data.get("problems", ())), findings=tuple(data.get("findings", ())),
                   recent_warnings=tuple(data.get("recent_warnings", ())), counts=data.get("counts", {}),
                   sftp=data.get("sftp"), images=data.get("images"),
                   rejected=tuple(RejectedBooking(**r) for r in data.get("rejected", ())),
                   foreign=tuple(data.get("foreign", ())), engine=data.get("engine"), **known)

    def with_containers(self, containers: Iterable[ContainerInfo], *, ports: Mapping[str, int]) -> Status:
        """The same status with what runs now, as the engine lists it (ports from State where a label lacks one)."""
        by_host = _by_host(containers, ports=ports, titles=self.titles())
        return replace(self, hosts=tuple(replace(h, running=by_host.get(h.name, ())) for h in self.hosts))

    def titles(self) -> dict[str, str]:
        """Booking id → its title, as the daemon's last pass knew them (the engine knows none)."""
        known: dict[str, str] = {}
        for host in self.hosts:
            for lane in host.timeline:
                known.update((s.booking, s.title) for s in lane.segments if s.title)
            known.update((n.id, n.title) for n in host.next if n.title)
            known.update((r.booking, r.title) for r in host.running if r.title)
        return known

    def projects(self) -> dict[str, str]:
        """Booking id → its project, as the daemon's last pass knew them (an ended booking keeps its own)."""
        return {s.booking: s.project for host in self.hosts for lane in host.timeline for s in lane.segments
                if s.project}

    def render(self, timezone: str) -> list[str]:
        zone = ZoneInfo(timezone)

        def local(text: str | None) -> str:
            return datetime.fromisoformat(text).astimezone(zone).strftime("%Y-%m-%d %H:%M:%S") if text else "-"

        lines = []
        for host in self.hosts:
            gpus = host.gpus
            title = "GPUs" if len(self.hosts) == 1 else f"Host {host.name}: GPUs"
            lines.append(f"{title}: {gpus.count} ({gpus.source}" + (f", driver {gpus.driver})" if gpus.driver else ")"))
            if gpus.note:
                lines.append(f"  {gpus.note}")
            lines.append(f"Running ({len(host.running)}):")
            for item in host.running:
                lines.append(f"  {_named(item.title, item.booking):<40} {item.user:<10} "
                             f"GPU {','.join(map(str, item.gpus)) or '-':<5} "
                             f"port {item.port}  until {local(item.end)}  [{item.state}]"
                             f"{_id(item.title, item.booking)}")
            lines.append(f"Next ({len(host.next)}):")
            for upcoming in host.next:
                lines.append(f"  {_named(upcoming.title, upcoming.id):<40} {upcoming.user:<10} "
                             f"GPU {','.join(map(str, upcoming.gpus)):<5} "
                             f"{local(upcoming.start)} → {local(upcoming.end)}{_id(upcoming.title, upcoming.id)}")
        lines.append(f"Last poll: {local(self.last_poll)} (last successful: {local(self.last_poll_ok)})")
        if self.engine:
            lines.append(f"Engine: {self.engine}")
        if self.outage:
            lines.append(f"Calendar unreachable: {self.outage}")
        lines.extend(sftp_lines(self.sftp))
        lines.extend(image_lines(self.images))
        lines.extend(foreign_lines(self.foreign, timezone=timezone))
        if self.findings:
            lines.append("Findings:")
            lines.extend(f"  {line}" for line in self.findings)
        if self.problems:
            lines.append("Problems:")
            lines.extend(f"  {line}" for line in self.problems)
        return lines


def sftp_lines(sftp: Mapping[str, Any] | None) -> list[str]:
    """The SFTP service and each user's space (against their quota)."""
    if sftp is None:
        return []
    state = "running" if sftp.get("running") else "NOT running"
    head = f"SFTP: {state} on {sftp.get('listen')}:{sftp.get('port')}"
    if sftp.get("restarts"):
        head += f" (started again {sftp['restarts']} time(s))"
    lines = [head]
    if sftp.get("problem"):
        lines.append(f"  problem: {sftp['problem']}")
    if sftp.get("host_key"):
        lines.append(f"  host key: {sftp['host_key']}")
    for name, usage in (sftp.get("usage") or {}).items():
        quota = usage.get("quota")
        used = f"{usage.get('bytes', 0) / 1e9:.2f} GB" + (f" of {quota / 1e9:g} GB" if quota else "")
        if "files" in usage:
            files = usage.get("quota_files")
            used += f", {usage['files']} files" + (f" of {files}" if files else "")
        if usage.get("complete") is False:
            used = f"at least {used} (not measured to the end)"
        lines.append(f"  {name:<16} {used}" + ("  OVER QUOTA: uploads refused" if usage.get("over") else ""))
    lines.extend(f"  left out: {line}" for line in sftp.get("left_out") or ())
    return lines


def image_lines(images: Mapping[str, Any] | None, *, sizes: bool = False) -> list[str]:
    """The images prepared ahead: each template's state, for which bookings; the engine's free space."""
    if not images or not images.get("preparations"):
        return []
    free, floor = images.get("free_bytes"), images.get("min_free_bytes") or 0
    head = "Images prepared ahead:"
    if free is not None:
        head += f" {free / 1e9:.1f} GB free in {images.get('storage')}" + (
            f" (cleaned under {floor / 1e9:g} GB)" if floor else "")
    lines = [head]
    for item in images["preparations"]:
        state = item["state"] + (f": {item['why']}: {item['detail']}" if item["state"] == "failed" else "")
        if item.get("sentence"):  # being made: how far, ready about when
            state = item["sentence"].split(": ", 1)[-1]
        size = f" {item['size'] / 1e9:.2f} GB" if sizes and item.get("size") else ""
        bookings = ", ".join(item.get("bookings") or ()) or "no booking now"
        lines.append(f"  {item['template']:<18} {item['run_image']}{size}  [{state}]  for {bookings}")
        if sizes and item["state"] == "ready" and item.get("detail"):
            lines.append(f"    {item['detail']}")
    return lines


def engine_line(engine: Any) -> str:
    """The engine's name and, where it says one, its mode (udocker: R1 with the host's runc)."""
    mode_line = getattr(engine, "mode_line", None)
    return mode_line() if callable(mode_line) else str(engine.name)


def setup_findings(engine: EngineSettings) -> tuple[str, ...]:
    """What the admin chose that weakens the walls between tenants, one sentence each."""
    if engine.network == "host":
        return (f'[engine] network = "host": {HOST_NETWORK_RISK}',)
    return ()


def _named(title: str, booking_id: str) -> str:
    """A booking in a terminal row: its title, shortened and escaped; its id where it has none."""
    return short_title(title) if title.strip() else printable(booking_id)


def _id(title: str, booking_id: str) -> str:
    """The id at the row's end, where a title leads it: what `gpubook stop` and `log` take (a UID
    may be a 40-character hash, so it goes last, not first)."""
    return f"  {printable(booking_id)}" if title.strip() else ""


def running_booking(info: ContainerInfo, *, ports: Mapping[str, int], title: str = "") -> RunningBooking:
    """A container as `gpubook status` shows it; one run ahead of its booking's start says "armed"
    (its SSH opens only at that start), never "running"."""
    state = info.state
    if info.running and info.start is not None and info.start > clock.now():
        state = f"armed: SSH opens at {info.start.astimezone(UTC):%H:%M:%S} UTC"
    return RunningBooking(booking=info.booking_id, user=info.user, gpus=info.gpus, state=state,
                          port=info.port or ports.get(info.booking_id),
                          end=info.end.isoformat() if info.end else None, container=info.name,
                          template=info.template, start=info.start.isoformat() if info.start else None,
                          title=title)


def next_bookings(plan: Plan, *, now: datetime, host: str) -> tuple[NextBooking, ...]:
    upcoming = [a for a in plan.accepted if a.booking.start > now and a.host == host]
    return tuple(NextBooking(id=a.booking.id, user=a.booking.user, gpus=a.gpus, start=a.booking.start.isoformat(),
                             end=a.booking.end.isoformat(), title=kept_title(a.booking.summary))
                 for a in upcoming[:NEXT_SHOWN])


def counts(plan: Plan, *, now: datetime) -> dict[str, int]:
    return {"now": sum(1 for a in plan.accepted if a.booking.start <= now < a.booking.end),
            "upcoming": sum(1 for a in plan.accepted if a.booking.start > now),
            "rejected": len(plan.rejected)}


def _clock(text: str | None) -> str:
    return datetime.fromisoformat(text).strftime("%H:%M:%S") if text else "-"


def iso(moment: datetime | None) -> str | None:
    return moment.isoformat() if moment else None


def hosts_status(summaries: Mapping[str, GpuSummary], *, plan: Plan, now: datetime,
                 containers: Sequence[ContainerInfo] = (), ports: Mapping[str, int] | None = None,
                 held: Mapping[str, str] | None = None, records: Sequence[ContainerRecord] = (),
                 previous: Status | None = None) -> tuple[HostStatus, ...]:
    """Each host's status from its GPUs, the plan (next bookings, timelines) and the containers
    running there; `held`, `records` and `previous` as `timeline.gpu_timelines` takes them (the
    previous status's timelines keep placing bookings that ended and left the calendar window)."""
    titles = {a.booking.id: kept_title(a.booking.summary) for a in plan.accepted}
    projects = {a.booking.id: a.booking.project for a in plan.accepted if a.booking.project is not None}
    if previous is not None:  # a booking gone from the calendar keeps the title and project it had
        titles = previous.titles() | titles
        projects = previous.projects() | projects
    running = _by_host([info for info in containers if info.running], ports=ports or {}, titles=titles)
    before = {h.name: gpus_of(h.timeline) for h in previous.hosts} if previous is not None else {}
    return tuple(HostStatus(name=name, gpus=gpus, running=running.get(name, ()),
                            next=next_bookings(plan, now=now, host=name),
                            timeline=gpu_timelines(plan, host=name, gpus=gpus.gpu_indices, now=now,
                                                   containers=containers, held=held, records=records,
                                                   known_gpus=before.get(name), titles=titles,
                                                   projects=projects))
                 for name, gpus in summaries.items())


def _by_host(containers: Iterable[ContainerInfo], *, ports: Mapping[str, int], titles: Mapping[str, str]
             ) -> dict[str, tuple[RunningBooking, ...]]:
    grouped: dict[str, list[RunningBooking]] = {}
    for info in containers:
        grouped.setdefault(info.host or LOCAL, []).append(
            running_booking(info, ports=ports, title=titles.get(info.booking_id, "")))
    return {host: tuple(bookings) for host, bookings in grouped.items()}
