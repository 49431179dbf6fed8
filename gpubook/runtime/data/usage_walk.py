"""A user's data folder measured: bytes on disk and files (inodes), within a time bound.

Run by the SFTP service's quota check as the owner of every booker's file (rootless podman: root
of its user namespace, through `podman unshare`), so that no folder a booker closed with
`chmod 700` hides what it holds. As a program it prints one JSON object:

    python -P -m gpubook.runtime.data.usage_walk --seconds 20 [--stop-bytes N] [--stop-files N] FOLDER

It never follows a symlink and counts each hard-linked inode once. It stops at the time bound, or
as soon as a figure is past its `--stop-*` limit (the user is over quota already: walking on would
only cost time); the figures are then lower bounds, and `complete` is false.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

CHECK_EVERY = 512  # entries between two looks at the clock


@dataclass(frozen=True)
class Measure:
    bytes: int  # allocated blocks, in bytes
    files: int  # inodes: files, folders, links of any kind
    complete: bool  # False: stopped early (time, a limit, something unreadable): the figures are at least these
    timed_out: bool = False
    unreadable: int = 0  # folders or entries that could not be read

    def to_json(self) -> dict[str, object]:
        return asdict(self)


def walk(folder: str, *, seconds: float, stop_bytes: int | None = None, stop_files: int | None = None) -> Measure:
    deadline = time.monotonic() + seconds
    total = files = unreadable = seen_entries = 0
    linked: set[tuple[int, int]] = set()
    stack = [folder]
    while stack:
        current = stack.pop()
        try:
            with os.scandir(current) as entries:
                for entry in entries:
                    seen_entries += 1
                    if seen_entries % CHECK_EVERY == 0 and time.monotonic() > deadline:
                        return Measure(total, files, complete=False, timed_out=True, unreadable=unreadable)
                    try:
                        info = entry.stat(follow_symlinks=False)
                    except OSError:
                        unreadable += 1
                        continue
                    if info.st_nlink > 1 and not entry.is_dir(follow_symlinks=False):
                        if (info.st_dev, info.st_ino) in linked:
                            continue
                        linked.add((info.st_dev, info.st_ino))
                    total += info.st_blocks * 512
                    files += 1
                    if (stop_bytes is not None and total > stop_bytes) or \
                            (stop_files is not None and files > stop_files):
                        return Measure(total, files, complete=False, unreadable=unreadable)
                    if entry.is_dir(follow_symlinks=False):
                        stack.append(entry.path)
        except OSError:
            unreadable += 1
    return Measure(total, files, complete=unreadable == 0, unreadable=unreadable)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpubook.runtime.data.usage_walk", allow_abbrev=False)
    parser.add_argument("--seconds", type=float, required=True)
    parser.add_argument("--stop-bytes", type=int)
    parser.add_argument("--stop-files", type=int)
    parser.add_argument("folder")
    args = parser.parse_args(argv)
    measure = walk(args.folder, seconds=args.seconds, stop_bytes=args.stop_bytes, stop_files=args.stop_files)
    json.dump(measure.to_json(), sys.stdout)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
