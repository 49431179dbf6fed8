"""One host folder or file bound into a container: shared by the engines, storage, templates and
the NVIDIA injection, so that none of them imports another just for this type."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Mount:
    """A host path bound into the container (read-only unless said otherwise)."""

    source: Path
    target: str
    read_only: bool = True
