"""Finding the running driver: its version, then the libraries and binaries of exactly that version.

`discover()` searches the host (ld.so.cache, the usual driver folders, [nvidia] driver_roots,
LD_LIBRARY_PATH and PATH) and reads every candidate's ELF header; the ld.so.cache listing can be
passed in as text. That search is the slow part of starting a GPU booking, so `discover(reuse=True)`
keeps its result per running driver version (see `_FileCache`): a second booking with the same
driver searches nothing, and a driver upgrade, which changes the version, searches again. The
GPUs, device nodes and IPC sockets are read afresh every time: they are cheap, and MPS comes and
goes while the driver stays.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from gpubook.runtime.errors import DriverError
from gpubook.runtime.nvidia import nvml
from gpubook.runtime.nvidia.catalog import (
    BINARIES,
    CAPABILITIES,
    DEFAULT_CAPABILITIES,
    LIBRARIES,
    REQUIRED_LIBRARIES,
    Arch,
)
from gpubook.runtime.nvidia.devices import control_devices, ipc_binds, list_gpus, mps_bind, proc_gpus
from gpubook.runtime.nvidia.elf import ET_DYN, ET_EXEC
from gpubook.runtime.nvidia.folders import binary_dirs, library_dirs, read_ld_cache
from gpubook.runtime.nvidia.model import Driver, DriverFile
from gpubook.runtime.nvidia.paths import arch_matches, host_arch, resolve, under

log = logging.getLogger(__name__)

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


def running_version(root: Path = Path("/"), *, use_nvml: bool | None = None) -> str | None:
    """The running driver's version where it can be told without searching files: the kernel
    module's, else NVML's; None when neither says."""
    proc = under(root, "/proc/driver/nvidia/version")
    try:
        version = parse_proc_version(proc.read_text(errors="replace"))
        if version:
            return version
        log.warning("%s does not say which driver version runs", proc)
    except OSError:
        pass
    if use_nvml if use_nvml is not None else root == Path("/"):
        return nvml.driver_version()
    return None


def driver_version(
    root: Path = Path("/"), *, use_nvml: bool | None = None, library_dirs: Sequence[Path] = ()
) -> str:
    """The running driver's version: the kernel module's, else NVML's, else libcuda's suffix."""
    version = running_version(root, use_nvml=use_nvml)
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


def _find_libraries(
    root: Path, arch: Arch, folders: Sequence[Path], version: str, capabilities: Sequence[str]
) -> tuple[DriverFile, ...]:
    found: list[DriverFile] = []
    for capability in capabilities:
        for prefix in LIBRARIES[capability]:
            name = f"{prefix}.{version}"
            for folder in folders:
                candidate = folder / name
                if not candidate.exists():
                    continue
                real = resolve(root, candidate)
                ok, soname = arch_matches(real, arch, types=(ET_DYN,))
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
    root: Path, arch: Arch, folders: Sequence[Path], capabilities: Sequence[str]
) -> tuple[DriverFile, ...]:
    found = []
    for capability in capabilities:
        for name in BINARIES.get(capability, ()):
            for folder in folders:
                candidate = folder / name
                if candidate.is_file():
                    real = resolve(root, candidate)
                    ok, _ = arch_matches(real, arch, types=(ET_EXEC, ET_DYN))
                    if ok:
                        found.append(DriverFile(capability, real, name))
                        break
    return tuple(found)


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




# ---------------------------------------------------------------------------------------------
# Discovery, and the search kept per driver version


@dataclass(frozen=True)
class _Files:
    version: str
    libraries: tuple[DriverFile, ...]
    binaries: tuple[DriverFile, ...]


# What decides the search's result besides the version: where it looked and for what.
_SearchKey = tuple[Path, tuple[str, ...], tuple[Path, ...], str, str | None, str | None, str | None]


class _FileCache:
    """The last search per (root, capabilities, extra roots, architecture, search paths), with
    the driver version it found. Only a version told by /proc or NVML is trusted for a lookup:
    without either, the version itself comes from the files, so nothing is saved."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # the daemon starts bookings from a thread pool
        self._found: dict[_SearchKey, _Files] = {}

    def get(self, key: _SearchKey, version: str) -> _Files | None:
        with self._lock:
            files = self._found.get(key)
        return files if files is not None and files.version == version else None

    def put(self, key: _SearchKey, files: _Files) -> None:
        with self._lock:
            self._found[key] = files  # a new version replaces the old one: its files are gone


_CACHE = _FileCache()


def _search(
    root: Path,
    arch: Arch,
    caps: tuple[str, ...],
    *,
    extra_roots: Sequence[Path],
    ld_cache: str | None,
    environ: Mapping[str, str],
    use_nvml: bool | None,
) -> _Files:
    cache_text = read_ld_cache(root) if ld_cache is None else ld_cache
    lib_folders = library_dirs(
        root, arch, ld_cache=cache_text, extra_roots=extra_roots, environ=environ
    )
    version = driver_version(root, use_nvml=use_nvml, library_dirs=lib_folders)
    return _Files(
        version=version,
        libraries=_find_libraries(root, arch, lib_folders, version, caps),
        binaries=_find_binaries(
            root, arch, binary_dirs(root, extra_roots=extra_roots, environ=environ), caps
        ),
    )


def discover(
    *,
    capabilities: Sequence[str] | str = DEFAULT_CAPABILITIES,
    root: Path = Path("/"),
    extra_roots: Sequence[Path] = (),
    ld_cache: str | None = None,
    environ: Mapping[str, str] | None = None,
    machine: str | None = None,
    use_nvml: bool | None = None,
    reuse: bool = False,
) -> Driver:
    """Find the running driver and its files under `root`; DriverError says what is missing.
    With `reuse`, the file search of an earlier call for the same running version is taken."""
    caps = _capabilities(capabilities)
    environ = os.environ if environ is None else environ
    arch = host_arch(machine)
    key: _SearchKey = (
        root,
        caps,
        tuple(extra_roots),
        arch.multiarch,
        ld_cache,
        environ.get("LD_LIBRARY_PATH"),
        environ.get("PATH"),
    )
    running = running_version(root, use_nvml=use_nvml) if reuse else None
    files = _CACHE.get(key, running) if running is not None else None
    if files is None:
        files = _search(
            root, arch, caps, extra_roots=extra_roots, ld_cache=ld_cache, environ=environ,
            use_nvml=use_nvml,
        )
        if running is not None and files.version == running:
            _CACHE.put(key, files)
    else:
        log.debug("driver %s: reusing the files found at an earlier start", running)
    entries = proc_gpus(root)
    return Driver(
        version=files.version,
        root=root,
        capabilities=caps,
        libraries=files.libraries,
        binaries=files.binaries,
        gpus=list_gpus(root, use_nvml=use_nvml),
        control_devices=control_devices(root, caps),
        ipc=ipc_binds(root),
        mps=mps_bind(root, environ),
        proc_gpu_entries=tuple((bus, path) for bus, path, _ in entries),
    )
