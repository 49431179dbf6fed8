"""`gpubook free`: which GPUs are free, now and in the coming days, and the next slots that fit a
request; `--ics` prints the availability calendar the page serves at /free.ics (no names).

This module is the admin's fallback with no daemon running: read from the calendars as `gpubook
bookings` reads them then (calendars.plan_window: no running bookings, no earned priority). With a
daemon running, every account asks it instead (commands/ask.py), and the answer is what the daemon
decided; the table's words (`free_text`, `moment`) are shared."""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime, timedelta, tzinfo
from typing import Any
from zoneinfo import ZoneInfo

from gpubook.runtime.errors import GpubookError
from gpubook.scheduler import calendars, config
from gpubook.scheduler.core import free, policy
from gpubook.scheduler.core.plan import LOCAL
from gpubook.scheduler.hosts.backend import topology_of
from gpubook.scheduler.outbox import free_feed

SPANS_SHOWN = 4  # free stretches per GPU in the table


def run(config_path: str, *, gpus: int, hours: float, model: str = "", days: float = 7.0, ics: bool = False,
        start: datetime | None = None, as_json: bool = False) -> int:
    """`start`: the free time from then on (`--from`; None: now)."""
    loaded = config.load(config_path)
    if gpus < 1 or hours <= 0 or days <= 0:
        raise GpubookError("--gpus must be 1 or more, and --hours and --days more than 0")
    now = datetime.now(UTC).replace(microsecond=0)
    try:
        asked = free.window(start, days=days, now=now, reach_ahead=policy.reach_ahead(loaded))
    except free.Beyond as error:
        raise GpubookError(str(error)) from None
    start, horizon = asked.start, asked.end
    result = calendars.plan_window(loaded, window_start=now, window_end=horizon, now=now,
                                   topology=topology_of(loaded))
    indices = calendars.inventory_indices(result.inventory)
    models = {gpu.index: gpu.name or "" for gpu in result.inventory.gpus}
    blocks = [b for b in free.blocks(result.plan.accepted) if b.end > start and b.start < horizon]
    name = ""
    if model:
        per_model = free_feed.model_gpus(models)
        if model not in per_model:
            known = ", ".join(sorted(per_model)) or "none (NVML names no GPU model here)"
            raise GpubookError(f"there is no GPU model {model!r} on {loaded.host.name} (models: {known})")
        indices = per_model[model]
        blocks = free_feed.only_gpus(blocks, indices)
        name = next(models[index] for index in indices)
    if ics:
        sys.stdout.write(free_feed.feed(blocks, host_name=loaded.host.name, viewer=None, now=now,
                                        model=name).decode())
        return 0
    lanes = free.lanes(blocks)
    request = free.Request(among={LOCAL: indices}, count=gpus, duration=timedelta(hours=hours))
    slots = free.next_slots(lanes, request, after=start, horizon=horizon, limit=3) if len(indices) >= gpus else []
    zone = ZoneInfo(loaded.host.timezone)
    if as_json:
        json.dump(_as_json(lanes.get(LOCAL, {}), indices, models=models, slots=slots, now=now, start=start,
                           horizon=horizon) | ({"capped": asked.capped} if asked.capped else {}), sys.stdout, indent=2)
        print()
        return 0
    print("\n".join(_table(lanes.get(LOCAL, {}), indices, models=models, zone=zone, now=now, start=start,
                           horizon=horizon, host=loaded.host.name)))
    what = f"{gpus} GPU{'' if gpus == 1 else 's'} for {hours:g} h"
    print(f"Next slots for {what}: " + (free.describe(slots, zone=zone, now=now) if slots
                                        else f"none until {moment(horizon, zone=zone, now=now)}"))
    if asked.capped:
        print(f"({asked.capped})")
    return 0


def _table(lanes: Mapping[int, free.Lane], indices: Sequence[int], *, models: Mapping[int, str], zone: tzinfo,
           now: datetime, start: datetime, horizon: datetime, host: str) -> list[str]:
    lines = [f"Free GPUs of {host}{since(start, zone=zone, now=now)}, times in {zone} (bookings read until "
             f"{moment(horizon, zone=zone, now=now)}):"]
    if not indices:
        return [*lines, "  no GPU (NVML lists none, and the config sets no [gpus] count)"]
    width = max((len(models.get(index, "")) for index in indices), default=0)
    for index in indices:
        spans = free.free_spans(lanes.get(index), start=start, end=horizon)
        model = f" {models.get(index, ''):<{width}}" if width else ""
        lines.append(f"  GPU {index}{model}  " + free_text(spans, zone=zone, now=now, horizon=horizon, start=start))
    return [line.rstrip() for line in lines]


def since(start: datetime, *, zone: tzinfo, now: datetime) -> str:
    """The table's heading for a window from `--from` ("": from now)."""
    return "" if start <= now else f" from {moment(start, zone=zone, now=now)}"


def free_text(spans: Sequence[tuple[datetime, datetime]], *, zone: tzinfo, now: datetime,
              horizon: datetime, start: datetime | None = None) -> str:
    """"free now → tomorrow 09:00; tomorrow 17:00 → Sat 28 Nov 07:00; from Sat 28 Nov 11:00" (from
    `start`, `--from`'s, else now)."""
    start = start or now
    at = "now" if start == now else moment(start, zone=zone, now=now)
    if not spans:
        return "busy throughout"
    if spans[0] == (start, horizon):
        return f"free {'now' if start == now else 'from ' + at}, nothing booked"
    shown = "; ".join(_span(begin, end, zone=zone, now=now, horizon=horizon) for begin, end in spans[:SPANS_SHOWN])
    more = f" (+{len(spans) - SPANS_SHOWN} more)" if len(spans) > SPANS_SHOWN else ""
    return ("free " if spans[0][0] == start else f"busy {'now' if start == now else 'at ' + at}; free ") + shown + more


def _span(start: datetime, end: datetime, *, zone: tzinfo, now: datetime, horizon: datetime) -> str:
    begin = "now" if start == now else moment(start, zone=zone, now=now)
    if end >= horizon:
        return f"from {begin}"
    return f"{begin} → {moment(end, zone=zone, now=now)}"


def moment(moment: datetime, *, zone: tzinfo, now: datetime) -> str:
    return f"{free.day(moment, zone=zone, now=now)} {moment.astimezone(zone):%H:%M}"


def _as_json(lanes: Mapping[int, free.Lane], indices: Sequence[int], *, models: Mapping[int, str],
             slots: Sequence[free.Slot], now: datetime, start: datetime, horizon: datetime) -> dict[str, Any]:
    return {
        "now": now.isoformat(), "from": start.isoformat(), "until": horizon.isoformat(),
        "gpus": [{"gpu": index, "model": models.get(index) or None,
                  "free": [{"start": begin.isoformat(), "end": end.isoformat()}
                           for begin, end in free.free_spans(lanes.get(index), start=start, end=horizon)]}
                 for index in indices],
        "slots": [{"start": slot.start.isoformat(), "end": slot.end.isoformat() if slot.end else None,
                   "gpus": list(slot.placement[0][1])} for slot in slots],
    }
