"""The daemon's crash points (gpubook/runtime/crash.py), listed from the code: what
tests/test_crash_points.py checks and what the fault harness (tests/kits/faults_kit.py) runs."""

from __future__ import annotations

import ast
from pathlib import Path

from gpubook.runtime import crash

ROOT = Path(__file__).resolve().parents[2]
STATE = ROOT / "gpubook" / "scheduler" / "state"
WRITES = ("INSERT", "UPDATE", "DELETE", "REPLACE")


def transactions(tree: ast.AST) -> list[ast.Call]:
    return [node for node in ast.walk(tree) if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr == "_transaction"]


def state_points() -> list[str]:
    """The crash point of every State write, from the code; a write without one is an AssertionError."""
    points = []
    for path in sorted(STATE.glob("*.py")):
        tree = ast.parse(path.read_text())
        for call in transactions(tree):
            if isinstance(call.func.value, ast.Name) and call.func.value.id == "self":
                assert len(call.args) == 1 and isinstance(call.args[0], ast.Constant), (
                    f"{path.name}:{call.lineno}: a State write without its crash point name")
                points.append(call.args[0].value)
    return points


def all_points() -> list[str]:
    """Every crash point: after each State write, around each engine verb, around each write-back."""
    return ([f"{p}:after" for p in state_points()]
            + [f"engine.{verb}:{when}" for verb in crash.ENGINE_VERBS for when in ("before", "after")]
            + ["writeback:before", "writeback:after"])
