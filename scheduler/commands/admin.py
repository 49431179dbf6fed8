"""`gpubook run`, `status`, `stop` and `log`: the daemon in the foreground, and what an admin asks of it.

status, stop and log never talk to a running daemon: they read the engine's containers (the truth
for what runs), the State database and the status file the daemon rewrites after each pass.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

from runtime import gpus as gpu_inventory
from runtime.engines import container_name
from runtime.errors import GpubookError
from scheduler import config as config_module
from scheduler.daemon import STATUS_FILE, WINDOW_AHEAD, Daemon, make_engine, state_dir
from scheduler.state import State

log = logging.getLogger(__name__)


def run(config_path: str) -> int:
    """The daemon in the foreground; logs go to stderr (journald adds the time under systemd)."""
    root = logging.getLogger()
    if not root.handlers:
        logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")
    root.setLevel(logging.INFO)
    logging.getLogger("apscheduler").setLevel(logging.ERROR)  # "skipped: already running" is expected
    return Daemon(config_module.load(config_path)).run()


def status(config_path: str, *, as_json: bool = False) -> int:
    config = config_module.load(config_path)
    folder = state_dir(config)
    engine = make_engine(config)
    containers = engine.list()
    daemon_status = {}
    status_path = folder / STATUS_FILE
    if status_path.is_file():
        daemon_status = json.loads(status_path.read_text())
    inventory = gpu_inventory.inventory(static_count=config.gpu_count)
    with State(folder / "state.sqlite") as state:
        ports = state.ports()
        problems = [e for e in state.events(limit=None) if e.level in ("warning", "error")][-5:]
    report = {
        "gpus": {"source": inventory.source, "count": inventory.count, "driver": inventory.driver_version,
                 "note": None if inventory.source == "nvml" else gpu_inventory.no_gpu_line(inventory)},
        "running": [{"booking": c.booking_id, "user": c.user, "gpus": list(c.gpus), "state": c.state,
                     "port": c.port or ports.get(c.booking_id), "end": c.end.isoformat() if c.end else None,
                     "container": c.name} for c in containers],
        "next": daemon_status.get("next", []),
        "last_poll": daemon_status.get("last_poll"),
        "last_poll_ok": daemon_status.get("last_poll_ok"),
        "outage": daemon_status.get("outage"),
        "problems": daemon_status.get("problems", []),
        "recent_warnings": [f"{e.at.isoformat()} {e.booking_id or '-'}: {e.message}" for e in problems],
    }
    if as_json:
        json.dump(report, sys.stdout, indent=2)
        print()
        return 0
    zone = ZoneInfo(config.host.timezone)

    def local(text: str | None) -> str:
        return datetime.fromisoformat(text).astimezone(zone).strftime("%Y-%m-%d %H:%M:%S") if text else "-"

    gpus = report["gpus"]
    print(f"GPUs: {gpus['count']} ({gpus['source']}" + (f", driver {gpus['driver']})" if gpus["driver"] else ")"))
    if gpus["note"]:
        print(f"  {gpus['note']}")
    print(f"Running ({len(report['running'])}):")
    for item in report["running"]:
        print(f"  {item['booking']:<40} {item['user']:<10} GPU {','.join(map(str, item['gpus'])) or '-':<5} "
              f"port {item['port']}  until {local(item['end'])}  [{item['state']}]")
    print(f"Next ({len(report['next'])}):")
    for item in report["next"]:
        print(f"  {item['id']:<40} {item['user']:<10} GPU {','.join(map(str, item['gpus'])):<5} "
              f"{local(item['start'])} → {local(item['end'])}")
    print(f"Last poll: {local(report['last_poll'])} (last successful: {local(report['last_poll_ok'])})")
    if report["outage"]:
        print(f"Calendar unreachable: {report['outage']}")
    if report["problems"]:
        print("Problems:")
        for line in report["problems"]:
            print(f"  {line}")
    return 0


def stop(config_path: str, booking: str) -> int:
    """Stop a booking's container now; it is not started again; the event says "ended"."""
    config = config_module.load(config_path)
    daemon = Daemon(config)
    now = datetime.now(UTC)
    matches = [c for c in daemon.engine.list() if booking in (c.booking_id, c.name)]
    if not matches:
        raise GpubookError(f"no running container for booking {booking!r} (see gpubook status)")
    info = matches[0]
    daemon.reconciler.stop_now(info.booking_id, now=now)
    print(f"stopped {container_name(info.booking_id)} (booking {info.booking_id})")
    try:
        snapshots = daemon.calendars.poll()
        occurrences, _ = daemon.calendars.occurrences(
            snapshots, window_start=now - timedelta(hours=config.defaults.max_hours), window_end=now + WINDOW_AHEAD)
        etags = {href: obj.etag for snap in snapshots.values() for href, obj in snap.objects.items()}
        plan = daemon.reconciler.plan([o for o in occurrences if o.id == info.booking_id], [], now=now)
        daemon.reconciler.write_back(plan, now=now, etags=etags)
    except GpubookError as error:
        print(f"gpubook: the calendar was not updated ({error}); the daemon writes it on its next pass",
              file=sys.stderr)
    finally:
        daemon.reconciler.close()
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
    print(f"{when} {entry.level:<7} {entry.booking_id or '-'}: {entry.message}", flush=True)
