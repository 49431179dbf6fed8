"""The host's NVIDIA driver, found on the host and handed to containers: only the booked GPUs.

Two steps. `discover()` finds the running driver (its version, its libraries and binaries that
carry exactly that version, the GPUs and their device minors, control nodes and IPC sockets).
`inject()` turns that into a frozen `GpuInjection` for some booked GPUs: device nodes, read-only
binds, environment, the /proc entries of the *other* GPUs to hide. `injection()` does both, and
`container_args()` spells an injection as podman/docker flags. Engines apply injections; they
never look for driver files themselves.

Every path is looked up under `root` (default "/"), so tests run discovery against driver trees
they build in a temporary folder, and the ld.so.cache listing can be passed in as text.

What is taken, by capability, follows libnvidia-container (src/nvc_info.c) and Apptainer's
etc/nvliblist.conf; where gpubook differs it says so beside the list below.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from runtime.elf import EM_AARCH64, EM_PPC64, EM_X86_64, ET_DYN, ET_EXEC, ElfFormatError, read_elf
from runtime.errors import DriverError

log = logging.getLogger(__name__)

# In the container the libraries live where nvidia-docker 1 put its driver volume: images of
# the CUDA 8/9 era (nvidia/cuda, TensorFlow, DIGITS) already carry
# LD_LIBRARY_PATH=/usr/local/nvidia/lib64, so they find the driver even when nothing runs first.
CONTAINER_LIBRARY_DIR = "/usr/local/nvidia/lib64"
CONTAINER_BINARY_DIR = "/usr/bin"
LD_SO_CONF = "/etc/ld.so.conf.d/000-gpubook-nvidia.conf"

CAPABILITIES = ("utility", "compute", "video", "graphics", "display")
DEFAULT_CAPABILITIES = ("utility", "compute")

# Library name prefixes per capability; the file taken is "<prefix>.<driver version>".
# Differences from the references, on purpose:
# - no 32-bit (compat32) libraries: bookings run 64-bit CUDA programs, and a wrong-class file in
#   the library folder only produces loader warnings;
# - none of the GLVND dispatchers or X server modules that Apptainer's list has (libGL.so,
#   libEGL.so, libGLX.so, libOpenGL.so, libGLdispatch.so, nvidia_drv.so, libglx.so, libnvidia-gtk*,
#   libnvidia-wfb): they are not versioned like the driver, belong to the image, and are not
#   needed for compute; libnvidia-container leaves them out too;
# - libnvidia-fatbinaryloader and libnvidia-compiler are listed for old drivers (< 495/470) that
#   still ship them; a newer driver simply has no such file.
LIBRARIES: Mapping[str, tuple[str, ...]] = {
    "utility": ("libnvidia-ml.so", "libnvidia-cfg.so", "libnvidia-nscq.so"),
    "compute": (
        "libcuda.so",
        "libcudadebugger.so",
        "libnvidia-ptxjitcompiler.so",
        "libnvidia-nvvm.so",
        "libnvidia-gpucomp.so",
        "libnvidia-allocator.so",
        "libnvidia-opencl.so",
        "libnvidia-pkcs11.so",
        "libnvidia-pkcs11-openssl3.so",
        "libnvidia-tileiras.so",
        "libnvidia-fatbinaryloader.so",
        "libnvidia-compiler.so",
    ),
    "video": (
        "libvdpau_nvidia.so",
        "libnvidia-encode.so",
        "libnvidia-opticalflow.so",
        "libnvcuvid.so",
    ),
    "graphics": (
        "libnvidia-eglcore.so",
        "libnvidia-glcore.so",
        "libnvidia-tls.so",
        "libnvidia-glsi.so",
        "libnvidia-fbc.so",
        "libnvidia-ifr.so",
        "libnvidia-rtcore.so",
        "libnvoptix.so",
        "libGLX_nvidia.so",
        "libEGL_nvidia.so",
        "libGLESv2_nvidia.so",
        "libGLESv1_CM_nvidia.so",
        "libnvidia-glvkspirv.so",
        "libnvidia-cbl.so",
    ),
    "display": (),
}
# Without these the capability is useless; the others are taken when present.
REQUIRED_LIBRARIES = {"utility": "libnvidia-ml.so", "compute": "libcuda.so"}

# nv-fabricmanager, in libnvidia-container's utility list, is a host service managing NVSwitches;
# a booking has no business running a second one, so gpubook leaves it out (Apptainer does too).
BINARIES: Mapping[str, tuple[str, ...]] = {
    "utility": ("nvidia-smi", "nvidia-debugdump", "nvidia-persistenced"),
    "compute": ("nvidia-cuda-mps-control", "nvidia-cuda-mps-server"),
}

# Unversioned development links some programs open by name (ctypes.CDLL("libcuda.so"), -lcuda).
DEVELOPMENT_LINKS = (
    "libcuda.so",
    "libnvidia-ml.so",
    "libnvcuvid.so",
    "libnvidia-encode.so",
    "libnvidia-opticalflow.so",
)

PROC_GPUS = "/proc/driver/nvidia/gpus"  # a folder per GPU (bus id): model, UUID, minor
PERSISTENCED_SOCKETS = ("/run/nvidia-persistenced/socket", "/var/run/nvidia-persistenced/socket")
# nvidia-cuda-mps-control's default; CUDA_MPS_PIPE_DIRECTORY overrides it
MPS_PIPE_DIRECTORY = "/tmp/nvidia-mps"  # noqa: S108


@dataclass(frozen=True)
class _Arch:
    bits: int
    machine: int
    ld_cache_tag: str  # how `ldconfig -p` marks this architecture's entries
    multiarch: str  # Debian's multiarch triplet


ARCHITECTURES: Mapping[str, _Arch] = {
    "x86_64": _Arch(64, EM_X86_64, "x86-64", "x86_64-linux-gnu"),
    "aarch64": _Arch(64, EM_AARCH64, "AArch64", "aarch64-linux-gnu"),
    "ppc64le": _Arch(64, EM_PPC64, "64bit", "powerpc64le-linux-gnu"),
}


@dataclass(frozen=True)
class Gpu:
    index: int  # as nvidia-smi numbers it (NVML's order; PCI bus order without NVML)
    minor: int  # N of /dev/nvidiaN; not the index
    bus_id: str  # as /proc/driver/nvidia/gpus names it, e.g. "0000:00:06.0"
    uuid: str | None = None
    name: str | None = None


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
class Bind:
    host: Path
    container: str
    read_only: bool = True


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
    ipc: tuple[Bind, ...]  # persistenced socket, MPS pipe folder when MPS runs
    proc_gpu_entries: tuple[tuple[str, str], ...]  # (bus id normalised, entry path in /proc)

    def gpu(self, index: int) -> Gpu:
        for gpu in self.gpus:
            if gpu.index == index:
                return gpu
        known = ", ".join(str(g.index) for g in self.gpus) or "none"
        raise DriverError(f"GPU {index} does not exist on this host (GPUs: {known})")


@dataclass(frozen=True)
class GpuInjection:
    """What a container needs for its booked GPUs. Engines apply it as it is."""

    driver_version: str
    gpus: tuple[int, ...]  # booked host indices (MIG: the parent GPU)
    devices: tuple[Device, ...]
    binds: tuple[Bind, ...]  # read-only driver files, the soname-link folder, ld.so.conf entry, IPC
    soname_links: tuple[tuple[str, str], ...]  # (link path in the container, target file name)
    library_dir: str  # container folder of the libraries; GPUBOOK_LIBRARY_DIR names it
    environment: tuple[tuple[str, str], ...]
    hidden_proc_paths: tuple[str, ...]  # /proc paths to mask: PROC_GPUS when a GPU is not booked

    @property
    def env(self) -> dict[str, str]:
        return dict(self.environment)


# ---------------------------------------------------------------------------------------------
# Paths under a root


def _under(root: Path, path: str | os.PathLike[str]) -> Path:
    return root / str(path).lstrip("/")


def _resolve(root: Path, path: Path) -> Path:
    """`path` with symlinks followed as if `root` were "/": absolute targets stay under root."""
    if root == Path("/"):
        return path.resolve()
    relative = path.relative_to(root).parts
    resolved: list[str] = []
    pending = list(relative)
    hops = 0
    while pending:
        part = pending.pop(0)
        if part in ("", "."):
            continue
        if part == "..":
            if resolved:
                resolved.pop()
            continue
        candidate = root.joinpath(*resolved, part)
        if candidate.is_symlink():
            hops += 1
            if hops > 40:
                raise DriverError(f"{path}: too many levels of symbolic links")
            target = os.readlink(candidate)
            if target.startswith("/"):
                resolved = []
            pending = [p for p in target.split("/") if p] + pending
        else:
            resolved.append(part)
    return root.joinpath(*resolved)


def _host_arch(machine: str | None) -> _Arch:
    name = machine or platform.machine()
    try:
        return ARCHITECTURES[name]
    except KeyError:
        raise DriverError(
            f"gpubook does not know the NVIDIA driver layout for {name!r} "
            f"(known: {', '.join(ARCHITECTURES)})"
        ) from None


def _arch_matches(path: Path, arch: _Arch, *, types: tuple[int, ...]) -> tuple[bool, str | None]:
    try:
        info = read_elf(path)
    except (OSError, ElfFormatError) as error:
        log.debug("skipping %s: %s", path, error)
        return False, None
    if info is None:
        log.debug("skipping %s: not an ELF file", path)
        return False, None
    if info.bits != arch.bits or info.machine != arch.machine or info.type not in types:
        log.debug(
            "skipping %s: ELF%d machine %d type %d is not this host's",
            path,
            info.bits,
            info.machine,
            info.type,
        )
        return False, None
    return True, info.soname


# ---------------------------------------------------------------------------------------------
# Driver version

# Proprietary: "NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.65.06  Sun Jul 27 …"
# Open:        "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.65.06  Release Build …"
_NVRM_VERSION = re.compile(
    r"^NVRM version:.*?Kernel Module(?: for \S+)?\s+(\d+\.\d+(?:\.\d+)?)\s", re.M
)
_VERSION_SUFFIX = re.compile(r"^libcuda\.so\.(\d+\.\d+(?:\.\d+)?)$")


def parse_proc_version(text: str) -> str | None:
    """The driver version in /proc/driver/nvidia/version (proprietary or open kernel module)."""
    match = _NVRM_VERSION.search(text)
    return match.group(1) if match else None


def _nvml_driver_version() -> str | None:
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception as error:  # NVMLError_* subclasses, OSError from a broken library
        log.debug("NVML unavailable: %s", error)
        return None
    try:
        version = pynvml.nvmlSystemGetDriverVersion()
        return version.decode() if isinstance(version, bytes) else str(version)
    except Exception as error:
        log.debug("NVML could not tell the driver version: %s", error)
        return None
    finally:
        _nvml_shutdown(pynvml)


def _nvml_shutdown(pynvml) -> None:
    try:
        pynvml.nvmlShutdown()
    except Exception as error:
        log.debug("nvmlShutdown: %s", error)


def driver_version(
    root: Path = Path("/"), *, use_nvml: bool | None = None, library_dirs: Sequence[Path] = ()
) -> str:
    """The running driver's version: the kernel module's, else NVML's, else libcuda's suffix."""
    proc = _under(root, "/proc/driver/nvidia/version")
    try:
        version = parse_proc_version(proc.read_text(errors="replace"))
        if version:
            return version
        log.warning("%s does not say which driver version runs", proc)
    except OSError:
        pass
    if use_nvml if use_nvml is not None else root == Path("/"):
        version = _nvml_driver_version()
        if version:
            return version
    found: dict[str, list[Path]] = {}
    for folder in library_dirs:
        for path in sorted(folder.glob("libcuda.so.*")):
            if match := _VERSION_SUFFIX.match(path.name):
                found.setdefault(match.group(1), []).append(path)
    if len(found) == 1:
        return next(iter(found))
    if not found:
        raise DriverError(
            "no NVIDIA driver found: no /proc/driver/nvidia/version (kernel module not "
            "loaded), NVML unavailable, and no libcuda.so.<version> in "
            + (", ".join(str(d) for d in library_dirs) or "any library folder")
        )
    listing = "; ".join(
        f"{v} ({', '.join(str(p) for p in paths)})" for v, paths in sorted(found.items())
    )
    raise DriverError(
        f"the NVIDIA kernel module is not loaded and several driver versions are "
        f"installed, so gpubook cannot tell which one runs: {listing}"
    )


# ---------------------------------------------------------------------------------------------
# Where the files are


def _ldconfig() -> str | None:
    return shutil.which("ldconfig") or next(
        (p for p in ("/sbin/ldconfig", "/usr/sbin/ldconfig") if os.access(p, os.X_OK)), None
    )


def read_ld_cache(root: Path = Path("/")) -> str:
    """`ldconfig -p` of the host, or of root's etc/ld.so.cache for another root; "" if none."""
    binary = _ldconfig()
    if binary is None:
        log.debug("no ldconfig on this host; relying on the usual driver folders")
        return ""
    command = [binary, "-p"]
    if root != Path("/"):
        cache = _under(root, "/etc/ld.so.cache")
        if not cache.is_file():
            return ""
        command += ["-C", str(cache)]
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired) as error:
        log.warning("%s failed: %s", " ".join(command), error)
        return ""
    if result.returncode != 0:
        log.warning("%s failed: %s", " ".join(command), result.stderr.strip())
    return result.stdout


_LD_CACHE_LINE = re.compile(r"^\s+(\S+)\s+\(([^)]*)\)\s+=>\s+(\S.*)$")


def parse_ld_cache(text: str, *, arch_tag: str) -> list[tuple[str, str]]:
    """(name, path) of the `ldconfig -p` entries of one architecture, in cache order."""
    entries = []
    for line in text.splitlines():
        match = _LD_CACHE_LINE.match(line)
        if match:
            flags = [flag.strip() for flag in match.group(2).split(",")]
            if arch_tag in flags:
                entries.append((match.group(1), match.group(3).strip()))
    return entries


def _cache_path_under_root(root: Path, path: str) -> Path:
    # A cache built for a root from outside it (ldconfig -C … on that tree) lists full host paths.
    if root != Path("/") and path.startswith(str(root) + "/"):
        return Path(path)
    return _under(root, path)


def library_dirs(
    root: Path,
    arch: _Arch,
    *,
    ld_cache: str,
    extra_roots: Sequence[Path] = (),
    environ: Mapping[str, str] | None = None,
) -> list[Path]:
    """Folders that may hold the driver's libraries, most trusted first, existing ones only."""
    environ = os.environ if environ is None else environ
    candidates: list[Path] = []
    for extra in extra_roots:
        base = _under(root, extra) if extra.is_absolute() else root / extra
        candidates += [
            base,
            base / "lib64",
            base / "lib",
            base / "usr/lib64",
            base / "usr/lib" / arch.multiarch,
        ]
    for name, path in parse_ld_cache(ld_cache, arch_tag=arch.ld_cache_tag):
        if name in ("libcuda.so.1", "libnvidia-ml.so.1"):
            candidates.append(_cache_path_under_root(root, path).parent)
    usual = [
        f"/usr/lib/{arch.multiarch}",
        f"/usr/lib/{arch.multiarch}/nvidia/current",
        "/usr/lib64",
        "/lib64",
        "/usr/lib64/nvidia",
        f"/lib/{arch.multiarch}",
        "/usr/local/nvidia/lib64",
        f"/run/nvidia/driver/usr/lib/{arch.multiarch}",
        "/run/nvidia/driver/usr/lib64",
        "/usr/lib",
    ]
    candidates += [_under(root, folder) for folder in usual]
    candidates += [
        _under(root, folder)
        for folder in environ.get("LD_LIBRARY_PATH", "").split(":")
        if folder.startswith("/")
    ]
    return _existing_unique(root, candidates)


def binary_dirs(
    root: Path, *, extra_roots: Sequence[Path] = (), environ: Mapping[str, str] | None = None
) -> list[Path]:
    environ = os.environ if environ is None else environ
    candidates = [(_under(root, e) if e.is_absolute() else root / e) / "bin" for e in extra_roots]
    candidates += [
        _under(root, folder)
        for folder in (
            "/usr/local/nvidia/bin",
            "/run/nvidia/driver/usr/bin",
            "/usr/bin",
            "/bin",
            "/usr/sbin",
            "/sbin",
        )
    ]
    candidates += [
        _under(root, folder)
        for folder in environ.get("PATH", "").split(":")
        if folder.startswith("/")
    ]
    return _existing_unique(root, candidates)


def _existing_unique(root: Path, paths: Iterable[Path]) -> list[Path]:
    """The folders that exist, symlinks resolved under root (nvidia/current -> nvidia-580)."""
    result: list[Path] = []
    for path in paths:
        try:
            folder = _resolve(root, path)
        except (OSError, ValueError, DriverError):
            continue
        if folder not in result and folder.is_dir():
            result.append(folder)
    return result


def _find_libraries(
    root: Path, arch: _Arch, folders: Sequence[Path], version: str, capabilities: Sequence[str]
) -> tuple[DriverFile, ...]:
    found: list[DriverFile] = []
    for capability in capabilities:
        for prefix in LIBRARIES[capability]:
            name = f"{prefix}.{version}"
            for folder in folders:
                candidate = folder / name
                if not candidate.exists():
                    continue
                real = _resolve(root, candidate)
                ok, soname = _arch_matches(real, arch, types=(ET_DYN,))
                if ok:
                    found.append(DriverFile(capability, real, name, soname))
                    break
            else:
                required = REQUIRED_LIBRARIES.get(capability) == prefix
                if required:
                    raise DriverError(_missing_library_message(prefix, version, folders))
                log.debug("driver library %s not found (optional)", name)
    return tuple(found)


def _missing_library_message(prefix: str, version: str, folders: Sequence[Path]) -> str:
    others = sorted(
        {
            p.name
            for folder in folders
            for p in folder.glob(prefix + ".*")
            if re.fullmatch(re.escape(prefix) + r"\.\d+\.\d+(\.\d+)?", p.name)
        }
    )
    where = ", ".join(str(f) for f in folders) or "no library folder"
    message = f"{prefix}.{version} of the running driver {version} not found in {where}"
    if others:
        message += (
            f"; found {', '.join(others)} instead: the installed libraries do not match the "
            f"loaded kernel module (reboot after a driver upgrade, or reinstall the driver)"
        )
    else:
        message += (
            "; install the NVIDIA driver's user-space libraries, "
            "or add their folder to [nvidia] driver_roots"
        )
    return message


def _find_binaries(
    root: Path, arch: _Arch, folders: Sequence[Path], capabilities: Sequence[str]
) -> tuple[DriverFile, ...]:
    found = []
    for capability in capabilities:
        for name in BINARIES.get(capability, ()):
            for folder in folders:
                candidate = folder / name
                if candidate.is_file():
                    real = _resolve(root, candidate)
                    ok, _ = _arch_matches(real, arch, types=(ET_EXEC, ET_DYN))
                    if ok:
                        found.append(DriverFile(capability, real, name))
                        break
    return tuple(found)


# ---------------------------------------------------------------------------------------------
# GPUs and their device minors


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
    folder = _under(root, "/proc/driver/nvidia/gpus")
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
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception as error:
        log.debug("NVML unavailable: %s", error)
        return None
    try:
        gpus = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            pci = pynvml.nvmlDeviceGetPciInfo(handle)
            bus = pci.busId.decode() if isinstance(pci.busId, bytes) else str(pci.busId)
            uuid = pynvml.nvmlDeviceGetUUID(handle)
            name = pynvml.nvmlDeviceGetName(handle)
            gpus.append(
                Gpu(
                    index=index,
                    minor=pynvml.nvmlDeviceGetMinorNumber(handle),
                    bus_id=normalise_bus_id(bus),
                    uuid=uuid.decode() if isinstance(uuid, bytes) else str(uuid),
                    name=name.decode() if isinstance(name, bytes) else str(name),
                )
            )
        return gpus
    except Exception as error:
        log.warning("NVML failed while listing GPUs, using /proc instead: %s", error)
        return None
    finally:
        _nvml_shutdown(pynvml)


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
    access = _under(root, path + "/access")
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


# ---------------------------------------------------------------------------------------------
# Discovery


def _control_devices(root: Path, capabilities: Sequence[str]) -> tuple[Device, ...]:
    wanted = ["/dev/nvidiactl"]
    if "compute" in capabilities:
        wanted += ["/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"]
    if "display" in capabilities:
        wanted.append("/dev/nvidia-modeset")
    devices = []
    for path in wanted:
        host = _under(root, path)
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


def _ipc(root: Path, environ: Mapping[str, str]) -> tuple[Bind, ...]:
    binds = []
    for socket_path in PERSISTENCED_SOCKETS:
        host = _under(root, socket_path)
        if host.exists():
            binds.append(Bind(host, PERSISTENCED_SOCKETS[0]))
            break
    mps = environ.get("CUDA_MPS_PIPE_DIRECTORY", MPS_PIPE_DIRECTORY)
    # The control pipe exists only while nvidia-cuda-mps-control runs: MPS "in use".
    if mps.startswith("/") and _under(root, mps + "/control").exists():
        binds.append(Bind(_under(root, mps), mps, read_only=False))
    return tuple(binds)


def _capabilities(capabilities: Sequence[str] | str) -> tuple[str, ...]:
    items = capabilities.split(",") if isinstance(capabilities, str) else list(capabilities)
    items = [c.strip() for c in items if c.strip()]
    if "all" in items:
        return CAPABILITIES
    unknown = [c for c in items if c not in CAPABILITIES]
    if unknown:
        raise DriverError(
            f"unknown driver capabilities {', '.join(unknown)} (known: "
            f"{', '.join(CAPABILITIES)}, all)"
        )
    if not items:
        raise DriverError("no driver capability asked for")
    return tuple(c for c in CAPABILITIES if c in items)


def discover(
    *,
    capabilities: Sequence[str] | str = DEFAULT_CAPABILITIES,
    root: Path = Path("/"),
    extra_roots: Sequence[Path] = (),
    ld_cache: str | None = None,
    environ: Mapping[str, str] | None = None,
    machine: str | None = None,
    use_nvml: bool | None = None,
) -> Driver:
    """Find the running driver and its files under `root`; DriverError says what is missing."""
    caps = _capabilities(capabilities)
    environ = os.environ if environ is None else environ
    arch = _host_arch(machine)
    cache_text = read_ld_cache(root) if ld_cache is None else ld_cache
    lib_folders = library_dirs(
        root, arch, ld_cache=cache_text, extra_roots=extra_roots, environ=environ
    )
    version = driver_version(root, use_nvml=use_nvml, library_dirs=lib_folders)
    libraries = _find_libraries(root, arch, lib_folders, version, caps)
    binaries = _find_binaries(
        root, arch, binary_dirs(root, extra_roots=extra_roots, environ=environ), caps
    )
    entries = proc_gpus(root)
    return Driver(
        version=version,
        root=root,
        capabilities=caps,
        libraries=libraries,
        binaries=binaries,
        gpus=list_gpus(root, use_nvml=use_nvml),
        control_devices=_control_devices(root, caps),
        ipc=_ipc(root, environ),
        proc_gpu_entries=tuple((bus, path) for bus, path, _ in entries),
    )


# ---------------------------------------------------------------------------------------------
# Injection


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "gpubook" / "nvidia"


def soname_links(driver: Driver) -> list[tuple[str, str]]:
    """(link name, target name) for the library folder: SONAME links plus development links."""
    links: dict[str, str] = {}
    for library in driver.libraries:
        if library.soname and library.soname != library.name:
            links[library.soname] = library.name
    for name in DEVELOPMENT_LINKS:
        target = next((soname for soname in links if soname.startswith(name + ".")), None)
        if target is not None and name not in links:
            links[name] = target
    return sorted(links.items())


def link_folder(driver: Driver, *, library_dir: str, cache_dir: Path) -> Path:
    """A host folder holding the library folder's symlinks, an empty mount point per library
    file, and the ld.so.conf.d entry; made once per driver and reused.

    Why a folder of symlinks, bound read-only over `library_dir`, with each library then bound
    onto its placeholder: the container gets exactly what a driver installation has (real files
    plus SONAME links), so the loader finds libcuda.so.1 through LD_LIBRARY_PATH when the image has
    no ldconfig (musl, distroless), and ldconfig, where the image has it, finds the links already
    correct and has nothing to write into the read-only folder. Binding each library a second time
    under its SONAME would work too, but ldconfig then warns about every such file on each start.
    """
    links = soname_links(driver)
    key = hashlib.sha256(
        repr(
            (driver.version, library_dir, sorted(f.name for f in driver.libraries), links)
        ).encode()
    ).hexdigest()[:16]
    folder = cache_dir / f"{driver.version}-{key}"
    if (folder / "complete").is_file():
        return folder
    cache_dir.mkdir(parents=True, exist_ok=True)
    staging = cache_dir / f".{folder.name}.{os.getpid()}.{threading.get_ident()}"
    shutil.rmtree(staging, ignore_errors=True)
    (staging / "lib").mkdir(parents=True)
    for library in driver.libraries:
        (staging / "lib" / library.name).touch(mode=0o644)
    for link, target in links:
        os.symlink(target, staging / "lib" / link)
    (staging / "ld.so.conf").write_text(
        f"# gpubook: the host's NVIDIA driver {driver.version}\n{library_dir}\n"
    )
    (staging / "complete").touch()
    try:
        os.rename(staging, folder)
    except OSError:
        # Another process made it first; theirs is identical.
        shutil.rmtree(staging, ignore_errors=True)
        if not (folder / "complete").is_file():
            raise DriverError(f"cannot create {folder}") from None
    return folder


def driver_binds(
    driver: Driver, *, library_dir: str = CONTAINER_LIBRARY_DIR, cache_dir: Path | None = None
) -> tuple[tuple[Bind, ...], tuple[tuple[str, str], ...]]:
    """The binds every GPU container of this driver gets, and the soname links they carry."""
    folder = link_folder(
        driver, library_dir=library_dir, cache_dir=cache_dir or default_cache_dir()
    )
    binds = [Bind(folder / "lib", library_dir)]
    binds += [Bind(lib.host_path, f"{library_dir}/{lib.name}") for lib in driver.libraries]
    binds.append(Bind(folder / "ld.so.conf", LD_SO_CONF))
    binds += [Bind(b.host_path, f"{CONTAINER_BINARY_DIR}/{b.name}") for b in driver.binaries]
    binds += list(driver.ipc)
    links = tuple((f"{library_dir}/{link}", target) for link, target in soname_links(driver))
    return tuple(binds), links


def inject(
    driver: Driver,
    gpus: Sequence[int | MigInstance],
    *,
    library_dir: str = CONTAINER_LIBRARY_DIR,
    cache_dir: Path | None = None,
) -> GpuInjection:
    """The injection for the booked `gpus` (nvidia-smi indices, or MIG instances)."""
    if not gpus:
        raise DriverError("a GPU injection needs at least one booked GPU")
    parents = [g.gpu if isinstance(g, MigInstance) else g for g in gpus]
    whole = {g for g in gpus if not isinstance(g, MigInstance)}
    if len(set(gpus)) != len(gpus) or whole & {g.gpu for g in gpus if isinstance(g, MigInstance)}:
        raise DriverError(f"a GPU is booked twice: {list(gpus)}")
    devices = list(driver.control_devices)
    for booked in gpus:
        gpu = driver.gpu(booked.gpu if isinstance(booked, MigInstance) else booked)
        node = f"/dev/nvidia{gpu.minor}"
        if not any(d.container == node for d in devices):
            host = _under(driver.root, node)
            if not host.exists():
                raise DriverError(
                    f"{node} (GPU {gpu.index}, bus {gpu.bus_id}) is missing: "
                    "run nvidia-smi once as root, or nvidia-modprobe -c=" + str(gpu.minor)
                )
            devices.append(Device(host, node))
        if isinstance(booked, MigInstance):
            # Only this instance's access capabilities, never all of /dev/nvidia-caps.
            for minor in (
                mig_access_minor(driver.root, gpu.minor, booked.gi),
                mig_access_minor(driver.root, gpu.minor, booked.gi, booked.ci),
            ):
                cap = f"/dev/nvidia-caps/nvidia-cap{minor}"
                if not _under(driver.root, cap).exists():
                    raise DriverError(
                        f"{cap} is missing (nvidia-modprobe -f /proc/driver/nvidia/"
                        f"capabilities/gpu{gpu.minor}/mig/gi{booked.gi}/access)"
                    )
                devices.append(Device(_under(driver.root, cap), cap))
    binds, links = driver_binds(driver, library_dir=library_dir, cache_dir=cache_dir)
    booked_buses = {driver.gpu(index).bus_id for index in parents}
    # Not each other GPU's /proc/driver/nvidia/gpus/<bus id> folder, as libnvidia-container does:
    # the engines' mask lists are ':'-separated and every bus id has colons. So the whole folder is
    # masked when some GPU is not booked; NVML and CUDA work from the device nodes, not from it.
    others = any(bus not in booked_buses for bus, _ in driver.proc_gpu_entries)
    hidden = (PROC_GPUS,) if others else ()
    environment = (
        # Overrides an image's NVIDIA_VISIBLE_DEVICES=all, so that where Docker's default runtime is
        # nvidia (nvidia-docker sites) its hook exposes the same GPUs and not every one.
        ("NVIDIA_VISIBLE_DEVICES", _visible_devices(driver, gpus)),
        ("CUDA_VISIBLE_DEVICES", ",".join(str(n) for n in range(len(gpus)))),
        ("NVIDIA_DRIVER_CAPABILITIES", ",".join(driver.capabilities)),
        ("GPUBOOK_LIBRARY_DIR", library_dir),
    )
    return GpuInjection(
        driver_version=driver.version,
        gpus=tuple(dict.fromkeys(parents)),
        devices=tuple(devices),
        binds=binds,
        soname_links=links,
        library_dir=library_dir,
        environment=environment,
        hidden_proc_paths=hidden,
    )


def _visible_devices(driver: Driver, gpus: Sequence[int | MigInstance]) -> str:
    if any(isinstance(g, MigInstance) for g in gpus):
        # The hook would want MIG UUIDs, which only NVML knows; "void" keeps it out altogether.
        return "void"
    return ",".join(driver.gpu(g).uuid or str(g) for g in gpus if isinstance(g, int))


def injection(
    gpus: Sequence[int | MigInstance],
    *,
    capabilities: Sequence[str] | str = DEFAULT_CAPABILITIES,
    root: Path = Path("/"),
    extra_roots: Sequence[Path] = (),
    ld_cache: str | None = None,
    environ: Mapping[str, str] | None = None,
    machine: str | None = None,
    use_nvml: bool | None = None,
    cache_dir: Path | None = None,
    library_dir: str = CONTAINER_LIBRARY_DIR,
) -> GpuInjection:
    """Discover the host driver and build the injection for the booked GPUs."""
    driver = discover(
        capabilities=capabilities,
        root=root,
        extra_roots=extra_roots,
        ld_cache=ld_cache,
        environ=environ,
        machine=machine,
        use_nvml=use_nvml,
    )
    return inject(driver, gpus, library_dir=library_dir, cache_dir=cache_dir)


# ---------------------------------------------------------------------------------------------
# Engine flags


def _checked(path: str | Path, what: str) -> str:
    text = str(path)
    # -v and --device split on ':'; a comma would break --mount and --security-opt mask lists.
    if ":" in text or "," in text or "\n" in text:
        raise DriverError(f"{what} {text!r} contains ':' or ',' and cannot be passed to the engine")
    return text


def container_args(injection: GpuInjection, *, engine: str = "podman") -> list[str]:
    """podman/docker `run` flags that apply the injection.

    - `--cap-drop MKNOD`: with the default capabilities NVML (ModifyDeviceFiles=1) creates the
      other GPUs' /dev/nvidiaN inside the container (seen on a 2-GPU host); the device cgroup
      keeps them unusable, but they should not be there. Device rules are "rw", never "m".
    - hidden /proc entries: libnvidia-container mounts a tmpfs over /proc/driver/nvidia from a
      hook; runc refuses OCI mounts inside /proc, but its maskedPaths are allowed, and podman
      exposes them as `--security-opt mask=` (a ':'-separated list, hence PROC_GPUS as a whole,
      see `inject`). runc masks a folder with an empty read-only tmpfs. Docker's CLI has no mask
      option; its API has HostConfig.MaskedPaths (which replaces Docker's defaults), so with
      `engine="docker"` these flags do not hide it: a Docker engine must pass
      `hidden_proc_paths` through the API, added to the defaults.
    """
    if engine not in ("podman", "docker"):
        raise DriverError(f"unknown engine {engine!r}")
    args = ["--cap-drop", "MKNOD"]
    for device in injection.devices:
        args += [
            "--device",
            f"{_checked(device.host, 'device')}:{_checked(device.container, 'device')}:rw",
        ]
    for bind in injection.binds:
        mode = ":ro" if bind.read_only else ""
        args += ["-v", f"{_checked(bind.host, 'path')}:{_checked(bind.container, 'path')}{mode}"]
    for name, value in injection.environment:
        args += ["-e", f"{name}={value}"]
    if engine == "podman" and injection.hidden_proc_paths:
        paths = [_checked(p, "/proc path") for p in injection.hidden_proc_paths]
        args += ["--security-opt", "mask=" + ":".join(paths)]
    return args
