"""A wall clock that steps (NTP, `date -s`), for the daemon's clock faults (issue 26), through
Debian's libfaketime (package faketime; ./quickstart test installs it).

`SteppedClock(folder).env()` is what a child process (the daemon) gets added to its environment:
libfaketime preloaded, reading its offset from a file in `folder` at every call (FAKETIME_NO_CACHE),
so that `.step(seconds)` moves the wall clock the child sees at once; CLOCK_MONOTONIC is left
alone (FAKETIME_DONT_FAKE_MONOTONIC), as a real step leaves it. The child's own children inherit
the environment (podman, ssh); podman and its helpers are Go programs, which read the clock
through the vDSO, not libc: they keep the real one.

libfaketime 0.9.10 (Debian 12) with FAKETIME_DONT_FAKE_MONOTONIC breaks clock_nanosleep on the
monotonic clock with TIMER_ABSTIME, which Python 3.11's time.sleep uses: every sleep fails with
EINVAL (libfaketime issue 426, fixed after 0.9.10). A small shim preloaded before libfaketime
sends those sleeps straight to the kernel; it is compiled with cc into the clock's folder.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
from pathlib import Path

OFFSET_FILE = "faketime-offset"
SHIM = "monotonic-sleep.so"

# clock_nanosleep on CLOCK_MONOTONIC to the kernel as asked; every other clock to libfaketime.
_SHIM_SOURCE = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

typedef int (*sleeper)(clockid_t, int, const struct timespec *, struct timespec *);

int clock_nanosleep(clockid_t clock, int flags, const struct timespec *request, struct timespec *remain) {
    static sleeper next;
    if (clock == CLOCK_MONOTONIC)
        return syscall(SYS_clock_nanosleep, clock, flags, request, remain) == 0 ? 0 : errno;
    if (next == NULL)
        next = (sleeper)dlsym(RTLD_NEXT, "clock_nanosleep");
    return next(clock, flags, request, remain);
}
"""


def library() -> Path:
    """libfaketime.so.1 under this machine's multiarch folder (dpkg -L libfaketime)."""
    found = sorted(glob.glob("/usr/lib/*/faketime/libfaketime.so.1"))
    if not found:
        raise RuntimeError("libfaketime.so.1 is not installed; apt-get install faketime (./quickstart test does)")
    return Path(found[0])


def _shim(folder: Path) -> Path:
    compiler = shutil.which("cc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc) for the clock's sleep shim; apt-get install gcc "
                           "(./quickstart test does)")
    source, built = folder / "monotonic-sleep.c", folder / SHIM
    source.write_text(_SHIM_SOURCE)
    subprocess.run([compiler, "-shared", "-fPIC", "-O2", "-o", str(built), str(source), "-ldl"], check=True,
                   capture_output=True, timeout=120)
    return built


class SteppedClock:
    """The wall clock of the processes started with `.env()`: real, until stepped."""

    def __init__(self, folder: Path) -> None:
        self.library = library()
        self.shim = _shim(folder)
        self.file = folder / OFFSET_FILE
        self.offset = 0
        self._write()

    def env(self) -> dict[str, str]:
        preload = " ".join(filter(None, [str(self.shim), str(self.library), os.environ.get("LD_PRELOAD", "")]))
        return {"LD_PRELOAD": preload, "FAKETIME_TIMESTAMP_FILE": str(self.file), "FAKETIME_NO_CACHE": "1",
                "FAKETIME_DONT_FAKE_MONOTONIC": "1"}

    def step(self, seconds: int) -> None:
        """The wall clock jumps by `seconds` (back when negative), on top of earlier steps."""
        self.offset += int(seconds)
        self._write()

    def reset(self) -> None:
        """The wall clock is the real one again."""
        self.offset = 0
        self._write()

    def _write(self) -> None:
        # Through a rename: a child reading the file at every call never sees it empty or half-written.
        partial = self.file.with_name(f".{self.file.name}.partial")
        partial.write_text(f"{self.offset:+d}\n")
        partial.chmod(0o644)
        partial.replace(self.file)
