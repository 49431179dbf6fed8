"""Docker (the nvidia-docker sites): the shared CLI engine with Docker's own flags.

Docker has no per-container user namespace: a container shares dockerd's (the host's, unless
dockerd runs with `userns-remap`). The booker's uid inside is therefore the same number on the
host, so bound folders chown'ed to the booker (as root) stay the booker's. Root inside a Docker
container is host root with the capabilities below only; sites that need the stronger boundary
use podman (rootless or with its per-container --uidmap).

Docker cannot hide the other GPUs' /proc/driver/nvidia/gpus entries. Its CLI has no mask option
(podman's `--security-opt mask=` does not exist there); HostConfig.MaskedPaths exists only in the
API and replaces Docker's default list; and a tmpfs or bind mount over the folder is refused by
runc, which allows no mounts inside /proc beyond a few lxcfs files. So a Docker booking on some
of the GPUs gets no mask flag, a warning at each start, and doctor says so: the other GPUs' device
nodes are still absent and the device cgroup denies them; only their model, UUID and bus id show.
"""

from __future__ import annotations

import builtins
import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from gpubook.runtime.checks import Check
from gpubook.runtime.engines.cli_engine import LOG_MAX_SIZE, QUICK_TIMEOUT, CliEngine, message_of
from gpubook.runtime.engines.spec import permanent
from gpubook.runtime.errors import EngineError

if TYPE_CHECKING:
    from gpubook.runtime.engines import EngineOptions, EngineSettings
    from gpubook.runtime.nvidia.model import GpuInjection

log = logging.getLogger(__name__)

PROC_ISOLATION = (
    "Docker cannot hide the other GPUs' /proc/driver/nvidia/gpus entries (model, UUID, bus id); "
    "their device nodes are still isolated"
)

DOCKER_ICC = (
    "Docker publishes only each booking's SSH port, but bookings on its bridge reach each other's "
    'services unless dockerd runs with "icc": false (and its iptables rules) in /etc/docker/daemon.json'
)


class DockerEngine(CliEngine):
    name = "docker"
    package = "docker.io"
    # [gpus] mps, refused by the config: no writable host folder is bound into a Docker container (gpu_args).
    mps_refused = ('cannot be used with [engine] name = "docker": the MPS pipe folder is a host folder every '
                   "booking writes into, and root in a Docker container is root on the host (a setuid file left "
                   "there runs as root for any host login); use podman, or set mps = false")

    def __init__(self, settings: EngineSettings, options: EngineOptions) -> None:
        # OCI runtime, storage driver and cgroups are dockerd's own settings, not the client's.
        super().__init__(settings, options)

    def engine_checks(self) -> builtins.list[Check]:
        checks = super().engine_checks()
        if checks[0].ok:
            checks.append(self.limits_check())
            # A limit to know of, not a fault to fix: doctor warns without failing.
            checks.append(Check("engine GPU isolation", False, PROC_ISOLATION,
                                '[engine] name = "podman" hides them', optional=True))
        return checks

    def network_checks(self) -> builtins.list[Check]:
        """A limit to know of (gpubook works, bookings are less apart): Docker's default bridge lets
        containers talk."""
        checks = super().network_checks()
        if self.network == "host":
            return checks
        return [*checks, Check("engine network isolation", False, DOCKER_ICC,
                               'put "icc": false in /etc/docker/daemon.json and restart dockerd', optional=True)]

    def limits_check(self) -> Check:
        """dockerd (root) sets every container's cgroup limits where its cgroups have the
        controllers: `docker info` says whether they do."""
        pids = f"pids {self.pids_limit} per container" if self.pids_limit else "no process limit"
        line = f"{pids}, {self.memory_line()}"
        try:
            done = self._process(["info", "--format", "{{json .}}"], timeout=QUICK_TIMEOUT)
        except EngineError as error:
            return Check("engine limits", False, f"{line}: docker info: {error}", "check that dockerd runs")
        if done.returncode != 0:
            return Check("engine limits", False, f"{line}: docker info: {message_of(done)[:200]}",
                         "check that dockerd runs and this user may use its socket")
        try:
            info = json.loads(done.stdout)
        except ValueError:
            info = {}
        missing = [name for name, key in (("memory", "MemoryLimit"), ("pids", "PidsLimit")) if not info.get(key)]
        version = info.get("CgroupVersion", "?")
        if missing:
            return Check("engine limits", False,
                         f"{line}: NOT enforced: dockerd reports no {' or '.join(missing)} limit support "
                         f"(cgroups v{version})", "enable the memory and pids cgroup controllers for dockerd")
        return Check("engine limits", True, f"{line}: enforced by dockerd (cgroups v{version})")

    def log_args(self) -> builtins.list[str]:
        """json-file, whatever dockerd's default driver is (journald, syslog and others take no
        max-size, or keep the log elsewhere), one file of at most LOG_MAX_SIZE."""
        return ["--log-driver", "json-file", "--log-opt", f"max-size={LOG_MAX_SIZE}", "--log-opt", "max-file=1"]

    def auth_args(self, auth_file: Path | None, folder: Path) -> tuple[builtins.list[str], builtins.list[str]]:
        """Docker reads credentials from DIR/config.json (`--config DIR`, before the command): a
        private copy of the auth.json, in a folder that lives as long as the pull."""
        if auth_file is None:
            return [], []
        copy = folder / "config.json"
        copy.write_bytes(auth_file.read_bytes())
        copy.chmod(0o600)
        return ["--config", str(folder)], []

    def storage_path(self) -> Path:
        return Path(self._call(["info", "--format", "{{.DockerRootDir}}"]).strip())

    def image_exists(self, image: str) -> bool:
        return self._process(["image", "inspect", image], timeout=QUICK_TIMEOUT).returncode == 0

    def gpu_args(self, injection: GpuInjection, *, booking_id: str = "") -> builtins.list[str]:
        """As every engine's, but no writable host folder of the injection (the MPS pipe folder):
        root inside is host root here, and a setuid copy of a shell it leaves there runs as root for
        any host login (issue 22, finding 4). The config refuses [gpus] mps with Docker already."""
        for bind in injection.binds:
            if not bind.read_only:
                raise permanent(
                    f"booking {booking_id or '?'}: the GPU injection would bind {bind.source} writable, and "
                    f"root in a Docker container is root on the host (a setuid file left there would run "
                    f"as root); Docker bookings get no MPS pipe folder: use podman or [gpus] mps = false")
        return super().gpu_args(injection, booking_id=booking_id)

    def gpu_isolation_args(self, injection: GpuInjection, *, booking_id: str) -> builtins.list[str]:
        if injection.hidden_proc_paths:
            log.warning(
                "booking %s: %s (%s stays visible in its container)",
                booking_id or "?",
                PROC_ISOLATION,
                ", ".join(injection.hidden_proc_paths),
            )
        return []
