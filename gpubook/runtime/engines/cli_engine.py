"""What podman and Docker share: both are driven through a CLI that takes the same `run` flags.

`CliEngine` runs the binary (argv lists only), reads containers back from their labels, and builds
the `run` argv from a ContainerSpec. What differs between engines is a handful of hooks
(`global_argv`, `userns_args`, `gpu_isolation_args`, `host_owner`, …) that each engine module
defines for itself, so no engine inherits another's flags.
"""

from __future__ import annotations

import builtins
import errno
import json
import logging
import math
import os
import selectors
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from gpubook.runtime import cgroups, images
from gpubook.runtime.checks import Check
from gpubook.runtime.engines.spec import (
    DROP_CAPABILITIES,
    KEEP_CAPABILITIES,
    LABEL_BOOKING,
    LABEL_SERVICE,
    ContainerInfo,
    ContainerSpec,
    ExecResult,
    ServiceSpec,
    info_from_labels,
    permanent,
)
from gpubook.runtime.errors import DriverError, EngineError
from gpubook.runtime.mounts import Mount

if TYPE_CHECKING:
    from gpubook.runtime.engines import EngineOptions, EngineSettings
    from gpubook.runtime.nvidia.model import GpuInjection

log = logging.getLogger(__name__)

QUICK_TIMEOUT = 60.0  # seconds for commands that should answer at once
RUN_TIMEOUT = 300.0  # seconds for `run` (a first start may set up storage)
BUILD_TIMEOUT = 3600.0  # seconds for building an image (apt-get inside)
EXEC_TIMEOUT = 60.0  # seconds for `exec` when the caller names none (a booker's container may hang it)
EXEC_OUTPUT_LIMIT = 64 * 1024  # bytes of an exec's stdout and of its stderr kept; the rest is read and dropped
MEMORY_OFF = "none"  # [engine] memory that turns the default limit off
# A container's log is the booker's to fill (issue 22, finding 6): the engine keeps at most
# LOG_MAX_SIZE of it on disk, and `logs` keeps the last LOG_READ_LIMIT bytes of what it reads.
LOG_MAX_SIZE = "10m"  # the engines' unit: 10 MB
LOG_READ_LIMIT = 1024 * 1024  # bytes


class CliEngine:
    name: ClassVar[str]
    package: ClassVar[str]  # the Debian package that installs the binary, for doctor's fix

    def __init__(self, settings: EngineSettings, options: EngineOptions) -> None:
        self.settings = settings
        self.binary = settings.binary or self.name
        self.network = settings.network
        self.ulimits = tuple(settings.ulimits)
        self.pids_limit = settings.pids_limit
        self.memory = settings.memory
        self.global_args = tuple(options.global_args)
        self.host_memory = options.host_memory
        self.host_gpus = options.host_gpus

    # --- the protocol --------------------------------------------------------------------------

    def ensure_image(self, image: str, *, pull: bool = False) -> None:
        if self.image_exists(image):
            return
        if not pull:
            raise permanent(
                f"image {image} is not present in {self.name}'s storage; build or "
                f"import it first (gpubook templates build NAME)"
            )
        self._call(["pull", image], timeout=BUILD_TIMEOUT)

    def start(self, spec: ContainerSpec) -> ContainerInfo:
        """Start the booking's container; a no-op if it already runs with the same spec."""
        current = self.inspect(spec.name)
        if current is not None:
            if current.running and current.spec_hash == spec.spec_hash:
                log.info("booking %s: already running as %s", spec.booking_id, spec.name)
                return current
            if current.running:
                raise permanent(
                    f"booking {spec.booking_id}: {spec.name} already runs with another "
                    f"spec (hash {current.spec_hash}, wanted {spec.spec_hash}); stop it first"
                )
            self._remove(spec.name)  # an exited leftover of an earlier start
        self._check_port_free(spec)
        self.ensure_image(spec.image)
        self._check_mounts(spec)
        self.prepare_network(spec)
        with tempfile.TemporaryDirectory(prefix="gpubook-run-") as folder:
            cidfile = Path(folder) / "cid"
            argv = self.run_args(spec)
            argv = [argv[0], "--cidfile", str(cidfile), *argv[1:]]
            try:
                self._call(argv, timeout=RUN_TIMEOUT)
                created = cidfile.read_text().strip() if cidfile.exists() else ""
                # What runs is what the spec says (its labels): read back from the engine only
                # when it gave no id. One engine process less per start (bookings starting
                # together share the cores); a container that dies at once is seen by the probe.
                info = (info_from_labels(name=spec.name, id=created, state="running", image=spec.image,
                                         labels=spec.labels()) if created else self.inspect(spec.name))
            except EngineError:
                # Only the container this call created (its id in the cidfile) is removed: after a
                # `run` refused because the name exists (another daemon's container), nothing is.
                created = cidfile.read_text().strip() if cidfile.exists() else ""
                if created:
                    self._remove(created)
                raise
        if info is None:
            raise EngineError(
                f"booking {spec.booking_id}: {spec.name} vanished right after its start"
            )
        return info

    def stop(self, name: str, grace: float) -> None:
        """SIGTERM, `grace` seconds for the booker's work to finish, SIGKILL; then remove it (a
        booking's container or a service's; anything else of that name is left alone)."""
        raws = self._inspect_raw([name], missing_ok=True)
        labels = _labels(raws[0]) if raws else {}
        if not (labels.get(LABEL_BOOKING) or labels.get(LABEL_SERVICE)):
            return
        self._call(
            ["stop", "--time", str(math.ceil(grace)), name],
            timeout=grace + QUICK_TIMEOUT,
            missing_ok=True,
        )
        self._remove(name)
        if labels.get(LABEL_BOOKING):
            self.release_network(name)

    def list(self) -> builtins.list[ContainerInfo]:
        for _attempt in range(3):  # a container may vanish between `ps` and `inspect`
            ids = self._call(
                ["ps", "--all", "--quiet", "--no-trunc", "--filter", f"label={LABEL_BOOKING}"]
            ).split()
            if not ids:
                return []
            try:
                return [self._info(raw) for raw in self._inspect_raw(ids)]
            except EngineError:
                continue
        raise EngineError(f"{self.name}: containers kept changing while being listed")

    def inspect(self, name: str) -> ContainerInfo | None:
        raws = self._inspect_raw([name], missing_ok=True)
        if not raws:
            return None
        info = self._info(raws[0])
        return info if info.booking_id else None  # not one of gpubook's containers

    def exec(self, name: str, argv: Sequence[str], *, user: str | None = None,
             timeout: float | None = None) -> ExecResult:
        """Bounded in time and output: what runs inside belongs to the booker, who may stop it or
        make it write without end. Past `timeout` the exec is killed and an EngineError raised."""
        user_args = ["--user", user] if user else []
        limit = EXEC_TIMEOUT if timeout is None else timeout
        returncode, stdout, stderr = self._bounded(["exec", *user_args, name, *argv], timeout=limit)
        return ExecResult(returncode, stdout, stderr)

    def start_service(self, spec: ServiceSpec) -> ContainerInfo:
        """Start the service container unless it runs with this very spec; an exited one, or one
        with another spec (a changed port or image), is replaced."""
        current = self.inspect_service(spec.name)
        if current is not None:
            if current.running and current.spec_hash == spec.spec_hash:
                return current
            self._remove(spec.name)
        self.ensure_image(spec.image)
        self._call(self.service_args(spec), timeout=RUN_TIMEOUT)
        info = self.inspect_service(spec.name)
        if info is None:
            raise EngineError(f"service {spec.service}: {spec.name} vanished right after its start")
        return info

    def inspect_service(self, name: str) -> ContainerInfo | None:
        raws = self._inspect_raw([name], missing_ok=True)
        if not raws or not _labels(raws[0]).get(LABEL_SERVICE):
            return None
        return self._info(raws[0])

    def signal(self, name: str, signal_name: str) -> None:
        self._call(["kill", "--signal", signal_name, name], timeout=QUICK_TIMEOUT)

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
            if problem := _mount_path_problem(mount):
                raise permanent(f"service {spec.service}: {problem}")
            argv += ["--volume", _volume(mount)]
        argv += ["--entrypoint", spec.command[0], spec.image, *spec.command[1:]]
        return argv

    def logs(self, name: str, *, tail: int | None = None) -> str:
        """The container's log (its last `tail` lines), at most its last LOG_READ_LIMIT bytes of
        stdout and of stderr: what a booker writes there never fills the daemon's memory."""
        tail_args = ["--tail", str(tail)] if tail is not None else []
        _, stdout, stderr = self._bounded(["logs", *tail_args, name], timeout=QUICK_TIMEOUT,
                                          limit=LOG_READ_LIMIT, keep_end=True)
        return stdout + stderr

    def build(self, tag: str, context: Path, *, containerfile: str = "Containerfile") -> None:
        # Host network: these machines have no slirp4netns for the unprivileged user.
        self._call(
            [
                "build",
                "--network",
                "host",
                "--tag",
                tag,
                "--file",
                str(context / containerfile),
                str(context),
            ],
            timeout=BUILD_TIMEOUT,
        )

    def import_rootfs(self, tarball: Path, tag: str) -> None:
        self._call(["import", str(tarball), tag], timeout=BUILD_TIMEOUT)

    # --- images from registries (gpubook/runtime/images.py drives these) --------------------------------

    def pull(self, image: str, *, auth_file: Path | None = None) -> None:
        """Pull one reference, with the site's credentials; raises PullError with the reason."""
        images.parse_reference(image)  # a reference, never an option
        with tempfile.TemporaryDirectory(prefix="gpubook-auth-") as folder:
            before, after = self.auth_args(auth_file, Path(folder))
            done = self._process([*before, "pull", *after, "--", image], timeout=BUILD_TIMEOUT)
        if done.returncode != 0:
            message = message_of(done)
            raise images.PullError(images.classify(message), message)

    def auth_args(self, auth_file: Path | None, folder: Path) -> tuple[builtins.list[str], builtins.list[str]]:
        """Flags before and after `pull` that name the credentials (auth.json format)."""
        raise NotImplementedError

    def tag(self, image: str, target: str) -> None:
        self._call(["tag", image, target])

    def remove_image(self, image: str) -> None:
        self._call(["rmi", image])  # refused while a container uses it

    def image_facts(self, image: str) -> images.ImageFacts | None:
        done = self._process(["image", "inspect", image], timeout=QUICK_TIMEOUT)
        if done.returncode != 0:
            return None
        raw = (json.loads(done.stdout) or [{}])[0]
        return images.ImageFacts(id=str(raw.get("Id", "")), size=int(raw.get("Size") or 0),
                                 digests=tuple(raw.get("RepoDigests") or ()), created=str(raw.get("Created", "")))

    def images_in_use(self) -> set[str]:
        ids = self._call(["ps", "--all", "--quiet", "--no-trunc"]).split()
        if not ids:
            return set()
        done = self._process(["inspect", "--format", "{{.Image}}", *ids], timeout=QUICK_TIMEOUT)
        return {line.strip().removeprefix("sha256:") for line in done.stdout.splitlines() if line.strip()}

    def storage_path(self) -> Path:
        raise NotImplementedError

    def preflight(self) -> builtins.list[Check]:
        """The binary is installed and runs; engines add their own checks after this one."""
        return [self.binary_check()]

    # --- what each engine spells its own way ---------------------------------------------------

    def global_argv(self) -> builtins.list[str]:
        return [self.binary, *self.global_args]

    def image_exists(self, image: str) -> bool:
        raise NotImplementedError

    def userns_args(self, spec: ContainerSpec) -> builtins.list[str]:
        """The container's own user namespace, where the engine gives it one."""
        return []

    def host_owner(self, uid: int, gid: int) -> tuple[int, int]:
        """The host ids that files of booker `uid`/`gid` in bound folders get (and folders need)."""
        return uid, gid

    def service_userns_args(self) -> builtins.list[str]:
        """A service container's ids: root the engine's own user, the others as in bookings."""
        return []

    def chown(self, path: Path, uid: int, gid: int) -> None:
        """Give a data folder to host ids `uid`/`gid` (as host_owner names them); only root can."""
        if os.geteuid() == 0:
            os.chown(path, uid, gid, follow_symlinks=False)

    def data_owner_argv(self) -> builtins.list[str] | None:
        """Bookers' files belong to their host ids: only root reads them all."""
        return [] if os.geteuid() == 0 else None

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

    # --- building the run command --------------------------------------------------------------

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

    # --- checks before anything starts ---------------------------------------------------------

    def binary_check(self) -> Check:
        path = shutil.which(self.binary)
        if path is None:
            return Check(
                "engine",
                False,
                f"{self.binary} is not installed or not on PATH",
                f"install it (apt-get install {self.package}) or set [engine] binary",
            )
        try:
            done = subprocess.run(
                [path, "--version"], capture_output=True, text=True, timeout=30, check=False
            )
        except (OSError, subprocess.TimeoutExpired) as error:
            return Check("engine", False, f"{path} --version failed: {error}", f"check that {path} runs")
        if done.returncode != 0:
            return Check(
                "engine", False, f"{path} --version: {done.stderr.strip()[:200]}", f"check that {path} runs"
            )
        return Check("engine", True, done.stdout.strip())

    def _check_port_free(self, spec: ContainerSpec) -> None:
        for family, address in ((socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")):  # noqa: S104
            try:
                probe = socket.socket(family, socket.SOCK_STREAM)
            except OSError:
                continue  # no IPv6 on this host
            with probe:
                # As sshd does: a port held only by TIME_WAIT leftovers is free for it.
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6:
                    probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                try:
                    probe.bind((address, spec.port))
                except OSError as error:
                    if error.errno == errno.EADDRINUSE:
                        raise EngineError(
                            f"booking {spec.booking_id}: port {spec.port} is already in "
                            f"use on this host"
                        ) from None
                    if error.errno != errno.EADDRNOTAVAIL:
                        raise EngineError(
                            f"booking {spec.booking_id}: cannot use port {spec.port}: "
                            f"{error.strerror}"
                        ) from None

    def _check_mounts(self, spec: ContainerSpec) -> None:
        for mount in spec.mounts:
            if problem := _mount_path_problem(mount):
                raise permanent(f"booking {spec.booking_id}: {problem}")
            if not mount.source.exists():
                raise permanent(f"booking {spec.booking_id}: mount source {mount.source} does not exist")

    # --- running the engine --------------------------------------------------------------------

    def _inspect_raw(
        self, names: Sequence[str], *, missing_ok: bool = False
    ) -> builtins.list[dict[str, Any]]:
        done = self._process(["container", "inspect", *names], timeout=QUICK_TIMEOUT)
        if done.returncode != 0:
            if missing_ok and _is_missing(done.stderr):
                return []
            raise EngineError(f"{self.name} inspect: {message_of(done)}")
        try:
            return list(json.loads(done.stdout or "[]"))
        except ValueError as error:
            raise EngineError(f"{self.name} inspect gave unreadable JSON: {error}") from None

    def _remove(self, name: str) -> None:
        self._process(["rm", "--force", name], timeout=QUICK_TIMEOUT)

    def _info(self, raw: dict[str, Any]) -> ContainerInfo:
        config = raw.get("Config") or {}
        image = config.get("Image") or raw.get("ImageName") or raw.get("Image") or ""
        return info_from_labels(
            name=raw.get("Name", ""),
            id=raw.get("Id", ""),
            state=(raw.get("State") or {}).get("Status", "unknown"),
            image=image,
            labels=_labels(raw),
            pid=int((raw.get("State") or {}).get("Pid") or 0),
        )

    def _process(self, args: Sequence[str], *, timeout: float) -> subprocess.CompletedProcess[str]:
        argv = [*self.global_argv(), *args]
        try:
            return subprocess.run(
                argv,
                capture_output=True,
                text=True,
                timeout=timeout,
                stdin=subprocess.DEVNULL,
                check=False,
            )
        except FileNotFoundError:
            raise permanent(f"{self.name}: {self.binary} is not installed or not on PATH") from None
        except subprocess.TimeoutExpired:
            raise EngineError(f"{self.name} {args[0]}: no answer within {timeout:.0f} s") from None

    def _bounded(self, args: Sequence[str], *, timeout: float, limit: int = EXEC_OUTPUT_LIMIT,
                 keep_end: bool = False) -> tuple[int, str, str]:
        """Run the engine with a deadline, keeping at most `limit` bytes of stdout and of stderr
        (the first ones, or the last with `keep_end`)."""
        argv = [*self.global_argv(), *args]
        try:
            process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE)
        except FileNotFoundError:
            raise permanent(f"{self.name}: {self.binary} is not installed or not on PATH") from None
        deadline = time.monotonic() + timeout
        kept = _read_bounded(process, deadline=deadline, limit=limit, keep_end=keep_end)
        if kept is not None:
            try:
                return process.wait(timeout=max(0.0, deadline - time.monotonic())), kept[0], kept[1]
            except subprocess.TimeoutExpired:
                pass
        process.kill()
        process.wait()
        raise EngineError(f"{self.name} {args[0]}: no answer within {timeout:.0f} s")

    def _call(
        self, args: Sequence[str], *, timeout: float = QUICK_TIMEOUT, missing_ok: bool = False
    ) -> str:
        done = self._process(args, timeout=timeout)
        if done.returncode != 0 and not (missing_ok and _is_missing(done.stderr)):
            raise EngineError(f"{self.name} {args[0]}: {message_of(done)}")
        return done.stdout


def _read_bounded(process: subprocess.Popen[bytes], *, deadline: float,
                  limit: int, keep_end: bool = False) -> tuple[str, str] | None:
    """Read both pipes to their end, keeping `limit` bytes of each (the last ones with
    `keep_end`); None past the deadline."""
    assert process.stdout is not None and process.stderr is not None  # noqa: S101 - made with PIPE
    kept = {process.stdout.fileno(): bytearray(), process.stderr.fileno(): bytearray()}
    with selectors.DefaultSelector() as selector, process.stdout, process.stderr:
        for pipe in (process.stdout, process.stderr):
            selector.register(pipe, selectors.EVENT_READ)
        while selector.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            for key, _ in selector.select(timeout=left):
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    selector.unregister(key.fileobj)
                    continue
                buffer = kept[key.fd]
                if keep_end:
                    buffer += chunk
                    del buffer[: max(0, len(buffer) - limit)]
                else:
                    buffer += chunk[: max(0, limit - len(buffer))]
    out, err = (bytes(kept[fd]).decode(errors="replace") for fd in kept)
    return out, err


def _labels(raw: dict[str, Any]) -> dict[str, str]:
    """A container's labels from `inspect`'s JSON."""
    return dict((raw.get("Config") or {}).get("Labels") or {})


def _mount_path_problem(mount: Mount) -> str | None:
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


def _is_missing(stderr: str) -> bool:
    text = stderr.lower()
    return "no such" in text or "not known" in text or "no container with name" in text


def message_of(done: subprocess.CompletedProcess[str]) -> str:
    text = (done.stderr or done.stdout).strip()
    return text.removeprefix("Error: ").strip() or f"exit status {done.returncode}"
