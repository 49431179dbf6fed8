"""Container engines behind one small protocol, registered by name: what runs is read back from
the engine's labels, and engines take argv lists only (nothing reaches a shell).

Adding an engine (udocker, Apptainer) is one module here and one `register` line below; a site may
also name its own class in `[engine] name` as a dotted path "package.module:Class", the way
Radicale loads its storage and auth plugins. Engines never import each other: podman and Docker
share the CLI plumbing through `cli_engine.CliEngine`, and each spells its own flags.
"""

from __future__ import annotations

import builtins
import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

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
    booker_digest,
    booking_id_problem,
    container_name,
    info_from_labels,
    permanent,
)
from gpubook.runtime.errors import EngineError
from gpubook.runtime.mounts import Mount

__all__ = [
    "DROP_CAPABILITIES",
    "ENGINES",
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
    "Engine",
    "EngineOptions",
    "EngineSettings",
    "ExecResult",
    "Mount",
    "booker_digest",
    "booking_id_problem",
    "container_name",
    "engine_from",
    "info_from_labels",
    "make_engine",
    "permanent",
    "name_problem",
    "preflight",
    "register",
]


class Engine(Protocol):
    """What the reconciler needs from a container engine."""

    name: str

    def ensure_image(self, image: str, *, pull: bool = False) -> None: ...

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

    def start_service(self, spec: ServiceSpec) -> ContainerInfo:
        """Start a service container (runs already with this spec: nothing; else replaced)."""
        ...

    def inspect_service(self, name: str) -> ContainerInfo | None:
        """The service container `name` (None when there is none)."""
        ...

    def signal(self, name: str, signal_name: str) -> None:
        """Send a signal ("HUP") to the container's first process."""
        ...

    def host_owner(self, uid: int, gid: int) -> tuple[int, int]: ...

    def chown(self, path: Path, uid: int, gid: int) -> None:
        """Give a data folder to the host ids that `host_owner` named, without following symlinks."""
        ...

    def data_owner_argv(self) -> builtins.list[str] | None:
        """The argv prefix that runs a command with power over every booker's file in the data
        folders (rootless podman: `podman unshare`); [] when the daemon's user has it already
        (root); None when nothing can."""
        ...

    def build(self, tag: str, context: Path, *, containerfile: str = "Containerfile") -> None: ...

    def import_rootfs(self, tarball: Path, tag: str) -> None: ...

    def preflight(self) -> builtins.list[Check]:
        """What `gpubook doctor` reports about this engine: installed, usable, configured."""
        ...


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
ENGINES: dict[str, str | EngineFactory] = {}


def register(name: str, factory: str | EngineFactory) -> None:
    """Make `[engine] name = "<name>"` mean this engine: a class (or "module:Class")."""
    ENGINES[name] = factory


register("podman", "gpubook.runtime.engines.podman:PodmanEngine")
register("docker", "gpubook.runtime.engines.docker:DockerEngine")


def name_problem(name: str) -> str | None:
    """None when `[engine] name` names a registered engine or a loadable class, else what is wrong."""
    if ":" not in name:
        return None if name in ENGINES else "must be " + " or ".join(f'"{known}"' for known in ENGINES)
    try:
        _factory(name)
    except EngineError as error:
        return str(error)
    return None


def _factory(name: str) -> EngineFactory:
    target = ENGINES.get(name, name if ":" in name else None)
    if target is None:
        known = ", ".join(f'"{known}"' for known in ENGINES)
        raise EngineError(f'unknown engine {name!r} (known: {known}, or "package.module:Class")')
    if not isinstance(target, str):
        return target
    module_name, _, class_name = target.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as error:
        raise EngineError(f"engine {name!r}: cannot load {target}: {error}") from None
    if not callable(factory):
        raise EngineError(f"engine {name!r}: {target} is not a class")
    return factory  # type: ignore[no-any-return]


def make_engine(settings: EngineSettings, options: EngineOptions | None = None) -> Engine:
    """The engine that `[engine]` names."""
    if settings.network not in NETWORKS:
        raise EngineError(f'engine network must be "host" or "private", not {settings.network!r}')
    return _factory(settings.name)(settings, options or EngineOptions())


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
    """The engine's own preflight; one failed check when the engine cannot even be made."""
    try:
        engine = make_engine(settings)
    except EngineError as error:
        return [Check("engine", False, str(error), 'set [engine] name to "podman" or "docker"')]
    return engine.preflight()
