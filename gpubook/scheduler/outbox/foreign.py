"""How a process seen on a GPU outside its booking's container ("foreign") reads: in the booking's
event, in `gpubook status` and its JSON, from State's rows (gpubook/scheduler/state/foreign.py)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any
from zoneinfo import ZoneInfo

from gpubook.scheduler.state import ForeignRow
from gpubook.scheduler.state.foreign import CANNOT, DUE, SPARED, STOPPED

EVENT_LINES = 5  # sightings told in one event, the newest; more are in `gpubook log`


def who(row: ForeignRow) -> str:
    """The process; a row that stood for several processes of its user on its GPU names the last
    and counts the others."""
    more = f" and {row.repeats} earlier process{'' if row.repeats == 1 else 'es'} of {row.user}" if row.repeats else ""
    return f"pid {row.pid} ({row.command}, {row.user}){more}"


def action_text(action: str, *, timezone: str) -> str:
    """What gpubook did or will do, as a clause: "gpubook stops it at 14:10"."""
    if action.startswith(DUE):
        return f"gpubook stops it at {_clock(datetime.fromisoformat(action[len(DUE):]), timezone)} unless it ends"
    if action.startswith(STOPPED):
        return f"gpubook stopped it at {_clock(datetime.fromisoformat(action[len(STOPPED):]), timezone)}"
    if action.startswith(CANNOT):
        return f"gpubook cannot stop it: {action[len(CANNOT):]}"
    if action.startswith(SPARED):
        return f"not stopped: {action[len(SPARED):]}"
    return ""


def event_line(row: ForeignRow, *, timezone: str) -> str:
    """"foreign: GPU 0 is also used by pid 4242 (python3, carol) since 14:05; not this booking's"."""
    since = _clock(row.first_seen, timezone)
    if row.gone_at is None:
        text = f"foreign: GPU {row.gpu} is also used by {who(row)} since {since}; not this booking's"
    else:
        text = (f"foreign: GPU {row.gpu} was also used by {who(row)} from {since} to "
                f"{_clock(row.gone_at, timezone)}; not this booking's")
    if row.container:
        text += f" (it runs in container {row.container})"
    action = action_text(row.action, timezone=timezone)
    return f"{text}; {action}" if action else text


def event_lines(rows: Sequence[ForeignRow], *, timezone: str) -> dict[str, list[str]]:
    """booking id → its event's foreign lines (the newest EVENT_LINES sightings on its GPUs)."""
    lines: dict[str, list[str]] = {}
    for row in rows:
        if row.booking_id is not None:
            lines.setdefault(row.booking_id, []).append(event_line(row, timezone=timezone))
    return {booking: found[-EVENT_LINES:] for booking, found in lines.items()}


def status_items(rows: Sequence[ForeignRow]) -> tuple[dict[str, Any], ...]:
    """The sightings still there, for the status file (and its readers: `gpubook status`, metrics)."""
    return tuple({"host": r.host, "gpu": r.gpu, "pid": r.pid, "user": r.user, "command": r.command,
                  "booking": r.booking_id, "container": r.container, "since": r.first_seen.isoformat(),
                  "action": r.action} for r in rows if r.gone_at is None)


def status_lines(items: Sequence[Mapping[str, Any]], *, timezone: str) -> list[str]:
    if not items:
        return []
    lines = [f"Foreign processes on GPUs ({len(items)}):"]
    for item in items:
        whose = f"booking {item['booking']}" if item.get("booking") else "not booked"
        since = _clock(datetime.fromisoformat(item["since"]), timezone)
        line = (f"  GPU {item['gpu']} ({whose}): pid {item['pid']} ({item['command']}, {item['user']}) "
                f"since {since}")
        if item.get("container"):
            line += f", in container {item['container']}"
        action = action_text(item.get("action") or "", timezone=timezone)
        lines.append(f"{line}; {action}" if action else line)
    return lines


def _clock(moment: datetime, timezone: str) -> str:
    return moment.astimezone(ZoneInfo(timezone)).strftime("%H:%M")
