"""A department on one calendar server (issue 42, part 3): twenty GPU servers' daemons on one Radicale.

    PYTHONPATH=. python bench/department.py [--daemons 20] [--events 2000] [--per-calendar] [--bookings 40]
                                            [--idle 60] [--outage 120] [--seed 42] [--out DIR]

One real Radicale holds one calendar per server (gpubook's layout: each server reads its own collection),
`--events` events in all (or in each, with `--per-calendar`), written into its storage before it starts:
a year of past bookings and a tenth in the coming weeks (which each daemon accepts, writing that back,
when it starts). `--daemons` real `gpubook run` processes on default [daemon] settings (a full poll a
minute, a change check a second), each with its own calendar, state, account lock, block of ports and
page (auth none, loopback, /metrics), on 8 GPUs of tests/kits/department_kit.py's `AnsweringEngine`: a
container is an SSH server in the daemon's process, with the booking's host key, that the daemon's probe
logs in to. Everything but the container is real.

Phases, each measured:
1. **idle** (`--idle` s, once every daemon has read its calendar): Radicale's CPU (a share of one core) and
   largest RSS, every daemon's change checks a second and their mean answer time (its
   gpubook_check_duration_seconds), and the daemons' own CPU together.
2. **bookings**: `--bookings` bookings for right now saved one after another (1 to 3 s apart, each into a
   random server's calendar, through caldav): from just before the PUT to the daemon's engine start, and to
   its probe's login (the booker could log in then). Radicale's CPU meanwhile.
3. **restart**: Radicale stopped and started again at once; then one booking for now per server.
4. **outage**: one booking per server whose start falls in the middle of the outage is saved (and seen by
   its daemon), then Radicale is away for `--outage` s. Each must start on time without the calendar. After
   Radicale is back, each daemon's outage gauge must clear by itself, and one more booking for now per
   server must start. Each daemon's log must say the outage once ("calendar unreachable") and its end once.

Judged (`judge`): no booking missed (every one started and let its probe in); every daemon said the outage
once and its end once, and recovered. It prints a table and writes department.json into `--out`.
tests/test_department.py runs the short form (5 daemons, 500 events) in the suite.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import paramiko  # noqa: E402
import requests  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from bench.book_now import cpu_seconds  # noqa: E402
from bench.soak import proc_figures  # noqa: E402
from tests.kits import servers  # noqa: E402
from tests.kits.daemon_kit import DaemonProcess, event_text, lane_ports, wait_for, write_config  # noqa: E402
from tests.kits.department_kit import STARTS_ENV  # noqa: E402

GPUS = 8
PORTS_EACH = 40  # booking ports per daemon, blocks side by side in the lane's range
FUTURE_SHARE = 10  # one event in this many is in the coming weeks (accepted by its daemon at its start)
BOOKING_MINUTES = 30  # a bench booking's length: none ends while the bench runs
AHEAD = 60.0  # seconds before the outage's middle the bookings started in it are saved (all seen by then)
START_LATE = 15.0  # seconds after its start a booking known before an outage may start, and still be on time
UPCOMING = "upcoming"  # scrape's key for gpubook_bookings{state="upcoming"}
UNREACHABLE, REACHABLE = "calendar unreachable", "calendar reachable again"


@dataclass
class Server:
    """One GPU server of the department: its daemon, calendar and page."""

    number: int
    folder: Path
    calendar_url: str
    page: str
    daemon: DaemonProcess

    @property
    def name(self) -> str:
        return f"server-{self.number:02d}"


@dataclass
class Booked:
    """One booking the bench saved: when (wall time, before the PUT), into which server, starting when."""

    uid: str
    server: int
    phase: str
    saved: float
    start: float  # its start, wall time (a booking for now: a second before it was saved)
    started: float | None = None  # the engine's start
    login: float | None = None  # the probe's login: running


@dataclass
class Phase:
    """Figures of one phase: Radicale's and the daemons' CPU, checks, and the bookings' times."""

    name: str
    seconds: float = 0.0
    radicale_cpu: float | None = None  # share of one core (None: Radicale was restarted meanwhile)
    radicale_rss_mb: float = 0.0  # the largest seen
    daemons_cpu: float = 0.0  # all daemons together, share of one core
    checks_per_second: list[float] = field(default_factory=list)  # each daemon's
    check_answer_ms: list[float] = field(default_factory=list)  # each daemon's mean check request time
    pass_ms: list[float] = field(default_factory=list)  # each daemon's mean pass time
    to_start: list[float] = field(default_factory=list)  # save (or, known ahead, its start) → engine start, s
    to_running: list[float] = field(default_factory=list)  # save (or its start) → the probe's login, s


@dataclass
class Result:
    daemons: int
    events: int
    machine: str
    date: str
    phases: list[Phase] = field(default_factory=list)
    missed: list[str] = field(default_factory=list)
    said: dict[str, list[int]] = field(default_factory=dict)  # server → [unreachable lines, reachable-again lines]
    said_restart: dict[str, list[int]] = field(default_factory=dict)  # the same, through the quick restart
    recovered_s: list[float | None] = field(default_factory=list)  # each server: Radicale back → its outage gauge 0
    startup_s: float = 0.0  # every daemon started → every daemon read its calendar


# --- the calendar server ---------------------------------------------------------------------------

def past_and_future_events(folder: Path, count: int, *, server: int, now: datetime, rng: random.Random) -> None:
    """`count` events of one server's calendar, as files in Radicale's collection folder."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / ".Radicale.props").write_text('{"C:supported-calendar-component-set": "VEVENT", "tag": "VCALENDAR"}')
    for number in range(count):
        if number % FUTURE_SHARE == 0:  # in the coming weeks, at night: none starts during the bench
            start = (now + timedelta(days=2 + number % 28)).replace(hour=2, minute=0, second=0, microsecond=0)
        else:  # the year behind
            start = (now - timedelta(days=1 + rng.randrange(365))).replace(minute=0, second=0, microsecond=0)
        user = ("alice", "bob")[number % 2]
        text = event_text(f"history-{server}-{number}@department", user=user, start=start,
                          end=start + timedelta(hours=1 + number % 4), gpus=str(1 + number % 4))
        (folder / f"history-{number}.ics").write_text(text, newline="")


def cpu(pid: int) -> float:
    """The process's own CPU seconds (book_now's reading of /proc)."""
    return cpu_seconds(pid)[0]


def histogram(before: dict[str, float], after: dict[str, float], family: str) -> tuple[float, float]:
    """(observations, their seconds) of the histogram `family` between two scrapes."""
    return (after[f"{family}_count"] - before[f"{family}_count"], after[f"{family}_sum"] - before[f"{family}_sum"])


# --- the daemons -------------------------------------------------------------------------------------

def start_servers(count: int, *, folder: Path, radicale: servers.CalendarServer, keys: dict[str, paramiko.PKey],
                  starts: Path, gpus: int = GPUS) -> list[Server]:
    low, high = lane_ports()
    if (high - low + 1) < count * PORTS_EACH + count:
        raise SystemExit(f"the port range {low}-{high} is too small for {count} daemons")
    made = []
    for number in range(count):
        home = folder / f"server-{number:02d}"
        home.mkdir()
        base = low + number * PORTS_EACH
        page_port = high - number  # the pages' ports from the top of the range, the bookings' from the bottom
        url = f"{radicale.base_url}/test/server-{number:02d}/"
        config = write_config(home, url, keys=keys, gpus=gpus, engine="answering",
                              ports=(base, base + PORTS_EACH - 1), poll_seconds=60)
        text = config.read_text().replace('name = "127.0.0.1"', f'name = "server-{number:02d}"')
        text += f'\n[web]\nenabled = true\nlisten = "127.0.0.1:{page_port}"\nauth = "none"\nmetrics = true\n'
        config.write_text(text)
        run = home / "run"  # the account's daemon lock lives here: one account, one lock per daemon
        run.mkdir(mode=0o700)
        daemon = DaemonProcess(config, env={STARTS_ENV: str(starts), "XDG_RUNTIME_DIR": str(run)}).start()
        made.append(Server(number, home, url, f"http://127.0.0.1:{page_port}", daemon))
    return made


def scrape(server: Server) -> dict[str, float]:
    """The figures the bench reads from one daemon's /metrics (absent ones are 0)."""
    wanted = {"gpubook_check_duration_seconds_count", "gpubook_check_duration_seconds_sum",
              "gpubook_pass_duration_seconds_count", "gpubook_pass_duration_seconds_sum",
              "gpubook_last_poll_success_timestamp_seconds", "gpubook_calendar_outage"}
    try:
        answer = requests.get(server.page + "/metrics", timeout=10)
        answer.raise_for_status()
    except requests.RequestException:
        return {}
    figures = dict.fromkeys([*wanted, UPCOMING], 0.0)
    for family in text_string_to_metric_families(answer.text):
        for sample in family.samples:
            if sample.name in wanted:
                figures[sample.name] = sample.value
            elif sample.name == "gpubook_bookings" and sample.labels.get("state") == "upcoming":
                figures[UPCOMING] = sample.value
    return figures


class Meter:
    """CPU of Radicale and of the daemons between `begin` and `end`, Radicale's RSS sampled by `tick`."""

    def __init__(self, radicale: servers.CalendarServer, department: list[Server]) -> None:
        self.radicale, self.department = radicale, department

    def begin(self, name: str) -> None:
        self.phase = Phase(name)
        self.began = time.monotonic()
        self.radicale_pid = self.radicale.process.pid  # type: ignore[union-attr]
        self.radicale_cpu = cpu(self.radicale_pid)
        self.daemons_cpu = sum(cpu(s.daemon.process.pid) for s in self.department)  # type: ignore[union-attr]
        self.scrapes = [scrape(s) for s in self.department]

    def tick(self) -> None:
        try:
            rss = proc_figures(self.radicale.process.pid)[0]  # type: ignore[union-attr]
            self.phase.radicale_rss_mb = max(self.phase.radicale_rss_mb, rss)
        except (OSError, AttributeError):
            pass

    def end(self) -> Phase:
        phase = self.phase
        phase.seconds = time.monotonic() - self.began
        if self.radicale.process is not None and self.radicale.process.pid == self.radicale_pid:
            phase.radicale_cpu = (cpu(self.radicale_pid) - self.radicale_cpu) / phase.seconds
        phase.daemons_cpu = (sum(cpu(s.daemon.process.pid) for s in self.department)  # type: ignore[union-attr]
                             - self.daemons_cpu) / phase.seconds
        for server, before in zip(self.department, self.scrapes, strict=True):
            after = scrape(server)
            if not before or not after:
                continue
            checks, spent = histogram(before, after, "gpubook_check_duration_seconds")
            phase.checks_per_second.append(checks / phase.seconds)
            if checks:
                phase.check_answer_ms.append(1000 * spent / checks)
            passes, spent = histogram(before, after, "gpubook_pass_duration_seconds")
            if passes:
                phase.pass_ms.append(1000 * spent / passes)
        return phase


# --- bookings --------------------------------------------------------------------------------------

class Department:
    def __init__(self, radicale: servers.CalendarServer, department: list[Server], starts: Path, seed: int) -> None:
        self.radicale, self.department, self.starts = radicale, department, starts
        self.rng = random.Random(seed)
        self.booked: list[Booked] = []

    def book(self, server: Server, phase: str, *, start: datetime | None = None) -> Booked:
        now = time.time()
        begins = start or datetime.fromtimestamp(now, UTC).replace(microsecond=0) - timedelta(seconds=1)
        uid = f"{phase}-{len(self.booked)}@department"
        client = self.radicale.client()
        calendar = client.calendar(url=server.calendar_url)
        calendar.save_event(event_text(uid, user="alice", start=begins,
                                       end=begins + timedelta(minutes=BOOKING_MINUTES), gpus="1"))
        booked = Booked(uid, server.number, phase, saved=now, start=begins.timestamp())
        self.booked.append(booked)
        return booked

    def least_booked(self) -> Server:
        """A random one of the servers with the fewest bench bookings: no server runs out of its GPUs (a
        booking refused for want of one would be no measure of the calendar server)."""
        counts = {s.number: sum(b.server == s.number for b in self.booked) for s in self.department}
        fewest = min(counts.values())
        return self.rng.choice([s for s in self.department if counts[s.number] == fewest])

    def read_starts(self) -> None:
        """The engine's starts and the probes' logins so far, into the bookings."""
        found: dict[str, dict[str, float]] = {}
        for line in self.starts.read_text().splitlines() if self.starts.exists() else []:
            record = json.loads(line)
            found.setdefault(record["booking"], {}).setdefault(record["kind"], record["at"])
        for booked in self.booked:
            times = found.get(booked.uid, {})
            booked.started, booked.login = times.get("start"), times.get("login")

    def wait_running(self, bookings: list[Booked], *, timeout: float) -> None:
        def all_in() -> bool:
            self.read_starts()
            return all(b.login is not None for b in bookings)

        try:
            wait_for("every booking running", all_in, timeout=timeout, interval=0.5)
        except AssertionError:
            pass  # the missed ones are counted by the caller

    def times(self, phase: Phase, bookings: list[Booked]) -> list[str]:
        """Each booking's times into the phase; the uids of those missed."""
        missed = []
        for booked in bookings:
            origin = max(booked.saved, booked.start)  # for now: the save; known ahead: its start
            if booked.login is None or booked.started is None:
                missed.append(booked.uid)
                continue
            phase.to_start.append(booked.started - origin)
            phase.to_running.append(booked.login - origin)
        return missed


def said_lines(server: Server, since: int) -> tuple[int, int]:
    text = server.daemon.log.read_bytes()[since:].decode(errors="replace")
    return text.count(UNREACHABLE), text.count(REACHABLE)


def run(*, daemons: int, events: int, bookings: int, idle: float, outage: float, seed: int, folder: Path,
        per_calendar: bool = False, say=print) -> Result:  # type: ignore[no-untyped-def]
    """The bench (see the module's docstring); `per_calendar`: `events` in each calendar, not in all."""
    rng = random.Random(seed)
    keys = {user: paramiko.ECDSAKey.generate() for user in ("alice", "bob")}
    now = datetime.now(UTC)
    storage = folder / "radicale"
    root = storage / "collections" / "collection-root" / "test"
    for number in range(daemons):
        count = events if per_calendar else events // daemons + (number < events % daemons)
        past_and_future_events(root / f"server-{number:02d}", count, server=number, now=now, rng=rng)
    events = events * daemons if per_calendar else events
    radicale = servers.radicale(storage).start()
    starts = folder / "starts.jsonl"
    result = Result(daemons=daemons, events=events, machine=f"{platform.node()} ({os.cpu_count()} cores)",
                    date=now.date().isoformat())
    department: list[Server] = []
    try:
        began = time.monotonic()
        # Enough GPUs that none is refused for want of one: the bookings spread evenly, and three more each.
        gpus = max(GPUS, -(-bookings // daemons) + 3)
        department = start_servers(daemons, folder=folder, radicale=radicale, keys=keys, starts=starts, gpus=gpus)
        for server in department:
            wait_for(f"{server.name} read its calendar",
                     lambda s=server: scrape(s).get("gpubook_last_poll_success_timestamp_seconds", 0) > 0,  # type: ignore[misc]
                     timeout=300, interval=1, daemon=server.daemon)
        result.startup_s = time.monotonic() - began
        say(f"{daemons} daemons read their calendars {result.startup_s:.0f} s after they were started")
        meter = Meter(radicale, department)
        plant = Department(radicale, department, starts, seed)

        meter.begin("idle")
        deadline = time.monotonic() + idle
        while time.monotonic() < deadline:
            meter.tick()
            time.sleep(1)
        result.phases.append(meter.end())
        say(table_row(result.phases[-1]))

        meter.begin("bookings")
        made = []
        for _ in range(bookings):
            made.append(plant.book(plant.least_booked(), "now"))
            meter.tick()
            time.sleep(rng.uniform(1, 3))
        plant.wait_running(made, timeout=120)
        phase = meter.end()
        result.missed += plant.times(phase, made)
        result.phases.append(phase)
        say(table_row(phase))

        logs = [s.daemon.log.stat().st_size for s in department]
        meter.begin("restart")
        radicale.stop()
        radicale.start()
        made = [plant.book(server, "restart") for server in department]
        plant.wait_running(made, timeout=180)
        phase = meter.end()
        result.missed += plant.times(phase, made)
        result.phases.append(phase)
        result.said_restart = {s.name: list(said_lines(s, at)) for s, at in zip(department, logs, strict=True)}
        say(table_row(phase))

        logs = [s.daemon.log.stat().st_size for s in department]
        meter.begin("outage")
        begins = datetime.now(UTC).replace(microsecond=0) + timedelta(seconds=AHEAD + outage / 2)
        known = {s.number: scrape(s).get(UPCOMING, 0) for s in department}
        ahead = [plant.book(server, "ahead", start=begins) for server in department]
        for server in department:  # each daemon knows its booking (its change check reads it within seconds)
            wait_for(f"{server.name} knew its booking", lambda s=server: scrape(s).get(  # type: ignore[misc]
                UPCOMING, 0) > known[s.number], timeout=AHEAD, interval=0.5, daemon=server.daemon)
        radicale.stop()
        away = time.monotonic()
        while time.monotonic() - away < outage:
            time.sleep(1)
        radicale.start()
        back = time.monotonic()
        for server in department:
            try:
                wait_for(f"{server.name} recovered", lambda s=server: scrape(s).get(  # type: ignore[misc]
                    "gpubook_calendar_outage", 1) == 0, timeout=180, interval=0.5)
                result.recovered_s.append(time.monotonic() - back)
            except AssertionError:
                result.recovered_s.append(None)
        after = [plant.book(server, "after") for server in department]
        plant.wait_running([*ahead, *after], timeout=180)
        phase = meter.end()
        result.missed += plant.times(phase, [*ahead, *after])
        late = [b.uid for b in ahead if b.started is not None and b.started - b.start > START_LATE]
        result.missed += [f"{uid} (started more than {START_LATE:g} s after its start)" for uid in late]
        result.phases.append(phase)
        result.said = {s.name: list(said_lines(s, at)) for s, at in zip(department, logs, strict=True)}
        say(table_row(phase))
    finally:
        for server in department:
            server.daemon.stop()
        radicale.stop()
    return result


# --- the verdict and the table ------------------------------------------------------------------------

def judge(result: Result) -> list[str]:
    problems = [f"missed: {uid}" for uid in result.missed]
    for name, (unreachable, reachable) in result.said.items():
        if (unreachable, reachable) != (1, 1):
            problems.append(f"{name} said the outage {unreachable} time(s) and its end {reachable} time(s), "
                            "not once each")
    for name, (unreachable, reachable) in result.said_restart.items():
        if unreachable > 1 or reachable != unreachable:
            problems.append(f"{name} said a quick restart {unreachable} time(s) and its end {reachable} time(s)")
    problems += [f"server-{n:02d} did not recover by itself" for n, s in enumerate(result.recovered_s) if s is None]
    return problems


def _ms(values: list[float]) -> str:
    return f"{statistics.median(values):.0f}" if values else "-"


def _s(values: list[float], how: str) -> str:
    if not values:
        return "-"
    value = statistics.median(values) if how == "median" else max(values)
    return f"{value:.2f}"


def table_row(phase: Phase) -> str:
    cpu = "-" if phase.radicale_cpu is None else f"{phase.radicale_cpu * 100:.0f} %"
    rss = f"{phase.radicale_rss_mb:.0f}" if phase.radicale_rss_mb else "-"
    return (f"| {phase.name} | {phase.seconds:.0f} | {cpu} | {rss} | "
            f"{phase.daemons_cpu * 100:.0f} % | {_s(phase.checks_per_second, 'median')} "
            f"({min(phase.checks_per_second, default=0):.2f}–{max(phase.checks_per_second, default=0):.2f}) | "
            f"{_ms(phase.check_answer_ms)} | {_ms(phase.pass_ms)} | "
            f"{_s(phase.to_running, 'median')} / {_s(phase.to_running, 'max')} ({len(phase.to_running)}) |")


HEADER = ("| phase | s | Radicale CPU | Radicale RSS MB | daemons' CPU | checks/s per daemon, median (range) | "
          "check answer ms, median of means | pass ms, median of means | to running s, median / worst (n) |\n"
          "|---|---|---|---|---|---|---|---|---|")


def table(result: Result) -> str:
    lines = [f"{result.daemons} daemons, {result.events} events on one Radicale; {result.machine}, {result.date}; "
             f"every daemon read its calendar {result.startup_s:.0f} s after the start", "", HEADER]
    lines += [table_row(phase) for phase in result.phases]
    recovered = [s for s in result.recovered_s if s is not None]
    if recovered:
        lines.append(f"\nafter the outage: every daemon's outage cleared {min(recovered):.1f}–{max(recovered):.1f} s "
                     f"after Radicale was back")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--daemons", type=int, default=20)
    parser.add_argument("--events", type=int, default=2000)
    parser.add_argument("--bookings", type=int, default=40)
    parser.add_argument("--idle", type=float, default=60)
    parser.add_argument("--outage", type=float, default=120)
    parser.add_argument("--per-calendar", action="store_true",
                        help="--events in each server's calendar, not in all (a stress: 20 x 2,000 events)")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="department-") as scratch:
        result = run(daemons=args.daemons, events=args.events, bookings=args.bookings, idle=args.idle,
                     outage=args.outage, seed=args.seed, folder=Path(scratch), per_calendar=args.per_calendar)
    print(table(result))
    problems = judge(result)
    print("\n".join(["", "verdict: " + ("PASS" if not problems else "FAIL"), *problems]))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "department.json").write_text(json.dumps(asdict(result), indent=1))
        (args.out / "department.md").write_text(table(result) + "\n")
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
