"""The suite's lanes (tools/lanes.py) and the check between modules (tests/plugins/lane_health.py).

The lanes: the user lanes take whole modules from one queue, longest first, each module run by exactly
one lane with its module fixtures set up and torn down once; pytest-repeat's ids are folded back for
the flake hunt. The check: a module that leaves a listener on the
lane's ports, or its podman unable to answer, fails at its end, names what is broken, and the lane
stops there (the next module does not run to fail for it)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tools.lanes import ROOT_LANES, ROOT_MARKERS, USER_PORTS, base_id, port_blocks, queue_order, split_args

ROOT = Path(__file__).resolve().parents[1]


QUEUED_MODULE = """
import os
import pathlib
import time

import pytest

LOG = pathlib.Path(os.environ["QUEUE_LOG"])


def note(what):
    with LOG.open("a") as log:
        log.write(f"{{os.environ['LANE']}} {{what}}\\n")


@pytest.fixture(scope="module")
def module_fixture():
    note("setup {name}")
    yield
    note("teardown {name}")


@pytest.mark.parametrize("n", range({tests}))
def test_it(module_fixture, n):
    time.sleep({seconds})
    note("ran {name} " + str(n))
"""


def _queued_project(tmp_path: Path, modules: dict[str, str], order: list[str]) -> Path:
    """An inner pytest project of `modules` (name: text) whose runs share one queue; the queue's folder."""
    for name, text in modules.items():
        (tmp_path / name).write_text(text)
    (tmp_path / "pyproject.toml").write_text("[tool.pytest.ini_options]\nmarkers = ['docker: docker']\n")
    (tmp_path / "conftest.py").write_text('pytest_plugins = ["tests.plugins.module_queue"]\n')
    queue = tmp_path / "queue"
    (queue / "claims").mkdir(parents=True)
    (queue / "order.json").write_text(json.dumps(order))
    return queue


def _queued_run(tmp_path: Path, queue: Path, *args: str, lane: str) -> list[str]:
    """One pytest process on the queue; what it ran, in order."""
    log = tmp_path / "ran.log"
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "--rootdir", str(tmp_path),
                           f"--module-queue={queue}", *args], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120, check=False,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "QUEUE_LOG": str(log), "LANE": lane})
    assert done.returncode == 0, done.stdout + done.stderr
    return [line.split(" ", 2)[2] for line in log.read_text().splitlines() if " ran " in line]


@pytest.mark.slow  # a second or more: out of the fast lane
def test_the_lanes_take_each_module_from_one_queue_once(tmp_path: Path) -> None:
    """Three pytest processes on one queue: every test runs exactly once, each module whole in one lane
    with its module fixture set up and torn down once there (which lane takes what depends on timing,
    and is not asserted)."""
    seconds = {"test_long.py": 100.0, "test_mid.py": 20.0}
    modules = {"test_long.py": (3, 0.6), "test_mid.py": (2, 0.1), "test_s1.py": (2, 0.05), "test_s2.py": (2, 0.05),
               "test_s3.py": (1, 0.05), "test_s4.py": (1, 0.05)}
    order = queue_order(sorted(modules), seconds)
    assert order[:2] == ["test_long.py", "test_mid.py"]
    queue = _queued_project(tmp_path, {name: QUEUED_MODULE.format(name=name, tests=tests, seconds=pause)
                                       for name, (tests, pause) in modules.items()}, order)
    log = tmp_path / "ran.log"
    argv = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "--rootdir", str(tmp_path),
            f"--module-queue={queue}", *sorted(modules)]
    lanes = [subprocess.Popen(argv, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env={**os.environ, "PYTHONPATH": str(ROOT), "QUEUE_LOG": str(log), "LANE": f"lane{n}"})
             for n in range(3)]
    outputs = [lane.communicate(timeout=120)[0] for lane in lanes]
    assert [lane.returncode for lane in lanes] == [0, 0, 0], outputs
    lines = [line.split(" ", 2) for line in log.read_text().splitlines()]
    ran = [(lane, rest) for lane, what, rest in lines if what == "ran"]
    expected = sorted(f"{name} {n}" for name, (tests, _) in modules.items() for n in range(tests))
    assert sorted(rest for _, rest in ran) == expected, lines  # every test once
    for name in modules:
        where = {lane for lane, rest in ran if rest.startswith(name + " ")}
        assert len(where) == 1, (name, lines)  # the module whole in one lane
        lane = where.pop()
        assert [line for line in lines if line[2].split()[0] == name] == [[lane, "setup", name], *(
            [lane, "ran", f"{name} {n}"] for n in range(modules[name][0])), [lane, "teardown", name]], lines
    assert sorted(path.name for path in (queue / "claims").iterdir()) == sorted(f"{name}@1" for name in modules)
    passed = [int(output.split(" passed")[0].split()[-1]) for output in outputs if " passed" in output]
    assert sum(passed) == len(expected), outputs


@pytest.mark.slow  # a second or more: out of the fast lane
def test_a_repeated_runs_rounds_are_units_of_their_own_first_rounds_first(tmp_path: Path) -> None:
    """The flake hunt (pytest-repeat, session scope): each round of a module is taken on its own, every
    module's first round before any second, each in the queue's order."""
    queue = _queued_project(tmp_path, {name: QUEUED_MODULE.format(name=name, tests=1, seconds=0)
                                       for name in ("test_a.py", "test_b.py")}, ["test_b.py", "test_a.py"])
    ran = _queued_run(tmp_path, queue, "--count", "2", "--repeat-scope", "session", "test_a.py", "test_b.py",
                      lane="lane0")
    assert ran == ["test_b.py 0", "test_a.py 0", "test_b.py 0", "test_a.py 0"], ran
    assert sorted(path.name for path in (queue / "claims").iterdir()) == [
        "test_a.py@1", "test_a.py@2", "test_b.py@1", "test_b.py@2"]


@pytest.mark.slow  # a second or more: out of the fast lane
def test_a_lane_takes_the_modules_only_it_runs_first(tmp_path: Path) -> None:
    """Root's lane (`--queue-first docker,slurm`): the marked module before the longer unmarked one."""
    queue = _queued_project(tmp_path, {
        "test_long.py": QUEUED_MODULE.format(name="test_long.py", tests=1, seconds=0),
        "test_own.py": "import pytest\npytestmark = pytest.mark.docker\n" + QUEUED_MODULE.format(
            name="test_own.py", tests=1, seconds=0)}, ["test_long.py", "test_own.py"])
    ran = _queued_run(tmp_path, queue, "--queue-first=docker,slurm", "test_long.py", "test_own.py", lane="root")
    assert ran == ["test_own.py 0", "test_long.py 0"], ran


def test_the_lanes_port_blocks_do_not_overlap_and_stay_below_the_ephemeral_range() -> None:
    blocks = [*(ports for _, _, ports in ROOT_LANES), *port_blocks(3)]
    for (low, high), (next_low, _) in zip(blocks, blocks[1:], strict=False):
        assert low < high < next_low
    assert blocks[-1][1] <= USER_PORTS[1] < 32768


def test_roots_lanes_collect_every_root_test_and_docker_and_slurm_only_in_root() -> None:
    """Every combination of the root markers is collected by root's lanes (which take each module once
    from their queue, as the user lanes do) and by no user lane; Docker's and Slurm's only by `root`,
    which takes them first (one dockerd, one Slurm test cluster)."""
    from itertools import product

    from tools.lanes import ROOT_FIRST

    names = ROOT_MARKERS.split(" or ")
    for values in product([False, True], repeat=len(names)):
        marks = dict(zip(names, values, strict=True))
        lanes = [name for name, markers, _ in ROOT_LANES if eval(markers, {}, marks)]  # noqa: S307 - our own
        assert bool(lanes) == any(values), (marks, lanes)
        if any(marks[name] for name in ROOT_FIRST.split(",")):
            assert lanes == ["root"], (marks, lanes)


def test_repeat_ids_fold_back_to_the_test() -> None:
    assert base_id("tests/test_a.py::test_x[1-5]") == "tests/test_a.py::test_x"
    assert base_id("tests/test_a.py::test_y[podman-3-5]") == "tests/test_a.py::test_y[podman]"
    assert base_id("tests/test_a.py::test_z[podman]") == "tests/test_a.py::test_z[podman]"


def test_own_options_selection_and_pytest_options_are_told_apart() -> None:
    own, selected, rest = split_args(["--repeat", "5", "-m", "daemon", "tests/test_plan.py", "-x", "-k", "end"])
    assert (own.repeat, own.markers) == (5, "daemon")
    assert selected == ["tests/test_plan.py"]
    assert rest == ["-x", "-k", "end"]


INNER_CONFIG = """[tool.pytest.ini_options]
markers = ["slow: slow", "podman: podman"]
"""
INNER_CONFTEST = """
pytest_plugins = ["tests.plugins.lanes", "tests.plugins.lane_health"]


def pytest_configure(config):
    import tests.plugins.lane_health as health
    health.PORTS_GRACE_SECONDS = 1.0
"""
LEAVES_A_LISTENER = """
import socket
import pytest

LEFT = []

@pytest.mark.slow
def test_leaves_a_listener():
    server = socket.socket()
    server.bind(("127.0.0.1", {port}))
    server.listen()
    LEFT.append(server)
"""
BREAKS_PODMAN = """
import pytest

@pytest.mark.podman
def test_breaks_podman():
    pass
"""
LATER = """
import pytest

@pytest.mark.slow
def test_later():
    pass
"""


def _inner(tmp_path: Path, first: str, *, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    (tmp_path / "pyproject.toml").write_text(INNER_CONFIG)
    (tmp_path / "conftest.py").write_text(INNER_CONFTEST)
    (tmp_path / "test_a_first.py").write_text(first)
    (tmp_path / "test_b_later.py").write_text(LATER)
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rA", "--rootdir", str(tmp_path),
                           str(tmp_path / "test_a_first.py"), str(tmp_path / "test_b_later.py")],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **env})


def _free_block() -> tuple[int, int]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return port, port


@pytest.mark.slow  # a second or more: out of the fast lane
def test_a_module_that_leaves_a_listener_on_the_lanes_ports_stops_the_lane_and_is_named(tmp_path: Path) -> None:
    low, high = _free_block()
    done = _inner(tmp_path, LEAVES_A_LISTENER.format(port=low),
                  env={"GPUBOOK_TEST_LANE": "user9", "GPUBOOK_TEST_PORTS": f"{low}-{high}"})
    out = done.stdout + done.stderr
    assert done.returncode == 2, out  # pytest's 'interrupted': the lane stopped
    assert f"test_a_first.py left lane user9 unfit for the next module: port(s) {low} of the lane's block" in out
    assert "ERROR at teardown of test_leaves_a_listener" in out
    assert "PASSED test_b_later.py::test_later" not in out, out  # it did not run
    assert "lane user9 stopped: test_a_first.py left it broken" in out


@pytest.mark.slow  # a second or more: out of the fast lane
def test_a_module_after_which_podman_fails_stops_the_lane(tmp_path: Path) -> None:
    """podman's own words when its pause process ended under a running container (stop 33's CI)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "podman").write_text("#!/bin/sh\necho 'Error: invalid internal status, try resetting the pause "
                                    "process with \"podman system migrate\"' >&2\nexit 125\n")
    (bin_dir / "podman").chmod(0o755)
    done = _inner(tmp_path, BREAKS_PODMAN, env={"PATH": f"{bin_dir}:{os.environ['PATH']}",
                                               "GPUBOOK_TEST_LANE": "user9", "GPUBOOK_TEST_PORTS": "1-1"})
    out = done.stdout + done.stderr
    if os.geteuid() == 0:  # root's lane has no podman of its own to check
        assert done.returncode == 0, out
        return
    assert done.returncode == 2, out  # pytest's 'interrupted': the lane stopped
    assert "`podman ps` failed (exit 125): Error: invalid internal status" in out
    assert "PASSED test_b_later.py::test_later" not in out, out


@pytest.mark.slow  # a second or more: out of the fast lane
def test_a_healthy_lane_runs_every_module(tmp_path: Path) -> None:
    done = _inner(tmp_path, BREAKS_PODMAN.replace("podman", "slow"), env={"GPUBOOK_TEST_LANE": "user9",
                                                                        "GPUBOOK_TEST_PORTS": "1-1"})
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert "2 passed" in out


INTERRUPTED = """
import pathlib
import time

import pytest

HERE = pathlib.Path(__file__).parent


@pytest.fixture
def started():
    (HERE / "began").write_text("")
    yield
    (HERE / "torn-down").write_text("")  # what a daemon's or a server's fixture does at its end


def test_long(started):
    time.sleep(300)
"""


@pytest.mark.slow  # a second or more: out of the fast lane
def test_an_interrupted_run_lets_each_lanes_fixtures_stop_what_they_started(tmp_path: Path) -> None:
    """quickstart interrupted mid-run (Ctrl-C, SIGTERM): each lane's pytest gets its own SIGINT and tears
    its fixtures down (before, the lanes ran on and left daemons, Radicale and containers behind)."""
    from tools.lanes import Lane, interrupt, start

    (tmp_path / "pyproject.toml").write_text("[tool.pytest.ini_options]\n")
    (tmp_path / "test_long.py").write_text(INTERRUPTED)
    lane = Lane(name="user9", account=None, modules=[], ports=(1, 1), env={**os.environ, "PYTHONPATH": str(ROOT)},
                argv=["-p", "no:cacheprovider", "--rootdir", str(tmp_path), str(tmp_path / "test_long.py")],
                log=tmp_path / "lane.log")
    start(lane, python=sys.executable, tree=str(tmp_path))
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "began").exists():
            assert lane.process is not None and lane.process.poll() is None, lane.log.read_text()
            assert time.monotonic() < deadline, lane.log.read_text()
            time.sleep(0.1)
        interrupt([lane], grace=60)
    finally:
        if lane.process is not None and lane.process.poll() is None:
            lane.process.kill()
    assert (tmp_path / "torn-down").exists(), lane.log.read_text()
    assert lane.rc == 2, lane.log.read_text()  # pytest's "interrupted"
    assert "KeyboardInterrupt" in lane.log.read_text()
