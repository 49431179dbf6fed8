"""The container engine under test. Rootless podman as the daemon tests run it, unless a test
module gives its own `engine_args` (Docker on a private dockerd, rootful podman, the limits)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from gpubook.runtime.engines import Engine, engine_from
from gpubook.runtime.templates import overlay_image
from gpubook.runtime.templates.catalog import get_template
from tests.kits import safe_data
from tests.kits.engine_suite import CACHE_DIR, PODMAN, Bookings


@pytest.fixture(scope="session")
def engine_args() -> dict:
    """How `engine` is made; a test module overrides this fixture to test another engine."""
    return dict(PODMAN)


@pytest.fixture(scope="module")
def engine(engine_args: dict) -> Engine:
    """The engine of the module's `engine_args`, with the debian-ssh test image in it (built once with
    mmdebstrap, the tarball cached in ~/.cache/gpubook)."""
    made = engine_from(**engine_args)
    overlay_image.build_rootfs_image(made, get_template("debian-ssh"), cache_dir=CACHE_DIR)
    return made


@pytest.fixture(scope="module")
def image(engine: Engine) -> str:
    """The debian-ssh image, present in `engine`."""
    return get_template("debian-ssh").image


@pytest.fixture
def bookings(engine: Engine, image: str) -> Iterator[Bookings]:
    """Bookings started straight on the engine (no daemon), with data folders on the test mount;
    their containers removed after the test, pass or fail."""
    with safe_data.data_root() as data_root:
        made = Bookings(engine, data_root, get_template("debian-ssh"))
        try:
            yield made
        finally:
            made.cleanup()
