"""The CLI engines' argv: a booking's `run` command from its ContainerSpec (labels, network, user
namespace, capabilities, ulimits, limits, logs, mounts), the GPU injection's flags and a service
container's `run`. What each engine spells its own way is a hook here that podman.py and docker.py
define for themselves.
"""

from __future__ import annotations

import builtins
from pathlib import Path
from typing import TYPE_CHECKING

from gpubook.runtime import cgroups
from gpubook.runtime.engines.cli_transport import CliTransport
from gpubook.runtime.engines.spec import (
    DROP_CAPABILITIES,
    KEEP_CAPABILITIES,
    ContainerSpec,
    ServiceSpec,
    permanent,
)
from gpubook.runtime.errors import DriverError
from gpubook.runtime.mounts import Mount

if TYPE_CHECKING:
    from gpubook.runtime.nvidia.model import GpuInjection

MEMORY_OFF = "none"  # [engine] memory that turns the default limit off
# A container's log is the booker's to fill (issue 22, finding 6): the engine keeps at most
# LOG_MAX_SIZE of it on disk, and `logs` keeps the last LOG_READ_LIMIT bytes of what it reads.
LOG_MAX_SIZE = "10m"  # the engines' unit: 10 MB


class CliArgv(CliTransport):
    """The argv of a booking's and a service's `run`, and the hooks each engine spells its way."""

    def service_args(self, spec: ServiceSpec) -> builtins.list[str]:
        """The `run` argv of a service container: on the host's network, or its own with
        `listen:port` published, only `capabilities` kept, no new privileges,
        its seccomp profile, the engine's own id mapping for services."""
        argv = ["run", "--detach", "--name", spec.name, *self.pull_never_args(), "--user", "0:0"]
        for key, value in spec.labels().items():
            argv += ["--label", f"{key}={value}"]
        if spec.host_network:
            argv += ["--network", "host"]
        else:
            wildcard = spec.listen in ("0.0.0.0", "::")  # noqa: S104 - both families, as sshd binds them itself
            publish = self.publish_args(spec.port) if wildcard else \
                ["--publish", f"{spec.listen}:{spec.port}:{spec.port}"]
            argv += [*self.private_network_args(), *publish]
        argv += self.service_userns_args()
        argv += ["--cap-drop", "ALL"]
        for capability in spec.capabilities:
            argv += ["--cap-add", capability]
        argv += ["--security-opt", "no-new-privileges"]
        if spec.seccomp is not None:
            argv += ["--security-opt", f"seccomp={_checked(spec.seccomp, 'path')}"]
        if spec.pids_limit:
            argv += ["--pids-limit", str(spec.pids_limit)]
        if spec.memory:
            argv += ["--memory", spec.memory, "--memory-swap", spec.memory]
        argv += self.cgroup_args() + self.log_args()
        for mount in spec.mounts:
            if problem := mount_path_problem(mount):
                raise permanent(f"service {spec.service}: {problem}")
            argv += ["--volume", _volume(mount)]
        argv += ["--entrypoint", spec.command[0], spec.image, *spec.command[1:]]
        return argv


    def userns_args(self, spec: ContainerSpec) -> builtins.list[str]:
        """The container's own user namespace, where the engine gives it one."""
        return []


    def service_userns_args(self) -> builtins.list[str]:
        """A service container's ids: root the engine's own user, the others as in bookings."""
        return []


    def default_ulimits(self) -> builtins.list[str]:
        """nproc: a fork bomb inside stops at its own limit (RLIMIT_NPROC counts per uid in the
        container's namespace, with or without cgroups)."""
        if not self.pids_limit or "nproc" in {limit.split("=", 1)[0] for limit in self.ulimits}:
            return []
        return [f"nproc={self.pids_limit}:{self.pids_limit}"]

    def pull_never_args(self) -> builtins.list[str]:
        return ["--pull", "never"]

    def gpu_isolation_args(self, injection: GpuInjection, *, booking_id: str) -> builtins.list[str]:
        """Flags that hide `injection.hidden_proc_paths` (the other GPUs' /proc entries)."""
        raise NotImplementedError


    def run_args(self, spec: ContainerSpec) -> builtins.list[str]:
        argv = ["run", "--detach", "--name", spec.name, *self.pull_never_args(), "--user", "0:0"]
        for key, value in spec.labels().items():
            argv += ["--label", f"{key}={value}"]
        argv += self.network_args(spec)
        argv += self.userns_args(spec)
        for capability in DROP_CAPABILITIES:
            argv += ["--cap-drop", capability]
        for capability in KEEP_CAPABILITIES:
            argv += ["--cap-add", capability]
        for ulimit in (*self.default_ulimits(), *self.ulimits):
            argv += ["--ulimit", ulimit]
        if spec.shm_size:
            argv += ["--shm-size", spec.shm_size]
        argv += self.limit_args(spec) + self.log_args()
        for name, value in spec.env:
            argv += ["--env", f"{name}={value}"]
        for mount in spec.mounts:
            argv += ["--volume", _volume(mount)]
        if spec.gpu is not None:
            argv += self.gpu_args(spec.gpu, booking_id=spec.booking_id)
        command = list(spec.command)
        if spec.entrypoint:
            # Docker's --entrypoint takes one executable; its arguments lead the command.
            argv += ["--entrypoint", spec.entrypoint[0]]
            command = [*spec.entrypoint[1:], *command]
        return [*argv, spec.image, *command]

    def limit_args(self, spec: ContainerSpec) -> builtins.list[str]:
        """Processes and memory. The memory limit holds swap too (--memory-swap the same): a
        booking over it is OOM-killed rather than pushing the host's other bookings into swap."""
        argv = ["--pids-limit", str(self.pids_limit)] if self.pids_limit else []
        memory = self.memory_limit(spec)
        if memory is not None:
            argv += ["--memory", memory, "--memory-swap", memory]
        return argv + self.cgroup_args()

    def memory_limit(self, spec: ContainerSpec) -> str | None:
        """The template's memory, else [engine] memory, else the booking's share of the host's
        memory (cgroups.memory_share); None where [engine] memory is "none"."""
        if spec.memory:
            return spec.memory
        if self.memory:
            return None if self.memory == MEMORY_OFF else self.memory
        return cgroups.size_text(self.default_memory(len(spec.gpus)))

    def default_memory(self, booked: int) -> int:
        """The default limit in bytes of a booking of `booked` GPUs on this host."""
        total = cgroups.mem_total() if self.host_memory is None else self.host_memory
        gpus = cgroups.host_gpu_count() if self.host_gpus is None else self.host_gpus
        return cgroups.memory_share(total, booked=booked, host_gpus=gpus)

    def memory_line(self) -> str:
        """What doctor says of the memory limit of a booking whose template names none."""
        if self.memory == MEMORY_OFF:
            return 'no memory limit ([engine] memory = "none")'
        if self.memory:
            return f"memory {self.memory} per container ([engine] memory)"
        share = cgroups.size_text(self.default_memory(1))
        return f"memory {share} per booked GPU by default (the host's memory less a reserve)"

    def cgroup_args(self) -> builtins.list[str]:
        """Where the engine puts a container's cgroup, where it must be told (rootless podman)."""
        return []

    def log_args(self) -> builtins.list[str]:
        """A log driver that honours a size cap, and the cap: LOG_MAX_SIZE on disk per container
        (podman and Docker spell it their own way; an engine plugin's log is its own business)."""
        return []

    def network_args(self, spec: ContainerSpec) -> builtins.list[str]:
        """Private (the default): the container's own network namespace with only the booking's
        port published on the host, where sshd listens inside on that same port; a booker's other
        services stay inside and cannot hold a host port. Host: sshd binds the host's port itself,
        and every booker's services share the host's ports (an admin's explicit choice)."""
        if self.network == "host":
            return ["--network", "host"]
        return [*self.private_network_args(), *self.publish_args(spec.port)]

    def publish_args(self, port: int) -> builtins.list[str]:
        """`port` published on every address of both families (Docker's proxy and rootless
        podman's rootlesskit bind one socket for both), so no local account can squat [::]:PORT."""
        return ["--publish", f"{port}:{port}"]

    def private_network_args(self) -> builtins.list[str]:
        """The engine's per-container network: a bridge unless the engine spells its own."""
        return ["--network", "bridge"]

    def prepare_network(self, spec: ContainerSpec) -> None:
        """Make what the booking's own network needs before its `run`, where the engine must."""

    def release_network(self, name: str) -> None:
        """Remove what `prepare_network` made for the container `name`, after it is removed."""

    def gpu_args(self, injection: GpuInjection, *, booking_id: str = "") -> builtins.list[str]:
        """The `run` flags that apply the injection: device nodes, binds and environment, which
        both CLIs spell alike, then the engine's own way to hide the other GPUs' /proc entries.

        `--cap-drop MKNOD`: with the default capabilities NVML (ModifyDeviceFiles=1) creates the
        other GPUs' /dev/nvidiaN inside the container (seen on a 2-GPU host); the device cgroup
        keeps them unusable, but they should not be there. Device rules are "rw", never "m".
        """
        args = ["--cap-drop", "MKNOD"]
        for device in injection.devices:
            args += [
                "--device",
                f"{_checked(device.host, 'device')}:{_checked(device.container, 'device')}:rw",
            ]
        for bind in injection.binds:
            mode = ":ro" if bind.read_only else ""
            args += ["-v", f"{_checked(bind.source, 'path')}:{_checked(bind.target, 'path')}{mode}"]
        for name, value in injection.environment:
            args += ["-e", f"{name}={value}"]
        return args + self.gpu_isolation_args(injection, booking_id=booking_id)



def mount_path_problem(mount: Mount) -> str | None:
    """`--volume` splits on ':' (and options on ','): a path with either cannot be bound."""
    text = str(mount.source)
    if ":" in text or ":" in mount.target or "," in text:
        return f"mount path {text} or {mount.target} contains ':' or ','"
    return None


def _volume(mount: Mount) -> str:
    return f"{mount.source}:{mount.target}:{'ro' if mount.read_only else 'rw'}"


def _checked(path: str | Path, what: str) -> str:
    text = str(path)
    # -v and --device split on ':'; a comma would break --mount and --security-opt mask lists.
    if ":" in text or "," in text or "\n" in text:
        raise DriverError(f"{what} {text!r} contains ':' or ',' and cannot be passed to the engine")
    return text


def checked_proc_path(path: str) -> str:
    return _checked(path, "/proc path")


