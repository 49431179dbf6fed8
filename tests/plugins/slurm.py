"""The Slurm tests' cluster (tests/kits/slurm_kit.py) and the daemon's account's image."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.kits import slurm_kit
from tests.kits.slurm_jobs_kit import as_account


@pytest.fixture
def cluster() -> Iterator[slurm_kit.Cluster]:
    """A Slurm cluster of this test alone."""
    with slurm_kit.running() as made:
        yield made


@pytest.fixture(scope="module")
def account_image() -> None:
    """The debian-ssh image in the account's own podman storage (cached: a no-op once built)."""
    as_account(slurm_kit.DEFAULT_USER, "from gpubook.runtime.templates import overlay_image; "
               "from gpubook.runtime.engines import engine_from; "
               "from gpubook.runtime.templates.catalog import get_template; "
               "from tests.kits.engine_suite import CACHE_DIR, PODMAN; "
               "overlay_image.build_rootfs_image(engine_from(**PODMAN), get_template('debian-ssh'), "
               "cache_dir=CACHE_DIR)")
