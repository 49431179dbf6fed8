"""Where the driver's files may be: the ld.so.cache listing, the usual driver folders of each
distribution, [nvidia] driver_roots, LD_LIBRARY_PATH and PATH, all looked up under a root."""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from gpubook.runtime.errors import DriverError
from gpubook.runtime.nvidia.catalog import Arch
from gpubook.runtime.nvidia.paths import resolve, under

log = logging.getLogger(__name__)


def _ldconfig() -> str | None:
    return shutil.which("ldconfig") or next(
        (p for p in ("/sbin/ldconfig", "/usr/sbin/ldconfig") if os.access(p, os.X_OK)), None
    )


def read_ld_cache(root: Path = Path("/")) -> str:
    """`ldconfig -p` of the host, or of root's etc/ld.so.cache for another root; "" if none."""
    binary = _ldconfig()
    if binary is None:
        log.debug("no ldconfig on this host; relying on the usual driver folders")
        return ""
    command = [binary, "-p"]
    if root != Path("/"):
        cache = under(root, "/etc/ld.so.cache")
        if not cache.is_file():
            return ""
        command += ["-C", str(cache)]
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired) as error:
        log.warning("%s failed: %s", " ".join(command), error)
        return ""
    if result.returncode != 0:
        log.warning("%s failed: %s", " ".join(command), result.stderr.strip())
    return result.stdout


_LD_CACHE_LINE = re.compile(r"^\s+(\S+)\s+\(([^)]*)\)\s+=>\s+(\S.*)$")


def parse_ld_cache(text: str, *, arch_tag: str) -> list[tuple[str, str]]:
    """(name, path) of the `ldconfig -p` entries of one architecture, in cache order."""
    entries = []
    for line in text.splitlines():
        match = _LD_CACHE_LINE.match(line)
        if match:
            flags = [flag.strip() for flag in match.group(2).split(",")]
            if arch_tag in flags:
                entries.append((match.group(1), match.group(3).strip()))
    return entries


def _cache_path_under_root(root: Path, path: str) -> Path:
    # A cache built for a root from outside it (ldconfig -C … on that tree) lists full host paths.
    if root != Path("/") and path.startswith(str(root) + "/"):
        return Path(path)
    return under(root, path)


def library_dirs(
    root: Path,
    arch: Arch,
    *,
    ld_cache: str,
    extra_roots: Sequence[Path] = (),
    environ: Mapping[str, str] | None = None,
) -> list[Path]:
    """Folders that may hold the driver's libraries, most trusted first, existing ones only."""
    environ = os.environ if environ is None else environ
    candidates: list[Path] = []
    for extra in extra_roots:
        base = under(root, extra) if extra.is_absolute() else root / extra
        candidates += [
            base,
            base / "lib64",
            base / "lib",
            base / "usr/lib64",
            base / "usr/lib" / arch.multiarch,
        ]
    for name, path in parse_ld_cache(ld_cache, arch_tag=arch.ld_cache_tag):
        if name in ("libcuda.so.1", "libnvidia-ml.so.1"):
            candidates.append(_cache_path_under_root(root, path).parent)
    usual = [
        f"/usr/lib/{arch.multiarch}",
        f"/usr/lib/{arch.multiarch}/nvidia/current",
        "/usr/lib64",
        "/lib64",
        "/usr/lib64/nvidia",
        f"/lib/{arch.multiarch}",
        "/usr/local/nvidia/lib64",
        f"/run/nvidia/driver/usr/lib/{arch.multiarch}",
        "/run/nvidia/driver/usr/lib64",
        "/usr/lib",
    ]
    candidates += [under(root, folder) for folder in usual]
    candidates += [
        under(root, folder)
        for folder in environ.get("LD_LIBRARY_PATH", "").split(":")
        if folder.startswith("/")
    ]
    return _existing_unique(root, candidates)


def binary_dirs(
    root: Path, *, extra_roots: Sequence[Path] = (), environ: Mapping[str, str] | None = None
) -> list[Path]:
    environ = os.environ if environ is None else environ
    candidates = [(under(root, e) if e.is_absolute() else root / e) / "bin" for e in extra_roots]
    candidates += [
        under(root, folder)
        for folder in (
            "/usr/local/nvidia/bin",
            "/run/nvidia/driver/usr/bin",
            "/usr/bin",
            "/bin",
            "/usr/sbin",
            "/sbin",
        )
    ]
    candidates += [
        under(root, folder)
        for folder in environ.get("PATH", "").split(":")
        if folder.startswith("/")
    ]
    return _existing_unique(root, candidates)


def _existing_unique(root: Path, paths: Iterable[Path]) -> list[Path]:
    """The folders that exist, symlinks resolved under root (nvidia/current -> nvidia-580)."""
    result: list[Path] = []
    for path in paths:
        try:
            folder = resolve(root, path)
        except (OSError, ValueError, DriverError):
            continue
        if folder not in result and folder.is_dir():
            result.append(folder)
    return result
