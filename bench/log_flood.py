"""The daemon's login sampler during a log flood (issue 22, finding 6), on real rootless podman.

    PYTHONPATH=TREE /opt/gpubook-dev/venv/bin/python bench/log_flood.py --label after [--bytes 2147483648]
        [--out FILE]

Run as the account whose rootless podman runs bookings, with GPUBOOK_TEST_DATA_ROOT naming a nosuid,nodev
folder (tests/kits/safe_data.py). TREE is the gpubook checkout under test: the booking is started and its log read
with that tree's code (main: no log cap, `logs` read whole; after: 10 MB cap, the last 1 MiB read).

A booking (debian-ssh) writes --bytes of `yes` lines to its stdout, then touches a marker. Meanwhile the
daemon's `usage.Sampler`, in a process of its own (tests/kits/log_flood_kit.py), looks at the log every round
(about every 0.5 s plus the read), until the marker is there and twice more. Printed: the flood's time, the
log file's size on disk at the end, the sampler's RSS before its first read, its peak (VmHWM), the RSS after
each round, the longest log text a read gave, and the reads that failed (podman's `logs` past 60 s). The
sampler process is limited to --memory-gib of address space, so that a run of the old code cannot take the
machine's memory: a read that hits it fails with MemoryError and counts as failed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "kits"))  # the kit, whichever tree is tested
import log_flood_kit  # noqa: E402

from gpubook.runtime.engines import engine_from  # noqa: E402
from gpubook.runtime.templates import overlay_image  # noqa: E402 - the tree's own (PYTHONPATH), as are the tests' kits
from gpubook.runtime.templates.catalog import get_template  # noqa: E402
from tests.kits import engine_suite, safe_data  # noqa: E402
from tests.kits.engine_suite import Bookings  # noqa: E402


def log_size(engine: object, name: str) -> int:
    raw = engine._inspect_raw([name])[0]  # type: ignore[attr-defined]  # noqa: SLF001
    path = (raw.get("HostConfig") or {}).get("LogConfig", {}).get("Path") or raw["LogPath"]
    done = subprocess.run(["podman", "unshare", "stat", "--format", "%s", path], capture_output=True, text=True,
                          check=True)
    return int(done.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--label", required=True)
    parser.add_argument("--bytes", type=int, default=2 << 30)
    parser.add_argument("--memory-gib", type=float, default=8.0)
    parser.add_argument("--timeout", type=float, default=1800.0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    tree = Path(os.environ.get("PYTHONPATH", ".").split(":")[0]).resolve()
    engine = engine_from(**engine_suite.PODMAN)
    overlay_image.build_rootfs_image(engine, get_template("debian-ssh"), cache_dir=engine_suite.CACHE_DIR)
    with safe_data.data_root() as root:
        bookings = Bookings(engine, root, get_template("debian-ssh"))
        try:
            started = time.monotonic()
            booking = bookings.start(command=log_flood_kit.flood_command(args.bytes, "/data/output/flooded"))
            result = log_flood_kit.run_sampler(booking.spec.name, booking.folders.output / "flooded", code=tree,
                                               timeout=args.timeout, memory=int(args.memory_gib * (1 << 30)))
            result |= {"label": args.label, "tree": str(tree), "flood_bytes": args.bytes,
                       "seconds": round(time.monotonic() - started, 1),
                       "log_file_bytes": log_size(engine, booking.spec.name),
                       "host": platform.node(), "cores": os.cpu_count(), "at": datetime.now(UTC).isoformat()}
        finally:
            bookings.cleanup()
    series = result.pop("rss_series_kib")
    print(f"{args.label}: {args.bytes / (1 << 30):.2f} GiB flooded in {result['seconds']} s; log file "
          f"{result['log_file_bytes'] / 1e6:.1f} MB; sampler RSS {result['baseline_rss_kib'] / 1024:.0f} MiB "
          f"before, peak {result['peak_rss_kib'] / 1024:.0f} MiB; {result['rounds']} rounds, longest log read "
          f"{result['longest_log_chars'] / 1e6:.2f} MB, {len(result['errors'])} reads failed")
    result["rss_series_kib"] = series
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
