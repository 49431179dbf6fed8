"""The driver, its GPUs and a booking's injection, as frozen values: no I/O here."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from gpubook.runtime.errors import DriverError
from gpubook.runtime.mounts import Mount


@dataclass(frozen=True)
class GpuProcess:
    pid: int
    name: str | None
    used_memory_mib: int | None  # None where the driver does not say (e.g. in a container)


@dataclass(frozen=True)
class Gpu:
    """One GPU. Discovery always knows `minor` and `bus_id`; the live status fields are filled
    only by `gpubook gpus` (NVML), and the config's static `[gpus] count` knows just the index."""

    index: int  # as nvidia-smi numbers it (NVML's order; PCI bus order without NVML)
    minor: int | None = None  # N of /dev/nvidiaN; not the index
    bus_id: str | None = None  # as /proc/driver/nvidia/gpus names it, e.g. "0000:00:06.0"
    uuid: str | None = None
    name: str | None = None
    memory_total_mib: int | None = None
    memory_used_mib: int | None = None
    utilisation_percent: int | None = None  # NVML's "GPU busy" share over its last sample period
    processes: tuple[GpuProcess, ...] = ()

    @property
    def device_minor(self) -> int:
        """`minor`, for code that needs the device node (discovered GPUs always have one)."""
        if self.minor is None:
            raise DriverError(f"GPU {self.index}: its device minor is unknown")
        return self.minor


@dataclass(frozen=True)
class MigInstance:
    """A MIG compute instance of one GPU: GPU index, GPU instance id, compute instance id."""

    gpu: int
    gi: int
    ci: int


@dataclass(frozen=True)
class DriverFile:
    capability: str
    host_path: Path  # the real file on the host (symlinks resolved)
    name: str  # its name in the container: "libcuda.so.580.65.06", "nvidia-smi"
    soname: str | None = None  # libraries only, read from the file


@dataclass(frozen=True)
class Device:
    host: Path
    container: str


@dataclass(frozen=True)
class Driver:
    """What `discover` found: everything about the host driver that does not depend on a booking."""

    version: str
    root: Path
    capabilities: tuple[str, ...]
    libraries: tuple[DriverFile, ...]
    binaries: tuple[DriverFile, ...]
    gpus: tuple[Gpu, ...]
    control_devices: tuple[Device, ...]  # nvidiactl, nvidia-uvm, …: every container gets these
    ipc: tuple[Mount, ...]  # persistenced socket
    proc_gpu_entries: tuple[tuple[str, str], ...]  # (bus id normalised, entry path in /proc)
    mps: Mount | None = None  # the MPS pipe folder while MPS runs; bound only where asked for

    def gpu(self, index: int) -> Gpu:
        for gpu in self.gpus:
            if gpu.index == index:
                return gpu
        known = ", ".join(str(g.index) for g in self.gpus) or "none"
        raise DriverError(f"GPU {index} does not exist on this host (GPUs: {known})")


@dataclass(frozen=True)
class GpuInjection:
    """What a container needs for its booked GPUs. Engines turn it into their own arguments."""

    driver_version: str
    gpus: tuple[int, ...]  # booked host indices (MIG: the parent GPU)
    devices: tuple[Device, ...]
    binds: tuple[Mount, ...]  # read-only driver files, the soname-link folder, ld.so.conf, IPC
    soname_links: tuple[tuple[str, str], ...]  # (link path in the container, target file name)
    library_dir: str  # container folder of the libraries; GPUBOOK_LIBRARY_DIR names it
    environment: tuple[tuple[str, str], ...]
    hidden_proc_paths: tuple[str, ...]  # /proc paths to mask: PROC_GPUS when a GPU is not booked

    @property
    def env(self) -> dict[str, str]:
        return dict(self.environment)


def normalise_bus_id(bus_id: str) -> str:
    """ "00000000:06:00.0" (NVML) and "0000:06:00.0" (/proc) both become "0000:06:00.0"."""
    match = re.fullmatch(
        r"(?:([0-9a-fA-F]+):)?([0-9a-fA-F]{1,2}):([0-9a-fA-F]{1,2})\.([0-7])", bus_id.strip()
    )
    if not match:
        raise DriverError(f"unexpected PCI bus id {bus_id!r}")
    domain = int(match.group(1) or "0", 16)
    return (
        f"{domain:04x}:{int(match.group(2), 16):02x}:{int(match.group(3), 16):02x}.{match.group(4)}"
    )
