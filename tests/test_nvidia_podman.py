"""The podman engine's GPU arguments applied by real rootless podman, without a GPU.

What can be proven here without NVIDIA hardware: the library-folder scheme works in a real
container (the soname-link folder bound read-only, each library bound onto its placeholder, the
ld.so.conf.d entry), with ldconfig (which then has nothing to complain about) and without it
(LD_LIBRARY_PATH), MKNOD is dropped, a device lands at its container path, the environment is
set, and podman's mask option hides a /proc folder. The "driver library" is a real one (a copy of
the host's libz, which the image does not have) so the dynamic loader really has to find it
through the injected folder; /dev/null stands in for /dev/nvidia0.
"""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
import tarfile
import uuid
from pathlib import Path

import pytest

from gpubook.runtime import nvidia
from gpubook.runtime.engines import engine_from
from tests.kits.nvidia_fake_driver import VERSION, device_nodes, driver_libraries, proc_driver

pytestmark = pytest.mark.podman

BINARIES = (
    "/bin/sh",
    "/bin/true",
    "/bin/cat",
    "/bin/readlink",
    "/bin/mknod",
    "/usr/bin/test",
    "/bin/grep",
    "/usr/bin/wc",
    "/bin/ls",
    "/sbin/ldconfig",
)
LIBZ = next(
    (
        p
        for p in (
            Path("/usr/lib/x86_64-linux-gnu/libz.so.1.2.13"),
            Path("/lib/x86_64-linux-gnu/libz.so.1"),
        )
        if p.exists()
    ),
    None,
)


def podman_works() -> str | None:
    if shutil.which("podman") is None:
        return "podman is not installed"
    if LIBZ is None or shutil.which("ldd") is None:
        return "needs the host's libz and ldd to build the test image"
    result = subprocess.run(["podman", "info"], capture_output=True, text=True, check=False)
    return None if result.returncode == 0 else f"podman info failed: {result.stderr.strip()[-300:]}"


def libraries_of(binary: str) -> set[str]:
    out = subprocess.run(["ldd", binary], capture_output=True, text=True, check=False).stdout
    return {part for line in out.splitlines() for part in line.split() if part.startswith("/")}


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> str:
    reason = podman_works()
    if reason:
        pytest.skip(reason)
    rootfs = tmp_path_factory.mktemp("rootfs")
    files = set(BINARIES)
    for binary in BINARIES:
        files |= libraries_of(binary)
    for name in sorted(files):
        source = Path(name)
        target = rootfs / name.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source.resolve(), target)
    (rootfs / "etc/ld.so.conf.d").mkdir(parents=True)
    (rootfs / "etc/ld.so.conf").write_text("include /etc/ld.so.conf.d/*.conf\n")
    for folder in ("tmp", "proc", "sys", "dev", "run"):
        (rootfs / folder).mkdir(exist_ok=True)
    archive = tmp_path_factory.mktemp("image") / "rootfs.tar"
    with tarfile.open(archive, "w") as tar:
        tar.add(rootfs, arcname=".")
    name = f"localhost/gpubook-nvidia-test:{uuid.uuid4().hex[:8]}"
    subprocess.run(["podman", "import", "-q", str(archive), name], check=True, capture_output=True)
    yield name
    subprocess.run(["podman", "rmi", "-f", name], check=False, capture_output=True)


@pytest.fixture
def injection(tmp_path: Path) -> nvidia.GpuInjection:
    root = tmp_path / "root"
    libs = root / "usr/lib/x86_64-linux-gnu"
    driver_libraries(libs, names=("libnvidia-ml.so",))
    libs.mkdir(parents=True, exist_ok=True)
    assert LIBZ is not None
    shutil.copy2(LIBZ, libs / f"libcuda.so.{VERSION}")  # a real library, SONAME libz.so.1
    proc_driver(root)
    device_nodes(root)
    driver = nvidia.discover(root=root, environ={}, use_nvml=False, machine="x86_64", ld_cache="")
    booked = nvidia.inject(driver, [1], cache_dir=tmp_path / "cache")
    # A real device for podman, and a /proc folder that exists on this machine to mask.
    return dataclasses.replace(
        booked,
        devices=(nvidia.Device(Path("/dev/null"), "/dev/nvidia1"),),
        hidden_proc_paths=("/proc/bus",),
    )


def run(
    image: str, injection: nvidia.GpuInjection, script: str
) -> subprocess.CompletedProcess[str]:
    argv = [
        "podman",
        "run",
        "--rm",
        "--network=host",
        *engine_from("podman").gpu_args(injection),  # type: ignore[attr-defined]
        image,
        "/bin/sh",
        "-c",
        script,
    ]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)


def test_library_folder_with_ldconfig(image: str, injection: nvidia.GpuInjection) -> None:
    lib = injection.library_dir
    script = (
        "ldconfig 2>&1; echo ldconfig-done; "
        "ldconfig -p | grep -c 'libz.so.1 (libc6,x86-64) => " + lib + "/libz.so.1'; "
        "LD_PRELOAD=libz.so.1 /bin/true 2>&1; echo preload-done; "
        f"readlink {lib}/libz.so.1; readlink {lib}/libnvidia-ml.so.1; "
        f"cat {nvidia.LD_SO_CONF} | grep -c '^{lib}$'"
    )
    result = run(image, injection, script)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n") == [
        "ldconfig-done",  # nothing to warn about: links correct, folder read-only but complete
        "1",
        "preload-done",  # the loader found libz.so.1 in the injected folder
        f"libcuda.so.{VERSION}",
        f"libnvidia-ml.so.{VERSION}",
        "1",
        "",
    ]


def test_library_folder_without_ldconfig(image: str, injection: nvidia.GpuInjection) -> None:
    script = (
        "LD_PRELOAD=libz.so.1 /bin/true 2>&1 | grep -c 'cannot be preloaded'; "
        "LD_LIBRARY_PATH=$GPUBOOK_LIBRARY_DIR LD_PRELOAD=libz.so.1 /bin/true 2>&1; echo done"
    )
    result = run(image, injection, script)
    assert result.returncode == 0, result.stderr
    # not found without the folder on the search path (so the image has no libz of its own),
    # found through GPUBOOK_LIBRARY_DIR without any complaint
    assert result.stdout.split("\n") == ["1", "done", ""]


def test_devices_capabilities_environment_and_mask(
    image: str, injection: nvidia.GpuInjection
) -> None:
    script = (
        "test -c /dev/nvidia1 && echo device; "
        "mknod /tmp/node c 1 3 2>/dev/null && echo mknod-allowed || echo mknod-refused; "
        "ls -A /proc/bus | wc -l; "
        'echo "$CUDA_VISIBLE_DEVICES|$NVIDIA_DRIVER_CAPABILITIES|$GPUBOOK_LIBRARY_DIR"; '
        'echo "$NVIDIA_VISIBLE_DEVICES"'
    )
    result = run(image, injection, script)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n") == [
        "device",
        "mknod-refused",
        "0",
        f"0|utility,compute|{nvidia.CONTAINER_LIBRARY_DIR}",
        "GPU-00000001-aaaa-bbbb-cccc-000000000001",
        "",
    ]
