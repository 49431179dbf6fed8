"""One host folder or file bound into a container: shared by the engines, storage, templates and
the NVIDIA injection, so that none of them imports another just for this type."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Mount:
    """A host path bound into the container (read-only unless said otherwise)."""

    source: Path
    target: str
    read_only: bool = True


def missing_mount_flags(path: Path) -> tuple[str, ...]:
    """Which of nosuid and nodev the mount holding `path` lacks: a folder that containers write
    into must have both, or a setuid or device file made inside works on the host. OSError when
    `path` cannot be read."""
    flags = os.statvfs(path).f_flag
    return tuple(name for name, bit in (("nosuid", os.ST_NOSUID), ("nodev", os.ST_NODEV)) if not flags & bit)
