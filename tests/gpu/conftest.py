"""GPU tests: run on the GPU test host only, after `source .bundle/podman-on-gpuhost.sh .bundle`.

Everything here carries the `gpu` marker and is skipped, with the reason, where there is no
NVIDIA device, no loaded driver or no podman. The fixtures the GPU modules share are defined here
(this conftest is their plugin: the GPU suite also runs alone, `--confcutdir=tests/gpu`, on a copied tree).
"""

from __future__ import annotations

import lzma
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpubook.runtime import nvidia
from gpubook.runtime.data import storage
from gpubook.runtime.engines import Engine, engine_from
from gpubook.runtime.errors import EngineError
from tests.kits import hostroot, safe_data, servers
from tests.kits.gpu_daemon_kit import BUNDLE, IMAGE, ULIMITS


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reason = hostroot.unavailable()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def host_gpus() -> tuple[nvidia.Gpu, ...]:
    gpus = nvidia.list_gpus()
    assert gpus, "the driver is loaded but lists no GPU"
    return gpus


@pytest.fixture(scope="session")
def host_driver() -> nvidia.Driver:
    return nvidia.discover()


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gpubook-nvidia-cache")


@pytest.fixture(scope="session")
def host_image() -> str:
    return hostroot.ensure_host_image()


@pytest.fixture
def booking(host_driver: nvidia.Driver, cache_dir: Path):
    """booking(*indices) -> the GpuInjection gpubook would give a booking of those GPUs."""

    def make(*indices: int) -> nvidia.GpuInjection:
        return nvidia.inject(host_driver, list(indices), cache_dir=cache_dir)

    return make


@pytest.fixture
def two_gpus(host_gpus: tuple[nvidia.Gpu, ...]) -> tuple[nvidia.Gpu, nvidia.Gpu]:
    if len(host_gpus) < 2:
        pytest.skip("needs a host with at least 2 GPUs")
    return host_gpus[0], host_gpus[1]


@pytest.fixture
def torch_python() -> str:
    if not Path(hostroot.TORCH_PYTHON).exists():
        pytest.skip(f"no PyTorch at {hostroot.TORCH_PYTHON}")
    return hostroot.TORCH_PYTHON


# -- the daemon's GPU suites (test_daemon_gpu, test_accounting_gpu, test_foreign_gpu, test_reclaim_gpu) --


@pytest.fixture(scope="module")
def bundle() -> Path:
    missing = [name for name in ("gpu-sshd.tar.xz", "cudacheck") if not (BUNDLE / name).is_file()]
    if missing:
        pytest.skip(f"no GPU-host bundle at {BUNDLE} ({', '.join(missing)} missing): run "
                    "tests/gpu/prepare_daemon_bundle.sh .bundle on the build machine and carry .bundle")
    return BUNDLE


@pytest.fixture(scope="module")
def engine(bundle: Path, tmp_path_factory: pytest.TempPathFactory) -> Engine:
    """The daemon's engine (podman, runc, storage driver overlay) with the bundle's image imported."""
    made = engine_from("podman", runtime="runc", storage_driver="overlay", ulimits=ULIMITS)
    try:
        made.ensure_image(IMAGE)
    except EngineError:
        tarball = tmp_path_factory.mktemp("image") / "gpu-sshd.tar"
        with lzma.open(bundle / "gpu-sshd.tar.xz") as packed, tarball.open("wb") as plain:
            shutil.copyfileobj(packed, plain, 1 << 20)
        made.import_rootfs(tarball, IMAGE)
        tarball.unlink()
    return made


@pytest.fixture(scope="module")
def data_mount() -> Iterator[Path]:
    """gpubook refuses a data_root without nosuid,nodev: the test mount, made here as root (a tmpfs),
    else /dev/shm where that is mounted nosuid,nodev."""
    mount = safe_data.MOUNT
    problem = storage.mount_problem(mount)
    if problem is None:
        yield mount
        return
    if os.geteuid() != 0:
        pytest.skip(f"{problem}; as root this test mounts a tmpfs there")
    mount.mkdir(parents=True, exist_ok=True)
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "nosuid,nodev,mode=0755,size=2g", "tmpfs", str(mount)],
                          capture_output=True, text=True, check=False)
    if made.returncode == 0:
        yield mount
        subprocess.run(["umount", "-l", str(mount)], check=False)
        return
    if storage.mount_problem(Path("/dev/shm")) is not None:
        pytest.skip(f"{problem}; mounting a tmpfs there failed: {made.stderr.strip()}")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(safe_data, "MOUNT", Path("/dev/shm"))
        yield Path("/dev/shm")


@pytest.fixture(scope="module")
def radicale() -> Iterator[servers.CalendarServer]:
    try:
        import radicale as _  # noqa: F401
    except ImportError:
        pytest.skip("Radicale is not installed (the bundle's wheels: source .bundle/install-daemon-deps.sh)")
    with servers.running(servers.radicale) as server:
        yield server
