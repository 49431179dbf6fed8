"""The fast lane, `pytest --fast`: the tests that carry none of the markers declared in
pyproject.toml ([tool.pytest.ini_options] markers, registered there and enforced by --strict-markers).

Each declared marker names what a test needs beyond Python and this machine's files (a calendar
server, an engine, a Slurm cluster, a browser, a GPU, an install, root, or minutes): those tests
wait for CI. The rest are unit and pure tests, under two minutes on a 2-core machine.
"""

from __future__ import annotations

import tomllib

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--fast", action="store_true",
                     help="run only the fast lane: tests without any marker declared in pyproject.toml")


def declared_markers(config: pytest.Config) -> tuple[str, ...]:
    """The names of the markers pyproject.toml declares (a marker line is "name: description")."""
    path = config.inipath
    if path is None or path.name != "pyproject.toml":
        raise pytest.UsageError("--fast: the lane is the markers declared in pyproject.toml, and there is none here")
    with path.open("rb") as file:
        lines = tomllib.load(file)["tool"]["pytest"]["ini_options"]["markers"]
    return tuple(line.split(":", 1)[0].strip() for line in lines)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not config.getoption("--fast"):
        return
    slow = declared_markers(config)
    kept, dropped = [], []
    for item in items:
        (dropped if any(item.get_closest_marker(name) for name in slow) else kept).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept
