"""A thousand bookings through one daemon (issue 42, part 1): does anything grow with each booking?

    PYTHONPATH=. python bench/soak.py [--bookings 1000] [--seed 42] [--sample-every 100] [--out DIR]

Run as an account with rootless podman and the debian-ssh image (the test lanes' accounts have both). A
real `gpubook run` on rootless podman with 8 declared GPUs (no GPU here: the containers get none) reads
a real Radicale. The bookings are 1 to 3 minutes long, up to 8 at once (each names its GPU), in the
daemon's own time: the bench tells the daemon its clock (tests/kits/told_clock.py) and moves it from one
booking boundary to the next once the daemon has caught up, so that only the waiting is compressed;
every container start, stop, SSH probe and write-back is real. Of the bookings, about 8 % are cancelled
before their start, 8 % moved (booked 30 s later, then moved to their slot), 8 % extended while they
run, 3 % refused (9 GPUs asked of 8), and every tenth is logged into by SSH at its start; the others are
no-shows (nobody logs in, as the quota and release policies are off).

Every `--sample-every` bookings done (ended, cancelled or refused), it samples the daemon's RSS, open
file descriptors and threads (/proc), the state database's size (with its WAL), the daemon's log, the
events' sizes (each ended booking's gpubook block), and podman's containers and volumes. At the end it
checks what must be left behind: no container, no SSH port held, no per-booking folder of the daemon's,
no forwarder process.

Pass criteria (`judge`): after the first `--sample-every` bookings, no figure grows by more than 5 % per
further `--sample-every` (the state database and the log grow by design, with a retention rule:
docs/guides/operate.md, "What grows and what is kept"); 0 missed starts; nothing left behind; every
ended booking's block the same number of lines whatever its history. It prints the table and the
verdict, and writes soak.json (and soak.png with matplotlib) into `--out`.

tests/test_soak.py runs the short form (100 bookings, a sample every 25) in the suite.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import paramiko  # noqa: E402

GPUS = 8
USERS = tuple(f"user{n}" for n in range(GPUS))  # one per GPU lane: no user ever waits on another
STEP = 15  # seconds: every boundary is a multiple of it in the daemon's time
AHEAD = 300  # seconds: a booking is saved this long before its start (in the daemon's time)
LOGIN_SECONDS = 15.0  # a booker's client retrying its login at the start
CATCH_UP = 120.0  # real seconds the daemon gets to catch up with a boundary before it counts as missed
GROWTH_LIMIT = 0.05  # per `sample_every` bookings, after the first
GAP = timedelta(days=8)  # quiet days after each `sample_every` bookings: more than the daemon's window back
BLOCK = re.compile(r"--- gpubook ---\n(.*?)\n--- end gpubook ---", re.S)
KINDS = (("plain", 73), ("cancel", 8), ("move", 8), ("extend", 8), ("refuse", 3))


@dataclass
class Planned:
    """One booking of the soak, in the daemon's time: where it ends up, and what happens to it first."""

    number: int
    uid: str
    user: str
    kind: str
    start: datetime
    end: datetime
    booked_at: datetime  # saved into the calendar
    edit_at: datetime | None = None  # cancelled, moved or extended then
    first_start: datetime | None = None  # a move's times before it (booked there)
    first_end: datetime | None = None
    final_end: datetime | None = None  # an extension's end
    gpu: int = 0  # its lane: the GPU it names (a booking moved earlier would otherwise meet GPUs the
    # daemon gave others for later, and rightly be refused: a move is a new request)
    login: bool = False
    saved: bool = False
    edited: bool = False
    ran: bool = False  # seen running when due
    missed: bool = False

    def times(self, at: datetime) -> tuple[datetime, datetime] | None:
        """Its slot as the calendar has it at `at` (None: not in the calendar, or not to run at all)."""
        if self.kind == "refuse" or not self.saved:
            return None
        if self.kind == "cancel" and self.edited:
            return None
        if self.kind == "move" and not self.edited:
            return self.first_start, self.first_end  # type: ignore[return-value]
        if self.kind == "extend" and self.edited:
            return self.start, self.final_end  # type: ignore[return-value]
        return self.start, self.end

    def due(self, at: datetime) -> bool:
        slot = self.times(at)
        return slot is not None and slot[0] <= at < slot[1]

    def done(self, at: datetime) -> bool:
        if self.kind == "refuse":
            return self.saved
        if self.kind == "cancel":
            return self.edited
        slot = self.times(at)
        return slot is not None and at >= slot[1]

    def moments(self) -> list[datetime]:
        found = [self.booked_at, self.start, self.end]
        found += [m for m in (self.edit_at, self.first_start, self.first_end, self.final_end) if m is not None]
        return found


def plan(count: int, *, origin: datetime, seed: int, gap_every: int = 0) -> list[Planned]:
    """`count` bookings on 8 GPU lanes from `origin`, each kind at its share, reproducible by `seed`;
    every `gap_every` bookings the lab is quiet for GAP (a lab's weeks between busy days: what ended
    leaves the daemon's window, as it does over months)."""
    chosen = random.Random(seed)
    lanes = [origin] * GPUS
    kinds, weights = zip(*KINDS, strict=True)
    planned = []
    for number in range(count):
        if gap_every and number and number % gap_every == 0:
            lanes = [max(lanes) + GAP] * GPUS
        kind = chosen.choices(kinds, weights)[0]
        lane = min(range(GPUS), key=lambda index: lanes[index])
        start = lanes[lane] + timedelta(seconds=STEP * chosen.choice((0, 1, 2)))
        end = start + timedelta(seconds=STEP * chosen.randint(4, 12))
        booked = Planned(number, f"soak-{number:04d}@bench", USERS[lane], kind, start, end,
                         booked_at=max(origin - timedelta(seconds=AHEAD), start - timedelta(seconds=AHEAD)),
                         gpu=lane, login=number % 10 == 0 and kind in ("plain", "extend", "move"))
        reserved = end
        if kind == "cancel":
            booked.edit_at = start - timedelta(seconds=2 * STEP)
        elif kind == "move":
            later = timedelta(seconds=2 * STEP)
            booked.first_start, booked.first_end = start + later, end + later
            booked.edit_at = start - timedelta(seconds=3 * STEP)
            reserved = booked.first_end
        elif kind == "extend":
            booked.final_end = end + timedelta(seconds=STEP * chosen.choice((2, 3, 4)))
            booked.edit_at = start + timedelta(seconds=STEP)
            reserved = booked.final_end
        elif kind == "refuse":
            reserved = lanes[lane]  # asks for 9 GPUs: refused when read, takes no lane
        lanes[lane] = reserved
        planned.append(booked)
    return planned


@dataclass
class Sample:
    done: int
    at: float  # real seconds since the soak began
    rss_mb: float
    fds: int
    threads: int
    database_kb: float
    log_kb: float
    event_bytes_max: int  # the largest ended booking's event (its whole iCalendar text)
    block_lines: list[int]  # distinct line counts of the ended bookings' gpubook blocks
    containers: int  # podman ps -a, gpubook's
    volumes: int


@dataclass
class Result:
    bookings: int
    samples: list[Sample] = field(default_factory=list)
    missed: list[str] = field(default_factory=list)
    left: dict[str, object] = field(default_factory=dict)
    seconds: float = 0.0
    machine: str = ""


def login_soon(port: int, user: str, key: paramiko.PKey) -> paramiko.SSHClient | None:
    """The booker's login, tried as a client does for LOGIN_SECONDS (one attempt was reset now and then
    right at the start: 4 of 100 in the first 1,000 run; the daemon's own probe had answered)."""
    from tests.kits.daemon_kit import try_login

    deadline = time.monotonic() + LOGIN_SECONDS
    while (client := try_login(port, user, key)) is None and time.monotonic() < deadline:
        time.sleep(0.5)
    return client


def proc_figures(pid: int) -> tuple[float, int, int]:
    status = Path(f"/proc/{pid}/status").read_text()
    rss = int(re.search(r"^VmRSS:\s+(\d+) kB", status, re.M).group(1)) / 1024  # type: ignore[union-attr]
    threads = int(re.search(r"^Threads:\s+(\d+)", status, re.M).group(1))  # type: ignore[union-attr]
    return rss, len(os.listdir(f"/proc/{pid}/fd")), threads


def podman_count(*argv: str) -> int:
    done = subprocess.run(["podman", *argv], capture_output=True, text=True, timeout=120, check=False)
    return len([line for line in done.stdout.split() if line.startswith("gpubook-") or argv[0] == "volume"])


def running_now(state_dir: Path) -> set[str] | None:
    """The bookings the daemon's last pass saw running (not armed), from its status file."""
    try:
        data = json.loads((state_dir / "daemon-status.json").read_text())
    except (OSError, ValueError):
        return None
    return {item["booking"] for host in data.get("hosts", ()) for item in host.get("running", ())
            if item.get("state") == "running"}


def event_sizes(calendar, planned: list[Planned], at: datetime) -> tuple[int, list[int]]:  # type: ignore[no-untyped-def]
    """The largest ended booking's event and the distinct line counts of ended bookings' blocks (those
    whose end is written back: its block begins "ended:")."""
    ended = {p.uid for p in planned if p.kind in ("plain", "move", "extend") and p.done(at)}
    biggest, lines = 0, set()
    for item in calendar.events():
        text = item.data
        uid = re.search(r"^UID:(.*)$", text, re.M)
        if uid is None or uid.group(1).strip() not in ended:
            continue
        unfolded = re.sub(r"\r?\n[ \t]", "", text).replace("\\n", "\n").replace("\\,", ",")
        block = BLOCK.search(unfolded)
        if block is None or not block.group(1).startswith("ended:"):
            continue  # its end not written back yet: judged at a later sample
        biggest = max(biggest, len(text.encode()))
        lines.add(len(block.group(1).splitlines()))
    return biggest, sorted(lines)


def judge(result: Result, *, limit: float = GROWTH_LIMIT) -> list[str]:
    """What fails the soak's pass criteria, one sentence each (empty: it passed).

    Growth is judged against the sample after the first `sample_every` bookings (the base): the k-th
    sample after it may hold at most base x (1 + limit)^k. Descriptors and threads move with what runs
    at the moment of the sample (an SSH probe's socket, a lane's thread, up to 8 bookings at once), so
    those two get 2 per GPU more on top: a leak of one per booking still shows as 50 per 25 bookings.
    The state database and the log grow by design and are bounded by retention rules instead
    (docs/guides/operate.md, "What grows, and what is kept")."""
    problems = [f"missed start: {uid}" for uid in result.missed]
    samples = result.samples
    if len(samples) < 3:
        problems.append(f"only {len(samples)} samples: too few to judge growth")
        return problems
    base = samples[1]
    for k, sample in enumerate(samples[2:], start=1):
        for name in ("rss_mb", "fds", "threads", "event_bytes_max"):
            slack = 2 * GPUS if name in ("fds", "threads") else 0
            allowed = getattr(base, name) * (1 + limit) ** k + slack
            if getattr(sample, name) > allowed:
                problems.append(f"{name} grew from {getattr(base, name)} (at {base.done} bookings) to "
                                f"{getattr(sample, name)} (at {sample.done}): more than {limit:.0%} per "
                                f"{base.done - samples[0].done} bookings")
    for sample in samples:
        if sample.containers > 2 * GPUS or sample.volumes > 0:
            problems.append(f"{sample.containers} containers and {sample.volumes} volumes at {sample.done} bookings "
                            f"(at most {GPUS} running and {GPUS} run ahead, no volume)")
    lines = sorted({n for s in samples for n in s.block_lines})
    if len(lines) > 1:
        problems.append(f"ended bookings' blocks differ in length: {lines} lines")
    problems += [f"left behind: {what}: {value}" for what, value in result.left.items() if value]
    return problems


def soak(count: int, *, folder: Path, seed: int, sample_every: int, say=print) -> Result:  # type: ignore[no-untyped-def]
    from gpubook.runtime.engines import container_name
    from tests.kits import servers
    from tests.kits.daemon_kit import DaemonProcess, book, write_config
    from tests.kits.faults_kit import Booked, Calendar
    from tests.kits.told_clock import ToldClock

    keys = {user: paramiko.ECDSAKey.generate(bits=256) for user in USERS}
    result = Result(bookings=count, machine=f"{os.cpu_count()} cores, {os.uname().release}")
    began = time.monotonic()
    with servers.running(servers.radicale) as server:
        calendar = Calendar(server.new_calendar())
        config = write_config(folder, str(calendar.calendar.url), keys=keys, gpus=GPUS, poll_seconds=60,
                              warn_minutes=0.1)
        state_dir = folder / "state"
        clock = ToldClock(folder)
        origin = clock.soon(60).replace(second=0) + timedelta(minutes=1)
        planned = plan(count, origin=origin, seed=seed, gap_every=sample_every)
        daemon = DaemonProcess(config, env=clock.env()).start()
        try:
            assert daemon.process is not None
            pid = daemon.process.pid
            # Its first pass written: from here on it has its SIGUSR1 handler (before, the signal ends it).
            while not (state_dir / "daemon-status.json").is_file():
                if daemon.process.poll() is not None or time.monotonic() - began > CATCH_UP:
                    raise RuntimeError(f"the daemon did not make its first pass: {daemon.tail()}")
                time.sleep(0.2)
            next_sample = sample_every
            while True:
                at = clock.now()
                for booked in planned:  # the bookers' side: saves and edits that are due
                    if not booked.saved and booked.booked_at <= at:
                        start, end = (booked.first_start, booked.first_end) if booked.kind == "move" else \
                            (booked.start, booked.end)
                        if booked.kind == "refuse":
                            book(calendar.calendar, booked.uid, user=booked.user, start=start, end=end, gpus="9")
                        else:
                            calendar.create(Booked(booked.uid, booked.user, start, end,  # type: ignore[arg-type]
                                                   text=f"gpus: {booked.gpu},\n", tag=booked.user))
                        booked.saved = True
                    if booked.saved and not booked.edited and booked.edit_at is not None and booked.edit_at <= at:
                        if booked.kind == "cancel":
                            calendar.delete(booked.uid)
                        elif booked.kind == "move":
                            calendar.move(booked.uid, start=booked.start, end=booked.end)
                        else:
                            calendar.move(booked.uid, start=booked.start, end=booked.final_end)  # type: ignore[arg-type]
                        booked.edited = True
                # The daemon catches up: what is due runs, nothing else does.
                deadline = time.monotonic() + CATCH_UP
                while True:
                    at = clock.now()
                    due = {b.uid for b in planned if b.due(at)}
                    seen = running_now(state_dir)
                    if seen is not None and seen == due:
                        break
                    if daemon.process.poll() is not None:
                        raise RuntimeError(f"the daemon exited ({daemon.process.returncode}): {daemon.tail()}")
                    if time.monotonic() > deadline:
                        for uid in due - (seen or set()):
                            if uid not in result.missed:
                                result.missed.append(uid)
                        say(f"soak: at {at:%H:%M:%S} the daemon has {sorted(seen or ())}, due {sorted(due)}")
                        break
                    daemon.signal(signal.SIGUSR1)  # a pass now (as a told step does)
                    time.sleep(0.5)
                for booked in planned:
                    if booked.due(at) and not booked.ran:
                        booked.ran = True
                        if booked.login:
                            port = json.loads((state_dir / "daemon-status.json").read_text())
                            found = [i["port"] for h in port["hosts"] for i in h["running"]
                                     if i["booking"] == booked.uid]
                            client = login_soon(found[0], booked.user, keys[booked.user]) if found else None
                            if client is None:
                                result.missed.append(f"{booked.uid} (no SSH login within {LOGIN_SECONDS:g} s)")
                            else:
                                client.close()
                done = sum(1 for b in planned if b.done(at))
                if done >= next_sample or (done == count and (not result.samples or result.samples[-1].done < done)):
                    rss, fds, threads = proc_figures(pid)
                    biggest, lines = event_sizes(calendar.calendar, planned, at)
                    database = sum(p.stat().st_size for p in state_dir.glob("state.sqlite*")) / 1024
                    sample = Sample(done=done, at=round(time.monotonic() - began, 1), rss_mb=round(rss, 1), fds=fds,
                                    threads=threads, database_kb=round(database, 1),
                                    log_kb=round(daemon.log.stat().st_size / 1024, 1), event_bytes_max=biggest,
                                    block_lines=lines, containers=podman_count("ps", "-a", "--format", "{{.Names}}"),
                                    volumes=podman_count("volume", "ls", "-q"))
                    result.samples.append(sample)
                    say(f"soak: {json.dumps(asdict(sample))}")
                    next_sample = (done // sample_every + 1) * sample_every
                if done == count:
                    break
                upcoming = [m for b in planned for m in b.moments() if m > at]
                if not upcoming:
                    break
                clock.advance_to(min(upcoming), daemon)
            # Left behind, once every booking is over (the daemon still running, as it would be).
            time.sleep(2)
            result.left = leftovers(state_dir, folder, container_name, planned)
        finally:
            daemon.stop()
    result.seconds = round(time.monotonic() - began, 1)
    return result


def leftovers(state_dir: Path, folder: Path, container_name, planned: list[Planned]) -> dict[str, object]:  # type: ignore[no-untyped-def]
    names = {container_name(b.uid) for b in planned}
    listed = subprocess.run(["podman", "ps", "-a", "--format", "{{.Names}}"], capture_output=True, text=True,
                            timeout=120, check=False).stdout.split()
    with sqlite3.connect(f"file:{state_dir / 'state.sqlite'}?mode=ro", uri=True) as db:
        ports = db.execute("SELECT COUNT(*) FROM ports").fetchone()[0]
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "gpubook"
    per_booking = [str(path) for path in cache.rglob("*") if any(name in path.name for name in names)]
    forwarders = subprocess.run(["pgrep", "-u", str(os.getuid()), "-f", "rootlessport|slirp4netns"],
                                capture_output=True, text=True, timeout=30, check=False).stdout.split()
    return {"containers": sorted(set(listed) & names), "ports held": ports, "per-booking files": per_booking[:20],
            "forwarder processes": forwarders}


def plot(result: Result, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    figure, axes = plt.subplots(2, 2, figsize=(10, 7))
    done = [s.done for s in result.samples]
    for axis, (name, label) in zip(axes.flat, (("rss_mb", "daemon RSS (MB)"), ("fds", "open fds"),
                                              ("threads", "threads"), ("database_kb", "state database (KB)")),
                                   strict=True):
        axis.plot(done, [getattr(s, name) for s in result.samples], marker="o")
        axis.set_title(label)
        axis.set_xlabel("bookings done")
        axis.set_ylim(bottom=0)
    figure.suptitle(f"gpubook soak: {result.bookings} bookings through one daemon")
    figure.tight_layout()
    figure.savefig(path, dpi=90)
    return True


def table(result: Result) -> str:
    rows = ["| bookings done | real s | RSS MB | fds | threads | state DB KB | log KB | largest event B | block lines "
            "| containers | volumes |", "| --- " * 11 + "|"]
    rows += [f"| {s.done} | {s.at} | {s.rss_mb} | {s.fds} | {s.threads} | {s.database_kb} | {s.log_kb} | "
             f"{s.event_bytes_max} | {','.join(map(str, s.block_lines))} | {s.containers} | {s.volumes} |"
             for s in result.samples]
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bookings", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--sample-every", type=int, default=100)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="gpubook-soak-") as folder:
        result = soak(args.bookings, folder=Path(folder), seed=args.seed, sample_every=args.sample_every)
    print(table(result))
    problems = judge(result)
    print(f"soak: {args.bookings} bookings in {result.seconds:.0f} s; "
          + ("PASS" if not problems else "FAIL:\n  " + "\n  ".join(problems)))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "soak.json").write_text(json.dumps(asdict(result), indent=1, default=str))
        (args.out / "soak.md").write_text(table(result) + "\n")
        plot(result, args.out / "soak.png")
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
