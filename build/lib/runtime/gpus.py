"""The host's GPUs as gpubook sees them, `gpubook gpus`, and the driver part of `gpubook doctor`.

NVML (nvidia-ml-py's pynvml) gives the live view: index, UUID, model, memory, device minor, and
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

from runtime import nvidia
from runtime.errors import DriverError

log = logging.getLogger(__name__)
MIB = 1024 * 1024


@dataclass(frozen=True)
class GpuProcess:
    pid: int
    name: str | None
    used_memory_mib: int | None  # None where the driver does not say (e.g. in a container)


@dataclass(frozen=True)
class GpuStatus:
    index: int
    uuid: str | None
    name: str | None
    minor: int | None
    memory_total_mib: int | None
    memory_used_mib: int | None
    processes: tuple[GpuProcess, ...] = ()


@dataclass(frozen=True)
class Inventory:
    source: str  # "nvml", "config" ([gpus] count) or "none"
    driver_version: str | None
    gpus: tuple[GpuStatus, ...] = ()
    problem: str | None = None  # why NVML could not be read, one line

    @property
    def count(self) -> int:
        return len(self.gpus)


def _text(value: bytes | str) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _process_name(pynvml, pid: int) -> str | None:
    try:
        return _text(pynvml.nvmlSystemGetProcessName(pid))
    except Exception:  # NVML refuses for processes of other users or namespaces
        try:
            return Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            return None


def _processes(pynvml, handle) -> tuple[GpuProcess, ...]:
    seen: dict[int, GpuProcess] = {}
    for getter in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses"):
        try:
            running = getattr(pynvml, getter)(handle)
        except Exception as error:
            log.debug("%s: %s", getter, error)
            continue
        for process in running:
            used = getattr(process, "usedGpuMemory", None)
            seen.setdefault(
                process.pid,
                GpuProcess(
                    pid=process.pid,
                    name=_process_name(pynvml, process.pid),
                    used_memory_mib=used // MIB if isinstance(used, int) and used >= 0 else None,
                ),
            )
    return tuple(sorted(seen.values(), key=lambda p: p.pid))


def _nvml_inventory() -> Inventory:
    try:
        import pynvml
    except ImportError:
        return Inventory("none", None, problem="nvidia-ml-py (pynvml) is not installed")
    try:
        pynvml.nvmlInit()
    except Exception as error:
        return Inventory("none", None, problem=f"NVML cannot be read ({_text(str(error))})")
    try:
        gpus = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
            try:
                minor: int | None = pynvml.nvmlDeviceGetMinorNumber(handle)
            except Exception:
                minor = None
            gpus.append(
                GpuStatus(
                    index=index,
                    uuid=_text(pynvml.nvmlDeviceGetUUID(handle)),
                    name=_text(pynvml.nvmlDeviceGetName(handle)),
                    minor=minor,
                    memory_total_mib=memory.total // MIB,
                    memory_used_mib=memory.used // MIB,
                    processes=_processes(pynvml, handle),
                )
            )
        return Inventory("nvml", _text(pynvml.nvmlSystemGetDriverVersion()), tuple(gpus))
    except Exception as error:
        return Inventory("none", None, problem=f"NVML failed while listing GPUs ({error})")
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception as error:
            log.debug("nvmlShutdown: %s", error)


def inventory(*, static_count: int | None = None) -> Inventory:
    """NVML's view of the GPUs; else `static_count` GPUs numbered 0..n-1 from the config."""
    live = _nvml_inventory()
    if live.source == "nvml" or static_count is None:
        return live
    gpus = tuple(
        GpuStatus(
            index=i, uuid=None, name=None, minor=None, memory_total_mib=None, memory_used_mib=None
        )
        for i in range(static_count)
    )
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
class Check:
    name: str
    ok: bool
    detail: str
    fix: str | None = None  # one sentence, when not ok


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
    )


def format_checks(checks: Sequence[Check]) -> tuple[list[str], int]:
    """One line per check (and its fix); exit code 1 if any failed."""
    lines = []
    for check in checks:
        if check.ok:
            lines.append(f"ok    {check.name}: {check.detail}")
        else:
            lines.append(f"FAIL  {check.name}: {check.detail}")
            if check.fix:
                lines.append(f"      fix: {check.fix}")
    return lines, 1 if any(not c.ok for c in checks) else 0


def cli_doctor_driver(
    args: argparse.Namespace, *, extra_roots: Sequence[Path] = (), out: TextIO | None = None
) -> int:
    lines, status = format_checks(driver_checks(DoctorOptions(extra_roots=tuple(extra_roots))))
    print("\n".join(lines), file=out or sys.stdout)
    return status
