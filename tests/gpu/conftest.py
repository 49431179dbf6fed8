"""GPU tests: run on the GPU test host only, after `source .bundle/podman-on-gpuhost.sh .bundle`.

Everything here carries the `gpu` marker and is skipped, with the reason, where there is no
NVIDIA device, no loaded driver or no podman.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from gpubook.runtime import nvidia
from tests.kits import hostroot


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
