"""What the SFTP quota walk costs over a million files (issue 22, finding 5): prints figures,
asserts nothing.

    PYTHONPATH=. python bench/sftp_quota_walk.py FOLDER [FILES] [BOUND_SECONDS]

Run as the daemon's account (rootless podman set up), FOLDER on a data tmpfs of that account. It
makes FILES empty files (default 1,000,000: 1,000 folders of 1,000, os.open in a loop), then
measures them the way the service does (gpubook.runtime.data.sftp.measure: `podman unshare` + the walk
as a child process): once with no practical bound (the full walk's wall time, and the child's
CPU time from getrusage), once with BOUND_SECONDS (default 20, [sftp] measure_seconds' default:
how far a bounded walk gets), and the walk in-process for comparison (no podman unshare). The
files are removed at the end.
"""

from __future__ import annotations

import os
import platform
import resource
import shutil
import sys
import time
from pathlib import Path

from gpubook.runtime.data import sftp, usage_walk
from gpubook.runtime.engines import EngineSettings, make_engine


def make_files(root: Path, count: int) -> float:
    started = time.perf_counter()
    per_folder = 1000
    for folder_index in range((count + per_folder - 1) // per_folder):
        folder = root / f"d{folder_index:04d}"
        folder.mkdir()
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
        try:
            for i in range(min(per_folder, count - folder_index * per_folder)):
                os.close(os.open(f"f{i}", os.O_CREAT | os.O_WRONLY | os.O_EXCL, 0o600, dir_fd=fd))
        finally:
            os.close(fd)
    return time.perf_counter() - started


def timed_child(work: object) -> tuple[float, float, object]:
    """Wall time, and CPU time of the child processes it ran (user + system)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    wall = time.perf_counter()
    result = work()  # type: ignore[operator]
    wall = time.perf_counter() - wall
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, result


def main() -> None:
    base = Path(sys.argv[1])
    count = int(sys.argv[2]) if len(sys.argv) > 2 else 1_000_000
    bound = float(sys.argv[3]) if len(sys.argv) > 3 else 20.0
    root = base / "quota-walk-bench"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir()
    owner = make_engine(EngineSettings(name="podman")).data_owner_argv()
    print(f"machine: {platform.node()}, {os.cpu_count()} CPUs, {platform.platform()}, "
          f"Python {platform.python_version()}")
    print(f"folder: {root} ({os.statvfs(root).f_files} inodes on its file system); owner argv: {owner}")
    try:
        made = make_files(root, count)
        print(f"made {count} empty files in {made:.1f} s")
        for label, seconds in (("unbounded (600 s)", 600.0), (f"bounded ({bound:g} s)", bound)):
            for run in range(2):
                wall, cpu, found = timed_child(lambda s=seconds: sftp.measure(root, owner_argv=owner, seconds=s))
                print(f"measure {label}, run {run + 1}: wall {wall:.2f} s, child CPU {cpu:.2f} s, "
                      f"files {found.files}, bytes {found.bytes}, complete {found.complete}, "  # type: ignore[attr-defined]
                      f"timed out {found.timed_out}")  # type: ignore[attr-defined]
        cpu, wall = time.process_time(), time.perf_counter()
        found = usage_walk.walk(str(root), seconds=600)
        print(f"walk in-process (no podman unshare): wall {time.perf_counter() - wall:.2f} s, "
              f"CPU {time.process_time() - cpu:.2f} s, files {found.files}, complete {found.complete}")
    finally:
        started = time.perf_counter()
        shutil.rmtree(root, ignore_errors=True)
        print(f"removed in {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    main()
