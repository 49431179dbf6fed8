"""Simultaneous starts: N one-GPU bookings starting at the same second, before and after, in one run.

    PYTHONPATH=. python bench/parallel_start.py [--before 9c6d4a3] [--count 8] [--singles 5] [--repeat 1]

Real Radicale, rootless podman, `gpubook run` as a real process on a static inventory of N GPUs
(no driver: bookings run on the [gpus] count without injection, as the daemon tests do). The
same scenario runs against the revision `--before` (exported with `git archive` into a temporary
folder; its own daemon code, this script's measuring) and against the working tree.

For each booker, measured by this script from the booking's start time:
  (a) ssh: the first successful SSH login with the booker's own key (paramiko), on the port the
      daemon allocated (read from its state database as soon as it is there);
  (b) line: the moment the event's `running: ssh -p PORT` line is readable from the CalDAV server
      (its ctag polled every 25 ms, the events read when it changes) and a login on that port
      succeeded — what a booker who reads their event experiences.
Also the daemon's own "SSH answered after" figure (from the start call to the probe's login).

`--create-ahead ROUNDS` instead measures one booking at a time started with `run` against
created ahead (`podman create`) and started with `start` (what creating ahead could save).

Scenarios: `together` (N bookings at one second) and `single` (one booking alone, `--singles`
of them 8 s apart; the median is the figure). Targets: the last of the 8 logs in (b) at most
1.5 s after the start; a single booking's median start-to-SSH at most 0.35 s.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import socket
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import paramiko  # noqa: E402
import requests  # noqa: E402

MACHINE = "Debian 12 VM, 2 cores, 24 GiB, rootless podman"
SSH_LINE = re.compile(r"(?:running|ssh from the start): ssh -p (\d+) ")
ANSWERED = re.compile(r"SSH answered after ([0-9.]+) s")


@dataclass
class Figure:
    booking_id: str
    start: datetime
    ssh: float | None = None  # (a)
    line_seen: float | None = None  # the ssh line readable in the event
    line: float | None = None  # (b)
    daemon: float | None = None  # the daemon's own start call → probe login


@dataclass
class Scenario:
    name: str
    figures: list[Figure] = field(default_factory=list)
    load: str = ""


def export(rev: str) -> Path:
    """The revision's files in a temporary folder readable by the test user."""
    folder = Path(tempfile.mkdtemp(prefix=f"gpubook-before-{rev[:8]}-"))
    archive = subprocess.run(["git", "-c", "safe.directory=*", "-C", str(ROOT), "archive", rev],
                             check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive, check=True)
    folder.chmod(0o755)
    return folder


def start_daemon(tree: Path, config: Path) -> subprocess.Popen[bytes]:
    log = config.with_name("daemon.log").open("ab")
    env = {**os.environ, "PYTHONPATH": str(tree)}
    return subprocess.Popen([sys.executable, "-m", "gpubook.scheduler.commands.cli", "run", "--config", str(config)],
                            stdout=log, stderr=log, env=env, stdin=subprocess.DEVNULL, cwd=tree)


def login(port: int, user: str, key: paramiko.PKey) -> bool:
    """One login as the booker; a port whose SSH server does not answer yet costs no paramiko."""
    from tests.kits.daemon_kit import try_login

    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2) as probe:
            probe.settimeout(2)
            if not probe.recv(4, socket.MSG_PEEK):
                return False
    except OSError:
        return False
    client = try_login(port, user, key, timeout=2)
    if client is None:
        return False
    client.close()
    return True


def since(start: datetime) -> float:
    return (datetime.now(UTC) - start).total_seconds()


def watch_ssh(figure: Figure, user: str, key: paramiko.PKey, state_path: Path, deadline: float) -> None:
    """(a): the booker's first login, on the port the daemon allocated."""
    while datetime.now(UTC) < figure.start:
        time.sleep(0.002)
    port = None
    while time.monotonic() < deadline:
        if port is None and state_path.exists():
            try:
                with sqlite3.connect(f"file:{state_path}?mode=ro", uri=True, timeout=1) as db:
                    row = db.execute("SELECT port FROM ports WHERE booking_id = ?", (figure.booking_id,)).fetchone()
                port = row[0] if row else None
            except sqlite3.Error:
                port = None
        if port is not None and login(port, user, key):
            figure.ssh = since(figure.start)
            return
        time.sleep(0.02)


def watch_lines(figures: list[Figure], users: dict[str, str], keys: dict[str, paramiko.PKey],
                calendar_url: str, hrefs: dict[str, str], auth: tuple[str, str], deadline: float) -> None:
    """(b): the calendar's ctag polled (from before the starts); on a change the pending events are
    read for their ssh line ("ssh from the start: ..." once the container is armed, "running: ..."
    after the start); each booker then logs in on their own thread from their start on."""
    session = requests.Session()
    session.auth = auth
    body = ('<?xml version="1.0"?><d:propfind xmlns:d="DAV:" xmlns:cs="http://calendarserver.org/ns/">'
            '<d:prop><cs:getctag/></d:prop></d:propfind>')
    pending = {f.booking_id: f for f in figures}
    bookers: list[threading.Thread] = []
    last = None
    while pending and time.monotonic() < deadline:
        ctag = session.request("PROPFIND", calendar_url, data=body, headers={"Depth": "0"}, timeout=5).text
        if ctag != last:
            last = ctag
            for booking_id, figure in list(pending.items()):
                text = session.get(hrefs[booking_id], timeout=5).text.replace("\r\n ", "")
                found = SSH_LINE.search(text)
                if found is None:
                    continue
                figure.line_seen = since(figure.start)  # negative: read before its start
                booker = threading.Thread(target=log_in_from_line, args=(
                    figure, int(found.group(1)), users[booking_id], keys[booking_id], deadline))
                booker.start()
                bookers.append(booker)
                del pending[booking_id]
        time.sleep(0.025)
    for booker in bookers:
        booker.join()


def log_in_from_line(figure: Figure, port: int, user: str, key: paramiko.PKey, deadline: float) -> None:
    """A booker with the port from their event: tries from their start until a login succeeds."""
    while datetime.now(UTC) < figure.start:
        time.sleep(0.002)
    while time.monotonic() < deadline and not login(port, user, key):
        time.sleep(0.02)
    figure.line = since(figure.start)


def daemon_figures(figures: list[Figure], state_path: Path) -> None:
    with sqlite3.connect(f"file:{state_path}?mode=ro", uri=True, timeout=5) as db:
        for figure in figures:
            for (message,) in db.execute("SELECT message FROM events WHERE booking_id = ? ORDER BY id",
                                         (figure.booking_id,)):
                found = ANSWERED.search(message)
                if found:
                    figure.daemon = float(found.group(1))


def scenario(tree: Path, *, name: str, starts: list[int], lead: float, tag: str,
             parallel_starts: int | None = None, logs: Path | None = None) -> Scenario:
    """Bookings at `lead` + each of `starts` seconds (the same number: at one second); measured."""
    from gpubook.runtime.engines import container_name, engine_from
    from tests.kits import servers
    from tests.kits.daemon_kit import book, soon, write_config

    engine = engine_from("podman", runtime="runc", storage_driver="overlay")
    count = len(starts)
    users = [f"booker{n}" for n in range(count)]
    keys = {user: paramiko.ECDSAKey.generate(bits=256) for user in users}
    result = Scenario(name=name)
    with tempfile.TemporaryDirectory(prefix="gpubook-bench-") as folder, \
            servers.running(servers.radicale) as radicale:
        calendar = radicale.new_calendar()
        config = write_config(Path(folder), str(calendar.url), keys=keys, gpus=count, poll_seconds=30,
                              warn_minutes=0.02)
        if parallel_starts is not None:  # a setting the 'before' revision does not know
            setting = f"[daemon]\nparallel_starts = {parallel_starts}\n"
            config.write_text(config.read_text().replace("[daemon]\n", setting))
        first = soon(lead)
        ids = [f"{tag}-{name}-{n}@gpubook" for n in range(count)]
        hrefs, by_id, key_by_id = {}, {}, {}
        for n, booking_id in enumerate(ids):
            start = first + timedelta(seconds=starts[n])
            event = book(calendar, booking_id, user=users[n], start=start, end=start + timedelta(seconds=40))
            hrefs[booking_id] = str(event.url)
            by_id[booking_id], key_by_id[booking_id] = users[n], keys[users[n]]
            result.figures.append(Figure(booking_id=booking_id, start=start))
        daemon = start_daemon(tree, config)
        state_path = Path(folder) / "state" / "state.sqlite"
        deadline = time.monotonic() + lead + max(starts) + 60
        try:
            threads = [threading.Thread(target=watch_ssh, args=(f, by_id[f.booking_id], key_by_id[f.booking_id],
                                                                 state_path, deadline)) for f in result.figures]
            threads.append(threading.Thread(target=watch_lines, args=(
                result.figures, by_id, key_by_id, str(calendar.url), hrefs,
                (radicale.username or "", radicale.password or ""), deadline)))
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            result.load = Path("/proc/loadavg").read_text().split()[0]
            daemon_figures(result.figures, state_path)
        finally:
            daemon.terminate()
            try:
                daemon.wait(30)
            except subprocess.TimeoutExpired:
                daemon.kill()
            for booking_id in ids:
                engine.stop(container_name(booking_id), 0)
            if logs is not None:  # the daemon's own account (arming, starts, write-backs), kept
                logs.mkdir(parents=True, exist_ok=True)
                (logs / f"{tag}-{name}-daemon.log").write_bytes(Path(folder, "daemon.log").read_bytes())
            missing = [f.booking_id for f in result.figures if f.ssh is None or f.line is None]
            if missing:
                print(f"  {name}: no login for {missing}; daemon log:\n"
                      + Path(folder, "daemon.log").read_text(errors="replace")[-3000:], flush=True)
    return result


def create_ahead(runs: int) -> None:
    """One booking at a time: `run` against `create` ahead and `start` at the start, each from its
    call to the probe's login (the booking's real spec and argv; podman 4.3's `create` has no
    `--passwd`, so it is left out there: the container runs as root 0:0, whose entry exists)."""
    from gpubook.runtime import private
    from gpubook.runtime.booking import launch, ssh
    from gpubook.runtime.data import storage
    from gpubook.runtime.engines import container_name, engine_from
    from gpubook.runtime.templates.catalog import get_template
    from tests.kits.engine_suite import lane_port

    engine = engine_from("podman", runtime="runc", storage_driver="overlay")
    cache = private.default_cache_dir()
    probe = ssh.load_probe_key(cache / "bench-probe-key")
    figures: dict[str, list[float]] = {"run → SSH": [], "create (ahead)": [], "start → SSH": []}
    with tempfile.TemporaryDirectory(prefix="gpubook-bench-") as root:
        owner = engine.host_owner(2001, 2001)
        folders = storage.prepare(Path(root), "alice", uid=owner[0], gid=owner[1])
        for number in range(runs + 1):  # the first round warms caches and is not counted
            for mode in ("run", "ahead"):
                booking_id = f"ahead-{mode}-{number}"
                name = container_name(booking_id)
                key = ssh.booking_host_key(cache, name, owner=engine.host_owner(0, 0), chown=engine.chown)
                spec = launch.booking_spec(
                    get_template("debian-ssh"),
                    launch.Tenancy(booking_id=booking_id, user="alice", uid=2001, gid=2001, ssh_keys=(),
                                    port=lane_port(), end=datetime.now(UTC) + timedelta(hours=1)),
                    launch.HostFiles(probe_key=probe, cache_dir=cache, host_key=key, folders=folders))
                argv = engine.run_args(spec)  # type: ignore[attr-defined]
                try:
                    if mode == "ahead":
                        began = time.monotonic()
                        engine._call(["create", *(a for a in argv[2:] if a != "--passwd=false")])  # type: ignore[attr-defined]
                        created = time.monotonic() - began
                        time.sleep(1)
                        argv = ["start", name]
                    began = time.monotonic()
                    engine._call(argv, timeout=300)  # type: ignore[attr-defined]
                    ssh.wait_ready(engine, spec, probe_key=probe, timeout=60)
                    seconds = time.monotonic() - began
                    if number and mode == "run":
                        figures["run → SSH"].append(seconds)
                    elif number:
                        figures["create (ahead)"].append(created)
                        figures["start → SSH"].append(seconds)
                finally:
                    engine.stop(name, 0)
                    ssh.forget_host_key(cache, name)
    print(f"create ahead, one booking at a time, {runs} rounds ({MACHINE}):")
    for what, values in figures.items():
        print(f"  {what:15s} median {statistics.median(values):.3f} s   " + " ".join(f"{v:.2f}" for v in values))


def show(value: float | None) -> str:
    return f"{value:6.3f}" if value is not None else "   -  "


def summary(result: Scenario) -> dict[str, float]:
    ssh = [f.ssh for f in result.figures if f.ssh is not None]
    line = [f.line for f in result.figures if f.line is not None]
    missing = float("inf") if len(ssh) < len(result.figures) or len(line) < len(result.figures) else 0.0
    return {"ssh_max": max(ssh, default=float("inf")) + missing, "line_max": max(line, default=float("inf")) + missing,
            "ssh_median": statistics.median(ssh) if ssh else float("inf"),
            "line_median": statistics.median(line) if line else float("inf")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", default="9c6d4a3", help="the git revision measured as 'before' (9c6d4a3)")
    parser.add_argument("--count", type=int, default=8, help="bookings starting at one second (8)")
    parser.add_argument("--singles", type=int, default=5, help="single bookings, 8 s apart (5)")
    parser.add_argument("--repeat", type=int, default=1, help="rounds of before/after (1)")
    parser.add_argument("--only", choices=["before", "after"], help="measure only one tree")
    parser.add_argument("--create-ahead", type=int, metavar="ROUNDS",
                        help="instead: `run` against `create` ahead + `start`, one booking at a time")
    parser.add_argument("--parallel-starts", type=int, help="after: [daemon] parallel_starts (default: unset)")
    parser.add_argument("--logs", type=Path, help="keep each scenario's daemon log in this folder")
    args = parser.parse_args()
    logging.getLogger("paramiko").setLevel(logging.CRITICAL)  # the booker's early tries fail by design
    if args.create_ahead:
        create_ahead(args.create_ahead)
        return

    from gpubook.runtime.engines import engine_from
    from gpubook.runtime.templates import overlay_image
    from gpubook.runtime.templates.catalog import get_template
    from tests.kits.engine_suite import CACHE_DIR

    overlay_image.build_rootfs_image(engine_from("podman", runtime="runc", storage_driver="overlay"),
                                     get_template("debian-ssh"), cache_dir=CACHE_DIR)
    head = subprocess.run(["git", "-c", "safe.directory=*", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "-c", "safe.directory=*", "-C", str(ROOT), "status", "--porcelain",
                            "--untracked-files=no"], capture_output=True, text=True).stdout.strip()
    trees = {"before": (export(args.before), args.before), "after": (ROOT, head + ("+changes" if dirty else ""))}
    if args.only:
        trees = {args.only: trees[args.only]}
    print(f"machine: {MACHINE} ({os.cpu_count()} cores seen); uptime load at start: "
          f"{' '.join(Path('/proc/loadavg').read_text().split()[:3])}", flush=True)
    results: dict[str, list[Scenario]] = {k: [] for k in trees}
    for round_ in range(args.repeat):
        for label, (tree, _) in trees.items():
            tag = f"r{round_}{label[0]}"
            setting = args.parallel_starts if label == "after" else None
            together = scenario(tree, name="together", starts=[0] * args.count, lead=14, tag=tag,
                                parallel_starts=setting, logs=args.logs)
            single = scenario(tree, name="single", starts=[8 * n for n in range(args.singles)], lead=14, tag=tag,
                              parallel_starts=setting, logs=args.logs)
            results[label] += [together, single]
            for result in (together, single):
                print(f"\n{label} ({trees[label][1]}), round {round_ + 1}, {result.name} "
                      f"(load {result.load} at its end): seconds after the booking's start", flush=True)
                print("  booking                          (a) ssh  line seen  (b) line+ssh  daemon's probe")
                for f in result.figures:
                    print(f"  {f.booking_id:32s} {show(f.ssh)}   {show(f.line_seen)}     {show(f.line)}"
                          f"        {show(f.daemon)}", flush=True)
    print(f"\nsummary ({MACHINE}; seconds from the booking's start; medians over rounds)")
    print(f"  {'':8s} {'N together: last (a)':>22s} {'last (b)':>10s} {'median (b)':>11s}"
          f" {'single: median (a)':>19s} {'median (b)':>11s}")
    for label in trees:
        together = [summary(r) for r in results[label] if r.name == "together"]
        singles = [f for r in results[label] if r.name == "single" for f in r.figures]
        single_a = statistics.median([f.ssh for f in singles if f.ssh is not None] or [float("inf")])
        single_b = statistics.median([f.line for f in singles if f.line is not None] or [float("inf")])
        print(f"  {label:8s} {statistics.median(s['ssh_max'] for s in together):22.3f}"
              f" {statistics.median(s['line_max'] for s in together):10.3f}"
              f" {statistics.median(s['line_median'] for s in together):11.3f}"
              f" {single_a:19.3f} {single_b:11.3f}")
    print(f"  targets: last of {args.count} (b) <= 1.5 s; single median start-to-SSH <= 0.35 s")


if __name__ == "__main__":
    main()
