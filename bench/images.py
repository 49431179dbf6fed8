"""Images prepared ahead: pull times from a local registry, the sshd overlay's build time, and the
start-to-SSH of a booking whose image was prepared ahead against one whose image is prepared at its
start; prints the figures.

    gpubook-userbench TREE bench/images.py [--runs 3] [--no-overlay]

The registry is Debian's docker-registry on 127.0.0.1 (TLS, htpasswd), as in the tests. Pulls:
(a) debian-ssh plus one new small layer (the base's layers are in podman's storage already, as on a
host that ran the template before), (b) an image of one new 100 MB layer of random bytes (nothing of
it present). The overlay is built on a fresh image FROM Debian minbase (apt-get from Debian's mirror
over the host network). Start-to-SSH goes through LocalHost.start and the ImagePreparer, as the daemon
does: "at its start" is the time from the first start call (the image absent: Preparing, queued) to
the probe's SSH login, after the pull; "ahead" from the start call to the login, the image ready.
Both bookings' images are debian-ssh plus a new 100 MB layer (a real template image is GBs: its
pull at the start would cost correspondingly more).
"""

from __future__ import annotations

import argparse
import os
import secrets
import statistics
import sys
import tempfile
import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpubook.runtime import images, overlay_image, ssh  # noqa: E402
from gpubook.runtime.engines import Engine, container_name, engine_from  # noqa: E402
from gpubook.runtime.errors import Preparing  # noqa: E402
from gpubook.runtime.templates import Template, get_template, load_template  # noqa: E402
from gpubook.scheduler.hosts import Booker, StartRequest  # noqa: E402
from gpubook.scheduler.hosts.images import ImagePreparer  # noqa: E402
from gpubook.scheduler.hosts.local import LocalHost  # noqa: E402
from tests.kits import registry_kit  # noqa: E402
from tests.kits.engine_suite import CACHE_DIR, free_port  # noqa: E402


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
                           port=free_port(), end=datetime.now(UTC) + timedelta(hours=1))
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--no-overlay", action="store_true", help="skip the overlay build (apt-get)")
    args = parser.parse_args()
    engine = engine_from("podman", runtime="runc", storage_driver="overlay")
    base = overlay_image.build_rootfs_image(engine, get_template("debian-ssh"), cache_dir=CACHE_DIR)
    cache = ssh.default_cache_dir()
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
