"""The host's NVIDIA driver, found on the host and handed to containers: only the booked GPUs.

Two steps. `discover()` finds the running driver (its version, its libraries and binaries that
carry exactly that version, the GPUs and their device minors, control nodes and IPC sockets).
`inject()` turns that into a frozen `GpuInjection` for some booked GPUs: device nodes, read-only
binds, environment, the /proc entries of the *other* GPUs to hide. `injection()` does both, reusing
the file search per driver version. Each engine spells an injection as its own flags.

Modules, each one step: model (the values), catalog (which files per capability), paths (roots and
ELF architecture), folders (where files may be), nvml (everything read from NVML), devices (GPUs,
minors, nodes, IPC), discovery, injection, cdi (the same injection as a CDI spec).
This package re-exports the public names, so `from gpubook.runtime import nvidia; nvidia.discover()` works.
"""

from gpubook.runtime.nvidia.catalog import (
    ARCHITECTURES,
    BINARIES,
    CAPABILITIES,
    CONTAINER_BINARY_DIR,
    CONTAINER_LIBRARY_DIR,
    DEFAULT_CAPABILITIES,
    DEVELOPMENT_LINKS,
    LD_SO_CONF,
    LIBRARIES,
    MPS_PIPE_DIRECTORY,
    PERSISTENCED_SOCKETS,
    PROC_GPUS,
    REQUIRED_LIBRARIES,
)
from gpubook.runtime.nvidia.devices import list_gpus, mig_access_minor, parse_information, proc_gpus
from gpubook.runtime.nvidia.discovery import discover, driver_version, parse_proc_version, running_version
from gpubook.runtime.nvidia.folders import binary_dirs, library_dirs, parse_ld_cache, read_ld_cache
from gpubook.runtime.nvidia.injection import (
    default_cache_dir,
    driver_binds,
    inject,
    injection,
    link_folder,
    soname_links,
)
from gpubook.runtime.nvidia.model import (
    Device,
    Driver,
    DriverFile,
    Gpu,
    GpuInjection,
    GpuProcess,
    MigInstance,
    normalise_bus_id,
)

__all__ = [
    "ARCHITECTURES",
    "BINARIES",
    "CAPABILITIES",
    "CONTAINER_BINARY_DIR",
    "CONTAINER_LIBRARY_DIR",
    "DEFAULT_CAPABILITIES",
    "DEVELOPMENT_LINKS",
    "LD_SO_CONF",
    "LIBRARIES",
    "MPS_PIPE_DIRECTORY",
    "PERSISTENCED_SOCKETS",
    "PROC_GPUS",
    "REQUIRED_LIBRARIES",
    "Device",
    "Driver",
    "DriverFile",
    "Gpu",
    "GpuInjection",
    "GpuProcess",
    "MigInstance",
    "binary_dirs",
    "default_cache_dir",
    "discover",
    "driver_binds",
    "driver_version",
    "inject",
    "injection",
    "library_dirs",
    "link_folder",
    "list_gpus",
    "mig_access_minor",
    "normalise_bus_id",
    "parse_information",
    "parse_ld_cache",
    "parse_proc_version",
    "proc_gpus",
    "read_ld_cache",
    "running_version",
    "soname_links",
]
