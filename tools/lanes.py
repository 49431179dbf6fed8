"""The test suite in lanes side by side: what `./quickstart test` runs once the machine is set up.

- **root's lanes**: the tests that need root (markers `docker`, `slurm`, `install`, `systemd`,
  `rootful`, `accounts`), as root, in two lanes taking whole modules from a queue of their own: only
  `root` takes Docker's and Slurm's (one dockerd, one Slurm test cluster, whose podman runs as an
  account of its own), and takes them first; both take the rest (the install by `gpubook setup`, the
  systemd-booted unit, rootful podman, commands run as several host accounts).
- **the user lanes**: every other test, as unprivileged accounts (gpubook-test, gpubook-test2, …), one
  per lane, each with its own podman store and pause process, runtime folder (and so its own daemon
  lock), data mounts and block of booking ports. Every user lane collects the same tests and takes
  whole modules from one queue (tests/plugins/module_queue.py), longest recorded first
  (tests/durations.json), each the next one not yet taken as soon as it is done with its last.

Every lane writes its whole output to a log of its own, printed when all lanes are done (root's first),
then a summary: each lane's time and result, every failed test, the slowest tests overall and, with
`--repeat N`, every test that failed in any of its N runs, with where its log is.

    tools/lanes.py --tree T --accounts a,b,c --slurm-account s --data-root D --full-root F \
        --udocker-root U -- [options] [pytest args]

Options after `--` (the rest goes to pytest):
    --repeat N      run each selected test N times (pytest-repeat): the flake hunt
    -m EXPR         only tests matching EXPR, in every lane (and'ed with the lane's own expression)
    --lane NAME     only this lane (root, root2, user1, user2, …); may be given more than once
    --record        write the user lanes' module times to tests/durations.json afterwards
Paths or node ids among the pytest args select what the lanes share out, instead of all of tests/.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
REPLAY_PREFIX = "GPUBOOK_FAULT_"  # what a user lane takes from the caller's environment (replaying a sample)
ROOT_MARKERS = "docker or slurm or install or systemd or rootful or accounts"
# Root's two lanes: (name, the tests they run, their block of booking ports). The Slurm tests use fixed
# ports in 22000-24999 (tests/test_slurm_jobs.py), inside the first block.
ROOT_LANES = (("root", ROOT_MARKERS, (20000, 24999)),
              ("root2", "(install or systemd or rootful or accounts) and not (docker or slurm)", (25000, 26499)))
# Root's two lanes take whole modules from a queue of their own, as the user lanes do; only `root` takes
# Docker's and Slurm's (one dockerd, one Slurm test cluster, its fixed ports), and takes them first.
ROOT_FIRST = "docker,slurm"
DURATIONS = HERE / "tests" / "durations.json"
UNKNOWN_SECONDS = 10.0  # a module with no recorded time yet
# Booking ports (tests/kits/daemon_kit.port_range): below the kernel's ephemeral range (32768-60999),
# root's lanes first, the rest split among the user lanes.
USER_PORTS = (26500, 32499)


@dataclass
class Lane:
    name: str
    account: str | None  # None: root
    modules: list[str]
    ports: tuple[int, int]
    env: dict[str, str]
    argv: list[str] = field(default_factory=list)
    log: Path = Path()
    junit: Path = Path()
    process: subprocess.Popen[bytes] | None = None
    began: float = 0.0
    seconds: float = 0.0
    rc: int | None = None


def queue_order(modules: list[str], seconds: dict[str, float]) -> list[str]:
    """The order the lanes take modules from their queue in: longest recorded first (a module with no recorded time
    counts UNKNOWN_SECONDS), so that the last ones taken are short and the lanes end close together."""
    return sorted(modules, key=lambda m: (-seconds.get(m, UNKNOWN_SECONDS), m))


def split_args(args: list[str]) -> tuple[argparse.Namespace, list[str], list[str]]:
    """Our own options, the paths or node ids that select tests, and the rest (for pytest)."""
    parser = argparse.ArgumentParser(prog="quickstart test", add_help=False)
    parser.add_argument("--repeat", type=int, default=0)
    parser.add_argument("-m", dest="markers", default=None)
    parser.add_argument("--lane", action="append", default=[])
    parser.add_argument("--record", action="store_true")
    own, rest = parser.parse_known_args(args)
    selected = [a for a in rest if not a.startswith("-") and (HERE / a.split("::", 1)[0]).exists()]
    others = [a for a in rest if a not in selected]
    return own, selected, others


def all_modules() -> list[str]:
    return sorted(str(path.relative_to(HERE)) for path in (HERE / "tests").rglob("test_*.py"))


def port_blocks(lanes: int) -> list[tuple[int, int]]:
    size = (USER_PORTS[1] - USER_PORTS[0] + 1) // lanes
    return [(USER_PORTS[0] + n * size, USER_PORTS[0] + (n + 1) * size - 1) for n in range(lanes)]


def plan(ns: argparse.Namespace, own: argparse.Namespace, selected: list[str], passed: list[str],
         out: Path) -> list[Lane]:
    accounts = ns.accounts.split(",")
    seconds: dict[str, float] = json.loads(DURATIONS.read_text()) if DURATIONS.is_file() else {}
    modules = selected or all_modules()
    files = sorted({m.split("::", 1)[0] for m in modules})
    queue, root_queue = out / "queue", out / "root-queue"  # tests/plugins/module_queue.py
    for folder in (queue, root_queue):
        (folder / "claims").mkdir(parents=True)
        (folder / "claims").chmod(0o1777)
        (folder / "order.json").write_text(json.dumps(queue_order(files, seconds)))
        (folder / "order.json").chmod(0o644)
    also = f" and ({own.markers})" if own.markers else ""
    repeat = ["--count", str(own.repeat), "--repeat-scope", "session"] if own.repeat > 1 else []
    common = ["-p", "no:cacheprovider", "-o", "junit_family=xunit1", "-o", "junit_logging=all",
              "-o", "junit_log_passing_tests=false", *repeat, *passed]
    ci = os.environ.get("CI", "")
    replays = {k: v for k, v in os.environ.items() if k.startswith(REPLAY_PREFIX)}  # e.g. GPUBOOK_FAULT_SEED
    lanes = []
    for name, markers, ports in ROOT_LANES:
        lane = Lane(name, None, modules, ports, {
            **os.environ, "PYTHONPATH": str(HERE), "GPUBOOK_TEST_DATA_ROOT": f"{ns.data_root}-root",
            "GPUBOOK_TEST_TREE": ns.tree, "GPUBOOK_SLURM_TEST_USER": ns.slurm_account,
            "GPUBOOK_TEST_LANE": name, "GPUBOOK_TEST_PORTS": f"{ports[0]}-{ports[1]}"})
        first = [f"--queue-first={ROOT_FIRST}"] if name == "root" else []
        lane.argv = ["-m", f"({markers}){also}", "--durations=10", f"--module-queue={root_queue}", *first, *common,
                     *modules]
        lanes.append(lane)
    for number, (account, ports) in enumerate(zip(accounts, port_blocks(len(accounts)), strict=True), 1):
        entry = pwd.getpwnam(account)
        suffix = "" if number == 1 else f"-{number}"
        lane = Lane(f"user{number}", account, modules, ports, {
            "PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": entry.pw_dir, "USER": account, "LOGNAME": account,
            "XDG_RUNTIME_DIR": f"/run/user/{entry.pw_uid}", "PYTHONPATH": ns.tree,
            "GPUBOOK_TEST_DATA_ROOT": ns.data_root + suffix, "GPUBOOK_TEST_FULL_ROOT": ns.full_root + suffix,
            "UDOCKER_DIR": ns.udocker_root + suffix,
            "GPUBOOK_TEST_LANE": f"user{number}", "GPUBOOK_TEST_PORTS": f"{ports[0]}-{ports[1]}", "CI": ci,
            "PYTHONDONTWRITEBYTECODE": "1", **replays})
        lane.argv = ["-m", f"not ({ROOT_MARKERS}){also}", "--durations=10", f"--module-queue={queue}", *common,
                     *lane.modules]
        lanes.append(lane)
    chosen = [lane for lane in lanes if not own.lane or lane.name in own.lane]
    unknown = set(own.lane) - {lane.name for lane in lanes}
    if unknown:
        sys.exit(f"quickstart test: no lane {', '.join(sorted(unknown))}; the lanes are "
                 f"{', '.join(lane.name for lane in lanes)}")
    for lane in chosen:
        folder = out / lane.name
        folder.mkdir(parents=True, exist_ok=True)
        if lane.account is not None:
            shutil.chown(folder, lane.account)
        lane.log, lane.junit = out / f"{lane.name}.log", folder / "junit.xml"
        lane.argv += [f"--junitxml={lane.junit}"]
    return [lane for lane in chosen if lane.modules]


def seed_rootfs() -> Path:
    """The debian-ssh template's root file system, made once (as root, mmdebstrap's fastest mode) in
    root's cache; at once when it is there."""
    from gpubook.runtime.private import default_cache_dir
    from gpubook.runtime.templates.catalog import get_template
    from gpubook.runtime.templates.overlay_image import rootfs_tarball

    return rootfs_tarball(get_template("debian-ssh"), cache_dir=default_cache_dir())


def seed_images(accounts: list[str]) -> None:
    """The debian-ssh root file system (seed_rootfs) copied into each account's cache, where the tests'
    image fixtures find it: each lane imports it into its own store, and no two lanes run mmdebstrap at
    once."""
    made = seed_rootfs()
    for account in accounts:
        entry = pwd.getpwnam(account)
        target = Path(entry.pw_dir) / ".cache" / "gpubook" / "rootfs" / made.name
        if target.is_file():
            continue
        for folder in reversed([target.parent, *target.parent.parents][:3]):  # .cache, gpubook, rootfs
            if not folder.exists():
                folder.mkdir(mode=0o700)
                os.chown(folder, entry.pw_uid, entry.pw_gid)
        partial = target.with_suffix(".partial.tar")
        shutil.copyfile(made, partial)
        os.chown(partial, entry.pw_uid, entry.pw_gid)
        partial.replace(target)


def start(lane: Lane, *, python: str, tree: str) -> None:
    pytest = [python, "-m", "pytest", *lane.argv]
    if lane.account is None:
        argv, cwd = pytest, str(HERE)
    else:
        argv = ["runuser", "-u", lane.account, "--", "env", "-i",
                *(f"{k}={v}" for k, v in lane.env.items()), *pytest]
        cwd = tree
    with lane.log.open("wb") as log:
        # a session of its own: an interrupt of quickstart reaches the lane through `interrupt`, which
        # lets its pytest end its tests and fixtures (daemons, servers, containers) before it goes
        lane.process = subprocess.Popen(argv, cwd=cwd, env=lane.env if lane.account is None else None,
                                        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                        start_new_session=True)
    lane.began = time.monotonic()


def interrupt(lanes: list[Lane], *, grace: float = 120.0) -> None:
    """quickstart interrupted (Ctrl-C, SIGTERM): each running lane's pytest gets SIGINT, as a Ctrl-C
    of its own, and ends its tests' fixtures, which stop what they started (daemons, Radicale,
    slurmctld, containers); a lane still there after `grace` seconds is killed with its whole session."""
    running = [lane for lane in lanes if lane.process is not None and lane.process.poll() is None]
    for lane in running:
        assert lane.process is not None
        print(f"quickstart: interrupting lane {lane.name} (its fixtures stop what they started)", flush=True)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(lane.process.pid, signal.SIGINT)
    deadline = time.monotonic() + grace
    for lane in running:
        assert lane.process is not None
        try:
            lane.process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            print(f"quickstart: lane {lane.name} did not end within {grace:.0f} s: killed", flush=True)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(lane.process.pid, signal.SIGKILL)
            lane.process.wait()
        lane.rc, lane.seconds = lane.process.returncode, time.monotonic() - lane.began


def _interrupted(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def minutes(seconds: float) -> str:
    return f"{int(seconds // 60)}:{int(seconds % 60):02d}"


def last_line(log: Path) -> str:
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1].strip("= ") if lines else "(no output)"


def where(log: Path) -> str:
    """The module a lane is at: the last line of its log that starts one."""
    modules = [line.split(" ", 1)[0] for line in log.read_text(errors="replace").splitlines()
               if line.startswith("tests/")]
    return modules[-1] if modules else "collecting"


def wait(lanes: list[Lane], *, every: float = 120.0) -> None:
    """Until every lane is done; a line when one is, and where the others are every `every` seconds."""
    running = list(lanes)
    said = time.monotonic()
    while running:
        time.sleep(1)
        if time.monotonic() - said > every:
            said = time.monotonic()
            print("quickstart: running: " + ", ".join(f"{lane.name} at {where(lane.log)}" for lane in running),
                  flush=True)
        for lane in list(running):
            assert lane.process is not None
            rc = lane.process.poll()
            if rc is None:
                continue
            lane.rc, lane.seconds = rc, time.monotonic() - lane.began
            running.remove(lane)
            who = f" ({lane.account})" if lane.account else " (root)"
            print(f"quickstart: lane {lane.name}{who} done in {minutes(lane.seconds)}: {last_line(lane.log)}",
                  flush=True)


def cases(lanes: list[Lane]) -> list[tuple[str, str, float, bool]]:
    """(lane, test id, seconds, failed) of every test case in the lanes' junit files."""
    found = []
    for lane in lanes:
        if not lane.junit.is_file():
            continue
        for case in ElementTree.parse(lane.junit).iter("testcase"):  # noqa: S314 - our own pytest wrote it
            path = case.get("file") or case.get("classname", "").replace(".", "/") + ".py"
            test = f"{path}::{case.get('name')}"
            failed = case.find("failure") is not None or case.find("error") is not None
            found.append((lane.name, test, float(case.get("time") or 0), failed))
    return found


def base_id(test: str) -> str:
    """A test id without pytest-repeat's `-N-M]`/`[N-M]` suffix."""
    if test.endswith("]"):
        head, _, param = test[:-1].rpartition("[")
        parts = param.rsplit("-", 2)
        if len(parts) >= 2 and parts[-1].isdigit() and parts[-2].isdigit():
            rest = parts[0] if len(parts) == 3 else ""
            return f"{head}[{rest}]" if rest else head
    return test


def summary(lanes: list[Lane], *, repeat: int, wall: float) -> int:
    print("\n" + "=" * 30 + " quickstart test: the lanes " + "=" * 30)
    for lane in lanes:
        print(f"{lane.name:6} {lane.account or 'root':14} {minutes(lane.seconds):>6}  {last_line(lane.log)}")
    print(f"all lanes: {minutes(wall)} wall")
    found = cases(lanes)
    slowest = sorted(found, key=lambda c: -c[2])[:25]
    if slowest:
        print("\nthe 25 slowest tests (setup, call and teardown):")
        for lane, test, seconds, _ in slowest:
            print(f"{seconds:8.1f} s  {lane:6} {test}")
    if repeat > 1:
        runs: dict[str, list[bool]] = {}
        where: dict[str, str] = {}
        for lane, test, _, failed in found:
            runs.setdefault(base_id(test), []).append(failed)
            where[base_id(test)] = lane
        flaky = {t: r for t, r in runs.items() if any(r)}
        print(f"\nflake hunt: {len(runs)} tests, each run {repeat} times: "
              f"{len(flaky)} failed at least once")
        for test, results in sorted(flaky.items()):
            lane = next(x for x in lanes if x.name == where[test])
            print(f"  {test}: failed {sum(results)} of {len(results)}; log {lane.log}, junit {lane.junit}")
    failures = []
    for lane in lanes:
        failures += [f"{lane.name}: {line}" for line in lane.log.read_text(errors="replace").splitlines()
                     if line.startswith(("FAILED ", "ERROR ", "!!!"))]
    if failures:
        print("\nfailed:")
        print("\n".join(failures))
    bad = [lane.name for lane in lanes if lane.rc not in (0, 5)]  # 5: no test of the lane was selected
    print(f"\nquickstart test: {'lanes failed: ' + ', '.join(bad) if bad else 'every lane passed'} "
          f"({minutes(wall)} wall)")
    return 1 if bad else 0


def record(lanes: list[Lane]) -> None:
    """tests/durations.json: each module's seconds, in whichever lane ran it."""
    seconds: dict[str, float] = json.loads(DURATIONS.read_text()) if DURATIONS.is_file() else {}
    measured: dict[str, float] = {}
    for _, test, took, _ in cases(lanes):
        module = test.split("::", 1)[0]
        measured[module] = measured.get(module, 0.0) + took
    seconds.update({module: round(took, 1) for module, took in measured.items()})
    DURATIONS.write_text(json.dumps(dict(sorted(seconds.items())), indent=1) + "\n")
    print(f"quickstart test: wrote {len(measured)} modules' times to {DURATIONS}")


def main() -> int:
    if sys.argv[1:] == ["--rootfs-only"]:  # quickstart, while pip installs: the seed's root file system only
        print(f"quickstart: the debian-ssh root file system: {seed_rootfs()}", flush=True)
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--tree", required=True, help="the tree the user lanes run (readable by them)")
    parser.add_argument("--accounts", required=True, help="the user lanes' accounts, comma-separated")
    parser.add_argument("--slurm-account", required=True, help="the account root's lane runs Slurm's podman as")
    parser.add_argument("--data-root", required=True, help="the first user lane's data tmpfs (others: -2, -3, …)")
    parser.add_argument("--full-root", required=True, help="the first user lane's small tmpfs (others: -2, …)")
    parser.add_argument("--udocker-root", required=True,
                        help="the first user lane's udocker store, a tmpfs (others: -2, …)")
    parser.add_argument("rest", nargs=argparse.REMAINDER)
    ns = parser.parse_args()
    rest = ns.rest[1:] if ns.rest[:1] == ["--"] else ns.rest
    own, selected, passed = split_args(rest)
    out = Path(tempfile.mkdtemp(prefix=f"gpubook-lanes-{time.strftime('%Y%m%d-%H%M%S')}-", dir="/var/tmp"))
    out.chmod(0o755)  # each lane's account writes its junit file into its own folder there
    lanes = plan(ns, own, selected, passed, out)
    began = time.monotonic()
    seed_images([*ns.accounts.split(","), ns.slurm_account])
    for lane in lanes:
        what = "modules from root's queue" if lane.account is None else "modules from the user lanes' queue"
        print(f"quickstart: lane {lane.name} ({lane.account or 'root'}): {what}, "
              f"ports {lane.ports[0]}-{lane.ports[1]}; log {lane.log}", flush=True)
        start(lane, python=sys.executable, tree=ns.tree)
    signal.signal(signal.SIGTERM, _interrupted)
    try:
        wait(lanes)
    except KeyboardInterrupt:
        interrupt(lanes)
        print("quickstart test: interrupted", flush=True)
        return 130
    wall = time.monotonic() - began
    for lane in lanes:
        print(f"\n{'#' * 30} lane {lane.name} ({lane.account or 'root'}) {'#' * 30}", flush=True)
        sys.stdout.write(lane.log.read_text(errors="replace"))
    if own.record:
        record(lanes)
    return summary(lanes, repeat=own.repeat, wall=wall)


if __name__ == "__main__":
    sys.exit(main())
