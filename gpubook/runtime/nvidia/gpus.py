"""The host's GPUs as gpubook sees them, `gpubook gpus`, and the driver part of `gpubook doctor`.

NVML (read in runtime.nvidia.nvml) gives the live view: index, UUID, model, memory, device minor, and
the processes using each GPU. Where NVML cannot be read (no driver on this machine, a broken
install) the config's `[gpus] count` is the static inventory the scheduler plans with. On a
machine without a GPU every entry point says so in one line and returns; nothing raises.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TextIO

from gpubook.runtime import nvidia
from gpubook.runtime.checks import Check
from gpubook.runtime.errors import DriverError
from gpubook.runtime.nvidia import nvml
from gpubook.runtime.nvidia.model import Gpu

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Inventory:
    source: str  # "nvml", "config" ([gpus] count) or "none"
    driver_version: str | None
    gpus: tuple[Gpu, ...] = ()
    problem: str | None = None  # why NVML could not be read, one line

    @property
    def count(self) -> int:
        return len(self.gpus)


def _nvml_inventory() -> Inventory:
    view = nvml.read(status=True)
    if view.driver_version is None:
        return Inventory("none", None, problem=view.problem)
    return Inventory("nvml", view.driver_version, view.gpus)


def inventory(*, static_count: int | None = None) -> Inventory:
    """NVML's view of the GPUs; else `static_count` GPUs numbered 0..n-1 from the config."""
    live = _nvml_inventory()
    if live.source == "nvml" or static_count is None:
        return live
    gpus = tuple(Gpu(index=i) for i in range(static_count))
    return Inventory("config", None, gpus, problem=live.problem)


def no_gpu_line(inv: Inventory) -> str:
    return f"no NVIDIA GPU visible on this machine: {inv.problem or 'NVML lists none'}"


def format_inventory(inv: Inventory) -> list[str]:
    if inv.source == "none" or (inv.source == "nvml" and not inv.gpus):
        return [no_gpu_line(inv)]
    if inv.source == "config":
        return [
            f"{inv.count} GPU(s) from the config's [gpus] count; "
            f"live data unavailable: {inv.problem}"
        ]
    lines = [f"NVIDIA driver {inv.driver_version}, {inv.count} GPU(s)"]
    for gpu in inv.gpus:
        lines.append(
            f"GPU {gpu.index}: {gpu.name} ({gpu.uuid}), /dev/nvidia{gpu.minor}, "
            f"{gpu.memory_used_mib} / {gpu.memory_total_mib} MiB used"
            + ("" if gpu.utilisation_percent is None else f", {gpu.utilisation_percent} % busy")
        )
        for process in gpu.processes:
            used = "?" if process.used_memory_mib is None else process.used_memory_mib
            lines.append(f"    pid {process.pid} {process.name or '?'}: {used} MiB")
    return lines


def cli_gpus(
    args: argparse.Namespace, *, static_count: int | None = None, out: TextIO | None = None
) -> int:
    """`gpubook gpus [--json]`. Exit 0 when GPUs are known (live or from the config), else 1."""
    out = out or sys.stdout
    inv = inventory(static_count=static_count)
    if getattr(args, "json", False):
        print(json.dumps(asdict(inv) | {"count": inv.count}, indent=2), file=out)
    else:
        print("\n".join(format_inventory(inv)), file=out)
    return 0 if inv.gpus else 1


# ---------------------------------------------------------------------------------------------
# doctor


@dataclass(frozen=True)
class DoctorOptions:
    root: Path = Path("/")
    extra_roots: tuple[Path, ...] = ()
    cdi_dirs: tuple[Path, ...] = (Path("/etc/cdi"), Path("/var/run/cdi"))
    use_nvml: bool | None = None
    environ: dict[str, str] | None = field(default=None, repr=False)


def driver_checks(options: DoctorOptions | None = None) -> list[Check]:
    """The driver and device part of `gpubook doctor`; the lead adds engine/calendar/data checks.
    Without a driver it is one failed check, not a cascade of consequences."""
    options = options or DoctorOptions()
    root = options.root
    if not (root / "proc/driver/nvidia/version").exists():
        try:
            version = nvidia.driver_version(root, use_nvml=options.use_nvml)
        except DriverError as error:
            return [
                Check(
                    "NVIDIA driver",
                    False,
                    f"no NVIDIA driver on this machine ({error})",
                    "Install the NVIDIA driver and load its kernel module (or ignore this on a "
                    "machine without GPUs).",
                )
            ]
        checks = [
            Check(
                "NVIDIA kernel module",
                False,
                f"driver {version} installed but /proc/driver/nvidia/version is missing",
                "Load the kernel module with `modprobe nvidia` (or reboot after installing).",
            )
        ]
    else:
        checks = []
    try:
        driver = nvidia.discover(
            root=root,
            extra_roots=options.extra_roots,
            use_nvml=options.use_nvml,
            environ=options.environ,
        )
    except DriverError as error:
        return checks + [
            Check(
                "NVIDIA driver files",
                False,
                str(error),
                "Install the driver's user-space libraries matching the kernel module, "
                "or add their folder to [nvidia] driver_roots in the config.",
            )
        ]
    checks.append(
        Check(
            "NVIDIA driver",
            True,
            f"version {driver.version}, "
            f"{len(driver.libraries)} libraries, binaries: "
            f"{', '.join(b.name for b in driver.binaries) or 'none'}",
        )
    )
    if not any(b.name == "nvidia-smi" for b in driver.binaries):
        checks.append(
            Check(
                "nvidia-smi",
                False,
                "not found with the driver",
                "Install the driver's utilities (nvidia-utils) so bookers can run nvidia-smi.",
            )
        )
    checks += _device_checks(driver)
    checks.append(_cdi_check(options.cdi_dirs))
    return checks


def _device_checks(driver: nvidia.Driver) -> list[Check]:
    checks = []
    if not driver.gpus:
        return [
            Check(
                "GPUs",
                False,
                "the driver is loaded but lists no GPU",
                "Check `nvidia-smi` and `dmesg | grep -i nvrm` for a GPU the driver rejected.",
            )
        ]
    nodes = [d.host for d in driver.control_devices]
    nodes += [driver.root / f"dev/nvidia{gpu.minor}" for gpu in driver.gpus]
    for node in nodes:
        if not node.exists():
            checks.append(
                Check(
                    f"device {node}",
                    False,
                    "missing",
                    "Create the nodes with `nvidia-modprobe -u -c=N` "
                    "or by running nvidia-smi once as root.",
                )
            )
        elif not os.access(node, os.R_OK | os.W_OK):
            checks.append(
                Check(
                    f"device {node}",
                    False,
                    f"not readable and writable by {_user()}",
                    "Give this user access (e.g. the driver's NVreg_DeviceFileMode=0666, "
                    "or a udev rule adding the device to the user's group).",
                )
            )
    if not checks:
        checks.append(
            Check(
                "device nodes",
                True,
                f"{len(nodes)} nodes, all usable by {_user()}; GPUs: "
                + ", ".join(f"{g.index}=/dev/nvidia{g.minor}" for g in driver.gpus),
            )
        )
    return checks


def _user() -> str:
    try:
        import pwd

        return pwd.getpwuid(os.getuid()).pw_name
    except (ImportError, KeyError):
        return f"uid {os.getuid()}"


def _cdi_check(directories: Sequence[Path]) -> Check:
    for folder in directories:
        for spec in sorted(folder.glob("*.json")) + sorted(folder.glob("*.yaml")):
            try:
                if (
                    '"nvidia.com/gpu"' in spec.read_text()
                    or "kind: nvidia.com/gpu" in spec.read_text()
                ):
                    return Check("CDI spec", True, f"{spec} describes nvidia.com/gpu")
            except OSError:
                continue
    return Check(
        "CDI spec",
        False,
        "no nvidia.com/gpu CDI spec in " + ", ".join(map(str, directories)),
        "Optional: `gpubook gpus cdi --output /etc/cdi/gpubook-nvidia.json` (as root) lets "
        "podman >= 4.1 use --device nvidia.com/gpu=N; gpubook works without it.",
        optional=True,
    )
