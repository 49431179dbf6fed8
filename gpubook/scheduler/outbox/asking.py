"""What the daemon answers `gpubook free`, `gpubook bookings` and `gpubook mine`: views of its last
`Status`, the model the page and the free feed read (outbox/status.py), so that every view shows
what the daemon decided: running bookings, earned priority, the backend's hosts and GPUs.

One rule, the page's and the feed's (outbox/free_feed.py): an asker sees their own bookings by
name (id, title, template, state; their ssh line while one runs) and everyone else's only as busy
time (host, GPUs, start, end). Their own refusals come with the reason; nobody else's are shown.
`Viewer.everyone` (the admin reading the daemon's status file with its config) sees all.

Pure: plain data in, plain JSON-able data out; the socket (outbox/ask_socket.py) and the
commands (commands/ask.py) carry and print it.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from gpubook.scheduler.core import free
from gpubook.scheduler.core.plan import LOCAL
from gpubook.scheduler.outbox import free_feed
from gpubook.scheduler.outbox.status import Status

KINDS = ("free", "bookings", "mine")
MAX_GPUS = 1024
MAX_DAYS = 366.0
MAX_SLOTS = 3
OWN_KINDS = ("booked", "running", "held", "ended")  # segments an asker sees of their own bookings


class AskError(ValueError):
    """A request the daemon does not answer, with the sentence it answers instead."""


@dataclass(frozen=True)
class Viewer:
    """Who asks: the gpubook users their host login is (empty: none), or everyone (the admin)."""

    users: frozenset[str] = frozenset()
    login: str = ""
    everyone: bool = False

    def owns(self, user: str) -> bool:
        return self.everyone or user in self.users

    def to_json(self) -> dict[str, Any]:
        return {"login": self.login, "users": sorted(self.users), "everyone": self.everyone}


def viewer_of(login: str | None, users: Mapping[str, Any]) -> Viewer:
    """The gpubook users a host login is (`[users.NAME] account`, default NAME): `users` maps each
    name to its UserConfig (anything with a `login`)."""
    if not login:
        return Viewer()
    return Viewer(users=frozenset(name for name, user in users.items() if user.login == login), login=login)


@dataclass(frozen=True)
class Context:
    """What the daemon adds to its status: its [host] name and time zone, how far ahead it reads
    (policy.reach_ahead), and each GPU's model (NVML's names, per host)."""

    host_name: str
    timezone: str
    reach_ahead: timedelta
    models: Mapping[str, Mapping[int, str]] = field(default_factory=dict)


def answer(status: Status | None, request: Mapping[str, Any], *, viewer: Viewer, context: Context,
           now: datetime) -> dict[str, Any]:
    """The answer to one request (a JSON object naming its `kind`); AskError for a bad request."""
    kind = request.get("kind")
    if kind not in KINDS:
        raise AskError(f"unknown request kind {str(kind)[:32]!r} (known: {', '.join(KINDS)})")
    if status is None or not status.hosts:
        raise AskError("the daemon has not finished its first pass yet; ask again in a minute")
    head = {"kind": kind, "host": context.host_name, "timezone": context.timezone, "now": now.isoformat(),
            "updated": status.updated, "viewer": viewer.to_json(), "outage": bool(status.outage)}
    if kind == "free":
        return head | free_view(status, request, context=context, now=now)
    if kind == "bookings":
        start, end = _window(request, now=now)
        return head | bookings_view(status, viewer=viewer, context=context, start=start, end=end, now=now)
    return head | mine_view(status, viewer=viewer, context=context, now=now)


def _number(request: Mapping[str, Any], key: str, default: float, *, low: float, high: float) -> float:
    value = request.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise AskError(f"{key} must be a number between {low:g} and {high:g}")
    return float(value)


def _moment(request: Mapping[str, Any], key: str) -> datetime | None:
    value = request.get(key)
    if value is None:
        return None
    try:
        moment = datetime.fromisoformat(str(value)[:64])
    except ValueError:
        raise AskError(f"{key} must be an ISO 8601 time") from None
    if moment.tzinfo is None:
        raise AskError(f"{key} must carry its UTC offset")
    return moment


def _window(request: Mapping[str, Any], *, now: datetime) -> tuple[datetime, datetime]:
    start = _moment(request, "from") or now
    end = _moment(request, "to") or start + timedelta(days=7)
    if end <= start:
        raise AskError(f"to ({end.isoformat()}) must be after from ({start.isoformat()})")
    return start, end


def _host_name(host: str, context: Context) -> str:
    return context.host_name if host == LOCAL else host


def segments(status: Status) -> list[dict[str, Any]]:
    """Each booking's segments of the status's timelines joined over its GPUs: one row per
    (host, booking, kind, start, end), with its GPUs."""
    joined: dict[tuple[str, str, str, str, str], dict[str, Any]] = {}
    for host in status.hosts:
        for lane in host.timeline:
            for segment in lane.segments:
                key = (host.name, segment.booking, segment.kind, segment.start, segment.end)
                row = joined.setdefault(key, {"host": host.name, "booking": segment.booking, "user": segment.user,
                                              "state": segment.kind, "start": segment.start, "end": segment.end,
                                              "template": segment.template, "title": segment.title,
                                              "note": segment.note, "project": segment.project, "gpus": []})
                row["gpus"].append(lane.gpu)
    rows = sorted(joined.values(), key=lambda r: (r["start"], r["host"], r["booking"]))
    for row in rows:
        row["gpus"] = sorted(row["gpus"])
    return rows


def _shown(row: Mapping[str, Any], *, viewer: Viewer, context: Context) -> dict[str, Any]:
    """A booking as this viewer may see it: their own in full, anyone else's as busy time only."""
    if viewer.owns(row["user"]):
        return {"own": True, "id": row["booking"], "user": row["user"], "title": row["title"],
                "template": row["template"], "state": row["state"], "note": row["note"],
                "host": _host_name(row["host"], context), "gpus": row["gpus"], "start": row["start"],
                "end": row["end"], "project": row.get("project") or None}
    return {"own": False, "state": "busy", "host": _host_name(row["host"], context), "gpus": row["gpus"],
            "start": row["start"], "end": row["end"]}


def _overlaps(row: Mapping[str, Any], start: datetime, end: datetime) -> bool:
    return datetime.fromisoformat(row["end"]) > start and datetime.fromisoformat(row["start"]) < end


def bookings_view(status: Status, *, viewer: Viewer, context: Context, start: datetime, end: datetime,
                  now: datetime) -> dict[str, Any]:
    """The plan of [start, end) as the daemon decided it: each booking that holds GPUs then (own by
    name, others as busy time), and the viewer's own refusals with their reasons."""
    rows = [r for r in segments(status) if r["state"] in free_feed.BUSY_KINDS and _overlaps(r, start, end)]
    rejected = [{"id": r.id, "user": r.user, "start": r.start, "end": r.end, "reason": r.reason,
                 **({"standby": True} if r.standby else {})}
                for r in status.rejected if viewer.owns(r.user)
                and _overlaps({"start": r.start, "end": r.end}, start, end)]
    return {"from": start.isoformat(), "to": end.isoformat(), "hosts": _hosts(status, context),
            "bookings": [_shown(r, viewer=viewer, context=context) for r in rows], "rejected": rejected}


def mine_view(status: Status, *, viewer: Viewer, context: Context, now: datetime) -> dict[str, Any]:
    """The viewer's own bookings only: running (with the ssh line), held, booked, ended in the
    last week, and refused (with why)."""
    if viewer.everyone:
        raise AskError("`gpubook mine` is a booker's view: ask it as the booker's own account")
    ports = {(host.name, r.booking): r.port for host in status.hosts for r in host.running}
    own = []
    for row in segments(status):
        if row["state"] not in OWN_KINDS or not viewer.owns(row["user"]):
            continue
        shown = _shown(row, viewer=viewer, context=context)
        port = ports.get((row["host"], row["booking"]))
        if row["state"] == "running" and port is not None:
            shown["ssh"] = f"ssh -p {port} {row['user']}@{shown['host']}"
        own.append(shown)
    rejected = [{"id": r.id, "user": r.user, "start": r.start, "end": r.end, "reason": r.reason,
                 **({"standby": True} if r.standby else {})}
                for r in status.rejected if viewer.owns(r.user)]
    return {"bookings": own, "rejected": rejected}


def _hosts(status: Status, context: Context) -> list[dict[str, Any]]:
    return [{"name": _host_name(h.name, context), "gpus": list(h.gpus.gpu_indices), "source": h.gpus.source}
            for h in status.hosts]


def free_view(status: Status, request: Mapping[str, Any], *, context: Context, now: datetime) -> dict[str, Any]:
    """Each GPU's free stretches until the horizon and the next slots that fit the request (no names)."""
    gpus = int(_number(request, "gpus", 1, low=1, high=MAX_GPUS))
    hours = _number(request, "hours", 1.0, low=1 / 60, high=MAX_DAYS * 24)
    days = _number(request, "days", 7.0, low=1 / 24, high=MAX_DAYS)
    model = str(request.get("model") or "")[:64]
    try:
        asked = free.window(_moment(request, "from"), days=days, now=now, reach_ahead=context.reach_ahead)
    except free.Beyond as error:
        raise AskError(str(error)) from None
    start, horizon, capped = asked.start, asked.end, asked.capped
    among = {h.name: tuple(h.gpus.gpu_indices) for h in status.hosts}
    models = {host: dict(context.models.get(host, {})) for host in among}
    if model:
        chosen = {host: free_feed.model_gpus(names).get(model, ()) for host, names in models.items()}
        among = {host: indices for host, indices in chosen.items() if indices}
        if not among:
            known = sorted({name for names in models.values() for name in free_feed.model_gpus(names)})
            raise AskError(f"there is no GPU model {model!r} on {context.host_name} "
                           f"(models: {', '.join(known) or 'none (NVML names no GPU model here)'})")
    blocks = [b for b in free_feed.blocks_of(status) if b.end > start and b.start < horizon]
    lanes = free.lanes(_only(blocks, among))
    request_ = free.Request(among=among, count=gpus, duration=timedelta(hours=hours))
    largest = max((len(indices) for indices in among.values()), default=0)
    if gpus > largest:  # no slot could ever fit: one sentence, not an empty list
        raise AskError(f"--gpus {gpus}: {context.host_name} has {largest} GPU{'s' if largest != 1 else ''}"
                       f"{' of that model' if model else ''} per host at most; ask for {max(largest, 1)} or fewer")
    slots = free.next_slots(lanes, request_, after=start, horizon=horizon, limit=MAX_SLOTS)
    return {
        "asked": {"gpus": gpus, "hours": hours, "days": days, "model": model},
        "from": start.isoformat(), "until": horizon.isoformat(),
        **({"capped": capped} if capped else {}),
        "hosts": [{"name": _host_name(host, context), "gpus": [
            {"gpu": index, "model": models.get(host, {}).get(index) or None,
             "free": [[begin.isoformat(), end.isoformat()]
                      for begin, end in free.free_spans(lanes.get(host, {}).get(index), start=start, end=horizon)]}
            for index in indices]} for host, indices in among.items()],
        "slots": [{"start": slot.start.isoformat(), "end": slot.end.isoformat() if slot.end else None,
                   "placement": [[_host_name(host, context), list(on)] for host, on in slot.placement]}
                  for slot in slots],
    }


def _only(blocks: list[free.Block], among: Mapping[str, Collection[int]]) -> list[free.Block]:
    kept = []
    for block in blocks:
        for host, indices in among.items():
            kept.extend(free_feed.only_gpus([block], indices, host=host))
    return kept
