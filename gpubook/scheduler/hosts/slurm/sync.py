"""The reservation sync, decided in pure code: what gpubook wants against what Slurm holds.

Each accepted booking placed on cluster nodes wants one advance reservation named
`prefix + a readable, hashed form of its booking id` (the same booking always gets the same
name, so a restarted daemon finds, adopts and keeps its reservations instead of making
duplicates). `diff` compares those with the reservations Slurm lists under gpubook's prefix and
returns only the commands that change something: a sync where nothing changed issues no Slurm
command beyond the one listing. Each command is an argv list for scontrol; no text from a
calendar reaches it except through the hashed, character-checked reservation name.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from gpubook.scheduler.core.plan import Accepted
from gpubook.scheduler.hosts.slurm.parse import Reservation

PREFIX_PATTERN = re.compile(r"^[A-Za-z0-9_-]{1,32}$")
FLAGS = ("OVERLAP",)  # gpubook's reservations share a node's GPUs between them (the plan divides them)


@dataclass(frozen=True)
class Wanted:
    """The reservation one booking needs."""

    name: str
    booking_id: str
    nodes: tuple[str, ...]  # sorted
    start: datetime  # aware, whole seconds
    end: datetime
    users: tuple[str, ...]


@dataclass(frozen=True)
class Change:
    """One scontrol command and the booking it is for ("" for an orphan's removal)."""

    kind: str  # "create", "update" or "delete"
    name: str
    booking_id: str
    argv: tuple[str, ...]  # scontrol's arguments (without "scontrol")


def reservation_name(booking_id: str, *, prefix: str) -> str:
    """The booking's reservation name: readable, within Slurm's characters, unique per booking id."""
    readable = re.sub(r"[^A-Za-z0-9_.-]+", "-", booking_id).strip("-.")[:40]
    digest = hashlib.sha256(booking_id.encode()).hexdigest()[:10]
    return f"{prefix}{readable}-{digest}" if readable else f"{prefix}{digest}"


def wanted(accepted: Iterable[Accepted], *, prefix: str, users: Sequence[str],
           nodes_of: dict[str, tuple[str, ...]] | None = None) -> list[Wanted]:
    """The reservations the plan's accepted bookings need; `nodes_of` maps a booking id to its nodes
    where it spans several (default: the one host the plan placed it on)."""
    out = []
    for item in accepted:
        booking = item.booking
        nodes = tuple(sorted((nodes_of or {}).get(booking.id, (item.host,))))
        out.append(Wanted(name=reservation_name(booking.id, prefix=prefix), booking_id=booking.id, nodes=nodes,
                          start=_floor(booking.start), end=_ceil(booking.end), users=tuple(users)))
    return out


def diff(want: Sequence[Wanted], have: Sequence[Reservation], *, prefix: str, now: datetime,
         keep: Collection[str] = ()) -> list[Change]:
    """The commands that make Slurm's gpubook reservations what `want` says, and nothing else.

    A reservation already active keeps its start (Slurm moved a late creation's start to the
    moment it was made); ended bookings are left to Slurm, which removes a reservation at its end.
    One in `keep` (a booking's job still runs in it: a cancelled booking is warned before its stop)
    is deleted only once its job has ended.
    """
    mine = {r.name: r for r in have if r.name.startswith(prefix)}
    changes = []
    for w in want:
        if w.end <= now:
            continue
        existing = mine.pop(w.name, None)
        if existing is None:
            changes.append(Change("create", w.name, w.booking_id, create_argv(w, now=now)))
        elif (update := update_argv(w, existing, now=now)) is not None:
            changes.append(Change("update", w.name, w.booking_id, update))
    for name in sorted(set(mine) - set(keep)):  # a cancelled booking's, or an orphan's left by an earlier daemon
        changes.append(Change("delete", name, "", ("delete", f"ReservationName={name}")))
    return changes


def create_argv(w: Wanted, *, now: datetime) -> tuple[str, ...]:
    start = "now" if w.start <= now else stamp(w.start)
    return ("create", "reservation", f"ReservationName={w.name}", f"StartTime={start}", f"EndTime={stamp(w.end)}",
            f"Nodes={','.join(w.nodes)}", f"Users={','.join(w.users)}", f"Flags={','.join(FLAGS)}")


def update_argv(w: Wanted, existing: Reservation, *, now: datetime) -> tuple[str, ...] | None:
    """The update that makes `existing` into `w`, or None when they already agree."""
    args = []
    if existing.start != w.start and not (existing.start <= now and w.start <= now):
        args.append(f"StartTime={'now' if w.start <= now else stamp(w.start)}")
    if existing.end != w.end:
        args.append(f"EndTime={stamp(w.end)}")
    if existing.nodes != w.nodes:
        args.append(f"Nodes={','.join(w.nodes)}")
    if tuple(sorted(existing.users)) != tuple(sorted(w.users)):
        args.append(f"Users={','.join(w.users)}")
    return ("update", f"ReservationName={w.name}", *args) if args else None


def stamp(moment: datetime) -> str:
    """A time as scontrol reads it when run with TZ=UTC."""
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S")


def _floor(moment: datetime) -> datetime:
    return moment.astimezone(UTC).replace(microsecond=0)


def _ceil(moment: datetime) -> datetime:
    whole = _floor(moment)
    return whole if whole == moment else whole + timedelta(seconds=math.ceil(moment.microsecond / 1e6))
