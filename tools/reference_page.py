"""The command line of a generated reference page (tools/cli_reference.py, tools/convention_reference.py):
print it, `--write` it, or `--check` that the committed page is what the code prints."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path


def main(argv: list[str], *, page: Path, render: Callable[[], str], script: str) -> int:
    """`script`: the tool as a contributor runs it (named in the stale page's sentence)."""
    text = render()
    if argv == ["--write"]:
        page.write_text(text)
    elif argv == ["--check"]:
        if page.read_text() != text:
            print(f"{page.relative_to(page.parents[2])} is stale: run python {script} --write", file=sys.stderr)
            return 1
    elif not argv:
        sys.stdout.write(text)
    else:
        print(f"usage: python {script} [--write | --check]", file=sys.stderr)
        return 2
    return 0
