"""The optional parts of gpubook, one package extra each: what a command needs that the daemon does not.

The base install (`pip install gpubook`) is the daemon. A command whose extra is not installed says
so in one sentence with the pip line, instead of a traceback from deep inside an import. The names
here match pyproject.toml's [project.optional-dependencies]; tests/test_package.py checks that the
daemon's modules import none of these packages.
"""

from __future__ import annotations

import importlib.util

from gpubook.runtime.errors import GpubookError

# extra -> (what needs it, the modules it brings that gpubook imports)
EXTRAS: dict[str, tuple[str, tuple[str, ...]]] = {
    "web": ("the status page", ("flask", "werkzeug", "waitress")),  # bcrypt too, but paramiko brings it
    "report": ("the report's plots (--png, --html)", ("matplotlib",)),
    "demo": ("gpubook demo", ("radicale",)),
}


class MissingExtra(GpubookError):
    """An optional part is asked for but its extra is not installed."""

    temporary = False


def missing(extra: str) -> list[str]:
    """The extra's modules that cannot be imported here."""
    return [name for name in EXTRAS[extra][1] if importlib.util.find_spec(name) is None]


def require(extra: str) -> None:
    """Raise MissingExtra (one sentence, with the pip line) unless every module of `extra` is installed."""
    if missing(extra):
        what = EXTRAS[extra][0]
        raise MissingExtra(f"{what} needs gpubook[{extra}]: pip install 'gpubook[{extra}]'")
