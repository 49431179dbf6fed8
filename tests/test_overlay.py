"""The overlay for images without sshd and sudo: a derived image is built once, then used.

The base is Debian minbase made here with mmdebstrap (no openssh-server, no sudo); the derived
image installs both from Debian's mirror (host network), as it would for an official CUDA image.
"""

from __future__ import annotations

import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from gpubook.runtime.booking.launch import OVERLAY_FILES, entrypoint_dir
from gpubook.runtime.engines import Engine, engine_from
from gpubook.runtime.templates import overlay_image
from gpubook.runtime.templates.catalog import load_template
from tests.kits.engine_suite import CACHE_DIR, Bookings, connect, run

pytestmark = [
    pytest.mark.podman,
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("podman") is None, reason="podman is not installed"),
]


@pytest.fixture(scope="module")
def engine() -> Engine:
    return engine_from("podman", runtime="runc", storage_driver="overlay")


def test_image_without_sshd_gets_the_overlay(engine: Engine, tmp_path: Path) -> None:
    folder = tmp_path / "templates"
    folder.mkdir()
    (folder / "bare-debian.toml").write_text(
        'image = "localhost/gpubook/test-bare-minbase:12"\ncuda = "none"\nhas_sshd = false\n'
        '[build]\nsuite = "bookworm"\nvariant = "minbase"\n'
    )
    template = load_template(folder / "bare-debian.toml")
    overlay_image.build_rootfs_image(engine, template, cache_dir=CACHE_DIR)
    lacking = subprocess.run(
        [
            *engine.global_argv(),
            "run",
            "--rm",
            "--network",
            "host",
            template.image,
            "sh",
            "-c",
            "command -v sshd || command -v sudo || echo none",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert lacking.stdout.strip() == "none"  # the base really has neither
    tag = overlay_image.build_overlay(engine, template)
    assert tag == overlay_image.run_image(template) and tag != template.image
    assert overlay_image.build_overlay(engine, template) == tag  # cached: no second build
    data_root = tmp_path / "data"
    data_root.mkdir()
    bookings = Bookings(engine, data_root, template)
    try:
        booking = bookings.start()
        with connect(booking.spec.port, "alice", booking.key) as client:
            assert run(client, "sudo -n id -un")[1] == "root\n"
    finally:
        bookings.cleanup()


def test_the_overlay_folder_is_made_by_many_starts_at_once(tmp_path: Path) -> None:
    """Seen in the upgrade test under 0.2.0: the first starts after a new overlay (a fresh cache, or an
    upgrade's new scripts) run in parallel lanes of one process, each wrote the same partial file
    (named by the pid alone) and all but one failed to rename it ("No such file or directory")."""
    for round_ in range(30):
        cache = tmp_path / str(round_)
        with ThreadPoolExecutor(8) as pool:
            made = set(pool.map(entrypoint_dir, [cache] * 8))
        assert len(made) == 1
        folder = made.pop()
        assert sorted(path.name for path in folder.iterdir()) == sorted(OVERLAY_FILES)
