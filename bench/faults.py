"""The fault harness (issue 26): every crash point once, then random faults, on real Radicale, rootless
podman and `gpubook run`; the invariants checked after each recovery (tests/kits/faults_kit.py).

    PYTHONPATH=. python bench/faults.py [--random 200] [--seed N] [--no-crash-points] [--longest 60]

Run as an unprivileged account with rootless podman (the debian-ssh image is built with mmdebstrap
on first use). The disk-full fault needs a small tmpfs of that account's at $GPUBOOK_TEST_FULL_ROOT
(`./quickstart test` mounts one for the test account); the clock fault needs Debian's libfaketime.
Without them those kinds are left out, and the table says which ran. The crash points around the
image verbs need Debian's docker-registry (a registry to pull from); without it they are not reached.

Prints, per fault kind: runs, how many reached their fault (a crash point the scenario passed, an
engine command that came), invariant violations (0 is the goal), and the recovery time (median and
worst, from recovery, the restart or the fault lifted, to every due booking running). Writes the
runs as JSON to --out.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import shutil
import sys
import tempfile
import time
from contextlib import ExitStack
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpubook.runtime.engines import engine_from  # noqa: E402
from gpubook.runtime.templates import overlay_image  # noqa: E402
from gpubook.runtime.templates.catalog import get_template  # noqa: E402
from tests.kits import crash_kit, fault_images, faults_kit, registry_kit  # noqa: E402
from tests.kits.engine_suite import CACHE_DIR, PODMAN  # noqa: E402


def machine() -> str:
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{platform.platform()}, {os.cpu_count()} cores, {memory:.0f} GiB, Python {platform.python_version()}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--random", type=int, default=200, help="random faults after the crash points")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--no-crash-points", action="store_true")
    parser.add_argument("--points", default="", help="only these crash points (comma-separated)")
    parser.add_argument("--longest", type=float, default=20.0, help="the longest a fault lasts, in seconds")
    parser.add_argument("--due-within", type=float, default=10.0)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    seed = args.seed if args.seed is not None else int(os.environ.get("GPUBOOK_FAULT_SEED", random.randrange(10**9)))
    print(f"seed {seed} (GPUBOOK_FAULT_SEED={seed} replays its choices); {machine()}", flush=True)
    engine = engine_from(**PODMAN)
    overlay_image.build_rootfs_image(engine, get_template("debian-ssh"), cache_dir=CACHE_DIR)
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="gpubench-faults-") as name, ExitStack() as stack:
        folder = Path(name)
        found = faults_kit.parts(stack, folder, required=False)
        side = None
        if shutil.which("docker-registry"):  # the image verbs' crash points (tests/kits/fault_images.py)
            registry = stack.enter_context(registry_kit.running())
            side = fault_images.ImageSide.make(engine, registry, folder)
        world = faults_kit.world_from(found, folder, engine=engine, seed=seed, due_within=args.due_within,
                                      images=side)
        injector = faults_kit.Injector(world, found, reach_timeout=60)
        kinds = found.kinds
        rng = random.Random(seed)
        points = crash_kit.all_points()
        chosen = args.points.split(",") if args.points else points
        # Every crash point first (the list), then the random faults.
        plan = [] if args.no_crash_points else [faults_kit.Fault("crash", p) for p in chosen]
        plan += [faults_kit.random_fault(rng, kinds=kinds, points=points, longest=args.longest)
                 for _ in range(args.random)]
        try:
            world.book_long()
            world.start_daemon()
            faults_kit.wait_until_running(world, timeout=300)
            world.start_threads()
            runs = faults_kit.campaign(world, injector, plan, out=args.out)
        finally:
            world.stop()
    print(f"\n{len(runs)} faults in {(time.monotonic() - began) / 60:.1f} min, seed {seed}, "
          f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC; {machine()}; kinds: {', '.join(kinds)}")
    print(faults_kit.table(runs))


if __name__ == "__main__":
    main()
