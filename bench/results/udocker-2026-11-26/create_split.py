"""How much of a udocker booking's start-to-SSH-login is `udocker create` (a fresh copy of the
image: every layer unpacked): bench/container_start.py's start, with the engine's create call timed.

    python bench/results/udocker-2026-11-26/create_split.py   # as the daemon's user
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from bench.container_start import one_start  # noqa: E402
from gpubook.runtime import overlay_image, private, ssh, storage  # noqa: E402
from gpubook.runtime.engines import engine_from  # noqa: E402
from gpubook.runtime.templates import get_template  # noqa: E402

RUNS = 10

engine = engine_from("udocker", network="host")
template = get_template("debian-ssh")
cache = private.default_cache_dir()
overlay_image.build_rootfs_image(engine, template, cache_dir=cache)
probe_key = ssh.load_probe_key(cache / "bench-probe-key")
creates: list[float] = []
plain = engine._udocker  # type: ignore[attr-defined]


def timed(args, **kwargs):  # type: ignore[no-untyped-def]
    began = time.monotonic()
    try:
        return plain(args, **kwargs)
    finally:
        if args[0] == "create":
            creates.append(time.monotonic() - began)


engine._udocker = timed  # type: ignore[attr-defined]
totals = []
with tempfile.TemporaryDirectory(prefix="gpubook-bench-") as root:
    owner = engine.host_owner(2001, 2001)
    folders = storage.prepare(Path(root), "alice", uid=owner[0], gid=owner[1], chown=engine.chown)
    for number in range(RUNS):
        totals.append(one_start(engine, template, folders, probe_key, f"bench-split-{number}")[0])
rest = [total - create for total, create in zip(totals, creates, strict=True)]
print(f"udocker start-to-SSH-login over {RUNS} runs: median {statistics.median(totals):.3f} s; "
      f"of it `udocker create`: median {statistics.median(creates):.3f} s (min {min(creates):.3f}, "
      f"max {max(creates):.3f}); the rest (udocker run, runc, entrypoint, sshd, login): median "
      f"{statistics.median(rest):.3f} s (min {min(rest):.3f}, max {max(rest):.3f})")
