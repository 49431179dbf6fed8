"""Paths under a root, and which files are this host's architecture.

Every path is looked up under `root` (default "/"), so tests run discovery against driver trees
they build in a temporary folder.
"""

from __future__ import annotations

import logging
import os
import platform
from pathlib import Path

from gpubook.runtime.errors import DriverError
from gpubook.runtime.nvidia.catalog import ARCHITECTURES, Arch
from gpubook.runtime.nvidia.elf import ElfFormatError, read_elf

log = logging.getLogger(__name__)

def under(root: Path, path: str | os.PathLike[str]) -> Path:
    return root / str(path).lstrip("/")


def resolve(root: Path, path: Path) -> Path:
    """`path` with symlinks followed as if `root` were "/": absolute targets stay under root."""
    if root == Path("/"):
        return path.resolve()
    relative = path.relative_to(root).parts
    resolved: list[str] = []
    pending = list(relative)
    hops = 0
    while pending:
        part = pending.pop(0)
        if part in ("", "."):
            continue
        if part == "..":
            if resolved:
                resolved.pop()
            continue
        candidate = root.joinpath(*resolved, part)
        if candidate.is_symlink():
            hops += 1
            if hops > 40:
                raise DriverError(f"{path}: too many levels of symbolic links")
            target = os.readlink(candidate)
            if target.startswith("/"):
                resolved = []
            pending = [p for p in target.split("/") if p] + pending
        else:
            resolved.append(part)
    return root.joinpath(*resolved)


def host_arch(machine: str | None) -> Arch:
    name = machine or platform.machine()
    try:
        return ARCHITECTURES[name]
    except KeyError:
        raise DriverError(
            f"gpubook does not know the NVIDIA driver layout for {name!r} "
            f"(known: {', '.join(ARCHITECTURES)})"
        ) from None


def arch_matches(path: Path, arch: Arch, *, types: tuple[int, ...]) -> tuple[bool, str | None]:
    try:
        info = read_elf(path)
    except (OSError, ElfFormatError) as error:
        log.debug("skipping %s: %s", path, error)
        return False, None
    if info is None:
        log.debug("skipping %s: not an ELF file", path)
        return False, None
    if info.bits != arch.bits or info.machine != arch.machine or info.type not in types:
        log.debug(
            "skipping %s: ELF%d machine %d type %d is not this host's",
            path,
            info.bits,
            info.machine,
            info.type,
        )
        return False, None
    return True, info.soname

