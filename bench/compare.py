"""Two source trees' benchmark figures side by side, runs interleaved, with the noise measured.

    python3 bench/compare.py --old /work/wt-old --new /work/main \\
        --account gpubook-ACCT --data-root /srv/gpubook-ACCT-data [--rounds 3] [--benches start,parallel,plan,idle]

Each bench is the tree's OWN script (`TREE/bench/...`), run with PYTHONPATH=TREE and the tree as
the working folder, so each side measures its own code with its own imports. OLD and NEW alternate
within every round, the order swapped from one round to the next (OLD NEW, NEW OLD, ...), so that a
drifting machine load falls on both alike (the idle daemons too, one after the other: gpubook holds one
daemon per account, so the two cannot run at once as one account). Run as root with --account (the
benches run as that account, through runuser, with a clean environment as the test scripts use), or
as the account itself without it. The account needs rootless podman with the debian-ssh image
cached (~/.cache/gpubook) and a nosuid,nodev data root (GPUBOOK_TEST_DATA_ROOT).

Benches (lower is better for every figure):
  start     bench/container_start.py --runs R: a booking's engine start to the probe's SSH login
  parallel  bench/parallel_start.py --only after: 8 bookings at one second through `gpubook run`
            (last (a) SSH login, last (b) event line + login), then single bookings (median (a))
  plan      bench/daemon.py plan: pin_running + plan_with_extensions + decide, 1,000 bookings
  read      bench/plan_scale.py: expanding 1,000 calendar objects (first and unchanged) and the plan
            (NEW's script over both sides' code: the script only calls the API both share)
  idle      bench/daemon.py idle --seconds S: `gpubook run` polling every 30 s: RSS max, CPU

The table: per figure OLD's median and range over the rounds, NEW's, NEW - OLD, and the noise: the
spread (max - min) of OLD's own rounds (--noise both: the larger of OLD's and NEW's spreads); NEW's
own spread beside it. A NEW median above OLD's by more than that noise is flagged. With 3 rounds on a
loaded 2-core VM, OLD's spread alone flagged 1 of 15 figures when both trees were the same code
(bench/results/compare-noise-2026-11-26/); `--noise both` flagged none. `--table DIR` prints the
table again from a kept --out folder, without running anything.
Every run's whole output is kept in --out.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import pwd
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

BENCHES = ("start", "parallel", "plan", "read", "idle")
DEFAULT_BENCHES = ("start", "parallel", "plan", "read", "idle")
RUN_TIMEOUT = 600  # seconds: one bench run past this is killed and counted as failed


@dataclass(frozen=True)
class Options:
    account: str | None
    python: str
    data_root: str
    out: Path
    start_runs: int
    singles: int
    idle_seconds: float


@dataclass(frozen=True)
class Bench:
    """One bench: its argv after the interpreter, and what to read from its output."""

    name: str
    argv: Callable[[Options], list[str]]
    figures: tuple[tuple[str, str, str], ...]  # (figure, unit, regex with one group)
    invalid: str | None = None  # output matching this regex is a failed run whatever it printed
    # The NEW tree's script measures both sides' code (PYTHONPATH picks the side): for a bench that only
    # calls an API both sides share, so that a change in how it measures is not read as the code's.
    same_script: bool = False


NUMBER = r"([0-9]+(?:\.[0-9]+)?)"


def parallel_column(column: int) -> str:
    """The summary row of parallel_start.py, one of its five columns as the only group."""
    groups = [r"[0-9.]+|inf"] * 5
    groups[column] = r"([0-9.]+|inf)"
    return r"\n\s*after\s+" + r"\s+".join(f"(?:{g})" if i != column else g for i, g in enumerate(groups))


SPECS = {
    "start": Bench("start", lambda o: ["bench/container_start.py", "--runs", str(o.start_runs)], (
        ("engine start → SSH login, median", "s", rf"private: start-to-SSH-login over \d+ runs: median {NUMBER} s"),
        ("engine start → SSH login, p95", "s", rf"private: start-to-SSH-login over \d+ runs: .*?p95 {NUMBER} s"),
        ("engine stop, median", "s", rf"private: stop \(SIGTERM, exit, remove\): median {NUMBER} s"),
    )),
    "parallel": Bench("parallel", lambda o: ["bench/parallel_start.py", "--only", "after", "--singles",
                                             str(o.singles)], (
        ("8 at once: last SSH login (a)", "s", parallel_column(0)),
        ("8 at once: last event line + login (b)", "s", parallel_column(1)),
        ("8 at once: median (b)", "s", parallel_column(2)),
        ("single booking: start → login (a), median", "s", parallel_column(3)),
        ("single booking: start → line + login (b), median", "s", parallel_column(4)),
    )),
    "plan": Bench("plan", lambda o: ["bench/daemon.py", "plan"], (
        ("plan + decide, 1,000 bookings, median of 20", "ms", rf"plan \+ reconcile, .*?: median {NUMBER} ms"),
    )),
    "read": Bench("read", lambda o: ["bench/plan_scale.py"], (
        ("read 1,000 objects, first (CPU)", "ms", rf"expand, first read.*?wall\s+{NUMBER} ms CPU"),
        ("read 1,000 objects, unchanged (CPU)", "ms", rf"expand, unchanged.*?wall\s+{NUMBER} ms CPU"),
        ("plan 1,547 occurrences (CPU)", "ms", rf"\nplan(?: \(median of \d+\))?:.*?wall\s+{NUMBER} ms CPU"),
    ), same_script=True),
    "idle": Bench("idle", lambda o: ["bench/daemon.py", "idle", "--seconds", str(o.idle_seconds)], (
        ("idle daemon: RSS max", "MB", rf"RSS max {NUMBER} MB"),
        ("idle daemon: CPU, own", "%", rf"CPU [0-9.]+ s = {NUMBER} % of one core"),
        ("idle daemon: CPU with its podman commands", "%", rf"commands it ran [0-9.]+ s = {NUMBER} %"),
    ), invalid=r"RSS max 0\.0 MB"),  # the daemon had exited: v0.2.0's bench/daemon.py reports zeros then
}


@dataclass(frozen=True)
class Run:
    bench: str
    side: str  # "old" or "new"
    round: int
    seconds: float
    code: int | None  # None: killed at the timeout
    output: str
    load: str  # /proc/loadavg's 1-minute figure at the start and the end

    def figures(self) -> dict[str, float]:
        found: dict[str, float] = {}
        invalid = SPECS[self.bench].invalid
        if invalid and re.search(invalid, self.output):
            return found
        for figure, _, pattern in SPECS[self.bench].figures:
            match = re.search(pattern, self.output, re.DOTALL if ".*?" in pattern else 0)
            if match and match.group(1) != "inf":
                found[figure] = float(match.group(1))
        return found


def load_now() -> str:
    return Path("/proc/loadavg").read_text().split()[0]


def command(tree: Path, argv: Sequence[str], options: Options, tmp: Path) -> list[str]:
    """The bench's argv, as the account where one is named; the environment the test scripts give."""
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "PYTHONPATH": str(tree), "PYTHONDONTWRITEBYTECODE": "1",
           "GPUBOOK_TEST_DATA_ROOT": options.data_root, "TMPDIR": str(tmp)}
    user = pwd.getpwnam(options.account) if options.account else pwd.getpwuid(os.getuid())
    env |= {"HOME": user.pw_dir, "USER": user.pw_name, "LOGNAME": user.pw_name,
            "XDG_RUNTIME_DIR": f"/run/user/{user.pw_uid}"}
    inner = ["env", "-i", *(f"{k}={v}" for k, v in env.items()), options.python, *argv]
    return ["runuser", "-u", options.account, "--", *inner] if options.account else inner


def run_one(bench: str, side: str, tree: Path, round_: int, options: Options, *, script_tree: Path) -> Run:
    """One bench run from its tree, its own temporary folder (parallel_start exports a git tree
    into it each run) removed afterwards; the whole output kept in --out. A `same_script` bench runs
    `script_tree`'s (NEW's) script over `tree`'s code."""
    tmp = Path(tempfile.mkdtemp(prefix=f"gpubook-compare-{bench}-{side}-"))
    if options.account:
        shutil.chown(tmp, options.account, options.account)
    script, *rest = SPECS[bench].argv(options)
    if SPECS[bench].same_script:
        script = str(script_tree / script)
    argv = command(tree, [script, *rest], options, tmp)
    load_before, began = load_now(), time.monotonic()
    process = subprocess.Popen(argv, cwd=tree, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=RUN_TIMEOUT)
        code: int | None = process.returncode
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)  # the session this call started: runuser and the bench below it
        output, _ = process.communicate()
        code = None
    except BaseException:
        # compare.py itself interrupted or ended (Ctrl-C, SIGTERM): its bench goes too. Left running, a
        # bench's daemon kept the daemon lock and broke the next benches of both trees.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    run = Run(bench=bench, side=side, round=round_, seconds=time.monotonic() - began, code=code,
              output=output.decode(errors="replace"), load=f"{load_before}→{load_now()}")
    (options.out / f"r{round_}-{bench}-{side}.txt").write_text(
        f"# {' '.join(argv)}\n# cwd {tree}; exit {code}; {run.seconds:.1f} s; load {run.load}\n{run.output}")
    return run


def report(run: Run) -> None:
    state = "ok" if run.code == 0 else ("timed out" if run.code is None else f"exit {run.code}")
    figures = run.figures()
    missing = len(SPECS[run.bench].figures) - len(figures)
    shown = ", ".join(f"{value:g}" for value in figures.values())
    print(f"  round {run.round} {run.bench:8s} {run.side}: {state}, {run.seconds:5.1f} s, load {run.load}: {shown}"
          + (f" ({missing} figure(s) not found)" if missing else ""), flush=True)
    if run.code != 0 or missing:
        print("    " + "\n    ".join(run.output.strip().splitlines()[-8:]), flush=True)


def rounds(benches: Sequence[str], trees: dict[str, Path], count: int, options: Options) -> list[Run]:
    runs: list[Run] = []
    for round_ in range(1, count + 1):
        order = ["old", "new"] if round_ % 2 else ["new", "old"]
        print(f"round {round_} of {count} ({' then '.join(order)}), load {load_now()}", flush=True)
        for bench in benches:
            done = [run_one(bench, side, trees[side], round_, options, script_tree=trees["new"]) for side in order]
            for run in done:
                report(run)
            runs += done
    return runs


def spread(values: list[float]) -> float:
    return max(values) - min(values) if values else float("nan")


def cell(values: list[float]) -> str:
    if not values:
        return "failed"
    return f"{statistics.median(values):.3f} [{min(values):.3f}–{max(values):.3f}]"


def table(runs: list[Run], benches: Sequence[str], *, both: bool) -> int:
    """Prints the comparison; returns how many figures NEW is worse in by more than the noise."""
    worse = 0
    header = f"{'figure':50s} {'unit':4s} {'OLD median [min–max]':>24s} {'NEW median [min–max]':>24s}" \
             f" {'NEW−OLD':>9s} {'noise':>8s} {'NEW sprd':>8s}"
    print("\n" + header + "\n" + "-" * len(header))
    for bench in benches:
        for figure, unit, _ in SPECS[bench].figures:
            values = {side: [r.figures()[figure] for r in runs
                             if r.bench == bench and r.side == side and figure in r.figures()]
                      for side in ("old", "new")}
            old, new = values["old"], values["new"]
            if not old or not new:
                print(f"{figure:50s} {unit:4s} {cell(old):>24s} {cell(new):>24s}")
                continue
            difference = statistics.median(new) - statistics.median(old)
            noise = max(spread(old), spread(new)) if both else spread(old)
            flag = ""
            if difference > noise:
                flag, worse = "  ← NEW worse by more than the noise", worse + 1
            print(f"{figure:50s} {unit:4s} {cell(old):>24s} {cell(new):>24s} {difference:+9.3f} {noise:8.3f}"
                  f" {spread(new):8.3f}{flag}")
    return worse


def kept(folder: Path) -> list[Run]:
    """The runs a --out folder kept (r{round}-{bench}-{side}.txt), read back for the table."""
    runs = []
    for path in sorted(folder.glob("r*-*-*.txt")):
        round_, bench, side = path.stem.split("-")
        header, _, output = path.read_text().partition("\n# cwd ")
        status = output.split("\n", 1)[0]
        code = re.search(r"exit (-?[0-9]+|None)", status)
        runs.append(Run(bench=bench, side=side, round=int(round_[1:]), seconds=0.0,
                        code=int(code.group(1)) if code and code.group(1) != "None" else None,
                        output=output.split("\n", 1)[1] if "\n" in output else "", load=""))
    return runs


def describe(tree: Path) -> str:
    found = subprocess.run(["git", "-c", "safe.directory=*", "-C", str(tree), "describe", "--always", "--tags",
                            "--dirty"], capture_output=True, text=True)
    return found.stdout.strip() or "not a git tree"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--old", type=Path, help="the tree measured as OLD (a checkout)")
    parser.add_argument("--new", type=Path, help="the tree measured as NEW (a checkout)")
    parser.add_argument("--table", type=Path, metavar="DIR", help="only print the table of a kept --out folder")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of OLD and NEW (3)")
    parser.add_argument("--benches", default=",".join(DEFAULT_BENCHES),
                        help=f"comma-separated, of {', '.join(BENCHES)} (default: all)")
    parser.add_argument("--account", help="run the benches as this account (when run as root)")
    parser.add_argument("--python", default="/opt/gpubook/venv/bin/python",
                        help="the interpreter the benches run with (/opt/gpubook/venv/bin/python)")
    parser.add_argument("--data-root",
                        help="a nosuid,nodev folder the account owns (GPUBOOK_TEST_DATA_ROOT)")
    parser.add_argument("--noise", choices=["old", "both"], default="old",
                        help="the noise: OLD's spread over its rounds (old), or the larger of both sides' (both)")
    parser.add_argument("--out", type=Path, help="folder for every run's output (default: a new one in /tmp)")
    parser.add_argument("--start-runs", type=int, default=10, help="start: measured starts per run (10)")
    parser.add_argument("--singles", type=int, default=2, help="parallel: single bookings per run (2)")
    parser.add_argument("--idle-seconds", type=float, default=60,
                        help="idle: seconds measured per run (60: two polls fall in it even after a slow start)")
    args = parser.parse_args(argv)
    args.benches = [b.strip() for b in args.benches.split(",") if b.strip()]
    unknown = [b for b in args.benches if b not in BENCHES]
    if unknown:
        parser.error(f"unknown bench {', '.join(unknown)}: choose among {', '.join(BENCHES)}")
    if args.table:
        return args
    if not (args.old and args.new and args.data_root):
        parser.error("--old, --new and --data-root are needed to run the benches (or --table DIR to reread them)")
    for side in ("old", "new"):
        tree = getattr(args, side)
        if not (tree / "bench" / "daemon.py").is_file():
            parser.error(f"--{side} {tree} is not a gpubook source tree: it has no bench/daemon.py")
    if os.getuid() == 0 and not args.account:
        parser.error("run as root: name the account the benches run as with --account")
    return args


def _ended(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # through run_one's cleanup: its bench's session is ended


def main(argv: Sequence[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, _ended)
    args = parse_args(argv)
    if args.table:
        runs = kept(args.table)
        benches = [b for b in args.benches if any(r.bench == b for r in runs)]
        return 1 if table(runs, benches, both=args.noise == "both") else 0
    out = args.out or Path(tempfile.mkdtemp(prefix="gpubook-compare-"))
    out.mkdir(parents=True, exist_ok=True)
    options = Options(account=args.account, python=args.python, data_root=args.data_root, out=out,
                      start_runs=args.start_runs, singles=args.singles, idle_seconds=args.idle_seconds)
    trees = {"old": args.old.resolve(), "new": args.new.resolve()}
    if args.rounds < 3:
        print(f"with {args.rounds} round(s) the noise is hardly measured (0 with one): take the flags as a smoke test")
    began = time.monotonic()
    print(f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC; {platform.platform()}, {os.cpu_count()} cores; "
          f"load {' '.join(Path('/proc/loadavg').read_text().split()[:3])}")
    print(f"OLD {trees['old']} ({describe(trees['old'])}); NEW {trees['new']} ({describe(trees['new'])})")
    print(f"as {args.account or pwd.getpwuid(os.getuid()).pw_name}, {args.python}; output kept in {out}", flush=True)
    runs = rounds(args.benches, trees, args.rounds, options)
    worse = table(runs, args.benches, both=args.noise == "both")
    failed = sum(run.code != 0 for run in runs)
    print(f"\n{len(runs)} runs in {(time.monotonic() - began) / 60:.1f} min, {failed} failed; load at the end "
          f"{' '.join(Path('/proc/loadavg').read_text().split()[:3])}; noise = "
          + ("the larger of OLD's and NEW's max − min" if args.noise == "both" else "OLD's max − min over its rounds"))
    print(f"{worse} figure(s) where NEW is worse than OLD by more than the noise" if worse
          else "no figure where NEW is worse than OLD by more than the noise")
    return 1 if worse or failed else 0


if __name__ == "__main__":
    sys.exit(main())
