"""Whether the host's runc has the fix for CVE-2024-21626 (round 3, L2): doctor's `runc` check.

udocker bookings run as the daemon's own uid (one id, no newuidmap), so runc's own hardening of
`runc exec` and of the container's start is the only barrier between a booker and the daemon. runc
1.1.12 fixed the leaked-descriptor breakouts of CVE-2024-21626. Distributions carry the fix in older
version numbers (Debian 12's 1.1.5+ds1-1+deb12u1 has it), so the version alone would call a patched
runc vulnerable: a runc older than 1.1.12 passes when the changelog of the Debian package that owns
the binary names the CVE, and fails otherwise, with the version it found and what to install.
"""

from __future__ import annotations

import gzip
import re
import shutil
import subprocess
from pathlib import Path

from gpubook.runtime.checks import Check

FIXED = (1, 1, 12)
CVE = "CVE-2024-21626"
_VERSION = re.compile(r"^runc version (\d+)\.(\d+)\.(\d+)(\S*)", re.MULTILINE)
_DOCS = Path("/usr/share/doc")


def runc_check(runc: str, *, docs: Path = _DOCS) -> Check:
    """doctor's check of the runc at `runc` (a path or a name on PATH)."""
    path = shutil.which(runc) or runc
    try:
        done = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30, check=False,
                              stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as error:
        return Check("runc", False, f"{path} --version did not answer: {error}", "install runc (apt-get install runc)")
    found = _VERSION.search(done.stdout)
    if done.returncode != 0 or found is None:
        said = (done.stderr or done.stdout).strip()[:200]
        return Check("runc", False, f"{path} --version printed no version ({said})", f"check that {path} is runc")
    version = tuple(int(part) for part in found.groups()[:3])
    shown = "{}.{}.{}{}".format(*found.groups())
    if version >= FIXED:
        return Check("runc", True, f"runc {shown} ({path}): {CVE} is fixed upstream since 1.1.12")
    package = _owning_package(Path(path))
    if package is not None and _changelog_names(docs / package, CVE):
        return Check("runc", True, f"runc {shown} ({path}): older than 1.1.12, and its package {package} carries "
                                   f"the fix for {CVE} (its changelog says so)")
    owner = f"package {package}, whose changelog does not name {CVE}" if package else "owned by no Debian package"
    return Check("runc", False, f"runc {shown} ({path}, {owner}) is older than 1.1.12 and may let a udocker booker, "
                                f"who runs as this account, out of the container ({CVE})",
                 "install runc 1.1.12 or newer, or your distribution's security update of runc")


def _owning_package(path: Path) -> str | None:
    """The Debian package that installed `path` (its links resolved), or None (no dpkg, or none)."""
    if shutil.which("dpkg-query") is None:
        return None
    for candidate in dict.fromkeys([str(path), str(path.resolve())]):
        done = subprocess.run(["dpkg-query", "-S", candidate], capture_output=True, text=True, check=False,
                              timeout=30, stdin=subprocess.DEVNULL)
        if done.returncode == 0 and ":" in done.stdout:
            return done.stdout.split(":", 1)[0].split(",")[0].strip() or None
    return None


def _changelog_names(folder: Path, cve: str) -> bool:
    for name in ("changelog.Debian.gz", "changelog.gz"):
        try:
            with gzip.open(folder / name, "rt", errors="replace") as changelog:
                if any(cve in line for line in changelog):
                    return True
        except OSError:
            continue
    return False
