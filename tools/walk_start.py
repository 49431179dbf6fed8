"""The walk of a start, measured: every gpubook file a booking's start runs in, from the pass's `run`
to the engine's `start`, in the order the calls and returns go (a pytest plug-in over
tests/test_architecture.py's registered-engine pass, which exists in v0.2.0 too):

    PYTHONPATH=. python -m pytest -q -p tools.walk_start \\
        "tests/test_architecture.py::test_a_registered_engine_and_source_run_a_pass"

It prints the walk's files (distinct), its returns (entries into a file visited before, a return to the
caller's file included), and the spine: the files on the stack when the engine's `start` is called.
Issue 39 counted 13 files and 18 returns by hand; this counts every helper too, so compare its figures
with its own figures for another tree (run it there with this file on PYTHONPATH), not with those.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path
from types import FrameType
from typing import Any

import pytest

_PACKAGE = str(Path(__import__("gpubook").__file__).parent) + "/"
_walks: dict[int, list[str]] = {}  # thread id → the files in order, consecutive repeats merged
_state = {"active": False, "done": False, "spine": []}


def _file(frame: FrameType | None) -> str | None:
    if frame is None or not frame.f_code.co_filename.startswith(_PACKAGE):
        return None
    return frame.f_code.co_filename[len(_PACKAGE):]


def _note(path: str | None) -> None:
    if path is None:
        return
    walk = _walks.setdefault(threading.get_ident(), [])
    if not walk or walk[-1] != path:
        walk.append(path)


def _profile(frame: FrameType, event: str, arg: Any) -> None:
    if _state["done"]:
        return
    code = frame.f_code
    if event == "call" and not _state["active"] and code.co_name == "run" \
            and code.co_filename.endswith("apply/passes.py"):
        _state["active"] = True
    if not _state["active"]:
        return
    if event == "call" and code.co_name == "start" and code.co_filename.endswith("test_architecture.py"):
        spine, at = [], frame.f_back
        while at is not None:
            if (path := _file(at)) is not None and (not spine or spine[-1] != path):
                spine.append(path)
            at = at.f_back
        _state["spine"], _state["done"] = list(reversed(spine)), True
        return
    if event == "call":
        _note(_file(frame))
    elif event == "return":
        _note(_file(frame.f_back))


def pytest_runtest_call(item: pytest.Item) -> None:
    sys.setprofile(_profile)
    threading.setprofile(_profile)


def pytest_unconfigure(config: pytest.Config) -> None:
    sys.setprofile(None)
    threading.setprofile(None)  # type: ignore[arg-type]  # None unsets it, as for sys.setprofile
    walk = [path for files in _walks.values() for path in files]  # thread by thread, in their order
    seen = set(walk)
    returns = _counts(walk)[1]
    print(f"\nwalk of a start: {len(seen)} files, {returns} returns to a file visited before, "
          f"{len(walk)} steps; threads {len(_walks)}")
    print("spine (the stack at the engine's start): " + str(len(_state["spine"])) + " files: "
          + " → ".join(_state["spine"]))
    print("files: " + ", ".join(sorted(seen)))
    for number, files in enumerate(_walks.values(), 1):
        counted = _counts(files)
        print(f"thread {number}: {counted[0]} files, {counted[1]} returns: " + " → ".join(files))


def _counts(walk: list[str]) -> tuple[int, int]:
    """(distinct files, entries into a file visited before)."""
    seen: set[str] = set()
    returns = 0
    for path in walk:
        returns += path in seen
        seen.add(path)
    return len(seen), returns
