"""Hosts: the machines bookings run on, each behind one small interface.

The plan places every booking on (host, GPUs); the apply stage hands each action to the host it
names. A backend (`hosts/backend.py`, chosen by `[backend] kind` through its registry) gives the
hosts: this machine (`hosts/local.py`: a container engine, the host's NVIDIA driver, SSH), or a
Slurm cluster's nodes (`hosts/slurm/`: reservations and jobs), each meeting the same `Host`
protocol: the planner, the decision and the stages after it do not change.

A host has the five doors of `Host` (list, start, stop, exec, inspect); the others are capabilities
it may have, each a Protocol of its own here (`PreparesAhead`, `Arms`, `MovesEnd`, `KeepsProvenance`,
`HasImages`). The apply stage asks `isinstance(host, Arms)` and the like, never `getattr`; `doors`
says in one sentence each what a host without one does instead (logged once by the pass).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from gpubook.runtime.booking.jupyter import Availability
from gpubook.runtime.engines import ContainerInfo, ExecResult
from gpubook.runtime.templates.catalog import Template

if TYPE_CHECKING:
    from gpubook.runtime.booking.provenance import Card
    from gpubook.scheduler.hosts.images import ImagePreparer


@dataclass(frozen=True)
class Booker:
    """Who a container is for: the account made inside, with the booker's keys."""

    name: str
    uid: int
    gid: int
    ssh_keys: tuple[str, ...] = ()


@dataclass(frozen=True)
class StartRequest:
    """Everything a host needs to start one booking's container."""

    booking_id: str
    booker: Booker
    template: Template
    gpus: tuple[int, ...]
    port: int
    end: datetime
    start: datetime | None = None  # the booking's start: the container opens SSH only then (see arm)
    armed: str = ""  # the spec hash of its container run ahead, as this pass listed it ("": none)
    # Every node a cluster booking holds (the first is this host) with its GPUs there; empty: this host alone.
    placement: tuple[tuple[str, tuple[int, ...]], ...] = ()
    # For the booker's booking.json inside (never part of the container's spec): the event's UID and
    # title (SUMMARY, as the calendar has it), and where the booker logs in ("": not known yet, armed).
    uid: str = ""
    title: str = ""
    address: str = ""


@dataclass(frozen=True)
class Ahead:
    """What a host may make for a booking before its start (a host that can has `prepare(ahead)`
    and `unprepare(booking_id)`): the booker's data folders, the booking's SSH host key. Its start
    then finds them made, and spends its first second on the container alone."""

    booking_id: str
    booker: Booker


@dataclass(frozen=True)
class Started:
    info: ContainerInfo
    seconds_to_ssh: float  # from the start call until SSH let the probe key in
    jupyter: Availability | None = None  # a template with jupyter = true: whether JupyterLab started
    # Its provenance card as known at the start (runtime/booking/provenance.py's `Card.to_json`, in UTC);
    # None: this host keeps none (a Slurm node).
    provenance: Mapping[str, Any] | None = None


@runtime_checkable
class Host(Protocol):
    """What the apply stage needs from a place where containers run: the required doors."""

    name: str
    gpus: tuple[int, ...]  # the GPU indices present (the inventory's row for this host)
    driver_version: str | None  # None: no NVIDIA driver; containers get no GPU

    def list(self) -> list[ContainerInfo]:
        """gpubook's containers on this host, each with `host` set to this host's name."""
        ...

    def start(self, request: StartRequest) -> Started:
        """Start the booking's container and wait until SSH answers (the probe). Raises `Preparing`
        while something it needs is made in the background (its image)."""
        ...

    def stop(self, name: str, grace: float) -> None: ...

    def exec(self, name: str, argv: Sequence[str], *, timeout: float | None = None) -> ExecResult:
        """Bounded: past `timeout` seconds it raises (None: the host's default)."""
        ...

    def inspect(self, name: str) -> ContainerInfo | None: ...


# The optional doors. A host class has a capability by having its methods (structural, as `Host`);
# the apply stage checks each with isinstance.

@runtime_checkable
class PreparesAhead(Protocol):
    """Makes a booking's data folders and SSH host key before its start (`Ahead`), and takes back
    what it made when the booking is gone before its start."""

    def prepare(self, ahead: Ahead) -> None: ...

    def unprepare(self, booking_id: str) -> None: ...


@runtime_checkable
class Arms(Protocol):
    """Runs a booking's container ahead of its start, with the very spec its start builds, SSH closed
    until `request.start`; the start then only probes SSH."""

    def arm(self, request: StartRequest) -> ContainerInfo: ...


@runtime_checkable
class MovesEnd(Protocol):
    """Writes a booking's new end into what the booker reads inside (booking.json); True: written."""

    def move_end(self, booking_id: str, end: datetime) -> bool: ...


@runtime_checkable
class KeepsProvenance(Protocol):
    """Writes a booking's ended provenance card into the booker's output; True: written."""

    def write_provenance(self, user: str, card: Card) -> bool: ...


@runtime_checkable
class HasImages(Protocol):
    """Prepares templates' images before the bookings that need them (pulls, builds, warm-up)."""

    images: ImagePreparer


REQUIRED = ("list", "start", "stop", "exec", "inspect")

# Each optional door, and what a host without it does instead.
OPTIONAL: tuple[tuple[type, str], ...] = (
    (PreparesAhead, "no booker's folders or host key made ahead (each start makes them)"),
    (Arms, "no container run ahead of its start (SSH opens once the start's run is done)"),
    (MovesEnd, "no booking.json kept (a booking's later end is not written inside)"),
    (KeepsProvenance, "no provenance.json kept in the booker's output"),
    (HasImages, "no image prepared ahead (a booking starts with the image the engine has)"),
)


def required_problem(name: str, host: object) -> str | None:
    """None, or one sentence naming the required doors a backend's host lacks."""
    if isinstance(host, Host):
        return None
    missing = [door for door in REQUIRED if not callable(getattr(host, door, None))]
    missing += [data for data in ("name", "gpus", "driver_version") if not hasattr(host, data)]
    return (f"host {name!r} ({type(host).__name__}) is not a gpubook Host: it lacks {', '.join(missing)} "
            f"(every host has list, start, stop, exec and inspect, and a name, gpus and driver_version)")


def doors(hosts: Mapping[str, object]) -> list[str]:
    """One sentence for each optional door a kind of host lacks, naming its hosts (empty: they have
    them all)."""
    kinds: dict[type, list[str]] = {}
    for name, host in hosts.items():
        kinds.setdefault(type(host), []).append(name)
    return [f"{'host' if len(names) == 1 else 'hosts'} {', '.join(names)} ({kind.__name__}): {instead}"
            for kind, names in kinds.items()
            for door, instead in OPTIONAL if not isinstance(hosts[names[0]], door)]
