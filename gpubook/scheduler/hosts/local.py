"""The machine the daemon runs on, as a host: a container engine, the host's driver, SSH.

Starting a booking here means: the booker's data folders, the GPU injection for exactly the
booked GPUs (from the driver found once per driver version), the template's image (pulled and its
sshd overlay built ahead by hosts/images.py; a start never pulls), the booking's own SSH host key,
the container, and the probe login that says SSH really answers, from the server that shows that
key. Data folders are only made on a nosuid,nodev data_root (storage.mount_problem): a booking is
refused otherwise.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from dataclasses import replace
from datetime import datetime, tzinfo
from pathlib import Path
from zoneinfo import ZoneInfo

import paramiko

from gpubook.runtime import engines, private
from gpubook.runtime.booking import booking_json, launch, ssh
from gpubook.runtime.booking import provenance as prov
from gpubook.runtime.booking.provenance_file import write as write_card_file
from gpubook.runtime.checks import Check
from gpubook.runtime.data import storage
from gpubook.runtime.engines import ContainerInfo, Engine, ExecResult, container_name
from gpubook.runtime.templates.images import Ledger
from gpubook.scheduler.core.plan import LOCAL, Accepted
from gpubook.scheduler.core.topology import ONE_MACHINE
from gpubook.scheduler.hosts import Ahead, Host
from gpubook.scheduler.hosts import start as start_steps
from gpubook.scheduler.hosts.backend import NOTHING_HELD, HostGpus, Parts, Reserved, Sampling
from gpubook.scheduler.hosts.images import ImagePreparer
from gpubook.scheduler.settings import Config


class LocalHost:
    def __init__(self, *, engine: Engine, gpus: Sequence[int], driver_version: str | None,
                 probe_key: paramiko.PKey, cache_dir: Path, data_root: Path | None = None,
                 persistent_home: bool = False, driver_roots: Sequence[Path] = (),
                 probe_address: str = "127.0.0.1", name: str = LOCAL, mps: bool = False,
                 images: ImagePreparer | None = None, parallel_starts: int = 0,
                 timezone: tzinfo | None = None) -> None:
        """`timezone`: the zone of the times bookers read inside (GPUBOOK_END, booking.json; None:
        the daemon's own)."""
        self.name = name
        self.timezone = timezone
        self.engine = engine
        self.gpus = tuple(gpus)
        self.driver_version = driver_version
        self.probe_key = probe_key
        self.cache_dir = cache_dir
        self.data_root = data_root
        self.persistent_home = persistent_home
        self.driver_roots = tuple(driver_roots)
        self.probe_address = probe_address
        self.images = images or ImagePreparer(engine=engine, ledger=Ledger(cache_dir / "images.json"))
        self.mps = mps
        # Bookings starting together: each one's engine start (CPU-bound) waits for a free slot.
        self.gates = launch.Gates(parallel_starts or os.cpu_count() or 1)

    def list(self) -> list[ContainerInfo]:
        return [replace(info, host=self.name) for info in self.engine.list()]

    def inspect(self, name: str) -> ContainerInfo | None:
        info = self.engine.inspect(name)
        return None if info is None else replace(info, host=self.name)

    # A start, an arm, their spec and provenance card are put together in hosts/start.py, whose
    # functions are these methods (the host is their `Place`): a start goes from the handler
    # straight into the one module that assembles it.
    start = start_steps.run
    arm = start_steps.arm
    spec = start_steps.spec
    provenance = start_steps.provenance

    def write_provenance(self, user: str, card: prov.Card) -> bool:
        """The ended booking's card as <data_root>/<user>/output/.gpubook/provenance.json, written as
        the owner of the booker's files without following anything the booker made there
        (gpubook/runtime/booking/provenance_file.py); False without data folders. Raises ProvenanceFileError."""
        if self.data_root is None:
            return False
        storage.check_user_name(user)
        output = Path(os.path.realpath(self.data_root)) / user / "output"
        data = json.dumps(card.to_json(zone=self.timezone), indent=2, ensure_ascii=True).encode() + b"\n"
        write_card_file(output, data, owner_argv=engines.data_owner_argv(self.engine))
        return True

    def move_end(self, booking_id: str, end: datetime) -> bool:
        """A running booking's agreed later end, written into its booking.json (False: it has none here)."""
        return booking_json.move_end(self.cache_dir, container_name(booking_id), end, zone=self.timezone)

    def prepare(self, ahead: Ahead) -> None:
        """Before the start: the booker's folders and the booking's host key (each a `podman
        unshare chown` the first time, rootless), so that at the start only the container is made."""
        start_steps.folders(self, ahead.booker)
        start_steps.host_key(self, container_name(ahead.booking_id))

    def unprepare(self, booking_id: str) -> None:
        """A booking gone or moved away before its start: its host key goes, unless a container of
        that name holds it."""
        name = container_name(booking_id)
        if self.engine.inspect(name) is None:
            ssh.forget_host_key(self.cache_dir, name)
            booking_json.forget_card(self.cache_dir, name)

    def stop(self, name: str, grace: float) -> None:
        self.engine.stop(name, grace)
        ssh.forget_host_key(self.cache_dir, name)
        booking_json.forget_card(self.cache_dir, name)
        self.gates.forget(name)

    def exec(self, name: str, argv: Sequence[str], *, timeout: float | None = None) -> ExecResult:
        return self.engine.exec(name, argv, timeout=timeout)


class OneMachine:
    """One machine as a backend around a host made elsewhere (a test's, a command's): the one host
    bookings run on. Nothing to read again between passes and nothing to reserve: the plan's GPUs
    are the host's."""

    topology = ONE_MACHINE

    def __init__(self, host: Host, *, server: str, gpus: HostGpus | None = None,
                 logs: Callable[[str], str] = lambda name: "") -> None:
        """`server`: the name bookers log in to ([host] name); `gpus`: for the status (None: as the
        host lists them); `logs`: a container's log by name, for the sampler."""
        self.host, self.server, self._logs = host, server, logs
        self._gpus = gpus or HostGpus(source="config", count=len(host.gpus), indices=host.gpus)
        self.hosts: dict[str, Host] = {host.name: host}

    def refresh(self) -> str:
        return ""

    def reserve(self, accepted: Sequence[Accepted], *, now: datetime) -> Reserved:
        return NOTHING_HELD

    def address(self, host: str) -> str:
        """This server's name, whatever the container's host label says."""
        return self.server

    @classmethod
    def preflight(cls, config: Config) -> list[Check]:
        return []  # this machine's engine, GPUs and ports are doctor's other rows

    def gpus(self) -> dict[str, HostGpus]:
        return {self.host.name: self._gpus}

    def sampling(self, world: Callable[[], Sequence[ContainerInfo]]) -> Sampling:
        return Sampling(running=world, logs=self._logs)

    @staticmethod
    def listed_here(engine: Engine) -> list[ContainerInfo] | None:
        return [replace(info, host=LOCAL) for info in engine.list()]


class LocalBackend(OneMachine):
    """`[backend] kind = "local"`: this machine, its engine, its NVIDIA driver, SSH to it."""

    def __init__(self, config: Config, parts: Parts) -> None:
        inventory = parts.inventory
        host = LocalHost(
            engine=parts.engine, gpus=tuple(gpu.index for gpu in inventory.gpus),
            driver_version=inventory.driver_version if inventory.source == "nvml" else None,
            probe_key=parts.probe_key, cache_dir=private.default_cache_dir(), data_root=config.storage.data_root,
            persistent_home=config.storage.persistent_home, driver_roots=config.nvidia.driver_roots,
            mps=config.gpu_mps, images=parts.images, parallel_starts=config.daemon.parallel_starts,
            timezone=ZoneInfo(config.host.timezone))
        super().__init__(host, server=config.host.name, gpus=HostGpus.of(inventory), logs=parts.engine.logs)
