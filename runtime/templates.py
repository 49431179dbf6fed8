"""Container templates: one TOML file per template, edited by admins.

(Issue 3 grows this into the full loader; `template_names` and `default_templates_dir` keep their
signatures because the scheduler's plan uses them.)
"""

from __future__ import annotations

import sys
from pathlib import Path


def default_templates_dir() -> Path:
    """The templates/ folder of the source tree, else the one installed under share/gpubook."""
    source_tree = Path(__file__).resolve().parents[1] / "templates"
    if source_tree.is_dir():
        return source_tree
    return Path(sys.prefix) / "share" / "gpubook" / "templates"


def template_names(directory: Path | None = None) -> frozenset[str]:
    """Names of the templates present (file stem of each *.toml), valid or not."""
    folder = directory or default_templates_dir()
    return frozenset(path.stem for path in folder.glob("*.toml"))
