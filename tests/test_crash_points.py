"""Crash points (issue 26, part 1): every State write, engine verb and write-back has a named point
where GPUBOOK_CRASH_AT makes the process die by SIGKILL; the points are listed here from the code,
so a State write without one fails this test."""

from __future__ import annotations

import ast
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from gpubook.runtime import crash
from gpubook.runtime.engines import Engine
from tests.kits.crash_kit import STATE, WRITES, state_points, transactions

ROOT = Path(__file__).resolve().parents[1]


def test_every_state_write_has_its_own_crash_point() -> None:
    points = state_points()
    assert len(points) >= 22 and len(set(points)) == len(points), points
    assert all(point.startswith("state.") for point in points)


def test_no_sql_write_happens_outside_a_named_transaction() -> None:
    """An INSERT, UPDATE or DELETE in State's code must sit in a `with self._transaction("state.…")`
    block, or in a helper handed that block's connection (a `db` parameter); schema.py, which makes
    and migrates the database before any pass, is the exception."""
    for path in sorted(STATE.glob("*.py")):
        if path.name == "schema.py":
            continue
        tree = ast.parse(path.read_text())
        inside: set[int] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.With) and any(
                    isinstance(item.context_expr, ast.Call) and item.context_expr in transactions(node)
                    for item in node.items):
                inside |= {id(child) for child in ast.walk(node)}
            if isinstance(node, ast.FunctionDef) and any(arg.arg == "db" for arg in node.args.args):
                inside |= {id(child) for child in ast.walk(node)}
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in ("execute", "executemany") and node.args
                    and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)
                    and node.args[0].value.lstrip().upper().startswith(WRITES)):
                assert id(node) in inside, f"{path.name}:{node.lineno}: a State write outside a named transaction"


def test_the_engine_verbs_that_change_something_have_points() -> None:
    protocol = {name for name in dir(Engine) if not name.startswith("_")}
    assert {"start", "stop", "exec"} <= set(crash.ENGINE_VERBS) and {"start", "stop", "exec"} <= protocol


def _die_at(point: str, program: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, crash.ENV: point, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(program), str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=60, check=False)


STATE_PROGRAM = """
    import sys
    from pathlib import Path
    from gpubook.runtime import crash
    from gpubook.scheduler.state import State
    crash.arm()
    state = State(Path(sys.argv[1]) / "state.sqlite")
    state.set_note("b1", "k", "first")
    print("first written", flush=True)
    state.set_note("b1", "k", "second")
    print("second written", flush=True)
"""


def test_a_state_write_dies_after_its_commit(tmp_path: Path) -> None:
    from gpubook.scheduler.state import State

    done = _die_at("state.set_note:after@2", STATE_PROGRAM, tmp_path)
    assert done.returncode == -signal.SIGKILL, done.stderr
    assert done.stdout == "first written\n"  # the first pass went on; the second died
    with State(tmp_path / "state.sqlite") as state:
        assert state.notes("k") == {"b1": "second"}  # committed before the crash


ENGINE_PROGRAM = """
    import sys
    from pathlib import Path
    from gpubook.runtime import crash

    class Engine:
        name = "fake"
        def start(self, spec):
            Path(sys.argv[1], "started").write_text(spec)
            return spec
        def host_owner(self, uid, gid):
            return uid, gid

    crash.arm()
    engine = crash.CrashingEngine(Engine())
    print(engine.host_owner(1, 2), flush=True)
    engine.start("x")
    print("after", flush=True)
"""


@pytest.mark.parametrize("when", ["before", "after"])
def test_an_engine_verb_dies_before_or_after_the_call(tmp_path: Path, when: str) -> None:
    done = _die_at(f"engine.start:{when}", ENGINE_PROGRAM, tmp_path)
    assert done.returncode == -signal.SIGKILL, done.stderr
    assert done.stdout == "(1, 2)\n"  # what is not a verb passes through untouched
    assert (tmp_path / "started").exists() == (when == "after")


def test_a_malformed_switch_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="GPUBOOK_CRASH_AT='state.port_for' is not like"):
        crash.arm({crash.ENV: "state.port_for"})
    assert crash.arm({}) is None and not crash.armed()
