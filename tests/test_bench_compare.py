"""bench/compare.py reads each bench's printed figures and flags NEW worse than OLD beyond the noise.
Read against the outputs a real comparison kept (bench/results/compare-noise-2026-11-26/)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[1]
KEPT = REPO / "bench" / "results" / "compare-noise-2026-11-26"


@pytest.fixture(scope="module")
def compare() -> ModuleType:
    """bench/ is scripts, not a package: the module loaded from its file."""
    spec = importlib.util.spec_from_file_location("bench_compare", REPO / "bench" / "compare.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


def test_every_figure_is_read_from_each_bench_of_a_kept_run(compare: ModuleType) -> None:
    runs = compare.kept(KEPT)
    assert {(run.bench, run.side) for run in runs} == {(b, s) for b in compare.BENCHES for s in ("old", "new")}
    for run in runs:
        assert run.code == 0
        assert set(run.figures()) == {figure for figure, _, _ in compare.SPECS[run.bench].figures}, run.bench
    plan = next(run for run in runs if run.bench == "plan" and run.round == 1 and run.side == "old")
    assert plan.figures() == {"plan + decide, 1,000 bookings, median of 20": 20.0}


def test_an_idle_run_whose_daemon_had_exited_counts_as_failed(compare: ModuleType) -> None:
    # What v0.2.0's bench/daemon.py prints when its daemon exited at once (another held the account's lock).
    dead = ("idle daemon over 60 s, poll every 30 s: RSS max 0.0 MB (target <= 80 MB), CPU 0.00 s = 0.00 % of "
            "one core, with the podman commands it ran 0.00 s = 0.00 % (target <= 1 %)")
    run = compare.Run(bench="idle", side="new", round=1, seconds=1.0, code=0, output=dead, load="")
    assert run.figures() == {}


def plan_runs(compare: ModuleType, old: list[float], new: list[float]) -> list:  # type: ignore[type-arg]
    return [compare.Run(bench="plan", side=side, round=n, seconds=1.0, code=0, load="",
                        output=f"plan + reconcile, 1000 bookings on 100 GPUs (x): median {value} ms, max 1 ms")
            for side, values in (("old", old), ("new", new)) for n, value in enumerate(values, 1)]


def test_new_above_old_by_more_than_olds_spread_is_flagged(compare: ModuleType,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    assert compare.table(plan_runs(compare, [10, 12, 11], [13.5, 13, 14]), ["plan"], both=False) == 1
    assert "NEW worse by more than the noise" in capsys.readouterr().out
    assert compare.table(plan_runs(compare, [10, 12, 11], [12.5, 13, 11]), ["plan"], both=False) == 0
    assert "NEW worse" not in capsys.readouterr().out


def test_noise_both_takes_the_larger_spread_of_the_two_sides(compare: ModuleType) -> None:
    runs = plan_runs(compare, [10, 11, 10.5], [12, 14, 10])  # medians 10.5 → 12: OLD spread 1, NEW spread 4
    assert compare.table(runs, ["plan"], both=False) == 1
    assert compare.table(runs, ["plan"], both=True) == 0


def test_compare_ended_ends_its_bench_and_what_the_bench_started(compare: ModuleType, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Killing compare.py (SIGTERM) left its bench running (a session of its own): a bench's daemon then held
    the account's lock and broke the next benches of both trees. Now its bench's whole session goes."""
    import os
    import signal
    import threading
    import time

    started = tmp_path / "grandchild.pid"
    monkeypatch.setattr(compare, "command", lambda tree, argv, options, tmp: [
        "bash", "-c", f'sleep 600 & echo $! > {started}; wait'])
    options = compare.Options(account=None, python=sys.executable, data_root=str(tmp_path), out=tmp_path,
                              start_runs=1, singles=1, idle_seconds=1.0)

    def terminate_once_started() -> None:
        deadline = time.monotonic() + 60
        while not started.exists() or not started.read_text().strip():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)

    before = signal.signal(signal.SIGTERM, compare._ended)
    killer = threading.Thread(target=terminate_once_started)
    try:
        killer.start()
        with pytest.raises(SystemExit):
            compare.run_one("plan", "new", REPO, 1, options, script_tree=REPO)
    finally:
        killer.join(60)
        signal.signal(signal.SIGTERM, before)
    pid = int(started.read_text())
    deadline = time.monotonic() + 30
    while (state := _state(pid)) not in (None, "Z"):  # gone (or a zombie left for its reaper)
        assert time.monotonic() < deadline, f"the bench's own child {pid} still runs ({state})"
        time.sleep(0.05)


def _state(pid: int) -> str | None:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return None
    return next(line.split()[1] for line in status.splitlines() if line.startswith("State:"))
