"""The GPUs and device nodes of the running driver: which minor each GPU has, MIG access nodes,
the control nodes every GPU container needs, and the IPC sockets of the driver's services."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path

from gpubook.runtime.errors import DriverError
from gpubook.runtime.mounts import Mount
from gpubook.runtime.nvidia import nvml
from gpubook.runtime.nvidia.catalog import MPS_PIPE_DIRECTORY, PERSISTENCED_SOCKETS
from gpubook.runtime.nvidia.model import Device, Gpu, normalise_bus_id
from gpubook.runtime.nvidia.paths import under

log = logging.getLogger(__name__)

def parse_information(text: str) -> dict[str, str]:
    """The `Key: value` lines of /proc/driver/nvidia/gpus/<bus>/information."""
    fields = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields[key.strip()] = value.strip()
    return fields


def proc_gpus(root: Path = Path("/")) -> list[tuple[str, str, dict[str, str]]]:
    """(normalised bus id, /proc entry path, information fields) per GPU of the kernel module."""
    folder = under(root, "/proc/driver/nvidia/gpus")
    entries = []
    try:
        children = sorted(folder.iterdir())
    except OSError:
        return []
    for child in children:
        try:
            info = parse_information((child / "information").read_text(errors="replace"))
            bus = normalise_bus_id(info.get("Bus Location", child.name))
        except (OSError, DriverError) as error:
            log.warning("cannot read %s: %s", child, error)
            continue
        entries.append((bus, "/proc/driver/nvidia/gpus/" + child.name, info))
    return entries


def _gpus_from_proc(entries: Sequence[tuple[str, str, dict[str, str]]]) -> list[Gpu]:
    gpus = []
    for index, (bus, path, info) in enumerate(sorted(entries)):
        try:
            minor = int(info["Device Minor"])
        except (KeyError, ValueError):
            raise DriverError(f"{path}/information has no 'Device Minor' line") from None
        uuid = info.get("GPU UUID")
        gpus.append(
            Gpu(
                index=index,
                minor=minor,
                bus_id=bus,
                uuid=uuid if uuid and "?" not in uuid else None,
                name=info.get("Model"),
            )
        )
    return gpus


def _gpus_from_nvml() -> list[Gpu] | None:
    view = nvml.read()
    if view.broken:
        log.warning("%s; using /proc instead", view.problem)
        return None
    if view.driver_version is None:
        log.debug("NVML unavailable: %s", view.problem)
        return None
    try:
        return [_with_device(gpu) for gpu in view.gpus]
    except DriverError as error:
        log.warning("NVML failed while listing GPUs, using /proc instead: %s", error)
        return None


def _with_device(gpu: Gpu) -> Gpu:
    # Injection needs both; NVML answering without them is a broken install, and /proc still knows.
    if gpu.minor is None or gpu.bus_id is None:
        raise DriverError(f"GPU {gpu.index}: NVML gave no device minor or PCI bus id")
    return gpu


def list_gpus(root: Path = Path("/"), *, use_nvml: bool | None = None) -> tuple[Gpu, ...]:
    """The host's GPUs with their device minors: NVML's view, else /proc's in PCI bus order."""
    if use_nvml if use_nvml is not None else root == Path("/"):
        gpus = _gpus_from_nvml()
        if gpus is not None:
            return tuple(gpus)
    return tuple(_gpus_from_proc(proc_gpus(root)))


def mig_access_minor(root: Path, gpu_minor: int, gi: int, ci: int | None = None) -> int:
    """Minor of /dev/nvidia-caps/nvidia-cap<N> granting a MIG GPU instance (or compute instance)."""
    path = f"/proc/driver/nvidia/capabilities/gpu{gpu_minor}/mig/gi{gi}"
    if ci is not None:
        path += f"/ci{ci}"
    access = under(root, path + "/access")
    try:
        fields = parse_information(access.read_text())
        return int(fields["DeviceFileMinor"])
    except (OSError, KeyError, ValueError):
        raise DriverError(
            f"MIG instance gi{gi}"
            + (f"/ci{ci}" if ci is not None else "")
            + f" of GPU minor {gpu_minor}: cannot read {path}/access "
            "(is MIG enabled and the instance created?)"
        ) from None


def control_devices(root: Path, capabilities: Sequence[str]) -> tuple[Device, ...]:
    """The nodes every GPU container of these capabilities needs, whichever GPUs it booked."""
    wanted = ["/dev/nvidiactl"]
    if "compute" in capabilities:
        wanted += ["/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"]
    if "display" in capabilities:
        wanted.append("/dev/nvidia-modeset")
    devices = []
    for path in wanted:
        host = under(root, path)
        if host.exists():
            devices.append(Device(host, path))
        elif path in ("/dev/nvidiactl", "/dev/nvidia-uvm"):
            raise DriverError(
                f"{path} is missing: load the driver's kernel modules "
                "(nvidia-modprobe -u -c=0, or modprobe nvidia nvidia-uvm)"
            )
        else:
            log.info("%s is missing; containers run without it", path)
    return tuple(devices)


def ipc_binds(root: Path) -> tuple[Mount, ...]:
    """The driver service socket every GPU container talks to: persistenced's, when it runs."""
    for socket_path in PERSISTENCED_SOCKETS:
        host = under(root, socket_path)
        if host.exists():
            return (Mount(host, PERSISTENCED_SOCKETS[0]),)
    return ()


def mps_bind(root: Path, environ: Mapping[str, str]) -> Mount | None:
    """The MPS pipe folder while an MPS control daemon runs. Clients need it writable, and with it
    any of them can stop or reconfigure MPS for every container: bound only where the site asks
    (`[gpus] mps`)."""
    mps = environ.get("CUDA_MPS_PIPE_DIRECTORY", MPS_PIPE_DIRECTORY)
    # The control pipe exists only while nvidia-cuda-mps-control runs: MPS "in use".
    if mps.startswith("/") and under(root, mps + "/control").exists():
        return Mount(under(root, mps), mps, read_only=False)
    return None
