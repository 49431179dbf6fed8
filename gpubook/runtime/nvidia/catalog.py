"""What the driver provides, per capability, and where it goes in the container.

What is taken follows libnvidia-container (src/nvc_info.c) and Apptainer's etc/nvliblist.conf;
where gpubook differs it says so beside the lists below.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from gpubook.runtime.nvidia.elf import EM_AARCH64, EM_PPC64, EM_X86_64

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
class Arch:
    bits: int
    machine: int
    ld_cache_tag: str  # how `ldconfig -p` marks this architecture's entries
    multiarch: str  # Debian's multiarch triplet


ARCHITECTURES: Mapping[str, Arch] = {
    "x86_64": Arch(64, EM_X86_64, "x86-64", "x86_64-linux-gnu"),
    "aarch64": Arch(64, EM_AARCH64, "AArch64", "aarch64-linux-gnu"),
    "ppc64le": Arch(64, EM_PPC64, "64bit", "powerpc64le-linux-gnu"),
}

