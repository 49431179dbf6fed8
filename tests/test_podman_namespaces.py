"""Podman's namespaces lost under gpubook: its pause process (which holds the user and mount namespaces
every container of the user was made in) ended while a container was recorded running.

Seen in CI: one such container made every later `podman ps` fail ("joining network namespace of
container …: unknown FS magic"), and the daemon failed every pass from then on; earlier, every podman
command failed ("invalid internal status … podman system migrate"). Each test here runs a podman of
its own (its store, run folder and pause process: --root, --runroot, XDG_RUNTIME_DIR), so that what it ends
is its own, never the account's other containers."""

from __future__ import annotations

import io
import logging
import os
import shutil
import signal
import subprocess
import tarfile
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpubook.runtime.engines import Engine, engine_from
from gpubook.runtime.engines.spec import LABEL_BOOKING
from tests.kits.daemon_kit import alive
from tests.kits.engine_suite import PODMAN

pytestmark = [
    pytest.mark.podman,
    pytest.mark.skipif(shutil.which("podman") is None, reason="podman is not installed"),
]
IMAGE = "localhost/gpubook-test/host-usr:1"


def _rootfs(path: Path) -> Path:
    """An image of symlinks only (bin -> usr/bin, …): its containers get the host's /usr, read-only."""
    with tarfile.open(path, "w") as tar:
        for name in ("bin", "lib", "lib64", "sbin"):
            entry = tarfile.TarInfo(name)
            entry.type, entry.linkname = tarfile.SYMTYPE, f"usr/{name}"
            tar.addfile(entry)
        for name in ("usr", "etc", "tmp", "proc", "sys", "dev"):
            entry = tarfile.TarInfo(name)
            entry.type, entry.mode = tarfile.DIRTYPE, 0o755
            tar.addfile(entry, io.BytesIO())
    return path


class Own:
    """A podman of this test's own, with the image in it."""

    def __init__(self, folder: Path) -> None:
        self.tmpdir = folder / "xdg" / "libpod" / "tmp"
        self.runroot = folder / "run"
        self.engine: Engine = engine_from(**PODMAN, global_args=(
            "--root", str(folder / "store"), "--runroot", str(self.runroot), "--tmpdir", str(self.tmpdir)))
        self.engine.import_rootfs(_rootfs(folder / "rootfs.tar"), IMAGE)

    def podman(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*self.engine.global_argv(), *args], capture_output=True, text=True,  # type: ignore[attr-defined]
                              timeout=300, check=check)

    def booking(self, name: str) -> str:
        """A running container with gpubook's booking label (what `list` reads); its id."""
        return self.podman("run", "-d", "--name", name, "--label", f"{LABEL_BOOKING}={name}@test",
                           "-v", "/usr:/usr:ro", IMAGE, "/usr/bin/sleep", "600").stdout.strip()

    def pause(self) -> int:
        return int((self.tmpdir / "pause.pid").read_text().strip())

    def conmon(self, container_id: str) -> int:
        return int((self.runroot / "overlay-containers" / container_id / "userdata" / "conmon.pid").read_text())


@pytest.fixture
def own(monkeypatch: pytest.MonkeyPatch) -> Iterator[Own]:
    folder = Path(tempfile.mkdtemp(prefix="gpubook-ns-"))  # podman wants a run folder of 50 characters at most
    (folder / "xdg").mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(folder / "xdg"))  # where podman keeps its pause process's pid
    made = Own(folder)
    try:
        yield made
    finally:
        made.podman("rm", "--all", "--force", "--time", "0", check=False)
        made.podman("unshare", "rm", "-rf", str(folder / "store"), check=False)  # files of the containers' ids
        try:
            os.kill(made.pause(), signal.SIGKILL)
        except (OSError, ValueError):
            pass
        shutil.rmtree(folder, ignore_errors=True)


def test_a_container_whose_network_namespace_podman_lost_is_removed_and_the_listing_works(
        own: Own, caplog: pytest.LogCaptureFixture) -> None:
    """Its network namespace is a mount in podman's mount namespace; a new pause process's namespaces
    do not have it. Unmounting it there makes exactly that state: `podman ps` fails on the container,
    for good. Before, `list` (each daemon pass) failed with it; now the container is removed (its
    booking starts again, as after any death) and the listing answers."""
    kept = own.booking("kept")
    lost = own.booking("lost")
    netns = own.podman("inspect", "--format", "{{.NetworkSettings.SandboxKey}}", lost).stdout.strip()
    own.podman("unshare", "umount", netns)
    failed = own.podman("ps", "--all", check=False)
    assert failed.returncode != 0 and "unknown FS magic" in failed.stderr, failed.stderr
    with caplog.at_level(logging.WARNING):
        listed = own.engine.list()
    assert [(c.id, c.state) for c in listed] == [(kept, "running")]
    assert own.podman("container", "exists", lost, check=False).returncode == 1
    assert "container lost lost its network namespace" in caplog.text


def test_with_the_pause_process_and_every_conmon_ended_podman_is_reset_and_answers_again(
        own: Own, caplog: pytest.LogCaptureFixture) -> None:
    """Killed together (a `pkill` of the account, a Slurm job's end with every container of its
    node), podman refuses every command until `podman system migrate`. Before, every daemon pass
    failed from then on; now the engine runs it once, says so, and its command is answered: the
    container is listed stopped (the daemon starts its booking again)."""
    container = own.booking("orphan")
    ended = [own.pause(), own.conmon(container)]
    for pid in ended:
        os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while any(alive(pid) for pid in ended) and time.monotonic() < deadline:
        time.sleep(0.1)
    refused = own.podman("ps", "--all", check=False)
    assert refused.returncode != 0 and "invalid internal status" in refused.stderr, refused.stderr
    with caplog.at_level(logging.WARNING):
        listed = own.engine.list()
    assert [(c.id, c.running) for c in listed] == [(container, False)]
    assert "running `podman system migrate`" in caplog.text
    assert own.podman("ps", "--all", "--quiet", "--no-trunc").stdout.split() == [container]


def test_a_bookers_words_saying_invalid_internal_status_never_reset_podman(
        own: Own, caplog: pytest.LogCaptureFixture) -> None:
    """Round 3, M3: the text was matched anywhere in any failed command's standard error, and `podman
    system migrate` stops every container of the account. A booker made `podman unshare du` (doctor's
    store check) print it, naming files "invalid internal status"; an exec's or a build's output can
    print it too, even at the start of a line."""
    container = own.booking("working")
    said = "Error: invalid internal status, try resetting the pause process with \"podman system migrate\""
    with caplog.at_level(logging.WARNING):
        done = own.engine._process(  # type: ignore[attr-defined]
            ["unshare", "sh", "-c", f"echo \"du: cannot access '/s/diff/tmp/invalid internal status/x'\" >&2; "
                                    f"echo '{said}' >&2; exit 1"], timeout=120)
        assert done.returncode == 1 and "invalid internal status" in done.stderr
        done = own.engine._process(  # type: ignore[attr-defined]
            ["exec", container, "/usr/bin/sh", "-c", f"echo '{said}' >&2; exit 1"], timeout=120)
        assert done.returncode == 1 and said in done.stderr
    assert "system migrate`" not in caplog.text
    assert own.podman("inspect", "--format", "{{.State.Running}}", container).stdout.strip() == "true"
