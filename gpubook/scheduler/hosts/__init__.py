"""Hosts: the machines bookings run on, each behind one small interface.

The plan places every booking on (host, GPUs); the apply stage hands each action to the host it
names. A backend (`hosts/backend.py`, chosen by `[backend] kind` through its registry) gives the
hosts: this machine (`hosts/local.py`: a container engine, the host's NVIDIA driver, SSH), or a
Slurm cluster's nodes (`hosts/slurm/`: reservations and jobs), each meeting the same `Host`
protocol: the planner, the decision and the stages after it do not change.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol

from gpubook.runtime.engines import ContainerInfo, ExecResult
from gpubook.runtime.jupyter import Availability
from gpubook.runtime.templates import Template


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
    # Its provenance card as known at the start (runtime/provenance.py's `Card.to_json`, in UTC);
    # None: this host keeps none (a Slurm node).
    provenance: Mapping[str, Any] | None = None


class Host(Protocol):
    """What the apply stage needs from a place where containers run."""

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
