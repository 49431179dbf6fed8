#!/usr/bin/env python3
"""The udocker place of bench/gpu_overhead.py: one measurement in a udocker container run by
gpubook's udocker engine (R1: the host's runc in a user namespace of one id, the runc policy, the
NVIDIA driver injected by gpubook, only the booked GPUs' nodes). Run as an ordinary account (udocker
refuses root); gpu_overhead.py, as root, starts it with runuser.

    prepare NAME   (NAME: a booking id; the container is named as the engine names its)
                   stdin: a tar of the host's root file system (hostroot's excludes); made into
                   udocker's container NAME with `udocker import --tocontainer` (no image copy)
    run NAME --gpus N --runc RUNC [--mount SRC:DST[:ro]]... [--env K=V]... -- ARGV...
                   ARGV in a fresh run of container NAME (as gpubook's engine runs a booking's
                   first process), on GPUs 0..N-1; prints {"started": <wall clock before udocker
                   run>, ...the worker's last JSON line}

The container is made once and run afresh for every measurement: its root file system is what a
podman image is to `podman run` (udocker copies an image into a container at `create`, 5-6 GB for
the host's root, which per run would measure the copy, not the GPU).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from gpubook.runtime import nvidia  # noqa: E402
from gpubook.runtime.engines import ContainerSpec, container_name, engine_from  # noqa: E402
from gpubook.runtime.engines.udocker import AS_BOOKER, LOG_FILE, RUNC_ID_FILE  # noqa: E402
from gpubook.runtime.errors import EngineError  # noqa: E402
from gpubook.runtime.mounts import Mount  # noqa: E402
from tests.kits.hostroot import LOADER_SHIM  # noqa: E402

RUN_TIMEOUT = 600.0


def prepare(booking_id: str, runc: str) -> int:
    engine = engine_from("udocker", runtime=runc, network="host")
    name = container_name(booking_id)  # the name the engine runs for a spec of this booking id
    engine._udocker(["rm", "-f", name], check=False)  # type: ignore[attr-defined]  # a former run's
    made = subprocess.run([engine.binary, "import", "--tocontainer", f"--name={name}", "-"],  # type: ignore[attr-defined]
                          capture_output=True, text=True, timeout=RUN_TIMEOUT, check=False,
                          env=engine._env())  # type: ignore[attr-defined]  # stdin: the tar stream
    if made.returncode != 0:
        print(f"udocker import --tocontainer {name}: exit {made.returncode}: {made.stderr[-2000:]}", file=sys.stderr)
        return 1
    print(json.dumps({"container": name, "id": made.stdout.strip().splitlines()[-1:]}))
    return 0


def run(options: argparse.Namespace) -> int:
    engine = engine_from("udocker", runtime=options.runc, network="host")
    top: Path = engine.top  # type: ignore[attr-defined]
    link = top / "containers" / container_name(options.name)
    if not link.is_symlink():
        print(f"udocker has no container {link.name}: run `prepare` first", file=sys.stderr)
        return 1
    folder = (link.parent / os.readlink(link)).resolve()
    for old in (LOG_FILE, LOG_FILE + ".1", AS_BOOKER):  # a former run's (as-booker is read-only)
        (folder / old).unlink(missing_ok=True)
    injection = nvidia.inject(nvidia.discover(), list(range(options.gpus)),
                              cache_dir=Path(tempfile.gettempdir()) / f"gpubook-bench-nvidia-{os.getuid()}") \
        if options.gpus else None  # --gpus 0: no GPU (a check of this program on a machine without one)
    mounts = tuple(Mount(Path(source), target, read_only=rest == ["ro"])
                   for source, target, *rest in (m.split(":") for m in options.mount))
    spec = ContainerSpec(
        booking_id=options.name, user="booker", uid=os.getuid(), gid=os.getgid(), image="bench",
        port=2299, end=datetime.now(UTC) + timedelta(hours=1), gpus=injection.gpus if injection else (),
        entrypoint=("sh", "-c", LOADER_SHIM, "sh"), command=tuple(options.argv),
        env=tuple(tuple(e.split("=", 1)) for e in options.env),  # type: ignore[misc]
        mounts=mounts, shm_size=options.shm_size, gpu=injection)
    started = time.time()
    try:
        engine._run(spec, folder)  # type: ignore[attr-defined]  # running: its first process started
    except EngineError as error:  # ended before it was seen running: a quick worker, or a failure
        print(f"udocker run: {error}", file=sys.stderr)
    deadline = time.monotonic() + RUN_TIMEOUT
    while engine._state(folder)[0] == "running" and time.monotonic() < deadline:  # type: ignore[attr-defined]
        time.sleep(0.05)
    runc_id = (folder / RUNC_ID_FILE).read_text().strip()
    engine._runc(folder, ["delete", "--force", runc_id])  # type: ignore[attr-defined]
    said = "".join((folder / name).read_text(errors="replace") for name in (LOG_FILE + ".1", LOG_FILE)
                   if (folder / name).exists())
    for line in reversed(said.strip().splitlines()):
        if line.startswith("{"):
            print(json.dumps({"started": started, **json.loads(line)}), flush=True)
            return 0
    print(f"no result from the udocker container:\n{said[-4000:]}", file=sys.stderr)
    return 1


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=("prepare", "run"))
    parser.add_argument("name")
    parser.add_argument("--runc", default="runc")
    parser.add_argument("--gpus", type=int, default=1)
    parser.add_argument("--mount", action="append", default=[])
    parser.add_argument("--env", action="append", default=[])
    parser.add_argument("--shm-size", default="8g")
    args = list(sys.argv[1:] if argv is None else argv)
    command = args[args.index("--") + 1:] if "--" in args else []
    options = parser.parse_args(args[:args.index("--")] if "--" in args else args)
    options.argv = command
    return options


def main(argv: list[str] | None = None) -> int:
    options = parse(argv)
    return prepare(options.name, options.runc) if options.action == "prepare" else run(options)


if __name__ == "__main__":
    sys.exit(main())
