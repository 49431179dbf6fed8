"""Shared by tests/gpu and bench/gpu_overhead.py: the host-rootfs image and podman argv.

On the GPU test host (../shared/gpuhost/README.md) the host's PyTorch needs the host's own
userspace, so the test image is the host's root file system (`tar --one-file-system` of /,
without /proc, /sys, /dev, /tmp, /root, /opt, /usr/local/cuda* and /usr/local/nvidia: the driver
must come from the injection, not the image), imported once into podman and reused.

The containers are started with `podman run` argv built here from the podman engine's
`gpu_args`; once the podman engine (gpubook/runtime/engines/podman.py) takes a
`ContainerSpec(gpu=injection)`, `run_argv` is the one place to switch. `LOADER_SHIM` does what
gpubook's entrypoint does for the driver:
ldconfig if the image has it, else LD_LIBRARY_PATH prepended.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from gpubook.runtime import nvidia  # noqa: E402
from gpubook.runtime.engines import engine_from  # noqa: E402

HOST_IMAGE = os.environ.get("GPUBOOK_HOST_IMAGE", "localhost/gpubook-hostroot:test")
# The sshd test image the daemon and Slurm GPU suites book (tests/gpu/prepare_daemon_bundle.sh).
BUNDLE = Path(os.environ.get("GPUBOOK_BUNDLE", REPO / ".bundle"))
SSHD_TEMPLATE, SSHD_IMAGE = "gpu-sshd", "localhost/gpubook/gpu-sshd:test"
SSHD_TEMPLATE_TOML = f'''description = "Debian 12 minbase with sshd and sudo (tests/gpu/prepare_daemon_bundle.sh)"
image = "{SSHD_IMAGE}"
cuda = "none"
has_sshd = true
shm_size = "256m"
'''
# runc on the GPU host refuses higher limits (../shared/gpuhost/README.md).
ULIMITS = ("nofile=1024:1024", "nproc=4096:4096")
TORCH_PYTHON = "/opt/torch/.venv/bin/python3"
PODMAN = os.environ.get("GPUBOOK_PODMAN", "podman")
# Contents excluded, folders kept (mount points); the NVIDIA driver and CUDA left out entirely.
EXCLUDES = (
    "./proc/*",
    "./sys/*",
    "./dev/*",
    "./tmp/*",
    "./run/*",
    "./root/*",
    "./opt/*",
    "./var/tmp/*",
    "./var/cache/*",
    "./var/log/*",
    "./var/lib/containers/*",
    "./home/*",
    "./usr/local/cuda*",
    "./usr/local/nvidia",
    "./swap.img",
    "./swapfile",
    "./snap/*",
)
LOADER_SHIM = (
    'if [ -n "${GPUBOOK_LIBRARY_DIR:-}" ]; then '
    "if command -v ldconfig >/dev/null 2>&1 || [ -x /sbin/ldconfig ]; then "
    "PATH=$PATH:/sbin:/usr/sbin ldconfig || exit 99; "
    "else export LD_LIBRARY_PATH=$GPUBOOK_LIBRARY_DIR${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}; "
    "fi; fi; "
    'exec "$@"'
)

# NVML through ctypes: the image's python3 has no pynvml, and this is what a CUDA program's
# libraries do anyway. Prints one JSON line.
NVML_SCRIPT = r"""
import ctypes, json, sys
try:
    nvml = ctypes.CDLL("libnvidia-ml.so.1")
except OSError as error:
    print(json.dumps({"error": str(error)})); sys.exit(0)
rc = nvml.nvmlInit_v2()
if rc:
    print(json.dumps({"error": f"nvmlInit_v2 returned {rc}"})); sys.exit(0)
count = ctypes.c_uint()
nvml.nvmlDeviceGetCount_v2(ctypes.byref(count))
text = ctypes.create_string_buffer(96)
nvml.nvmlSystemGetDriverVersion(text, 96)
result = {"driver": text.value.decode(), "gpus": []}
for index in range(count.value):
    handle = ctypes.c_void_p()
    nvml.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(handle))
    nvml.nvmlDeviceGetUUID(handle, text, 96)
    minor = ctypes.c_uint()
    nvml.nvmlDeviceGetMinorNumber(handle, ctypes.byref(minor))
    result["gpus"].append({"uuid": text.value.decode(), "minor": minor.value})
print(json.dumps(result))
"""


def unavailable() -> str | None:
    """Why the GPU tests cannot run here, or None."""
    if not Path("/dev/nvidiactl").exists():
        return "no NVIDIA device (/dev/nvidiactl) on this machine"
    if not Path("/proc/driver/nvidia/version").exists():
        return "the NVIDIA kernel module is not loaded"
    if shutil.which(PODMAN) is None:
        return "podman not found: run `source .bundle/podman-on-gpuhost.sh .bundle` first"
    return None


def host_tar_argv() -> list[str]:
    """tar of the host's root file system to stdout, without what EXCLUDES names."""
    return ["tar", "--one-file-system", "-C", "/", "-cf", "-", *[f"--exclude={pattern}" for pattern in EXCLUDES], "."]


def ensure_host_image(name: str = HOST_IMAGE) -> str:
    """Import the host's root file system as `name` unless it exists (about 90 s, 5-6 GB)."""
    if subprocess.run([PODMAN, "image", "exists", name], check=False).returncode == 0:
        return name
    tar = subprocess.Popen(
        host_tar_argv(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert tar.stdout is not None
    try:
        imported = subprocess.run(
            [PODMAN, "import", "-q", "-", name],
            stdin=tar.stdout,
            capture_output=True,
            text=True,
            timeout=900,
            check=False,
        )
    finally:
        tar.stdout.close()
        tar_status = tar.wait()
        tar_errors = tar.stderr.read().decode(errors="replace") if tar.stderr else ""
    # tar exits 1 when a file changed while it was read (logs, sockets): harmless here.
    if tar_status > 1 or imported.returncode != 0:
        raise RuntimeError(
            f"importing / as {name} failed: tar {tar_status} {tar_errors[-2000:]}; "
            f"podman import {imported.returncode} {imported.stderr[-2000:]}"
        )
    return name


def run_argv(
    image: str,
    command: Sequence[str],
    *,
    injection: nvidia.GpuInjection | None = None,
    extra: Sequence[str] = (),
    name: str | None = None,
    detach: bool = False,
) -> list[str]:
    """`podman run` argv exactly as gpubook's podman engine builds it for a booking (its user
    namespace, dropped capabilities, ulimits, labels and GPU injection), run in the foreground
    with --rm unless `detach`. GPUBOOK_GPU_TESTS_RAW=1 uses a bare `podman run` instead."""
    if os.environ.get("GPUBOOK_GPU_TESTS_RAW"):
        argv = [PODMAN, "run", "--network=host", "--shm-size=1g"]
        argv += ["-d"] if detach else ["--rm"]
        if name:
            argv += ["--name", name]
        if injection is not None:
            argv += engine_from("podman").gpu_args(injection)  # type: ignore[attr-defined]
        return [*argv, *extra, image, "sh", "-c", LOADER_SHIM, "sh", *command]
    from datetime import UTC, datetime, timedelta

    from gpubook.runtime.engines import ContainerSpec

    # The host's own storage and cgroup defaults, so that plain `podman exec/rm` find the container.
    # The bundle's limits (podman-on-gpuhost.sh): runc there refuses higher nofile/nproc values.
    # Host network: these containers run no sshd, and several share the spec's port 2299.
    engine = engine_from("podman", binary=PODMAN, storage_driver=None, cgroup_manager=None,
                         ulimits=("nofile=1024:1024", "nproc=4096:4096"), network="host")
    spec = ContainerSpec(
        booking_id=name or f"gpu-test-{os.getpid()}-{id(command)}",
        user="booker", uid=2001, gid=2001, image=image, port=2299,
        end=datetime.now(UTC) + timedelta(hours=1),
        gpus=injection.gpus if injection is not None else (),
        entrypoint=("sh", "-c", LOADER_SHIM, "sh"), command=tuple(command), gpu=injection,
    )
    argv = [*engine.global_argv(), *engine.run_args(spec)]  # type: ignore[attr-defined]
    image_at = len(argv) - 1 - len(spec.command) - (len(spec.entrypoint) - 1)
    assert argv[image_at] == image, argv
    argv = [*argv[:image_at], *(extra if any(a.startswith("--shm-size") for a in extra)
                                else ["--shm-size=1g", *extra]), *argv[image_at:]]
    argv[argv.index("--name") + 1] = name or spec.name
    if not detach:
        argv[argv.index("--detach")] = "--rm"
    return argv


def torch_bind() -> list[str]:
    return ["-v", "/opt/torch:/opt/torch:ro"]
