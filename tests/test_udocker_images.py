"""Images for udocker, the ways an admin gets them into udocker's store (run as the tests'
unprivileged user): `gpubook templates build` imports the mmdebstrap tarball; an image made by
podman arrives as an OCI archive (`udocker load`) or through Debian's docker-registry (`udocker
login` + `udocker pull`), and a booking starts from it; what udocker cannot read is said in one
sentence (podman's docker-archive, a registry's port in the name); the daemon's image readiness."""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path

import pytest

from gpubook.runtime.engines import Engine, engine_from
from gpubook.runtime.errors import EngineError
from gpubook.runtime.templates import images, overlay_image
from gpubook.runtime.templates.catalog import get_template, load_template
from gpubook.scheduler import config as config_module
from gpubook.scheduler.commands import doctor
from gpubook.scheduler.hosts.images import FAILED, READY, ImagePreparer
from tests.kits import registry_kit, safe_data
from tests.kits.engine_suite import BOOKER, CACHE_DIR, PODMAN, Bookings, connect, run

pytestmark = [
    pytest.mark.udocker,
    pytest.mark.podman,
    pytest.mark.skipif(os.geteuid() == 0, reason="udocker runs as a user"),
    pytest.mark.skipif(shutil.which("podman") is None, reason="podman is not installed"),
]

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def engine_args() -> dict:
    return {"name": "udocker", "network": "host"}


@pytest.fixture(scope="module")
def podman() -> Engine:
    made = engine_from(**PODMAN)
    overlay_image.build_rootfs_image(made, get_template("debian-ssh"), cache_dir=CACHE_DIR)
    return made


@pytest.fixture(scope="module")
def marked(podman: Engine) -> Iterator[tuple[str, str]]:
    """An image podman made from debian-ssh with a file of its own: (its name, the file's text)."""
    token = secrets.token_hex(8)
    tag = f"localhost/gpubook-test/udocker-{token}:1"
    with tempfile.TemporaryDirectory(prefix="gpubook-marked-") as context:
        (Path(context) / "token").write_text(token + "\n")
        (Path(context) / "Containerfile").write_text(
            f"FROM {get_template('debian-ssh').image}\nCOPY token /gpubook-token\n")
        registry_kit.podman(podman, "build", "--quiet", "--tag", tag, context)
    yield tag, token
    registry_kit.remove(podman, tag)


def udocker(engine: Engine, *args: str, stdin: str | None = None, env: dict[str, str] | None = None) -> str:
    """udocker as an admin runs it by hand, on the engine's store; its output, or the test fails."""
    done = subprocess.run([engine.binary, *args], capture_output=True, text=True, timeout=600, input=stdin,  # type: ignore[attr-defined]
                          env={**os.environ, "UDOCKER_DIR": str(engine.top), "UDOCKER_TARBALL": "",  # type: ignore[attr-defined]
                               **(env or {})}, check=False)
    assert done.returncode == 0, f"udocker {args[0]}: {done.stderr[-2000:]}"
    return done.stdout


def load(engine: Engine, podman: Engine, image: str, folder: Path, *, fmt: str) -> str:
    """`podman save --format fmt`, then `udocker load -i` (the archive removed: a few hundred MB).
    udocker unpacks the archive in its temporary folder and moves the layers into its store: on one
    filesystem (a host whose /tmp and homes share a disk) a move keeps a symlink as the link, across two
    it copies what the link points at. Its temporary folder is put on the store's filesystem, so the
    test meets the first case whatever disks this machine's /tmp and store are on."""
    archive = folder / f"{fmt}.tar"
    registry_kit.podman(podman, "save", "--format", fmt, "--output", str(archive), image)
    temporary = engine.top / "admin-tmp"  # type: ignore[attr-defined]
    temporary.mkdir(exist_ok=True)
    try:
        return udocker(engine, "load", "-i", str(archive), env={"UDOCKER_TMP": str(temporary)})
    finally:
        archive.unlink()
        shutil.rmtree(temporary, ignore_errors=True)


def booked_token(engine: Engine, image: str) -> str:
    """A booking of debian-ssh's template on `image`, logged into: the file the image brought."""
    with safe_data.data_root() as data_root:
        bookings = Bookings(engine, data_root, replace(get_template("debian-ssh"), image=image))
        try:
            booking = bookings.start()
            client = connect(booking.spec.port, BOOKER, booking.key)
            try:
                status, out, err = run(client, "id -un; cat /gpubook-token")
            finally:
                client.close()
        finally:
            bookings.cleanup()
    assert status == 0, err
    user, token = out.split()
    assert user == BOOKER
    return token


def test_templates_build_imports_debian_ssh_into_udockers_store(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """`gpubook templates build` with `[engine] name = "udocker"` in the config (it refused before:
    the engine was made without the config's network)."""
    config = tmp_path / "gpubook.toml"
    config.write_text('[engine]\nname = "udocker"\nnetwork = "host"\n\n'
                      '[[calendar]]\nurl = "http://127.0.0.1:5232/lab/devbox1/"\n')
    store = tmp_path / "udocker"
    done = subprocess.run([sys.executable, "-m", "gpubook", "templates", "--config", str(config), "build",
                           "debian-ssh"], capture_output=True, text=True, timeout=600, check=False, cwd=ROOT,
                          env={**os.environ, "UDOCKER_DIR": str(store)})
    assert done.returncode == 0, done.stderr
    image = get_template("debian-ssh").image
    assert done.stdout.strip().splitlines()[-1] == image
    monkeypatch.setenv("UDOCKER_DIR", str(store))
    assert engine_from("udocker", network="host").image_exists(image)  # type: ignore[attr-defined]


def test_an_oci_archive_saved_by_podman_loads_and_a_booking_starts_from_it(
        engine: Engine, podman: Engine, marked: tuple[str, str], tmp_path: Path) -> None:
    image, token = marked
    with pytest.raises(EngineError, match="not present in udocker's store"):
        engine.ensure_image(image)
    try:
        assert image in load(engine, podman, image, tmp_path, fmt="oci-archive")
        engine.ensure_image(image)
        assert booked_token(engine, image) == token
    finally:
        udocker(engine, "rmi", image)


def test_a_docker_archive_of_podman_is_named_as_unusable_with_the_way_that_works(
        engine: Engine, podman: Engine, marked: tuple[str, str], tmp_path: Path) -> None:
    """podman's docker-archive links each layer.tar to a blob; udocker 1.3.17 loads the links, not
    the layers, and says it loaded the image: gpubook says what happened and what to do instead."""
    image, _ = marked
    layers = engine.top / "layers"  # type: ignore[attr-defined]
    before = set(layers.iterdir())
    try:
        load(engine, podman, image, tmp_path, fmt="docker-archive")
        assert image in udocker(engine, "images")
        with pytest.raises(EngineError) as caught:
            engine.ensure_image(image)
        sentence = str(caught.value)
        assert "cannot use" in sentence and "--format oci-archive" in sentence and "\n" not in sentence
    finally:
        udocker(engine, "rmi", image)
        for link in set(layers.iterdir()) - before:  # `udocker rmi` leaves the load's dangling links
            if link.is_symlink() and not link.exists():
                link.unlink()


def test_an_image_from_docker_registry_reaches_udocker_by_login_and_pull(
        engine: Engine, podman: Engine, marked: tuple[str, str], tmp_path: Path) -> None:
    """TLS with the registry's own CA (curl's CURL_CA_BUNDLE) and htpasswd auth (`udocker login`, its
    keystore kept here); udocker parses a name with a port wrongly, so `--registry` names the host."""
    image, token = marked
    name = f"lab/udocker-{secrets.token_hex(4)}:1"
    admin = {"CURL_CA_BUNDLE": "", "UDOCKER_KEYSTORE": str(tmp_path / "keystore")}
    with registry_kit.running() as registry:
        registry_kit.push(podman, registry, image, name)
        admin["CURL_CA_BUNDLE"] = str(registry.folder / "ca.crt")
        udocker(engine, "login", f"--registry=https://{registry.address}", f"--username={registry_kit.USER}",
                "--password-stdin", stdin=registry_kit.PASSWORD + "\n", env=admin)
        try:
            udocker(engine, "pull", f"--registry=https://{registry.address}", name, env=admin)
            with pytest.raises(EngineError) as caught:  # the name with the registry's port: one sentence
                engine.ensure_image(f"{registry.address}/{name}")
            assert "--registry=https://" in str(caught.value) and "\n" not in str(caught.value)
            assert booked_token(engine, name) == token
        finally:
            udocker(engine, "rmi", name)


def test_readiness_says_not_found_with_the_way_in_then_ready_once_an_admin_loads_it(
        engine: Engine, podman: Engine, marked: tuple[str, str], tmp_path: Path) -> None:
    """udocker is not one of the engines gpubook pulls with: the preparer checks udocker's store. A
    missing image is "not found" in the event's block, with the commands in the detail; once an
    admin has loaded it, the next start finds it ready without waiting for the retry's delay."""
    image, _ = marked
    folder = tmp_path / "templates"
    folder.mkdir()
    (folder / "lab.toml").write_text(f'image = "{image}"\ncuda = "none"\nhas_sshd = true\n')
    template = load_template(folder / "lab.toml")
    preparer = ImagePreparer(engine=engine, ledger=images.Ledger(tmp_path / "images.json"))
    try:
        preparer.want({"b1": template}, now=datetime.now(UTC))
        row = wait_for(preparer, lambda r: r["state"] == FAILED)
        assert row["why"] == images.NOT_FOUND and "udocker load" in row["detail"]
        assert preparer.lines() == {"b1": f"image: not ready: not found ({image}); gpubook tries again"}
        load(engine, podman, image, tmp_path, fmt="oci-archive")
        assert preparer.ready(template) == image  # the retry is an hour away at most, not waited for
        assert wait_for(preparer, lambda r: r["state"] == READY)
        assert preparer.lines() == {"b1": "image: ready"}
    finally:
        preparer.close()
        subprocess.run([engine.binary, "rmi", image], capture_output=True, check=False,  # type: ignore[attr-defined]
                       env={**os.environ, "UDOCKER_DIR": str(engine.top)})  # type: ignore[attr-defined]


def wait_for(preparer: ImagePreparer, condition, timeout: float = 120.0) -> dict:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rows = preparer.snapshot()["preparations"]
        if rows and condition(rows[0]):
            return rows[0]
        time.sleep(0.1)
    raise AssertionError(f"the preparation did not get there within {timeout:.0f} s: {rows}")


def test_doctor_says_which_images_bookings_wait_for_and_how_each_gets_into_udockers_store(
        engine: Engine, tmp_path: Path) -> None:
    """gpubook does not pull with udocker: a registry's image not in the store fails doctor (it
    warned that the daemon would pull it), with udocker's own way in, the port's too."""
    folder = tmp_path / "templates"
    folder.mkdir()
    shutil.copy(ROOT / "gpubook" / "templates" / "debian-ssh.toml", folder)
    (folder / "ported.toml").write_text('image = "127.0.0.1:5999/lab/ported:1"\ncuda = "none"\nhas_sshd = true\n')
    (folder / "remote.toml").write_text('image = "registry.invalid/lab/remote:1"\ncuda = "none"\nhas_sshd = true\n')
    config = tmp_path / "gpubook.toml"
    config.write_text('[[calendar]]\nurl = "http://127.0.0.1:9/cal/"\n[defaults]\ntemplate = "debian-ssh"\n'
                      f'[templates]\ndir = "{folder}"\n[engine]\nname = "udocker"\nnetwork = "host"\n'
                      '[users.alice]\nuid = 2001\ntemplates = ["*"]\n')
    by_name = {c.name: c for c in doctor.image_checks(config_module.load(config))}
    assert list(by_name) == ["image debian-ssh", "image ported", "image remote"]
    assert by_name["image debian-ssh"].level == "ok"
    ported, remote = by_name["image ported"], by_name["image remote"]
    assert (ported.level, remote.level) == ("fail", "fail")
    assert "`udocker pull --registry=https://127.0.0.1:5999 lab/ported:1`" in ported.detail
    assert "`udocker pull registry.invalid/lab/remote:1`" in remote.detail and "oci-archive" in remote.detail
    assert "gpubook does not pull with engine udocker" in remote.detail


def test_the_store_of_every_bookings_root_is_the_daemons_alone(engine: Engine, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """udocker makes its store 0755: a booking's root (its /tmp, what the booker leaves outside
    /data) would be readable by every account on the host. The engine closes it, even one an admin
    made first by hand, before anything runs in it."""
    store = tmp_path / "udocker"
    store.mkdir(mode=0o755)
    store.chmod(0o755)
    monkeypatch.setenv("UDOCKER_DIR", str(store))
    assert engine_from("udocker", network="host").image_exists("localhost/gpubook-test/none:1") is False
    assert oct(store.stat().st_mode & 0o777) == oct(0o700)
    with safe_data.data_root() as data_root:
        bookings = Bookings(engine, data_root, get_template("debian-ssh"))
        try:
            booking = bookings.start()
            client = connect(booking.spec.port, BOOKER, booking.key)
            try:
                assert run(client, "echo left > /tmp/left-here")[0] == 0
            finally:
                client.close()
            left = next(engine.top.glob("containers/*/ROOT/tmp/left-here"))  # type: ignore[attr-defined]
            assert left.stat().st_mode & 0o004  # readable by others in itself ...
            assert engine.top.stat().st_mode & 0o077 == 0  # type: ignore[attr-defined]  # ... not reachable
        finally:
            bookings.cleanup()


def test_a_template_without_sshd_is_named_as_waiting_for_an_image_with_sshd(engine: Engine, tmp_path: Path) -> None:
    """udocker builds no sshd overlay: the preparer says "not found" with the way out (it said
    "pull failed"), and doctor fails the template's image (it said ok: the image is there)."""
    folder = tmp_path / "templates"
    folder.mkdir()
    image = get_template("debian-ssh").image
    (folder / "nosshd.toml").write_text(f'image = "{image}"\ncuda = "none"\nhas_sshd = false\n')
    template = load_template(folder / "nosshd.toml")
    preparer = ImagePreparer(engine=engine, ledger=images.Ledger(tmp_path / "images.json"))
    try:
        preparer.want({"b1": template}, now=datetime.now(UTC))
        row = wait_for(preparer, lambda r: r["state"] == FAILED)
    finally:
        preparer.close()
    assert row["why"] == images.NOT_FOUND and "has_sshd = true" in row["detail"]
    config = tmp_path / "gpubook.toml"
    config.write_text('[[calendar]]\nurl = "http://127.0.0.1:9/cal/"\n[defaults]\ntemplate = "nosshd"\n'
                      f'[templates]\ndir = "{folder}"\n[engine]\nname = "udocker"\nnetwork = "host"\n')
    [check] = doctor.image_checks(config_module.load(config))
    assert check.level == "fail" and "has no sshd" in check.detail and "has_sshd = true" in check.fix
