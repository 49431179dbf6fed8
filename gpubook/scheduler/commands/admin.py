"""`gpubook run`, `status`, `stop` and `log`: the daemon in the foreground, and what an admin asks of it.

status, stop and log never talk to a running daemon: they read the engine's containers (the truth
for what runs), the State database and the status file the daemon rewrites after each pass.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from dataclasses import replace
from datetime import UTC, datetime
from zoneinfo import ZoneInfo

from gpubook.runtime import gpus as gpu_inventory
from gpubook.runtime.engines import container_name
from gpubook.runtime.errors import GpubookError
from gpubook.scheduler import config as config_module
from gpubook.scheduler.apply.passes import World
from gpubook.scheduler.core.plan import LOCAL
from gpubook.scheduler.daemon import STATUS_FILE, Daemon, make_engine, state_dir
from gpubook.scheduler.outbox.status import GpuSummary, HostStatus, Status, setup_findings
from gpubook.scheduler.sources.errors import printable
from gpubook.scheduler.state import State

log = logging.getLogger(__name__)


def run(config_path: str) -> int:
    """The daemon in the foreground; logs go to stderr (journald adds the time under systemd)."""
    root = logging.getLogger()
    if not root.handlers:
        logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")
    root.setLevel(logging.INFO)
    logging.getLogger("apscheduler").setLevel(logging.ERROR)  # "skipped: already running" is expected
    return Daemon(config_module.load(config_path), exclusive=True).run()


def status(config_path: str, *, as_json: bool = False) -> int:
    config = config_module.load(config_path)
    folder = state_dir(config)
    engine = make_engine(config)
    containers = [replace(info, host=LOCAL) for info in engine.list()] if config.backend.kind == "local" else []
    status_path = folder / STATUS_FILE
    if status_path.is_file():
        report = Status.from_json(json.loads(status_path.read_text()))
    else:  # the daemon has not run a pass yet: this host's GPUs, nothing planned
        summary = GpuSummary.of(gpu_inventory.inventory(static_count=config.gpu_count))
        report = Status(hosts=(HostStatus(name=LOCAL, gpus=summary),))
    with State(folder / "state.sqlite") as state:
        if config.backend.kind == "local":  # a cluster's nodes: as the daemon's last pass listed them
            report = report.with_containers(containers, ports=state.ports())
        problems = [e for e in state.events(limit=None) if e.level in ("warning", "error")][-5:]
    report = replace(report, findings=setup_findings(config.engine), recent_warnings=tuple(
        printable(f"{e.at.isoformat()} {e.booking_id or '-'}: {e.message}") for e in problems))
    limits = getattr(engine, "limits_problem", lambda: None)()  # an engine may enforce everything
    if limits is not None:
        report = replace(report, problems=(*report.problems, f"resource limits: {limits}"))
    if as_json:
        json.dump(report.to_json(), sys.stdout, indent=2)
        print()
        return 0
    print("\n".join(report.render(config.host.timezone)))
    return 0


def stop(config_path: str, booking: str) -> int:
    """Stop a booking's container now; it is not started again; the event says "ended"."""
    config = config_module.load(config_path)
    daemon = Daemon(config)
    now = datetime.now(UTC)
    if daemon.cluster is not None:  # a cluster's bookings: its nodes' jobs, read as a pass reads them
        if problem := daemon.passes.refresh_cluster():
            raise GpubookError(problem)
        listed = [c for host in daemon.passes.hosts.values() for c in host.list()]
    else:
        listed = daemon.engine.list()
    matches = [c for c in listed if booking in (c.booking_id, c.name)]
    if not matches:
        raise GpubookError(f"no running container for booking {booking!r} (see gpubook status)")
    info = matches[0]
    daemon.passes.stop_now(info.booking_id, now=now)
    print(f"stopped {container_name(info.booking_id)} (booking {info.booking_id})")
    try:
        reading = daemon.calendars.read(now=now)
        if daemon.cluster is not None:  # the job cancelled: its nodes read again
            daemon.passes.refresh_cluster()
        plan = daemon.passes.plan([o for o in reading.occurrences if o.id == info.booking_id], [], now=now)
        world = World.read(list(daemon.passes.hosts.values()), daemon.state)
        daemon.passes.write_back(plan, world, now=now, etags=reading.etags)
    except GpubookError as error:
        print(f"gpubook: the calendar was not updated ({error}); the daemon writes it on its next pass",
              file=sys.stderr)
    finally:
        daemon.passes.close()
        daemon.state.close()
    return 0


def show_log(config_path: str, *, follow: bool = False, booking: str | None = None, last: int = 50) -> int:
    config = config_module.load(config_path)
    zone = ZoneInfo(config.host.timezone)
    with State(state_dir(config) / "state.sqlite") as state:
        entries = state.events(booking_id=booking)
        entries = entries[-last:] if last else entries
        after = entries[-1].id if entries else 0
        for entry in entries:
            _print_entry(entry, zone)
        while follow:
            time.sleep(1.0)
            for entry in state.events(after_id=after, booking_id=booking):
                _print_entry(entry, zone)
                after = entry.id
    return 0


def _print_entry(entry, zone: ZoneInfo) -> None:  # type: ignore[no-untyped-def]
    when = entry.at.astimezone(zone).strftime("%Y-%m-%d %H:%M:%S")
    print(printable(f"{when} {entry.level:<7} {entry.booking_id or '-'}: {entry.message}"), flush=True)
