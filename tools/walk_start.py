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
# thread id → each call in order: (the callee's file, the gpubook files on the stack above it, from
# the pass's `run` or the thread's first gpubook frame down to its caller)
_calls: dict[int, list[tuple[str, tuple[str, ...]]]] = {}
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
        if (path := _file(frame)) is not None:
            _calls.setdefault(threading.get_ident(), []).append((path, _above(frame.f_back)))
    elif event == "return":
        _note(_file(frame.f_back))


def _above(frame: FrameType | None) -> tuple[str, ...]:
    """The gpubook files on the stack from `frame` up to the pass's `run` (or the thread's top)."""
    files: list[str] = []
    while frame is not None:
        if (path := _file(frame)) is not None:
            files.append(path)
            if frame.f_code.co_name == "run" and path == "scheduler/apply/passes.py":
                break
        frame = frame.f_back
    return tuple(reversed(files))


def _read(spine: set[str]) -> list[list[str]]:
    """The reader's walk, thread by thread: the spine's files and each file a spine function calls
    into (one step out of the spine: a reader looks at what each call on the way does, not at the
    helpers those call), in the order the calls go, with the return to the caller's file."""
    walks = []
    for calls in _calls.values():
        walk: list[str] = []
        for callee, above in calls:
            if not above or not all(path in spine for path in above):
                continue
            for path in (above[-1], callee):
                if not walk or walk[-1] != path:
                    walk.append(path)
        walks.append(walk)
    return walks


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
    spine = set(_state["spine"]) | {"scheduler/apply/passes.py"}
    read = _read(spine)
    whole = [path for files in read for path in files]
    print(f"reader's walk (the spine's files and what they call, one step out): {len(set(whole))} files, "
          f"{_counts(whole)[1]} returns")
    for number, files in enumerate(read, 1):
        counted = _counts(files)
        print(f"read, thread {number}: {counted[0]} files, {counted[1]} returns: " + " → ".join(files))


def _counts(walk: list[str]) -> tuple[int, int]:
    """(distinct files, entries into a file visited before)."""
    seen: set[str] = set()
    returns = 0
    for path in walk:
        returns += path in seen
        seen.add(path)
    return len(seen), returns
