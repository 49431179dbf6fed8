"""Container engines behind one small protocol, registered by name: what runs is read back from
the engine's labels, and engines take argv lists only (nothing reaches a shell).

`Engine` is what every engine must do to run a booking; what only some can do is a capability
(`Builder`, `ServiceRunner`, `IdMapper`, and runtime.templates.images' `ImageEngine`) that callers test with
`isinstance`, saying in one sentence what is missing where one is needed.

Adding an engine (udocker, Apptainer) is one module here and one `register` line below; a site may
also name its own class in `[engine] name` as a dotted path "package.module:Class", the way
Radicale loads its storage and auth plugins (runtime.plugins.Registry, the loader sources and
backends use too). Engines never import each other: podman and Docker share the CLI plumbing
through `cli_engine.CliEngine`, and each spells its own flags and checks its own networks.
"""

from __future__ import annotations

import builtins
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from gpubook.runtime.checks import Check
from gpubook.runtime.engines.spec import (
    DROP_CAPABILITIES,
    KEEP_CAPABILITIES,
    LABEL_BOOKING,
    LABEL_END,
    LABEL_GPUS,
    LABEL_HASH,
    LABEL_HOST_KEY,
    LABEL_PORT,
    LABEL_PREFIX,
    LABEL_SERVICE,
    LABEL_START,
    LABEL_TEMPLATE,
    LABEL_USER,
    ContainerInfo,
    ContainerSpec,
    ExecResult,
    ServiceSpec,
    SpecTaken,
    booker_digest,
    booking_id_problem,
    container_name,
    info_from_labels,
    permanent,
)
from gpubook.runtime.errors import EngineError
from gpubook.runtime.mounts import Mount
from gpubook.runtime.plugins import Registry

__all__ = [
    "DROP_CAPABILITIES",
    "REGISTRY",
    "SETTING_CHECKS",
    "HOST_NETWORK_RISK",
    "NETWORKS",
    "KEEP_CAPABILITIES",
    "LABEL_BOOKING",
    "LABEL_END",
    "LABEL_START",
    "LABEL_GPUS",
    "LABEL_HASH",
    "LABEL_HOST_KEY",
    "LABEL_PORT",
    "LABEL_PREFIX",
    "LABEL_SERVICE",
    "LABEL_TEMPLATE",
    "LABEL_USER",
    "ContainerInfo",
    "ContainerSpec",
    "ServiceSpec",
    "Builder",
    "Engine",
    "IdMapper",
    "ServiceRunner",
    "EngineOptions",
    "EngineSettings",
    "ExecResult",
    "Mount",
    "booker_digest",
    "builder",
    "chown_for",
    "data_owner_argv",
    "host_owner",
    "network_checks",
    "mps_problem",
    "engine_network_problem",
    "network_problem",
    "service_runner",
    "booking_id_problem",
    "container_name",
    "engine_from",
    "info_from_labels",
    "make_engine",
    "permanent",
    "SpecTaken",
    "preflight",
    "register",
]


@runtime_checkable
class Engine(Protocol):
    """What every container engine must do for gpubook to run a booking on it.

    The seven verbs of a booking's life (start, stop, list, inspect, exec, logs) and doctor's
    `preflight` (its own network checks included), plus `name` (the word logs and doctor use) and
    `ensure_image`: a start needs its image present, and only the engine can say whether it is
    (pulling and cleaning go further, behind `runtime.templates.images.ImageEngine`). What only some engines
    can do is a capability below, which callers test with `isinstance`.
    """

    name: str

    def ensure_image(self, image: str, *, pull: bool = False) -> None:
        """Nothing when `image` is in the engine's store (pulled first with `pull`); else a
        permanent EngineError saying how to get it."""
        ...

    def start(self, spec: ContainerSpec) -> ContainerInfo: ...

    def stop(self, name: str, grace: float) -> None: ...

    def list(self) -> list[ContainerInfo]: ...

    def inspect(self, name: str) -> ContainerInfo | None: ...

    def exec(self, name: str, argv: Sequence[str], *, user: str | None = None,
             timeout: float | None = None) -> ExecResult:
        """Run argv in the container; `timeout` seconds at most (None: the engine's default), the
        output kept only up to a bound (a booker's process decides how much it writes)."""
        ...

    def logs(self, name: str, *, tail: int | None = None) -> str: ...

    def preflight(self) -> builtins.list[Check]:
        """What `gpubook doctor` reports about this engine: installed, usable, configured, and
        whether bookings' networks can be made here (engines.network_checks covers the setting)."""
        ...


@runtime_checkable
class Builder(Protocol):
    """An engine that makes images itself: the sshd overlay of a template without sshd, and the
    images built from a root filesystem (`gpubook templates build`)."""

    def build(self, tag: str, context: Path, *, containerfile: str = "Containerfile") -> None: ...

    def import_rootfs(self, tarball: Path, tag: str) -> None: ...


@runtime_checkable
class Loader(Protocol):
    """An engine that loads image archives made elsewhere (`podman save`, `docker save`) and names them:
    `gpubook templates import`, for a host that cannot build or pull a template's image."""

    def load(self, archive: Path) -> list[str]: ...

    def tag(self, image: str, target: str) -> None: ...


def loader(engine: Engine, *, why: str) -> Loader:
    """The engine as a Loader, or a permanent EngineError saying that `why` needs one."""
    if not isinstance(engine, Loader):
        raise permanent(f"{why} needs an engine that loads image archives, and engine {engine.name!r} cannot")
    return engine


@runtime_checkable
class KeepsSpares(Protocol):
    """An engine that makes a booking's container of an image ahead (udocker's spare: its `udocker create`
    copy, 9 s for debian-ssh, paid before a booking for now rather than at its start)."""

    def keep_spare(self, image: str) -> None:
        """A spare of `image` made in the background where none fits (none, half-made, of an older pull)."""
        ...


@runtime_checkable
class ServiceRunner(Protocol):
    """An engine that runs long-lived service containers beside bookings (the SFTP service)."""

    def start_service(self, spec: ServiceSpec) -> ContainerInfo:
        """Start a service container (runs already with this spec: nothing; else replaced)."""
        ...

    def inspect_service(self, name: str) -> ContainerInfo | None:
        """The service container `name` (None when there is none)."""
        ...

    def signal(self, name: str, signal_name: str) -> None:
        """Send a signal ("HUP") to the container's first process."""
        ...


@runtime_checkable
class IdMapper(Protocol):
    """An engine whose containers' ids are not the host's (rootless podman's subordinate ids): it
    says which host ids a booker's files get and gives folders to them. An engine without it runs
    containers on the host's own ids (`host_owner`, `chown_for`, `data_owner_argv` below)."""

    def host_owner(self, uid: int, gid: int) -> tuple[int, int]: ...

    def chown(self, path: Path, uid: int, gid: int) -> None:
        """Give a data folder to the host ids that `host_owner` named, without following symlinks."""
        ...

    def data_owner_argv(self) -> builtins.list[str] | None:
        """The argv prefix that runs a command with power over every booker's file in the data
        folders (rootless podman: `podman unshare`); [] when the daemon's user has it already
        (root); None when nothing can."""
        ...


def host_owner(engine: Engine, uid: int, gid: int) -> tuple[int, int]:
    """The host ids of a booker's files: the engine's mapping, or the same ids where it maps none."""
    return engine.host_owner(uid, gid) if isinstance(engine, IdMapper) else (uid, gid)


def chown_for(engine: Engine) -> Callable[[Path, int, int], None] | None:
    """How folders are given to host ids: the engine's way, or None (storage's own: root only)."""
    return engine.chown if isinstance(engine, IdMapper) else None


def ownership(engine: Engine, uid: int, gid: int) -> tuple[tuple[int, int], Callable[[Path, int, int], None] | None]:
    """The host ids of files owned by `uid`:`gid` inside (`host_owner`) and how a folder is given to
    them (`chown_for`): what making a booker's folders or a booking's host key needs, at once."""
    return host_owner(engine, uid, gid), chown_for(engine)


def data_owner_argv(engine: Engine) -> builtins.list[str] | None:
    """The argv prefix with power over every booker's file: the engine's, else root's own ([])."""
    if isinstance(engine, IdMapper):
        return engine.data_owner_argv()
    return [] if os.geteuid() == 0 else None


def builder(engine: Engine, *, why: str) -> Builder:
    """The engine as a Builder, or a permanent EngineError saying that `why` needs one."""
    if not isinstance(engine, Builder):
        raise permanent(f"{why} needs an engine that builds images, and engine {engine.name!r} cannot")
    return engine


def service_runner(engine: Engine, *, why: str) -> ServiceRunner:
    """The engine as a ServiceRunner, or a permanent EngineError saying that `why` needs one."""
    if not isinstance(engine, ServiceRunner):
        raise permanent(f"{why} needs an engine that runs service containers, and engine {engine.name!r} cannot")
    return engine


@dataclass(frozen=True)
class EngineSettings:
    """`[engine]` in the config: which engine, and the settings every engine understands."""

    name: str = "podman"  # "podman", "docker", or a dotted path "package.module:Class"
    binary: str | None = None  # default: the engine's name, looked up on PATH
    runtime: str | None = None  # OCI runtime for podman ("runc", "crun"); None: the engine's default
    # podman storage driver ("overlay", "vfs"); None: the user's own podman configuration, so that
    # gpubook and a plain `podman` see the same store (a store made with another driver refuses
    # every command that overrides it)
    storage_driver: str | None = None
    # "private": each booking in its own network namespace with only its SSH port published on the
    # host (rootless podman: slirp4netns); "host": the host's network, where bookers reach each
    # other's services and can squat ports (an admin's explicit choice, flagged by status and doctor)
    network: str = "private"
    ulimits: tuple[str, ...] = ()  # e.g. ("nofile=1024:1024",)
    # processes per container (--pids-limit, where cgroups enforce it) and per uid inside it (the
    # nproc ulimit, which holds on cgroup-v1 rootless hosts too); 0: no limit
    pids_limit: int = 4096
    # a container's memory (--memory, like "32g") where its template sets none; None: the host's
    # memory less a reserve, shared by GPUs (runtime.cgroups.memory_share); "none": no limit
    memory: str | None = None
    stop_grace_seconds: float = 10.0


@dataclass(frozen=True)
class EngineOptions:
    """How this process talks to the engine, beside the site's `[engine]`: tests and tools only."""

    global_args: tuple[str, ...] = ()  # e.g. ("-H", "unix:///tmp/x/docker.sock") for a private dockerd
    # podman's --cgroup-manager; "auto": systemd where a user manager delegates the controllers,
    # else cgroupfs (in a delegated subtree where there is one: runtime.cgroups.placement); None: podman's own
    cgroup_manager: str | None = "auto"
    # The host's memory in bytes and its GPUs, which the default memory limit shares out; None: read
    # from this host (/proc/meminfo, /proc/driver/nvidia/gpus).
    host_memory: int | None = None
    host_gpus: int | None = None


NETWORKS = ("host", "private")
HOST_NETWORK_RISK = "bookers can reach each other's services and squat ports"

EngineFactory = Callable[[EngineSettings, EngineOptions], Engine]

# name -> "module:Class", imported only when that engine is used (Docker sites never load podman's).
REGISTRY: Registry[EngineFactory] = Registry("engine", error=EngineError)
register = REGISTRY.register  # `[engine] name = "<name>"` means this engine: a class (or "module:Class")

register("podman", "gpubook.runtime.engines.podman:PodmanEngine")
register("docker", "gpubook.runtime.engines.docker:DockerEngine")
register("udocker", "gpubook.runtime.engines.udocker:UdockerEngine")


def make_engine(settings: EngineSettings, options: EngineOptions | None = None) -> Engine:
    """The engine that `[engine]` names."""
    if network_problem(settings.network):
        raise EngineError(f'engine network must be "host" or "private", not {settings.network!r}')
    return REGISTRY.load(settings.name)(settings, options or EngineOptions())


def network_problem(network: str) -> str | None:
    """None for a network setting every engine understands, else what is wrong."""
    return None if network in NETWORKS else 'must be "host" or "private"'


def mps_problem(settings: EngineSettings) -> str | None:
    """Why `[gpus] mps` (a host folder every booking writes into) cannot be used with this engine;
    None where it can, or where the engine cannot be loaded (`[engine] name` says so itself)."""
    try:
        engine_class = REGISTRY.load(settings.name)
    except EngineError:
        return None
    return getattr(engine_class, "mps_refused", None)


def engine_network_problem(settings: EngineSettings) -> str | None:
    """Why this engine cannot make the `[engine] network` asked for (udocker has no network
    namespaces: only "host"); None where it can, or where the engine cannot be loaded."""
    try:
        engine_class = REGISTRY.load(settings.name)
    except EngineError:
        return None
    if settings.network in getattr(engine_class, "networks", NETWORKS):
        return None
    return getattr(engine_class, "network_refused", None) or (
        f"engine {settings.name!r} cannot make a {settings.network!r} network")


def _not_negative(value: float) -> str | None:
    return None if value >= 0 else "must be 0 or more"


def _memory_problem(value: str | None) -> str | None:
    """None: the host's memory less a reserve, shared by GPUs (runtime.cgroups.memory_share); "none": no limit."""
    if value is None or value == "none" or re.fullmatch(r"[1-9][0-9]*[bkmg]?", value):
        return None
    return "must be like '512m' or '32g', or \"none\""


# The checks of `[engine]` keys, by field of EngineSettings: what the config reports for a bad value.
SETTING_CHECKS: dict[str, Callable[[Any], str | None]] = {
    "name": REGISTRY.problem,  # a registered engine, or "package.module:Class"
    "network": network_problem,
    "stop_grace_seconds": _not_negative,
    "pids_limit": _not_negative,
    "memory": _memory_problem,
}


def engine_from(
    name: str = "podman",
    *,
    binary: str | None = None,
    runtime: str | None = None,
    storage_driver: str | None = None,
    network: str = "private",
    ulimits: Sequence[str] = (),
    pids_limit: int = EngineSettings.pids_limit,
    memory: str | None = None,
    cgroup_manager: str | None = "auto",
    global_args: Sequence[str] = (),
    host_memory: int | None = None,
    host_gpus: int | None = None,
) -> Engine:
    """`make_engine` with the settings one by one (tools, tests and benchmarks)."""
    settings = EngineSettings(
        name=name,
        binary=binary,
        runtime=runtime,
        storage_driver=storage_driver,
        network=network,
        ulimits=tuple(ulimits),
        pids_limit=pids_limit,
        memory=memory,
    )
    options = EngineOptions(global_args=tuple(global_args), cgroup_manager=cgroup_manager,
                            host_memory=host_memory, host_gpus=host_gpus)
    return make_engine(settings, options)


def preflight(settings: EngineSettings) -> list[Check]:
    """The engine's own preflight (its networks' checks included); one failed check, and the network
    setting's line, when the engine cannot even be made."""
    if (refused := engine_network_problem(settings)) is not None:
        return [Check("engine network", False, refused, "set [engine] network to one this engine makes, or use podman")]
    try:
        engine = make_engine(settings)
    except EngineError as error:
        return [Check("engine", False, str(error), 'set [engine] name to "podman" or "docker"'),
                *network_checks(settings)]
    return engine.preflight()


def network_checks(settings: EngineSettings) -> list[Check]:
    """What every engine's preflight says first about `[engine] network`: the host network's risk,
    or the private network's promise (each engine then checks that it can make it here)."""
    if settings.network == "host":
        return [Check("engine network", False, f'[engine] network = "host": {HOST_NETWORK_RISK}',
                      'set [engine] network = "private" (each booking its own network, only its SSH port '
                      "published)")]
    return [Check("engine network", True, "private: each booking its own network namespace, only its SSH "
                  "port published on the host")]
