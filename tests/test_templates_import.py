"""`gpubook templates import NAME FILE` (issue 41): a host that cannot build a template's image (no
mmdebstrap, offline) loads an archive made on another machine (`podman save`) under the name the
template gives it, with real rootless podman. The lane's debian-ssh image stands in for the other
machine's: saved to a file, imported for a template naming another image. Bad input is one sentence
and names nothing new."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gpubook.runtime.engines import Engine
from tests.kits.cli_kit import write_config
from tests.kits.daemon_kit import ROOT, child_env

pytestmark = [pytest.mark.podman, pytest.mark.slow,
              pytest.mark.skipif(shutil.which("podman") is None, reason="podman is not installed")]

IMPORTED = "localhost/gpubook-test/imported:1"


def podman(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["podman", *args], capture_output=True, text=True, check=False, timeout=600)


def templates_dir(folder: Path) -> Path:
    """A config whose templates folder has `imported`: an image with sshd, named otherwise than
    debian-ssh's, and no [build] recipe (this host cannot make it)."""
    made = folder / "templates"
    made.mkdir()
    (made / "imported.toml").write_text(f'description = "an image made elsewhere"\nimage = "{IMPORTED}"\n'
                                        'cuda = "none"\nhas_sshd = true\n')
    return write_config(folder / "gpubook.toml", state_dir=folder / "state",
                        extra=f'[templates]\ndir = "{made}"\n[engine]\nname = "podman"\nruntime = "runc"\n'
                        'storage_driver = "overlay"\n')


def gpubook_templates(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gpubook.scheduler.commands.cli", "templates", *args],
                          capture_output=True, text=True, check=False, timeout=600, cwd=ROOT, env=child_env())


def test_an_archive_made_elsewhere_is_loaded_under_the_templates_image_name(tmp_path: Path, engine: Engine,
                                                                            image: str) -> None:
    archive = tmp_path / "debian-ssh.tar"
    assert podman("save", "--quiet", "-o", str(archive), image).returncode == 0
    folder = templates_dir(tmp_path)
    podman("rmi", IMPORTED)  # left by an earlier run: the import must make it
    try:
        done = gpubook_templates("--config", str(folder), "import", "imported", str(archive))
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == IMPORTED
        assert podman("image", "exists", IMPORTED).returncode == 0
        same = [podman("image", "inspect", "--format", "{{.Id}}", name).stdout for name in (image, IMPORTED)]
        assert same[0] == same[1]  # the very image saved, not another
        listed = gpubook_templates("--config", str(folder), "list")
        assert listed.returncode == 0 and "imported" in listed.stdout
    finally:
        podman("rmi", IMPORTED)


def test_a_missing_or_wrong_archive_is_one_sentence_and_names_nothing(tmp_path: Path, engine: Engine) -> None:
    folder = templates_dir(tmp_path)
    podman("rmi", IMPORTED)
    missing = gpubook_templates("--config", str(folder), "import", "imported", str(tmp_path / "none.tar"))
    assert missing.returncode == 1
    assert missing.stderr == (f"gpubook: {tmp_path / 'none.tar'}: no such file (make it on a machine that has the "
                              f"image: podman save -o none.tar {IMPORTED})\n")
    junk = tmp_path / "junk.tar"
    junk.write_bytes(b"not an image archive\n" * 10)
    wrong = gpubook_templates("--config", str(folder), "import", "imported", str(junk))
    assert wrong.returncode == 1 and wrong.stderr.startswith(f"gpubook: {junk} could not be loaded: "), wrong.stderr
    assert len(wrong.stderr.strip().splitlines()) == 1
    assert podman("image", "exists", IMPORTED).returncode != 0
