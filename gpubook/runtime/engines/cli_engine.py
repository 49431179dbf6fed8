"""What podman and Docker share: both are driven through a CLI that takes the same `run` flags.

`CliEngine` is the `Engine` (and `Builder`, `ServiceRunner`, `IdMapper`) they both are, put
together from three phases: cli_transport.py runs the binary (argv lists only) and reads
containers back from their labels, cli_argv.py builds the `run` argv from a ContainerSpec, and
cli_images.py pulls, builds and imports. What differs between engines is a handful of hooks
(`global_argv`, `userns_args`, `gpu_isolation_args`, `host_owner`, `network_checks`, …) that each
engine module defines for itself, so no engine inherits another's flags.
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import logging
import math
import os
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from gpubook.runtime.checks import Check
from gpubook.runtime.engines import network_checks
from gpubook.runtime.engines.cli_argv import LOG_MAX_SIZE, MEMORY_OFF, CliArgv, checked_proc_path, mount_path_problem
from gpubook.runtime.engines.cli_images import BUILD_TIMEOUT, CliImages
from gpubook.runtime.engines.cli_transport import (
    EXEC_OUTPUT_LIMIT,
    QUICK_TIMEOUT,
    labels_of,
    message_of,
)
from gpubook.runtime.engines.spec import (
    LABEL_BOOKING,
    LABEL_SERVICE,
    ContainerInfo,
    ContainerSpec,
    ExecResult,
    ServiceSpec,
    SpecTaken,
    info_from_labels,
    permanent,
)
from gpubook.runtime.errors import EngineError
from gpubook.runtime.mounts import Mount
from gpubook.runtime.ports import bind_error

__all__ = [  # what the engine modules and tests take from here, wherever it lives now
    "BUILD_TIMEOUT", "EXEC_OUTPUT_LIMIT", "EXEC_TIMEOUT", "LOG_MAX_SIZE", "LOG_READ_LIMIT", "MEMORY_OFF",
    "QUICK_TIMEOUT", "RUN_TIMEOUT", "CliEngine", "checked_proc_path", "message_of",
]

log = logging.getLogger(__name__)

RUN_TIMEOUT = 300.0  # seconds for `run` (a first start may set up storage)
EXEC_TIMEOUT = 60.0  # seconds for `exec` when the caller names none (a booker's container may hang it)
ANY_ADDRESS = ("0.0.0.0", "::")  # noqa: S104 - sshd binds a booking's port on both families
FORWARDER_GRACE = 30.0  # seconds for a port forwarder to exit after its container's conmon was ended
LOG_READ_LIMIT = 1024 * 1024  # bytes of a container's log that `logs` keeps (its end)


class CliEngine(CliArgv, CliImages):
    """An engine driven through its CLI: the protocol's verbs, services, ids and the preflight."""

    def start(self, spec: ContainerSpec) -> ContainerInfo:
        """Start the booking's container; a no-op if it already runs with the same spec."""
        current = self.inspect(spec.name)
        if current is not None:
            if current.running and current.spec_hash == spec.spec_hash:
                log.info("booking %s: already running as %s", spec.booking_id, spec.name)
                return current
            if current.running:
                raise SpecTaken(spec, current)
            self._remove_leftover(current)  # an exited leftover of an earlier start (a died container)
        else:
            self._end_unlisted(spec.name)  # an earlier `run` killed midway, still running
        # A died container's port forwarder lets go of the booking's port only once that container is
        # removed (just above, or by the listing that found its namespace lost), a moment later.
        wait_port_free(spec.port, seconds=FORWARDER_GRACE)
        self._check_port_free(spec)
        self.ensure_image(spec.image)
        self._check_mounts(spec)
        self.prepare_network(spec)
        try:
            info = self._run(spec)
        except EngineError:
            try:
                removed = self._remove_half_there(spec.name)
            except EngineError as error:
                log.warning("booking %s: looking for a half-made %s failed: %s", spec.booking_id, spec.name, error)
                removed = False
            if not removed:
                raise  # the run's own error is the one to tell
            info = self._run(spec)  # once more, its name free again
        if info is None:
            raise EngineError(
                f"booking {spec.booking_id}: {spec.name} vanished right after its start"
            )
        return info

    def _run(self, spec: ContainerSpec) -> ContainerInfo | None:
        """`run` the booking's container; on failure remove what this call made, and end a container
        a `run` killed midway left running unlisted."""
        with tempfile.TemporaryDirectory(prefix="gpubook-run-") as folder:
            cidfile = Path(folder) / "cid"
            argv = self.run_args(spec)
            argv = [argv[0], "--cidfile", str(cidfile), *argv[1:]]
            try:
                self._call(argv, timeout=RUN_TIMEOUT, exclusive=self.first_use(spec.image, "booking"))
                self.used(spec.image, "booking")
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
                with contextlib.suppress(EngineError):  # the run's own error is the one to tell
                    if self.inspect(spec.name) is None:  # a `run` killed midway may have left it running
                        self._end_unlisted(spec.name)
                raise
        return info

    def stop(self, name: str, grace: float) -> None:
        """SIGTERM, `grace` seconds for the booker's work to finish, SIGKILL; then remove it (a
        booking's container or a service's; anything else of that name is left alone)."""
        raws = self._inspect_raw([name], missing_ok=True)
        if not raws:
            # None by that name, or one half there that only the engine's listing knows (a `run` or `rm`
            # killed midway): that one goes, or it would be cleared again every pass and hold its name.
            self._remove_half_there(name)
            return
        labels = labels_of(raws[0])
        if not (labels.get(LABEL_BOOKING) or labels.get(LABEL_SERVICE)):
            return
        # One left "removing" (an `rm` killed midway) runs nothing, and `stop` refuses it ("container
        # state improper"): only its removal is left to do.
        if (raws[0].get("State") or {}).get("Status") != "removing":
            self._call(
                ["stop", "--time", str(math.ceil(grace)), name],
                timeout=grace + QUICK_TIMEOUT,
                missing_ok=True,
            )
        self._remove(name)
        if labels.get(LABEL_BOOKING):
            self.release_network(name)

    def _end_unlisted(self, name: str) -> bool:
        """End a container of `name` whose processes run while the engine lists none (podman's
        conmon, conmon.py); True if one was. None here: docker's run under dockerd, which lists them all."""
        return False

    def _remove_half_there(self, name: str) -> bool:
        """Remove a container of `name` that the engine lists but cannot inspect (a `run` or `rm` killed
        midway), which holds its name and no stop by name reaches; True if one was. None here: dockerd
        makes and removes a container in one step."""
        return False

    def _remove_leftover(self, current: ContainerInfo) -> None:
        """Remove a container that does not run as it should. One left "stopping" (a `stop` killed
        midway) is stopped first: podman 4.3's `rm --force` forgets it while it runs on, unlisted,
        holding its GPUs and port (fixed in podman 4.4)."""
        if current.state == "stopping":
            self._process(["stop", "--time", "0", current.name], timeout=QUICK_TIMEOUT)
        self._remove(current.name)

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
            self._remove_leftover(current)
        self.ensure_image(spec.image)
        self._call(self.service_args(spec), timeout=RUN_TIMEOUT, exclusive=self.first_use(spec.image, "service"))
        self.used(spec.image, "service")
        info = self.inspect_service(spec.name)
        if info is None:
            raise EngineError(f"service {spec.service}: {spec.name} vanished right after its start")
        return info

    def inspect_service(self, name: str) -> ContainerInfo | None:
        raws = self._inspect_raw([name], missing_ok=True)
        if not raws or not labels_of(raws[0]).get(LABEL_SERVICE):
            return None
        return self._info(raws[0])

    def signal(self, name: str, signal_name: str) -> None:
        self._call(["kill", "--signal", signal_name, name], timeout=QUICK_TIMEOUT)


    def logs(self, name: str, *, tail: int | None = None) -> str:
        """The container's log (its last `tail` lines), at most its last LOG_READ_LIMIT bytes of
        stdout and of stderr: what a booker writes there never fills the daemon's memory."""
        tail_args = ["--tail", str(tail)] if tail is not None else []
        _, stdout, stderr = self._bounded(["logs", *tail_args, name], timeout=QUICK_TIMEOUT,
                                          limit=LOG_READ_LIMIT, keep_end=True)
        return stdout + stderr


    def preflight(self) -> builtins.list[Check]:
        """The engine's own checks, then its networks' (doctor's order: engine, then network); only
        the first where the engine does not run at all (nothing more can be asked of it)."""
        checks = self.engine_checks()
        return checks if not checks[0].ok else [*checks, *self.network_checks()]

    def engine_checks(self) -> builtins.list[Check]:
        """The binary is installed and runs; engines add their own checks after this one."""
        return [self.binary_check()]

    def network_checks(self) -> builtins.list[Check]:
        """`[engine] network`'s line; engines add what their private network needs on this host."""
        return network_checks(self.settings)


    def host_owner(self, uid: int, gid: int) -> tuple[int, int]:
        """The host ids that files of booker `uid`/`gid` in bound folders get (and folders need)."""
        return uid, gid


    def chown(self, path: Path, uid: int, gid: int) -> None:
        """Give a data folder to host ids `uid`/`gid` (as host_owner names them); only root can."""
        if os.geteuid() == 0:
            os.chown(path, uid, gid, follow_symlinks=False)

    def data_owner_argv(self) -> builtins.list[str] | None:
        """Bookers' files belong to their host ids: only root reads them all."""
        return [] if os.geteuid() == 0 else None


    def _check_port_free(self, spec: ContainerSpec) -> None:
        check_port_free(spec.booking_id, spec.port)

    def _check_mounts(self, spec: ContainerSpec) -> None:
        for mount in spec.mounts:
            if problem := mount_problem(mount):
                raise permanent(f"booking {spec.booking_id}: {problem}")


def mount_problem(mount: Mount) -> str | None:
    """Why `mount` cannot be bound (a path the CLI would split, a source that is not there); None if it can."""
    if problem := mount_path_problem(mount):
        return problem
    if not mount.source.exists():
        return f"mount source {mount.source} does not exist"
    return None


def wait_port_free(port: int, *, seconds: float) -> None:
    """Until nothing binds `port` any more, for at most `seconds` (check_port_free then tells)."""
    deadline = time.monotonic() + seconds
    while any(bind_error(address, port) == errno.EADDRINUSE for address in ANY_ADDRESS):
        if time.monotonic() >= deadline:
            return
        time.sleep(0.2)


def check_port_free(booking_id: str, port: int) -> None:
    """An EngineError unless `port` is free on every address of both families, as sshd binds it."""
    for address in ANY_ADDRESS:
        error = bind_error(address, port)
        if error == errno.EADDRINUSE:
            raise EngineError(f"booking {booking_id}: port {port} is already in use on this host")
        if error not in (None, errno.EADDRNOTAVAIL):
            raise EngineError(f"booking {booking_id}: cannot use port {port}: {os.strerror(error)}")
