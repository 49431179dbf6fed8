"""A `data_root` on a nosuid,nodev mount for tests, as gpubook requires of every data_root.

The tests run unprivileged and cannot mount; `./quickstart test` (as root, before them) mounts a
tmpfs with nosuid,nodev at /srv/gpubook-test-data owned by the test user. GPUBOOK_TEST_DATA_ROOT
names another such mount. Each test gets a fresh folder under it, removed afterwards (rootless
podman leaves files of subordinate ids there, removable only through `podman unshare`).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from gpubook.runtime.data import storage

MOUNT = Path(os.environ.get("GPUBOOK_TEST_DATA_ROOT", "/srv/gpubook-test-data"))


@contextmanager
def data_root() -> Iterator[Path]:
    """A fresh, empty folder on the nosuid,nodev test mount; removed afterwards."""
    problem = storage.mount_problem(MOUNT)
    if problem is not None:
        raise RuntimeError(f"{problem}. ./quickstart test mounts it (as root) before the tests")
    folder = Path(tempfile.mkdtemp(prefix="data-", dir=MOUNT))
    try:
        yield folder
    finally:
        remove(folder)


def remove(folder: Path) -> None:
    if os.geteuid() != 0 and shutil.which("podman"):
        subprocess.run(["podman", "unshare", "rm", "-rf", "--", str(folder)], capture_output=True, check=False)
    shutil.rmtree(folder, ignore_errors=True)
