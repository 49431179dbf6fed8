"""Images prepared ahead: pull times from a local registry, the sshd overlay's build time, and the
start-to-SSH of a booking whose image was prepared ahead against one whose image is prepared at its
start; prints the figures.

    gpubook-userbench TREE bench/images.py [--runs 3] [--no-overlay]
    gpubook-userbench TREE bench/images.py --sizes     (the real-size image against the small one)
    gpubook-userbench TREE bench/images.py --sizes --ahead   (and bookings made 1 min, 5 min, 1 h ahead)

The registry is Debian's docker-registry on 127.0.0.1 (TLS, htpasswd), as in the tests. Pulls:
(a) debian-ssh plus one new small layer (the base's layers are in podman's storage already, as on a
host that ran the template before), (b) an image of one new 100 MB layer of random bytes (nothing of
it present). The overlay is built on a fresh image FROM Debian minbase (apt-get from Debian's mirror
over the host network). Start-to-SSH goes through LocalHost.start and the ImagePreparer, as the daemon
does: "at its start" is the time from the first start call (the image absent: Preparing, queued) to
the probe's SSH login, after the pull; "ahead" from the start call to the login, the image ready.
Both bookings' images are debian-ssh plus a new 100 MB layer (a real template image is GBs: its
pull at the start would cost correspondingly more).

--sizes (issue 27): the real-size image of bench/real_image.py (debian-ssh + PyTorch and JAX with their
CUDA wheels, 11.9 GB, built and pushed once) against debian-ssh + a new 100 MB layer, in one run: the
pull (gpubook.runtime.templates.images.pull), the first start with gpubook's uidmap (rootless podman 4.3 without
idmapped overlay mounts makes a flattened, chowned copy of the whole image there), the disk each takes
(df of the storage's file system, and the copy's own folder), the second start, and the start after a
warm-up (create + rm with the same uidmap right after a second pull: PodmanEngine.warm, which the
image's preparation runs). --ahead: bench/images_ahead.py, for both images.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import cast

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import images_ahead  # noqa: E402
from gpubook.runtime import private  # noqa: E402
from gpubook.runtime.booking import ssh
from gpubook.runtime.engines import ContainerSpec, Engine, container_name, engine_from  # noqa: E402
from gpubook.runtime.engines.podman import PodmanEngine  # noqa: E402
from gpubook.runtime.errors import Preparing  # noqa: E402
from gpubook.runtime.templates import images, overlay_image
from gpubook.runtime.templates.catalog import Template, get_template, load_template  # noqa: E402
from gpubook.scheduler.hosts import Booker, StartRequest  # noqa: E402
from gpubook.scheduler.hosts.images import ImagePreparer  # noqa: E402
from gpubook.scheduler.hosts.local import LocalHost  # noqa: E402
from tests.kits import registry_kit  # noqa: E402
from tests.kits.engine_suite import CACHE_DIR, lane_port  # noqa: E402


def pushed_only(engine: Engine, registry: registry_kit.Registry, *, base: str, big: bool = False) -> str:
    """A new image in the registry and not in podman's storage (FROM `base`, plus a small file or a
    new 100 MB layer of random bytes); its name there."""
    local = f"localhost/gpubook-bench/img:{secrets.token_hex(4)}"
    if big:
        with tempfile.TemporaryDirectory() as context:
            (Path(context) / "blob").write_bytes(os.urandom(100 * 1024 * 1024))
            (Path(context) / "Containerfile").write_text(f"FROM {base}\nCOPY blob /blob\n")
            registry_kit.podman(engine, "build", "--quiet", "--tag", local, context)
    else:
        registry_kit.tiny_image(engine, local, base=base)
    name = f"bench/img:{secrets.token_hex(4)}"
    registry_kit.push(engine, registry, local, name)
    registry_kit.remove(engine, local)
    return f"{registry.address}/{name}"


def timed_pull(engine: Engine, image: str, auth: Path) -> float:
    began = time.monotonic()
    images.pull(engine, image, auth_file=auth)  # type: ignore[arg-type]
    return time.monotonic() - began


def template_of(folder: Path, image: str, *, has_sshd: bool = True) -> Template:
    path = folder / f"t{secrets.token_hex(3)}.toml"
    path.write_text(f'image = "{image}"\ncuda = "none"\nhas_sshd = {str(has_sshd).lower()}\n')
    return load_template(path)


def start_to_ssh(host: LocalHost, template: Template, finished: threading.Event, booking_id: str) -> float:
    """From the first start call to the probe's login, waiting out `Preparing` as the daemon's
    pass does (a pass as soon as the preparer says it finished)."""
    request = StartRequest(booking_id=booking_id, booker=Booker("alice", 2001, 2001), template=template, gpus=(),
                           port=lane_port(), end=datetime.now(UTC) + timedelta(hours=1))
    began = time.monotonic()
    try:
        while True:
            finished.clear()
            try:
                host.start(request)
                return time.monotonic() - began
            except Preparing:
                finished.wait(600)
    finally:
        host.stop(container_name(booking_id), 0)


# --- Real-size images (issue 27): the pull, the first start with gpubook's uidmap (the remapped copy
# of the image that rootless podman makes when the kernel's overlay has no idmapped mounts for it), the
# disk each takes, the second start, and the start after a warm-up (a create and rm right after the
# pull). Each start is `podman create` + `podman start` of `sleep infinity` with the uidmap a booking
# gets (PodmanEngine.userns_args) and no network, so that the figures are the storage's alone.

DEBUG_WORDS = re.compile(r"idmap|fuse|shift|chown|mount.?program|mapped|copy|template", re.IGNORECASE)


@dataclass(frozen=True)
class StartCost:
    create: float  # seconds
    start: float


@dataclass(frozen=True)
class SizeFigures:
    image: str
    size: int  # podman's size of the image, bytes
    pull: float  # seconds
    pull_disk: int  # bytes the storage's file system lost in the pull
    first: StartCost  # the first start after the pull
    copy_disk: int  # bytes it lost in the first create (the remapped copy)
    added: tuple[str, ...]  # the layers the first create added to the store: "id parent size"
    debug: tuple[str, ...]  # podman --log-level=debug lines of the first create about id mapping
    second: StartCost
    repull: float  # the pull again, for the warm-up round
    warm_up: float  # create + rm right after that pull
    warmed: StartCost  # the booking-like start after the warm-up


def booking_userns(engine: PodmanEngine) -> list[str]:
    """The --uidmap/--gidmap a rootless booking gets (`--uidmap=0:1:N`), from gpubook's own code; less
    `--passwd=false`, which podman 4.3's `run` takes and its `create` does not (it is no storage matter)."""
    args = engine.userns_args(cast(ContainerSpec, _Ids(uid=2001, gid=2001)))
    return [arg for arg in args if not arg.startswith("--passwd")]


@dataclass(frozen=True)
class _Ids:
    uid: int
    gid: int


def _podman(engine: PodmanEngine, *args: str, debug: bool = False) -> subprocess.CompletedProcess[str]:
    argv = [*engine.global_argv(), *(["--log-level=debug"] if debug else []), *args]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=3600, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"podman {args[0]}: {done.stderr.strip()[-2000:]}")
    return done


def _free(engine: PodmanEngine) -> int:
    return shutil.disk_usage(engine.storage_path()).free


def _store_layers(engine: PodmanEngine) -> dict[str, dict[str, object]]:
    """The storage's layers (overlay-layers/layers.json, the account's own file), by id."""
    path = engine.storage_path() / "overlay-layers" / "layers.json"
    return {str(layer["id"]): layer for layer in json.loads(path.read_text())}


def _layer_bytes(engine: PodmanEngine, layer: str) -> int:
    """What a layer's folder holds: its diff, and for a remapped copy the flattened, chowned copy of
    the whole image beside it (diff1); `du` inside podman's namespace, the files being subordinate ids'."""
    folder = engine.storage_path() / "overlay" / layer
    return int(_podman(engine, "unshare", "du", "-sb", str(folder)).stdout.split()[0])


def _layer_folders(engine: PodmanEngine, layer: str) -> str:
    folder = engine.storage_path() / "overlay" / layer
    return " ".join(sorted(_podman(engine, "unshare", "ls", str(folder)).stdout.split()))


def forget(engine: PodmanEngine, image: str) -> None:
    """Remove `image` under every registry address it was pulled from (the tests' registry has a new
    port each run): an image still present under an old name would make the pull a no-op."""
    path = image.split("/", 1)[1]
    names = _podman(engine, "images", "--format", "{{.Repository}}:{{.Tag}}").stdout.split()
    same = [name for name in names if "/" in name and name.split("/", 1)[1] == path]
    registry_kit.remove(cast(Engine, engine), *same)


def timed_start(engine: PodmanEngine, image: str, *, debug: bool = False) -> tuple[StartCost, list[str]]:
    """Create and start a booking-like container of `image`, then remove it; the times and, with
    `debug`, podman's debug lines of the create about id mapping."""
    began = time.monotonic()
    created = _podman(engine, "create", *booking_userns(engine), "--network", "none", image, "sleep", "infinity",
                      debug=debug)
    container = created.stdout.strip().splitlines()[-1]
    middle = time.monotonic()
    try:
        _podman(engine, "start", container)
        cost = StartCost(create=middle - began, start=time.monotonic() - middle)
    finally:
        _podman(engine, "rm", "--force", "--time", "0", container)
    return cost, [line for line in created.stderr.splitlines()
                  if DEBUG_WORDS.search(line) and "PersistentPreRunE" not in line]


def warm_up(engine: PodmanEngine, image: str) -> float:
    """What the image's preparation does ahead (PodmanEngine.warm): create a container with the
    bookings' uidmap and remove it (the remapped copy stays with the image)."""
    began = time.monotonic()
    engine.warm(image)
    return time.monotonic() - began


def measure_sizes(engine: PodmanEngine, image: str, auth: Path) -> SizeFigures:
    """Every figure of one image that is in the registry and not in podman's storage; leaves it absent."""
    forget(engine, image)
    free = _free(engine)
    pull = timed_pull(cast(Engine, engine), image, auth)
    pulled = _free(engine)
    facts = engine.image_facts(image)
    before = _store_layers(engine)
    first, debug = timed_start(engine, image, debug=True)
    copied = _free(engine)
    added = tuple(f"{layer[:12]} (parent {str(entry.get('parent', ''))[:12]}, folders {_layer_folders(engine, layer)}):"
                  f" {_layer_bytes(engine, layer) / 1e9:.2f} GB"
                  for layer, entry in _store_layers(engine).items() if layer not in before)
    second, _ = timed_start(engine, image)
    forget(engine, image)
    repull = timed_pull(cast(Engine, engine), image, auth)
    warm = warm_up(engine, image)
    warmed, _ = timed_start(engine, image)
    forget(engine, image)
    return SizeFigures(image=image, size=facts.size if facts else 0, pull=pull, pull_disk=free - pulled,
                       first=first, copy_disk=pulled - copied, added=added, debug=tuple(debug[:12]), second=second,
                       repull=repull, warm_up=warm, warmed=warmed)


def print_sizes(figures: list[SizeFigures], userns: list[str]) -> None:
    def row(what: str, value: Callable[[SizeFigures], str]) -> None:
        print(f"{what:<44}" + "".join(f"{value(figure):>22}" for figure in figures))

    print("machine: Debian 12 VM, 2 cores, 24 GiB, kernel " + os.uname().release
          + ", rootless podman 4.3 (overlay, runc); gpubook's uidmap: " + " ".join(userns))
    row("image", lambda f: f.image.rsplit("/", 1)[-1][:21])
    row("size (podman), GB", lambda f: f"{f.size / 1e9:.2f}")
    row("pull, s", lambda f: f"{f.pull:.1f}")
    row("disk taken by the pull, GB (df)", lambda f: f"{f.pull_disk / 1e9:.2f}")
    row("first start: create + start, s", lambda f: f"{f.first.create:.2f} + {f.first.start:.2f}")
    row("disk taken by the first create, GB (df)", lambda f: f"{f.copy_disk / 1e9:.2f}")
    row("second start: create + start, s", lambda f: f"{f.second.create:.2f} + {f.second.start:.2f}")
    row("pull again, s", lambda f: f"{f.repull:.1f}")
    row("warm-up right after it (create + rm), s", lambda f: f"{f.warm_up:.2f}")
    row("next start after the warm-up, s", lambda f: f"{f.warmed.create:.2f} + {f.warmed.start:.2f}")
    for figure in figures:
        print(f"{figure.image}: layers the first create added: " + "; ".join(figure.added))
        for line in figure.debug:
            print(f"  debug: {line[:200]}")


def sizes(engine: Engine, base: str, *, ahead: bool = False) -> None:
    """The real-size image (bench/real_image.py) and a small one (debian-ssh + a new 100 MB layer)."""
    from bench.real_image import real_image  # noqa: PLC0415 - only this mode builds it

    podman = cast(PodmanEngine, engine)
    with registry_kit.running() as registry:
        real = real_image(engine, registry)
        small = pushed_only(engine, registry, base=base, big=True)
        figures = [measure_sizes(podman, image, registry.auth_file) for image in (real, small)]
        print_sizes(figures, booking_userns(podman))
        if ahead:
            print("start → SSH of a booking made ahead of its start, the image only in the registry "
                  "(gpubook run, Radicale, a fresh daemon and store per booking):", flush=True)
            for name, image in (("real", real), ("small", small)):
                for case in images_ahead.cases(engine, image, registry.auth_file,
                                               forget=lambda image: forget(podman, image)):
                    print(f"  {name}: {case.line()}", flush=True)
            forget(podman, real)
            forget(podman, small)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--no-overlay", action="store_true", help="skip the overlay build (apt-get)")
    parser.add_argument("--sizes", action="store_true", help="the real-size image's costs against a small one's")
    parser.add_argument("--ahead", action="store_true", help="with --sizes: bookings made 1 min, 5 min, 1 h ahead")
    args = parser.parse_args()
    engine = engine_from("podman", runtime="runc", storage_driver="overlay")
    base = overlay_image.build_rootfs_image(engine, get_template("debian-ssh"), cache_dir=CACHE_DIR)
    if args.sizes:
        sizes(engine, base, ahead=args.ahead)
        return
    cache = private.default_cache_dir()
    removed: list[str] = []
    with registry_kit.running() as registry, tempfile.TemporaryDirectory() as folder:
        small = [timed_pull(engine, image, registry.auth_file)
                 for image in [pushed_only(engine, registry, base=base) for _ in range(args.runs)]]
        big_images = [pushed_only(engine, registry, base="scratch", big=True) for _ in range(args.runs)]
        big = [timed_pull(engine, image, registry.auth_file) for image in big_images]
        removed += big_images
        finished = threading.Event()
        preparer = ImagePreparer(engine=engine, ledger=images.Ledger(Path(folder) / "images.json"),
                                 auth_file=registry.auth_file, on_done=finished.set)
        host = LocalHost(engine=engine, gpus=(), driver_version=None, probe_key=ssh.load_probe_key(
            cache / "bench-probe-key"), cache_dir=cache, images=preparer)
        ahead, at_start = [], []
        for number in range(args.runs + 1):  # the first round warms caches and is not counted
            prepared = template_of(Path(folder), pushed_only(engine, registry, base=base, big=True))
            preparer.want({"ahead": prepared}, now=datetime.now(UTC))
            finished.wait(600)
            seconds_ahead = start_to_ssh(host, prepared, finished, f"bench-ahead-{number}")
            late = template_of(Path(folder), pushed_only(engine, registry, base=base, big=True))
            seconds_late = start_to_ssh(host, late, finished, f"bench-late-{number}")
            removed += [prepared.image, late.image]
            if number:
                ahead.append(seconds_ahead)
                at_start.append(seconds_late)
        overlay = None
        minbase = "localhost/gpubook/test-bare-minbase:12"
        if not args.no_overlay and engine.image_exists(minbase):  # type: ignore[attr-defined]
            fresh = registry_kit.tiny_image(engine, f"localhost/gpubook-bench/bare:{secrets.token_hex(4)}",
                                            base=minbase)
            bare = template_of(Path(folder), fresh, has_sshd=False)
            began = time.monotonic()
            tag = overlay_image.build_overlay(engine, bare)
            overlay = time.monotonic() - began
            removed += [tag, fresh]
        preparer.close()
    registry_kit.remove(engine, *removed)
    print("machine: Debian 12 VM, 2 cores, 24 GiB, rootless podman 4.3 (overlay, runc); registry: "
          "docker-registry 2.8 on 127.0.0.1 over TLS with htpasswd")
    print(f"pull, debian-ssh + one new small layer: {' '.join(f'{s:.2f}' for s in small)} s "
          f"(median {statistics.median(small):.2f} s)")
    print(f"pull, one new 100 MB layer: {' '.join(f'{s:.2f}' for s in big)} s (median {statistics.median(big):.2f} s)")
    if overlay is not None:
        print(f"sshd overlay build (apt-get openssh-server sudo on Debian minbase): {overlay:.1f} s")
    print("start-to-SSH (image: debian-ssh + a new 100 MB layer, through LocalHost.start):")
    print(f"start-to-SSH, image prepared ahead: {' '.join(f'{s:.2f}' for s in ahead)} s "
          f"(median {statistics.median(ahead):.2f} s)")
    print(f"start-to-SSH, image prepared at its start (pull, then start): {' '.join(f'{s:.2f}' for s in at_start)} s "
          f"(median {statistics.median(at_start):.2f} s)")


if __name__ == "__main__":
    main()
