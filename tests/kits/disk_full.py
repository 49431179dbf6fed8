"""A disk that fills up, for the state folder's faults (issue 26).

The tests run unprivileged and cannot mount; `./quickstart test` (as root, before them) mounts a
small tmpfs (16 MiB, nosuid,nodev) at /srv/gpubook-test-full owned by the test user, and
GPUBOOK_TEST_FULL_ROOT names another such mount. A small mount of its own, not the data mount: a
filler grows until the mount is full, which on an 8 GiB data mount would take the other tests'
space and seconds to write. Each test gets a fresh folder on it (`full_folder`), `fill` makes the
next write there fail with ENOSPC, `unfill` gives the space back.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

FULL_MOUNT = Path(os.environ.get("GPUBOOK_TEST_FULL_ROOT", "/srv/gpubook-test-full"))
FILLER = ".filler"
_CHUNKS = (1 << 20, 1 << 16, 1 << 12, 1)  # big writes first, then down to the last byte that fits


@contextmanager
def full_folder() -> Iterator[Path]:
    """A fresh, empty folder on the small test mount; removed afterwards (the filler with it)."""
    if not os.path.ismount(FULL_MOUNT):
        raise RuntimeError(f"{FULL_MOUNT} is not a mount point; ./quickstart test mounts a small tmpfs there "
                           f"(as root) before the tests, or set GPUBOOK_TEST_FULL_ROOT to one")
    folder = Path(tempfile.mkdtemp(prefix="full-", dir=FULL_MOUNT))
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def fill(folder: Path) -> int:
    """Grow folder's filler file until the mount has no byte left: the next write anywhere on it
    that needs a new block fails with ENOSPC (checked here with a fresh file). Returns the bytes added."""
    added = 0
    fd = os.open(folder / FILLER, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
    try:
        for size in _CHUNKS:
            block = b"\0" * size
            while True:
                try:
                    written = os.write(fd, block)
                except OSError as error:
                    if error.errno != errno.ENOSPC:
                        raise
                    break
                added += written
                if written < size:
                    break  # a short write: the mount is full to within less than `size`
    finally:
        os.close(fd)
    _check_full(folder)
    return added


def unfill(folder: Path) -> None:
    """Give back the filler's space (the mount is as it was before `fill`)."""
    (folder / FILLER).unlink(missing_ok=True)


def _check_full(folder: Path) -> None:
    probe = folder / ".probe"
    fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, b"x" * 4096)
    except OSError as error:
        if error.errno == errno.ENOSPC:
            return
        raise
    finally:
        os.close(fd)
        probe.unlink()
    raise RuntimeError(f"{folder}: a 4 KiB write still fits after filling the mount")
