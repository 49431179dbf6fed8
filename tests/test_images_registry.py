"""Images from a real registry (Debian's docker-registry over TLS with htpasswd auth), pulled by the
background preparer with rootless podman: credentials, reasons a booker reads in the event's
block, pinned digests, a mirror per template, and the cleanup of gpubook's own images only."""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from gpubook.runtime.engines import Engine, container_name, engine_from, podman
from gpubook.runtime.engines.cli_images import LABEL_WARM, WARM_PREFIX
from gpubook.runtime.templates import images
from gpubook.runtime.templates.catalog import Template, load_template
from gpubook.scheduler.hosts.images import FAILED, READY, ImagePreparer
from tests.kits import registry_kit
from tests.kits.registry_kit import Registry

pytestmark = [
    pytest.mark.podman,
    pytest.mark.skipif(shutil.which("podman") is None, reason="podman is not installed"),
    pytest.mark.skipif(shutil.which("docker-registry") is None, reason="docker-registry is not installed"),
]


@pytest.fixture(scope="module")
def engine() -> Engine:
    return engine_from("podman", runtime="runc", storage_driver="overlay")


@pytest.fixture(scope="module")
def registry() -> Iterator[Registry]:
    with registry_kit.running() as running:
        yield running


@pytest.fixture
def pushed(engine: Engine, registry: Registry) -> Iterator[tuple[str, str]]:
    """A tiny image only in the registry, as lab/tiny:<random>: its name there and its digest."""
    name = f"lab/tiny:{secrets.token_hex(4)}"
    local = registry_kit.tiny_image(engine, f"localhost/gpubook-test/tiny:{secrets.token_hex(4)}")
    digest = registry_kit.push(engine, registry, local, name)
    registry_kit.remove(engine, local)
    remote = f"{registry.address}/{name}"
    yield remote, digest
    registry_kit.remove(engine, remote)


def template(folder: Path, image: str, *, mirror: str | None = None, name: str = "lab") -> Template:
    folder.mkdir(exist_ok=True)
    path = folder / f"{name}.toml"
    extra = f'mirror = "{mirror}"\n' if mirror else ""
    path.write_text(f'image = "{image}"\ncuda = "none"\nhas_sshd = true\n{extra}')
    return load_template(path)


def prepared(engine: Engine, tmp_path: Path, chosen: Template, *, auth_file: Path | None) -> ImagePreparer:
    """A preparer asked for one booking of `chosen`; returned once that preparation has ended."""
    finished = threading.Event()
    preparer = ImagePreparer(engine=engine, ledger=images.Ledger(tmp_path / "images.json"), auth_file=auth_file,
                             on_done=finished.set)
    preparer.want({"booking-1": chosen}, now=datetime.now(UTC))
    assert finished.wait(120), "the preparation did not end"
    return preparer


def state(preparer: ImagePreparer) -> dict:  # type: ignore[type-arg]
    (row,) = preparer.snapshot()["preparations"]
    return row


def test_pull_with_the_right_credentials_and_the_reasons_of_the_wrong(engine: Engine, registry: Registry,
                                                                      pushed: tuple[str, str], tmp_path: Path) -> None:
    remote, _ = pushed
    refused = prepared(engine, tmp_path / "a", template(tmp_path / "t", remote), auth_file=registry.wrong_auth_file)
    assert state(refused)["state"] == FAILED and state(refused)["why"] == images.REFUSED
    assert refused.lines() == {"booking-1": f"image: not ready: registry refused ({remote}); gpubook tries again"}
    anonymous = prepared(engine, tmp_path / "b", template(tmp_path / "t", remote), auth_file=None)
    assert state(anonymous)["why"] == images.REFUSED
    missing = prepared(engine, tmp_path / "c", template(tmp_path / "t", remote + "-missing"),
                       auth_file=registry.auth_file)
    assert state(missing)["why"] == images.NOT_FOUND
    assert not engine.image_exists(remote)  # type: ignore[attr-defined]
    good = prepared(engine, tmp_path / "d", template(tmp_path / "t", remote), auth_file=registry.auth_file)
    assert state(good)["state"] == READY and good.lines() == {"booking-1": "image: ready"}
    assert f"pulled from {remote}" in state(good)["detail"]
    assert engine.image_exists(remote)  # type: ignore[attr-defined]
    assert [e.image for e in images.Ledger(tmp_path / "d" / "images.json").entries()] == [remote]


def test_a_pinned_digest_is_honoured_and_a_wrong_one_refused(engine: Engine, registry: Registry,
                                                             pushed: tuple[str, str], tmp_path: Path) -> None:
    remote, digest = pushed
    repository, tag = remote.rsplit(":", 1)
    wrong = "sha256:" + "0" * 64
    refused = prepared(engine, tmp_path / "a", template(tmp_path / "t", f"{remote}@{wrong}"),
                       auth_file=registry.auth_file)
    assert state(refused)["state"] == FAILED and state(refused)["why"] == images.NOT_FOUND
    for number, image in enumerate((f"{repository}@{digest}", f"{remote}@{digest}")):
        good = prepared(engine, tmp_path / f"b{number}", template(tmp_path / "t", image), auth_file=registry.auth_file)
        local = images.parse_reference(image).local_name()
        assert state(good)["state"] == READY and state(good)["run_image"] == local
        facts = engine.image_facts(local)  # type: ignore[attr-defined]
        assert facts is not None and f"{repository}@{digest}" in facts.digests
        registry_kit.remove(engine, local)


def test_a_mirror_serves_the_template_and_the_result_says_which_source(engine: Engine, registry: Registry,
                                                                       pushed: tuple[str, str], tmp_path: Path) -> None:
    remote, _ = pushed
    path = remote.split("/", 1)[1]  # lab/tiny:TAG
    origin = f"{registry.address}/origin-{secrets.token_hex(3)}/{path}"  # the template's image: absent there
    mirror = f"{registry.address}/mirror"
    registry_kit.tiny_image(engine, "localhost/gpubook-test/mirrored:1")
    registry_kit.push(engine, registry, "localhost/gpubook-test/mirrored:1", f"mirror/{origin.split('/', 1)[1]}")
    registry_kit.remove(engine, "localhost/gpubook-test/mirrored:1")
    served = prepared(engine, tmp_path / "a", template(tmp_path / "t", origin, mirror=mirror),
                      auth_file=registry.auth_file)
    assert state(served)["state"] == READY
    assert state(served)["detail"] == f"pulled from {mirror}/{origin.split('/', 1)[1]}"
    assert engine.image_exists(origin)  # type: ignore[attr-defined]  # tagged as the template's image
    registry_kit.remove(engine, origin, f"{mirror}/{origin.split('/', 1)[1]}")
    # A mirror without the image: its origin serves it, and the result says what the mirror lacked.
    fallback = prepared(engine, tmp_path / "b", template(tmp_path / "t", remote, mirror=mirror),
                        auth_file=registry.auth_file)
    assert state(fallback)["state"] == READY
    detail = state(fallback)["detail"]
    assert detail.startswith(f"pulled from {remote}; {mirror}/{path}: not found")


def test_cleanup_removes_only_gpubooks_unused_images_oldest_first(engine: Engine, tmp_path: Path) -> None:
    run = secrets.token_hex(3)
    names = [registry_kit.tiny_image(engine, f"localhost/gpubook-test/clean-{run}-{n}:1") for n in range(5)]
    oldest, in_use, kept, newer, admins = names
    ledger = images.Ledger(tmp_path / "images.json")
    start = datetime.now(UTC) - timedelta(days=1)
    for hours, image in enumerate((oldest, in_use, kept, newer)):  # the admin's image is not recorded
        ledger.add(image, kind="pulled", now=start + timedelta(hours=hours))
    container = f"gpubook-test-clean-{run}"
    registry_kit.podman(engine, "create", "--name", container, in_use, "/gpubook-token")
    try:
        removals = iter([0, 10**15])  # under the floor, then above it after one removal
        removed = images.clean(engine, ledger, keep={kept}, min_free=10**12,  # type: ignore[arg-type]
                               free=lambda: next(removals))
        assert removed == [oldest]  # then the floor was reached: `newer` stays
        everything = images.clean(engine, ledger, keep={kept}, min_free=10**12,  # type: ignore[arg-type]
                                  free=lambda: 0)
        assert everything == [newer]
        present = {n: engine.image_exists(n) for n in names}  # type: ignore[attr-defined]
        assert present == {oldest: False, in_use: True, kept: True, newer: False, admins: True}
        assert [e.image for e in ledger.entries()] == [in_use, kept]
    finally:
        registry_kit.podman(engine, "rm", "--force", container)
        registry_kit.remove(engine, *names)


def test_a_warm_up_cut_short_does_not_keep_its_image_from_the_cleanup(engine: Engine, tmp_path: Path) -> None:
    """The fault harness's finding: a daemon killed during an image's warm-up (`podman create`,
    never started) leaves that container behind; it counted as a use, so the image could never be
    removed to free disk space, its booking long gone."""
    image = registry_kit.tiny_image(engine, f"localhost/gpubook-test/warmed-{secrets.token_hex(3)}:1")
    ledger = images.Ledger(tmp_path / "images.json")
    ledger.add(image, kind="pulled")
    registry_kit.podman(engine, "create", "--name", podman.warm_name(image), "--label", f"{LABEL_WARM}=1", image,
                        "true")  # a cut warm-up's, as PodmanEngine.warm makes it
    try:
        removed = images.clean(engine, ledger, keep=set(), min_free=10**12, free=lambda: 0)  # type: ignore[arg-type]
        assert removed == [image]
        assert not engine.image_exists(image)  # type: ignore[attr-defined]
        assert podman.warm_name(image) not in registry_kit.podman(engine, "ps", "--all", "--format", "{{.Names}}")
    finally:
        registry_kit.podman(engine, "rm", "--force", "--ignore", podman.warm_name(image))
        registry_kit.remove(engine, image)


def test_a_booking_whose_uid_begins_with_warm_keeps_its_image_in_use(engine: Engine, tmp_path: Path) -> None:
    """Round 3, L5: warm-ups were told by their name, and `container_name("warm-x")` is
    "gpubook-warm-x-…": that booking's image counted as unused, and the cleanup removed what it
    could of it (an image under several names loses its tags while the container runs)."""
    image = registry_kit.tiny_image(engine, f"localhost/gpubook-test/warmish-{secrets.token_hex(3)}:1")
    name = container_name(f"warm-{secrets.token_hex(3)}")
    assert name.startswith(WARM_PREFIX)
    registry_kit.podman(engine, "create", "--name", name, image, "/gpubook-token")
    try:
        image_id = registry_kit.podman(engine, "image", "inspect", "--format", "{{.Id}}", image).strip()
        assert image_id.removeprefix("sha256:") in engine.images_in_use()  # type: ignore[attr-defined]
        ledger = images.Ledger(tmp_path / "images.json")
        ledger.add(image, kind="pulled")
        assert images.clean(engine, ledger, keep=set(), min_free=10**12, free=lambda: 0) == []  # type: ignore[arg-type]
        assert engine.image_exists(image)  # type: ignore[attr-defined]
    finally:
        registry_kit.podman(engine, "rm", "--force", "--ignore", name)
        registry_kit.remove(engine, image)


def _random_layers(engine: Engine, tag: str, *, base: str, sizes: tuple[int, ...]) -> str:
    """FROM `base`, one layer of random bytes (nothing to compress) per size."""
    with tempfile.TemporaryDirectory(prefix="gpubook-layers-") as context:
        for number, size in enumerate(sizes):
            (Path(context) / f"part{number}").write_bytes(os.urandom(size))
        (Path(context) / "Containerfile").write_text(
            f"FROM {base}\n" + "".join(f"COPY part{n} /part{n}\n" for n in range(len(sizes))))
        registry_kit.podman(engine, "build", "--quiet", "--tag", tag, context)
    return tag


@pytest.mark.skipif(shutil.which("skopeo") is None, reason="skopeo is not installed")
def test_the_download_is_the_layers_the_store_lacks_and_a_pull_tells_how_far_it_is(
        engine: Engine, registry: Registry) -> None:
    """Issue 27's progress: the bytes to download come from the registry's manifest less the
    layers whose content the store has (a base kept here: not counted, as podman does not fetch
    it); a pull over a slow link tells the bytes downloaded so far while it runs."""
    run = secrets.token_hex(4)
    base = _random_layers(engine, f"localhost/gpubook-test/base-{run}:1", base="scratch", sizes=(2_000_000,))
    top = _random_layers(engine, f"localhost/gpubook-test/top-{run}:1", base=base, sizes=(3_000_000, 3_000_000))
    name = f"lab/top-{run}:1"
    registry_kit.push(engine, registry, top, name)
    registry_kit.podman(engine, "rmi", top)  # its own two layers go; the base's stays
    remote = f"{registry.address}/{name}"
    try:
        total = images.download_size(engine, remote, auth_file=registry.auth_file)  # type: ignore[arg-type]
        assert total is not None and 6_000_000 <= total < 6_050_000, total
        scratch = engine.pull_scratch()  # type: ignore[attr-defined]
        dead = scratch / "gpubook-pull-killed" / "storage1"  # a daemon killed mid-pull two hours ago
        dead.mkdir(parents=True)
        (dead / "1").write_bytes(b"x" * 1000)
        os.utime(dead.parent, (time.time() - 7200, time.time() - 7200))
        with registry_kit.slowed(registry, 1_000_000) as slow:
            through = f"{slow.address}/{name}"
            assert images.download_size(engine, through, auth_file=slow.auth_file) == total  # type: ignore[arg-type]
            seen: list[int] = []
            images.pull(engine, through, auth_file=slow.auth_file, progress=seen.append)  # type: ignore[arg-type]
            registry_kit.remove(engine, through)
        assert not dead.parent.exists() and not list(scratch.glob("gpubook-pull-*"))  # nothing left behind
        assert any(0 < value < total for value in seen), seen  # on its way
        assert max(seen) >= 0.75 * total, (seen, total)  # near the end (sampled twice a second), no more than it
        assert max(seen) <= total * 1.01, (seen, total)
        assert images.download_size(engine, remote, auth_file=registry.auth_file) == total  # type: ignore[arg-type]
    finally:
        registry_kit.remove(engine, remote, base)
    assert images.download_size(engine, f"{registry.address}/lab/none-{run}:1", auth_file=registry.auth_file) is None  # type: ignore[arg-type]
