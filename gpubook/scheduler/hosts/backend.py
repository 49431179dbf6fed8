"""Backends: where bookings run, one plug-in each, named by `[backend] kind` like an engine or a source.

A backend gives the pass its hosts (read again by `refresh`), holds the plan's placements where
the hosts need that (`reserve`: a cluster's reservations), names its place for the pure plan and
the booking convention (`topology`), says where a booker logs in (`address`), what the daemon
samples on this machine (`sampling`), its GPUs for the status (`gpus`) and its problems for
`gpubook doctor` (`preflight`). Every backend is built by one call, `make(config, parts)`: `parts`
are what the daemon makes once whatever the backend (the engine, the probe key, the image preparer,
this machine's GPUs). Adding one: a module with the class, and one `backends.register` line here
(or `[backend] kind = "package.module:Class"`, with no line at all).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Protocol, runtime_checkable

import paramiko

from gpubook.runtime.checks import Check
from gpubook.runtime.engines import ContainerInfo, Engine
from gpubook.runtime.errors import ConfigError
from gpubook.runtime.nvidia import gpus as gpu_inventory
from gpubook.runtime.plugins import Registry
from gpubook.scheduler.core.plan import Accepted
from gpubook.scheduler.core.topology import Topology
from gpubook.scheduler.hosts import Host
from gpubook.scheduler.hosts.images import ImagePreparer
from gpubook.scheduler.settings import Config


@dataclass(frozen=True)
class Parts:
    """What the daemon makes once for any backend (a backend takes what it needs of them)."""

    engine: Engine  # this machine's container engine
    probe_key: paramiko.PKey  # the daemon's key for the SSH readiness probe
    images: ImagePreparer  # this machine's image preparer
    inventory: gpu_inventory.Inventory  # this machine's GPUs


@dataclass(frozen=True)
class Reserved:
    """One reservation round's outcome: the bookings whose placement was refused, or why none was made."""

    refused: Mapping[str, str]  # booking id → the backend's sentence
    problem: str = ""  # the backend unreachable: nothing reserved this pass, nothing starts


NOTHING_HELD = Reserved({})


@dataclass(frozen=True)
class HostGpus:
    """One host's GPUs as the status shows them."""

    source: str  # "nvml", "config" ([gpus] count), "none", or the backend's own ("slurm")
    count: int
    driver: str | None = None
    note: str | None = None  # why there is no live GPU data, one line
    indices: tuple[int, ...] = ()  # empty: 0 to count - 1

    @classmethod
    def of(cls, inventory: gpu_inventory.Inventory) -> HostGpus:
        """This machine's GPUs as NVML (or the [gpus] count) gives them."""
        return cls(source=inventory.source, count=inventory.count, driver=inventory.driver_version,
                   note=None if inventory.source == "nvml" else gpu_inventory.no_gpu_line(inventory),
                   indices=tuple(gpu.index for gpu in inventory.gpus))


@dataclass(frozen=True)
class Sampling:
    """What the daemon's sampler and foreign-process watch read on this machine: the bookings'
    containers running here (as the last pass saw them) and a container's log by name."""

    running: Callable[[], Sequence[ContainerInfo]]
    logs: Callable[[str], str]


NOTHING_SAMPLED = Sampling(running=lambda: [], logs=lambda name: "")  # the bookings run elsewhere


class Backend(Protocol):
    """Where bookings run, as the pass, the daemon and the commands use it."""

    topology: Topology  # a class attribute: known before the backend is built (see `topology_of`)

    @property
    def hosts(self) -> Mapping[str, Host]: ...

    def refresh(self) -> str:
        """Read the hosts again (each pass, before the plan): "" or why they could not be read
        (then nothing starts this pass, and the hosts keep their last listing)."""
        ...

    def reserve(self, accepted: Sequence[Accepted], *, now: datetime) -> Reserved:
        """Hold the plan's placements where the hosts need it, before anything starts."""
        ...

    def address(self, host: str) -> str:
        """Where a booker logs in to a booking on `host` (a host name, or "" when unknown)."""
        ...

    @classmethod
    def preflight(cls, config: Config) -> list[Check]:
        """`gpubook doctor`'s rows for this backend, each problem with its fix (read from the config
        alone: doctor builds no backend)."""
        ...

    def gpus(self) -> dict[str, HostGpus]:
        """Each host's GPUs for the status."""
        ...

    def sampling(self, world: Callable[[], Sequence[ContainerInfo]]) -> Sampling:
        """What the sampler reads here; `world`: the containers as the last pass saw them."""
        ...

    @staticmethod
    def listed_here(engine: Engine) -> list[ContainerInfo] | None:
        """`gpubook status` without a daemon: the bookings' containers running on this machine,
        read live from its engine; None: they run elsewhere (the status file's listing stands)."""
        ...


@runtime_checkable
class ChecksConfig(Protocol):
    """A backend (its class) with settings the config reader cannot check alone."""

    @classmethod
    def config_problem(cls, config: Config) -> str | None:
        """What the daemon refuses to start with, one sentence (None: nothing)."""
        ...


def backend_error(message: str) -> ConfigError:
    return ConfigError(f"[backend] kind: {message}")


backends: Registry[Callable[[Config, Parts], Backend]] = Registry("backend", error=backend_error)
backends.register("local", "gpubook.scheduler.hosts.local:LocalBackend")
backends.register("slurm", "gpubook.scheduler.hosts.slurm.backend:SlurmBackend")
register = backends.register  # `register("name", "package.module:Class")`: a backend of one's own


def make(config: Config, parts: Parts) -> Backend:
    """The config's backend (`[backend] kind`), built from the daemon's parts."""
    return _chosen(config)(config, parts)  # type: ignore[call-arg]


def topology_of(config: Config) -> Topology:
    """The config's backend's topology, without building the backend (commands that only plan)."""
    return _chosen(config).topology


def listed_here(config: Config, engine: Engine) -> list[ContainerInfo] | None:
    """See `Backend.listed_here`."""
    return _chosen(config).listed_here(engine)


def preflight(config: Config) -> list[Check]:
    """See `Backend.preflight`."""
    return _chosen(config).preflight(config)


def config_problem(config: Config) -> str | None:
    """What the config's backend refuses to start with (None: nothing), before it is built."""
    chosen = _chosen(config)
    return chosen.config_problem(config) if isinstance(chosen, ChecksConfig) else None


def kind_problem(name: str) -> str | None:
    """None when `name` names a backend (registered, or "package.module:Class"), else what is wrong
    (the config's check of `[backend] kind`)."""
    try:
        _load(name)
    except ConfigError as error:
        return str(error).removeprefix("[backend] kind: ")
    return None


def _chosen(config: Config) -> type[Backend]:
    """The backend class `[backend] kind` names: the one place a backend is picked by its name."""
    return _load(config.backend.kind)


def _load(name: str) -> type[Backend]:
    found = backends.load(name)
    if not isinstance(getattr(found, "topology", None), Topology):
        raise backend_error(f"{name!r} is not a backend: it has no topology (a Topology class attribute)")
    return found  # type: ignore[return-value]
