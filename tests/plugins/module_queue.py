"""The user lanes' shared queue, `pytest --module-queue DIR` (tools/lanes.py): every user lane collects
the same tests, then takes whole modules from one queue, longest first, each lane the next module
no lane has taken yet, as soon as it is done with its last. A lane whose modules ran long no longer
holds up the run while the others stand idle: the lanes end within about one module of each other,
whatever the recorded times said (a fresh machine's first image builds make some modules longer).

DIR holds `order.json` (the module paths, longest recorded first; a module not in it goes last) and
`claims/`, where a lane takes a module by creating its file (O_EXCL: exactly one lane gets it). A lane
may collect modules the others do not (root's lane alone runs Docker's and Slurm's) and take those
first (`--queue-first docker,slurm`).
With pytest-repeat's session scope the same module comes once per round: each round is a unit of its
own, and the first round of every module is taken before any second one.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--module-queue", metavar="DIR", default=None,
                     help="take whole modules from the queue in DIR, shared with other pytest processes")
    parser.addoption("--queue-first", metavar="MARKERS", default="",
                     help="take the modules with a test marked with any of these (comma-separated) first")


def units(items: list[pytest.Item], order: list[str]) -> list[tuple[str, list[pytest.Item]]]:
    """The items in runs of one module, each named `module@round`, in the queue's order: by round,
    then by the module's place in `order` (an unknown module last), then as collected."""
    runs: list[tuple[str, int, list[pytest.Item]]] = []
    rounds: dict[str, int] = {}
    for item in items:
        module = item.nodeid.split("::", 1)[0]
        if runs and runs[-1][0] == module:
            runs[-1][2].append(item)
            continue
        rounds[module] = rounds.get(module, 0) + 1
        runs.append((module, rounds[module], [item]))
    place = {module: n for n, module in enumerate(order)}
    ranked = sorted(enumerate(runs), key=lambda pair: (pair[1][1], place.get(pair[1][0], len(order)), pair[0]))
    return [(f"{module}@{round_}", run) for _, (module, round_, run) in ranked]


def claim(folder: Path, unit: str) -> bool:
    """Whether this process takes `unit`: the first to create its claim file does."""
    path = folder / "claims" / unit.replace("/", "%")
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
    except FileExistsError:
        return False
    return True


@pytest.hookimpl(tryfirst=True)
def pytest_runtestloop(session: pytest.Session) -> bool | None:
    folder = session.config.getoption("--module-queue")
    if folder is None or session.config.option.collectonly:
        return None
    queue = Path(folder)
    order = json.loads((queue / "order.json").read_text())
    first = [name for name in session.config.getoption("--queue-first").split(",") if name]
    ranked = units(list(session.items), order)
    if first:  # a stable sort: in the queue's order within each part
        ranked.sort(key=lambda unit: not any(item.get_closest_marker(name) for item in unit[1] for name in first))

    def after(run: list[pytest.Item]) -> pytest.Item | None:
        """What the last test of `run` is told comes next: a test of another module, whichever (the next
        module is taken only once this one is done, so that no lane holds one it has not begun), so its
        module's fixtures end there and the session's stay; pytest ends those when the session does."""
        return next((other[0] for _, other in ranked if other[0].path != run[0].path),
                    next((other[0] for _, other in ranked if other is not run), None))

    for unit, run in ranked:
        if not claim(queue, unit):
            continue
        for n, item in enumerate(run):
            nextitem = run[n + 1] if n + 1 < len(run) else after(run)
            item.config.hook.pytest_runtest_protocol(item=item, nextitem=nextitem)
            if session.shouldfail:
                raise session.Failed(session.shouldfail)
            if session.shouldstop:
                raise session.Interrupted(session.shouldstop)
    return True
