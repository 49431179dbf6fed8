"""The fault harness (issue 26): a world of real Radicale (behind a fault proxy), rootless podman
(behind a wrapper that can hang or kill its commands) and `gpubook run` as a real process; a driver
that books, moves, shortens, cancels and re-creates events and kills containers, as bookers and
their trainings do; faults injected one at a time; the invariants checked after each recovery, and
the ones that must hold at every moment sampled all along.

bench/faults.py runs every crash point and hundreds of random faults; tests/test_faults.py runs a
seeded sample in CI. Both print the seed: `GPUBOOK_FAULT_SEED=N` replays the same choices (the
timing of a real daemon, podman and a server is never replayed exactly).
"""

from __future__ import annotations

import json
import random
import secrets
import sqlite3
import statistics
import subprocess
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from http.server import ThreadingHTTPServer
from pathlib import Path

import caldav
import icalendar
import paramiko
from caldav.lib import error as dav_error

from gpubook.runtime import crash
from gpubook.runtime.engines import ContainerInfo, Engine
from gpubook.scheduler.commands.embedded import free_port
from tests.kits import disk_full, fake_gpus, fault_images, servers
from tests.kits.clock_step import SteppedClock
from tests.kits.daemon_kit import DaemonProcess, try_login, write_config
from tests.kits.faulty_engine import FaultyEngine
from tests.kits.front import FaultFront
from tests.kits.notify_kit import HookHandler

LONG = 2  # bookings running all along (a training each, an SSH session kept open on each)
NOTICE_SECONDS = 3.0  # [daemon] notice_seconds: a cancelled or shortened running booking's notice
STOP_GRACE = 1.0  # [engine] stop_grace_seconds
CALENDAR_KINDS = ("error", "hang", "refuse", "partition")
ENGINE_VERBS = ("run", "stop", "rm", "ps", "inspect", "exec")  # the podman commands gpubook runs
CLOCK_HOLD = 11.0  # seconds a clock step lasts at least


def now() -> datetime:
    return datetime.now(UTC)


# -- the bookers' side: the model of what the calendar holds -------------------------------------


@dataclass
class Booked:
    """A booking as the harness made it; the calendar's event and the truth the invariants use."""

    uid: str
    user: str
    start: datetime
    end: datetime
    text: str  # the booker's own lines of DESCRIPTION (gpubook's block goes below them)
    tag: str  # the booker's X- property and the attendee's name: must survive every write-back
    long: bool = False
    deleted: bool = False
    changed: float = field(default_factory=time.monotonic)  # the driver's last change (monotonic)
    kills: int = 0
    gpus: str = "1"
    rejected: bool = False  # asks for more GPUs than are free: gpubook must refuse it, and never run it
    image: bool = False  # booked minutes ahead for its template's image (fault_images); the driver leaves it
    absent: bool = False  # a crash point's no-show (World.stir): never logged into, left alone by the driver

    def due(self, at: datetime, *, margin: float = 3.0) -> bool:
        """Must run now: not deleted, not refused, started, and not within `margin` s of its end."""
        return not self.deleted and not self.rejected and self.start <= at < self.end - timedelta(seconds=margin)

    def gone_by(self) -> float | None:
        """The monotonic time after which no container may be left for it (None: it may run)."""
        ended = self.end - now()
        if self.deleted:
            return self.changed + NOTICE_SECONDS
        if self.rejected:
            return self.changed
        if ended.total_seconds() < 0:
            # Shortened while running: the notice from the change; ended on time: the end itself.
            return max(self.changed + NOTICE_SECONDS, time.monotonic() + ended.total_seconds())
        return None


def event_ical(booked: Booked) -> str:
    calendar = icalendar.Calendar()
    calendar.add("prodid", "-//gpubook fault harness//EN")
    calendar.add("version", "2.0")
    event = icalendar.Event()
    event.add("uid", booked.uid)
    event.add("summary", f"{booked.user} debian-ssh {booked.tag}")
    event.add("dtstart", booked.start)
    event.add("dtend", booked.end)
    event.add("dtstamp", now())
    event.add("description", booked.text)
    event.add("x-lab-project", booked.tag)
    attendee = icalendar.vCalAddress(f"mailto:{booked.user}@lab.example")
    attendee.params["cn"] = icalendar.vText(f"{booked.user} {booked.tag}")
    attendee.params["partstat"] = icalendar.vText("ACCEPTED")
    event.add("attendee", attendee)
    calendar.add_component(event)
    return calendar.to_ical().decode()


class Calendar:
    """The bookers' calendar program: writes straight to Radicale (never through the fault proxy),
    edits with If-Match as clients do, and keeps the model."""

    def __init__(self, calendar: caldav.Calendar) -> None:
        self.calendar = calendar
        self.booked: dict[str, Booked] = {}
        self.lock = threading.Lock()

    def create(self, booked: Booked) -> None:
        self.calendar.save_event(event_ical(booked))
        with self.lock:
            booked.changed = time.monotonic()
            self.booked[booked.uid] = booked

    def move(self, uid: str, *, start: datetime, end: datetime) -> bool:
        """New times for an event, keeping whatever else it holds (gpubook's block included)."""
        for _ in range(5):
            event = self.calendar.event_by_uid(uid)
            component = event.icalendar_component
            component["DTSTART"] = icalendar.vDDDTypes(start)
            component["DTEND"] = icalendar.vDDDTypes(end)
            try:
                event.save()
            except dav_error.ETagMismatchError:
                continue  # gpubook wrote back in between: read it again, as a client does
            with self.lock:
                booked = self.booked[uid]
                booked.start, booked.end, booked.changed = start, end, time.monotonic()
            return True
        return False

    def delete(self, uid: str) -> None:
        self.calendar.event_by_uid(uid).delete()
        with self.lock:
            self.booked[uid].deleted = True
            self.booked[uid].changed = time.monotonic()

    def live(self) -> list[Booked]:
        with self.lock:
            return [b for b in self.booked.values() if not b.deleted]

    def all(self) -> list[Booked]:
        """Every booking made, deleted ones too (a copy: the driver adds bookings meanwhile)."""
        with self.lock:
            return list(self.booked.values())

    def events(self) -> dict[str, icalendar.Event]:
        found = {}
        for item in self.calendar.events():
            for component in icalendar.Calendar.from_ical(item.data).walk("VEVENT"):
                found[str(component["UID"])] = component
        return found


# -- the world ---------------------------------------------------------------------------------


class QuietServer(ThreadingHTTPServer):
    """The webhook receiver: a daemon killed mid-request resets its connection, which is no news."""

    def handle_error(self, request: object, client_address: object) -> None:
        pass


@dataclass
class Violation:
    fault: str
    invariant: str
    detail: str


@dataclass
class Run:
    fault: str
    reached: bool = True  # a crash point the scenario passed (False: the daemon never got there)
    recovery: float | None = None  # seconds from recovery to every due booking running
    restarted: bool = False  # the daemon was restarted: recovery also waits for its first complete pass
    violations: list[Violation] = field(default_factory=list)


def port_disagreements(containers: Iterable[ContainerInfo], *, before: Mapping[str, int],
                       after: Mapping[str, int]) -> list[str]:
    """Running containers on another port than State held for their booking both before and after
    their listing (a port that changed in between: the booking stopped and started again, no proof)."""
    return [f"{info.booking_id} runs on {info.port}, State holds {held}" for info in containers
            if info.running and info.port is not None
            and (held := after.get(info.booking_id)) not in (None, info.port) and before.get(info.booking_id) == held]


class World:
    """Radicale behind a FaultFront; podman behind a FaultyEngine wrapper; the daemon as a process;
    a driver thread changing the calendar; a sampler thread checking what must hold at all times."""

    def __init__(self, folder: Path, *, engine: Engine, seed: int, gpus: int = 4, due_within: float = 10.0,
                 state_dir: Path | None = None, daemon_env: dict[str, str] | None = None,
                 engine_binary: Path | None = None, log: Callable[[str], None] | None = None,
                 images: fault_images.ImageSide | None = None) -> None:
        self.folder, self.engine, self.gpus = folder, engine, gpus
        self.images = images
        self.random = random.Random(seed)
        self.due_within = due_within
        self.log = log or (lambda line: print(line, flush=True))
        self.daemon_env = dict(daemon_env or {})
        self.keys = {"alice": paramiko.ECDSAKey.generate(bits=256), "bob": paramiko.ECDSAKey.generate(bits=256)}
        storage = folder / "radicale"
        storage.mkdir(parents=True)
        self.radicale = servers.radicale(storage).start()
        self.front = FaultFront(self.radicale.base_url).start()
        made = self.radicale.new_calendar()
        self.calendar = Calendar(made)
        url = self.front.base_url + made.url.path
        engine_lines = [f'binary = "{engine_binary}"'] if engine_binary else []
        self.config = write_config(folder, url, keys=self.keys, gpus=gpus, poll_seconds=10, warn_minutes=0.05,
                                   stale_after_minutes=0.25, notice_seconds=NOTICE_SECONDS,
                                   restart_backoff_seconds=1, engine_lines=engine_lines, state_dir=state_dir)
        self.gpu_file = folder / "gpus.json"
        fake_gpus.write(self.gpu_file, [{"utilisation": 0} for _ in range(gpus)])
        self.daemon_env[fake_gpus.ENV] = str(self.gpu_file)
        self.hooks = QuietServer(("127.0.0.1", 0), HookHandler)
        self.hooks.received, self.hooks.answer = [], 204  # type: ignore[attr-defined]
        threading.Thread(target=self.hooks.serve_forever, daemon=True).start()
        self._extend_config()
        self.state_db = (state_dir or folder / "state") / "state.sqlite"
        self.foreign: list[subprocess.Popen[bytes]] = []
        # Containers still running that the engine no longer lists (FaultyEngine.orphans): they hold
        # GPUs and ports unseen. The caller sets it where it can look.
        self.orphans: Callable[[], list[object]] = list
        self.daemon: DaemonProcess | None = None
        self.sessions: dict[str, paramiko.SSHClient] = {}
        self.violations: list[Violation] = []  # the sampler's, tagged with the fault under way
        self.fault = "setup"
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        # The sampler's last listing and when it began (monotonic): converge reads it rather than list
        # again (each listing is two podman commands; the lanes share two cores).
        self._listed = threading.Condition()
        self._latest: tuple[float, list[ContainerInfo]] = (float("-inf"), [])
        self._serial = 0
        self.suffix = f"@faults-{secrets.token_hex(3)}"  # this world's bookings (not the replayed choices)

    def _extend_config(self) -> None:
        """The rest of a lab's daemon, so that every part of a pass (and its crash points) runs: the
        GPU monitor (a file here) sampled every second, outside processes stopped, no-shows released
        (the turnover bookings nobody logs into), webhook notices, the SFTP service."""
        text = self.config.read_text()
        text = text.replace("[gpus]\n", '[gpus]\nmonitor = "tests.kits.fake_gpus:read"\n')
        text = text.replace("[daemon]\n", "[daemon]\nsample_seconds = 1\n")
        port = self.hooks.server_address[1]
        text += ('\n[policy]\nforeign_processes = "stop"\nforeign_grace_minutes = 0.05\nno_show_minutes = 0.4\n'
                 f'\n[notify.webhook]\nenabled = true\nurl = "http://127.0.0.1:{port}/hook"\ntimeout_seconds = 5\n'
                 f'\n[sftp]\nenabled = true\nport = {free_port()}\nlisten = "127.0.0.1"\n')
        if self.images is not None:
            text += self.images.config_lines()
        self.config.write_text(text)

    # -- the daemon

    def start_daemon(self, *, crash_at: str | None = None) -> DaemonProcess:
        env = dict(self.daemon_env)
        if crash_at:
            env[crash.ENV] = crash_at
        self.daemon = DaemonProcess(self.config, env=env).start()
        return self.daemon

    def kill_daemon(self) -> None:
        if self.daemon is not None:
            self.daemon.kill()

    # -- the bookings

    def new_uid(self, prefix: str) -> str:
        self._serial += 1
        return f"{prefix}-{self._serial}-{self.random.randrange(10**6)}{self.suffix}"

    def book_long(self) -> None:
        for number in range(LONG):
            user = ("alice", "bob")[number % 2]
            tag = f"long-{number}-{self.random.randrange(10**6)}"
            self.calendar.create(Booked(uid=self.new_uid("long"), user=user, long=True, tag=tag,
                                        start=now() - timedelta(minutes=10), end=now() + timedelta(hours=6),
                                        text=f"Training {tag}.\nuser: {user}\ngpus: 1\nKeep this line.\n"))

    def _turnover_fits(self, start: datetime, end: datetime, *, ignore: str = "") -> bool:
        """At most gpus - LONG turnover bookings at any moment, with 15 s around each end for the
        stop to finish (never a GPU asked twice: every booking is accepted)."""
        edge = timedelta(seconds=15)
        others = [b for b in self.calendar.live() if not b.long and b.uid != ignore]
        moments = [start] + [b.start for b in others if start <= b.start < end + edge]
        return all(sum(1 for b in others if b.start <= moment < b.end + edge) < self.gpus - LONG
                   for moment in moments)

    def drive_once(self) -> str:
        """One booker's action, chosen at random; its name."""
        rng = self.random
        live = [b for b in self.calendar.live() if not (b.long or b.image or b.absent)]  # a scene's are left alone
        action = rng.choice(["create", "create", "move", "shorten", "delete", "recreate", "kill", "refused",
                             "foreign", "login"])
        if action == "refused":  # more GPUs than the host has: refused, with the reason, never run
            user = rng.choice(["alice", "bob"])
            start = now().replace(microsecond=0) + timedelta(seconds=rng.randint(-2, 8))
            self.calendar.create(Booked(uid=self.new_uid("refused"), user=user, tag=f"r{rng.randrange(10**6)}",
                                        start=start, end=start + timedelta(seconds=30), gpus=str(self.gpus + 1),
                                        rejected=True, text=f"Too big.\nuser: {user}\ngpus: {self.gpus + 1}\n"))
            return action
        if action == "foreign":  # a process outside every booking on a GPU: reported, then stopped
            self._plant_foreign()
            return action
        if action == "create" or not live:
            start = now().replace(microsecond=0) + timedelta(seconds=rng.randint(-2, 8))
            return "create" if self.book_turnover(start, start + timedelta(seconds=rng.randint(20, 90))) else "full"
        target = rng.choice(live)
        if action == "move":
            start = now().replace(microsecond=0) + timedelta(seconds=rng.randint(-1, 10))
            end = start + (target.end - target.start)
            if not self._turnover_fits(start, end, ignore=target.uid):
                return "full"
            self.calendar.move(target.uid, start=start, end=end)
        elif action == "shorten":
            end = max(target.start + timedelta(seconds=5), target.end - timedelta(seconds=rng.randint(5, 20)))
            self.calendar.move(target.uid, start=target.start, end=end)
        elif action == "delete":
            self.calendar.delete(target.uid)
        elif action == "recreate":
            self.calendar.delete(target.uid)
            if target.rejected or self._turnover_fits(target.start, target.end, ignore=target.uid):
                self.calendar.create(replace(target, deleted=False))
        elif action == "login":  # the booker comes and goes (the others are no-shows, released)
            self.log_in(target)
        elif action == "kill" and target.kills == 0 and target.due(now()):
            info = self._running().get(target.uid)
            if info is not None and info.pid:
                target.kills += 1  # one death each: restart_limit is 3, faults may cost restarts too
                subprocess.run(["podman", "kill", "--signal", "KILL", info.id], capture_output=True,
                               timeout=60, check=False)
        return action

    def book_turnover(self, start: datetime, end: datetime, *, absent: bool = False) -> Booked | None:
        """A booker's booking, where it fits (None where it does not)."""
        if not self._turnover_fits(start, end):
            return None
        user = self.random.choice(["alice", "bob"])
        tag = f"t{self.random.randrange(10**6)}"
        booked = Booked(uid=self.new_uid("turn"), user=user, tag=tag, start=start, end=end, absent=absent,
                        text=f"Run {tag}, please.\nuser: {user}\ngpus: 1\n")
        self.calendar.create(booked)
        return booked

    def book_image(self, template: str) -> Booked:
        """A booking of `template` five minutes ahead: what it needs now is its image prepared."""
        user = self.random.choice(["alice", "bob"])
        tag = f"i{self.random.randrange(10**6)}"
        start = now().replace(microsecond=0) + timedelta(minutes=5)
        booked = Booked(uid=self.new_uid("image"), user=user, tag=tag, start=start, end=start + timedelta(seconds=30),
                        image=True, text=f"Needs {template}.\nuser: {user}\ngpus: 1\ntemplate: {template}\n")
        self.calendar.create(booked)
        return booked

    def stir(self, *, absent: bool = True, seconds: int = 40) -> None:
        """A stop and a start within seconds, as bookers cause them: one running booking cancelled,
        one of `seconds` booked to start in 12 s (made ahead, then started) with room made for it,
        whose booker never comes with `absent` (released as a no-show half a minute later; else it
        is warned of its end, a command run in its container)."""
        running = self._running()
        turns = [b for b in self.calendar.live() if not b.long and not b.image]
        ongoing = [b for b in turns if b.uid in running]
        if ongoing:
            self.calendar.delete(self.random.choice(ongoing).uid)
        start = now().replace(microsecond=0) + timedelta(seconds=12)
        end = start + timedelta(seconds=seconds)
        for booked in sorted(turns, key=lambda b: b.start, reverse=True):
            if self._turnover_fits(start, end):
                break
            if not booked.deleted and booked.start < end + timedelta(seconds=15) and start < booked.end:
                self.calendar.delete(booked.uid)
        self.book_turnover(start, end, absent=absent)

    def log_in(self, booked: Booked) -> bool:
        """The booker logs into their running booking, runs a command and leaves."""
        info = self._running().get(booked.uid)
        if info is None or info.port is None:
            return False
        client = try_login(info.port, booked.user, self.keys[booked.user], timeout=10)
        if client is None:
            return False
        try:
            _, out, _ = client.exec_command("true", timeout=10)
            out.channel.recv_exit_status()
        finally:
            client.close()
        return True

    def first_login(self, *, timeout: float) -> None:
        """A booker's first login into a running booking (for the login's crash point)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            fresh = [b for b in self.calendar.live() if not b.long and b.due(now())]
            if any(self.log_in(b) for b in fresh):
                return
            time.sleep(1)

    def _plant_foreign(self) -> None:
        self.foreign = [p for p in self.foreign if p.poll() is None]
        if self.foreign:
            return
        process = subprocess.Popen(["sleep", "600"])
        self.foreign.append(process)
        gpu = self.random.randrange(self.gpus)
        fake_gpus.write(self.gpu_file, [{"utilisation": 0, "processes": [{"pid": process.pid}]} if index == gpu
                                        else {"utilisation": 0} for index in range(self.gpus)])

    # -- threads

    def start_threads(self, *, drive_every: tuple[float, float] = (1.5, 4.0)) -> None:
        def driver() -> None:
            while not self._stop.wait(self.random.uniform(*drive_every)):
                try:
                    self.drive_once()
                except Exception as error:  # noqa: BLE001 - a driver step failing is logged, not fatal
                    self.log(f"driver: {error}")

        def sampler() -> None:
            while not self._stop.wait(0.5):
                try:
                    self._sample()
                except Exception as error:  # noqa: BLE001
                    self.log(f"sampler: {error}")

        for target in (driver, sampler):
            thread = threading.Thread(target=target, daemon=True)
            thread.start()
            self._threads.append(thread)

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=60)
        for client in self.sessions.values():
            client.close()
        if self.daemon is not None:
            self.daemon.stop()
        for info in self._containers():  # the daemon leaves them running, as it should
            self.engine.stop(info.name, 0)
        self.remove_sftp_service()
        if self.images is not None:
            self.images.close()
        for process in self.foreign:
            process.kill()
        self.hooks.shutdown()
        self.hooks.server_close()
        self.front.lift()
        self.front.stop()
        self.radicale.stop()

    # -- what holds at every moment

    def _containers(self) -> list[ContainerInfo]:
        """This world's containers (the account may run others: a test beside it)."""
        return [c for c in self.engine.list() if c.booking_id.endswith(self.suffix)]

    def _running(self) -> dict[str, ContainerInfo]:
        return {c.booking_id: c for c in self._containers() if c.running}

    def _listing_since(self, began: float, *, timeout: float = 5.0) -> list[ContainerInfo]:
        """This world's containers as listed by a listing begun at `began` or later: the sampler's,
        or (no sampler running, or none in `timeout` s) one made here."""
        if not self._threads:
            time.sleep(0.2)  # no sampler: this caller's own listings, paced
            return self._containers()
        with self._listed:
            if self._listed.wait_for(lambda: self._latest[0] >= began, timeout=timeout):
                return self._latest[1]
        return self._containers()

    def _sample(self) -> None:
        began = time.monotonic()
        containers = self._containers()
        with self._listed:
            self._latest = (began, containers)
            self._listed.notify_all()
        running = [c for c in containers if c.running]
        holders: dict[int, str] = {}
        bookings: dict[str, str] = {}
        ports: dict[int, str] = {}
        for info in running:
            for gpu in info.gpus:
                if gpu in holders:
                    self._violate("one GPU, one container", f"GPU {gpu} held by {holders[gpu]} and {info.name}")
                holders[gpu] = info.name
            if info.booking_id in bookings:
                self._violate("one container per booking", f"{info.booking_id}: {bookings[info.booking_id]} "
                                                            f"and {info.name} both running")
            bookings[info.booking_id] = info.name
            if info.port is not None:
                if info.port in ports:
                    self._violate("one port, one booking", f"port {info.port}: {ports[info.port]} and {info.name}")
                ports[info.port] = info.name

    def _violate(self, invariant: str, detail: str, *, into: list[Violation] | None = None) -> None:
        violation = Violation(self.fault, invariant, detail)
        (self.violations if into is None else into).append(violation)
        self.log(f"VIOLATION [{self.fault}] {invariant}: {detail}")

    # -- after each recovery

    def converge(self, recovered: float, run: Run) -> None:
        """Wait until every due booking runs and no ended or deleted one does; each must happen
        within due_within s of the later of recovery and its own moment. Then the rest."""
        while True:
            at, clock = now(), time.monotonic()
            containers = self._listing_since(clock)
            running = {c.booking_id: c for c in containers if c.running}
            late, left = [], []
            released = self.released()
            for booked in self.calendar.all():
                if booked.uid in released:
                    continue  # a no-show, released: its GPUs went back to the pool (gpubook stops it)
                if booked.due(at) and booked.uid not in running:
                    since = max(recovered, booked.changed, clock - (at - booked.start).total_seconds())
                    late.append((booked.uid, since + self.due_within))
                gone = booked.gone_by()
                if gone is not None and booked.uid in running:
                    left.append((booked.uid, max(recovered, gone) + self.due_within))
            passed = not run.restarted or self._passed_since(recovered)
            if not late and not left and passed:
                run.recovery = max(0.0, clock - recovered)
                break
            overdue = [uid for uid, deadline in late if clock > deadline]
            stale = [uid for uid, deadline in left if clock > deadline]
            if not passed and clock > recovered + self.due_within:
                self._violate("the restarted daemon passes", f"no complete pass {self.due_within:.0f} s "
                                                             "after its restart", into=run.violations)
                overdue = overdue or ["(no pass)"]
            if overdue or stale:
                for uid in (u for u in overdue if u != "(no pass)"):
                    self._violate("due bookings run", f"{uid} not running {self.due_within:.0f} s after "
                                                      "recovery (or its start)", into=run.violations)
                for uid in stale:
                    self._violate("ended bookings stop", f"{uid} still running past its end or deletion "
                                                         "and its grace", into=run.violations)
                run.recovery = None
                break
        self._check_after(run)

    def released(self) -> set[str]:
        """The bookings gpubook released as no-shows (State's record)."""
        try:
            with closing_ro(self.state_db) as db:
                return {row[0] for row in db.execute("SELECT booking_id FROM releases")}
        except sqlite3.Error:
            return set()  # not made yet; the integrity check says if it is broken

    def edit_sshd_config(self) -> None:
        """The SFTP service's sshd_config changed behind gpubook's back (as a new gpubook's would be):
        the next check writes it again and tells sshd (HUP)."""
        path = self.state_db.parent / "sftp" / "etc" / "sshd_config"
        with suppress(OSError):
            path.write_text(path.read_text() + "# edited\n")

    def remove_sftp_service(self) -> None:
        """The SFTP service's container gone (the next daemon starts it again)."""
        listed = subprocess.run(["podman", "ps", "-a", "-q", "--filter", "label=gpubook.service"], capture_output=True,
                                text=True, timeout=60, check=False)
        for container in listed.stdout.split():
            subprocess.run(["podman", "rm", "-f", container], capture_output=True, timeout=60, check=False)

    def wait_passed(self, *, timeout: float) -> None:
        """Until the daemon now running has completed a pass (or `timeout` s)."""
        began = time.monotonic()
        while time.monotonic() < began + timeout and not self._passed_since(began - 3600):
            time.sleep(0.1)

    def _passed_since(self, recovered: float) -> bool:
        """The daemon now running wrote its status (after a complete pass) since `recovered`."""
        path = self.state_db.with_name("daemon-status.json")
        try:
            stat = path.stat()
            pid = json.loads(path.read_text())["pid"]
        except (OSError, ValueError, KeyError):
            return False
        written = time.monotonic() - (time.time() - stat.st_mtime)  # the file's time, the wall's, unfaked
        return self.daemon is not None and self.daemon.process is not None \
            and pid == self.daemon.process.pid and written >= recovered

    def _check_after(self, run: Run) -> None:
        # State's ports before the listing and again after it (_check_state): a booking stopped and started
        # again in between (a turnover booking: a new port) shows its old container with the new port held.
        before = self._state_ports()
        containers = self._containers()
        per_booking: dict[str, int] = {}
        for info in containers:
            per_booking[info.booking_id] = per_booking.get(info.booking_id, 0) + 1
        for uid, count in per_booking.items():
            if count > 1:
                self._violate("one container per booking", f"{uid}: {count} containers", into=run.violations)
        for orphan in self.orphans():
            self._violate("one GPU, one container", f"a container runs unlisted by the engine: {orphan}",
                          into=run.violations)
        self._check_state(run, containers, before=before)
        self._check_sessions(run)
        self._check_calendar(run)

    def _state_ports(self) -> dict[str, int]:
        """booking id → the port State holds for it ({} where State cannot be read: _check_state says so)."""
        try:
            with closing_ro(self.state_db) as db:
                return dict(db.execute("SELECT booking_id, port FROM ports").fetchall())
        except sqlite3.Error:
            return {}

    def _check_state(self, run: Run, containers: list[ContainerInfo], *, before: Mapping[str, int]) -> None:
        """`containers`: a listing made after `before` (State's ports then) and before this read of State:
        a running container on another port than State held all along is a violation."""
        try:
            with closing_ro(self.state_db) as db:
                verdict = db.execute("PRAGMA integrity_check").fetchone()[0]
                ports = dict(db.execute("SELECT booking_id, port FROM ports").fetchall())
        except sqlite3.Error as error:
            self._violate("state database sound", f"cannot read it: {error}", into=run.violations)
            return
        if verdict != "ok":
            self._violate("state database sound", f"integrity_check: {verdict}", into=run.violations)
        for detail in port_disagreements(containers, before=before, after=ports):
            self._violate("one port, one booking", detail, into=run.violations)

    def _check_sessions(self, run: Run) -> None:
        """The SSH session to each long booking still answers; one is opened where none is yet."""
        running = self._running()
        for booked in self.calendar.all():
            if not booked.long:
                continue
            client = self.sessions.get(booked.uid)
            if client is not None:
                try:
                    _, out, _ = client.exec_command("echo alive", timeout=20)
                    alive = out.read().strip() == b"alive"
                except (OSError, paramiko.SSHException, EOFError):
                    alive = False
                if not alive:
                    self._violate("SSH sessions survive", f"the session to {booked.uid} was lost",
                                  into=run.violations)
                    client.close()
                    del self.sessions[booked.uid]
            info = running.get(booked.uid)
            if booked.uid not in self.sessions and info is not None and info.port is not None:
                opened = try_login(info.port, booked.user, self.keys[booked.user], timeout=10)
                if opened is not None:
                    self.sessions[booked.uid] = opened

    def _check_calendar(self, run: Run, *, within: float = 20.0) -> None:
        """Every event keeps the booker's text, property and attendee; its status converges to what
        State wrote and to what runs (a running booking says running)."""
        deadline = time.monotonic() + within
        while True:
            problems = self._calendar_problems()
            if not problems or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        for invariant, detail in problems:
            self._violate(invariant, detail, into=run.violations)

    def _calendar_problems(self) -> list[tuple[str, str]]:
        problems = []
        try:
            events = self.calendar.events()
            with closing_ro(self.state_db) as db:
                written = dict(db.execute("SELECT booking_id, status FROM write_backs").fetchall())
        except (sqlite3.Error, dav_error.DAVError) as error:
            return [("write-back converges", f"cannot read: {error}")]
        running = self._running()
        at = now()
        for booked in self.calendar.live():
            event = events.get(booked.uid)
            if event is None:
                problems.append(("booker's text kept", f"{booked.uid} is gone from the calendar"))
                continue
            description = str(event.get("DESCRIPTION", ""))
            if not description.startswith(booked.text):
                problems.append(("booker's text kept", f"{booked.uid}: {description[:200]!r}"))
            if str(event.get("X-LAB-PROJECT", "")) != booked.tag:
                problems.append(("booker's text kept", f"{booked.uid}: X-LAB-PROJECT lost"))
            attendees = event.get("ATTENDEE", [])
            attendees = attendees if isinstance(attendees, list) else [attendees]
            if not any(str(a) == f"mailto:{booked.user}@lab.example" for a in attendees):
                problems.append(("booker's text kept", f"{booked.uid}: the booker's attendee lost"))
            status = str(event.get("X-GPUBOOK-STATUS", ""))
            if booked.end < at:
                continue  # over: gpubook reads and writes no past event (one re-created after its end)
            wrote = written.get(booked.uid, "").split(" ")[0]  # "running 3bb052889e72": the word, a digest
            if wrote and status != wrote:
                problems.append(("write-back converges", f"{booked.uid}: the event says {status!r}, "
                                                         f"State wrote {wrote!r}"))
            if booked.rejected and status != "rejected" and time.monotonic() - booked.changed > 10:
                problems.append(("write-back converges", f"{booked.uid} cannot fit, its event says {status!r}"))
            if booked.due(at, margin=8) and booked.uid in running and status != "running" \
                    and time.monotonic() - booked.changed > 5:
                problems.append(("write-back converges", f"{booked.uid} runs, its event says {status!r}"))
        return problems


@contextmanager
def closing_ro(path: Path) -> Iterator[sqlite3.Connection]:
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=10)
    try:
        yield db
    finally:
        db.close()


# -- the faults --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Fault:
    kind: str  # "crash", "kill9", "calendar", "engine", "disk", "clock", "sighup"
    what: str = ""  # the crash point, the calendar or engine fault, the clock step
    seconds: float = 0.0  # how long it lasts before it is lifted

    @property
    def name(self) -> str:
        return f"{self.kind}:{self.what}" if self.what else self.kind


def random_fault(rng: random.Random, *, kinds: tuple[str, ...], points: list[str], longest: float) -> Fault:
    kind = rng.choice(kinds)
    seconds = round(rng.uniform(1.0, longest), 1)
    if kind == "crash":
        return Fault("crash", rng.choice(points))
    if kind == "calendar":
        return Fault("calendar", rng.choice(CALENDAR_KINDS), seconds)
    if kind == "engine":
        return Fault("engine", f"{rng.choice(('hang', 'kill'))}-{rng.choice(ENGINE_VERBS)}", seconds)
    if kind == "clock":
        return Fault("clock", rng.choice(("+300", "-300")), seconds)
    return Fault(kind, "", seconds)


@dataclass
class Parts:
    """What injects the faults beyond the daemon and the calendar: podman's wrapper, a folder on a
    small mount to fill (the state folder goes there), the daemon's steppable clock."""

    faulty_engine: FaultyEngine
    disk: Path | None
    clock: SteppedClock | None

    @property
    def kinds(self) -> tuple[str, ...]:
        return ("crash", "kill9", "calendar", "engine", "sighup", *(("disk",) if self.disk else ()),
                *(("clock",) if self.clock else ()))


def parts(stack: ExitStack, folder: Path, *, required: bool) -> Parts:
    """The fault parts this machine has; `required` (CI): all of them, or a RuntimeError saying what
    is missing (`./quickstart test` mounts the small tmpfs and installs libfaketime)."""
    disk = clock = None
    try:
        disk = stack.enter_context(disk_full.full_folder())
    except (RuntimeError, OSError):  # no small mount, or another account's
        if required:
            raise
    try:
        clock = SteppedClock(folder)
    except (RuntimeError, subprocess.CalledProcessError):
        if required:
            raise
    return Parts(FaultyEngine(folder / "engine", real="podman"), disk, clock)


def world_from(found: Parts, folder: Path, *, engine: Engine, seed: int, due_within: float,
               images: fault_images.ImageSide | None = None) -> World:
    """A World with the fault parts found: the state folder on the small disk, the daemon on the
    steppable clock, podman behind the wrapper (whose unlisted containers the checks look for)."""
    world = World(folder, engine=engine, seed=seed, due_within=due_within,
                  state_dir=found.disk / "state" if found.disk else None,
                  daemon_env=found.clock.env() if found.clock else {},
                  engine_binary=found.faulty_engine.path, images=images)
    world.orphans = lambda: found.faulty_engine.orphans(engine.global_argv()[1:])  # type: ignore[attr-defined]
    return world


class Injector:
    """Injects one fault into a World, lifts it, and gives the moment of recovery."""

    def __init__(self, world: World, parts: Parts, *, reach_timeout: float = 30.0) -> None:
        self.world = world
        self.parts = parts
        self.faulty_engine, self.disk, self.clock = parts.faulty_engine, parts.disk, parts.clock
        self.reach_timeout = reach_timeout

    def inject(self, fault: Fault, run: Run) -> float:
        world = self.world
        world.fault = fault.name
        method = getattr(self, f"_{fault.kind}")
        return method(fault, run)

    def _kill9(self, fault: Fault, run: Run) -> float:
        time.sleep(self.world.random.uniform(0, 3))
        self.world.kill_daemon()
        run.restarted = True
        recovered = time.monotonic()
        self.world.start_daemon()
        return recovered

    def _crash(self, fault: Fault, run: Run) -> float:
        world = self.world
        world.kill_daemon()
        if fault.what.startswith("engine.start_service:"):
            world.remove_sftp_service()
        if fault.what.startswith(("state.record_foreign:", "state.foreign_action:")):
            world._plant_foreign()  # a process outside every booking on a GPU: recorded, then stopped
        verb = fault_images.verb_of(fault.what)
        # A command run in a container: a booking warned of its end (a no-show is released unwarned).
        exec_point = fault.what.startswith("engine.exec:")
        undo = self._image_scene(verb) if verb else world.stir(absent=not exec_point, seconds=20 if exec_point else 40)
        daemon = world.start_daemon(crash_at=fault.what)
        assert daemon.process is not None
        if fault.what.startswith("engine.signal:"):
            world.wait_passed(timeout=self.reach_timeout)
            world.edit_sshd_config()
        if fault.what.startswith("state.record_login:"):
            world.wait_passed(timeout=self.reach_timeout)
            world.first_login(timeout=self.reach_timeout)
        try:
            daemon.process.wait(timeout=self.reach_timeout)
        except subprocess.TimeoutExpired:
            run.reached = False
            world.log(f"{fault.what} not reached in {self.reach_timeout:.0f} s; the daemon's log ends:\n"
                      + daemon.tail()[-1500:])
        world.kill_daemon()
        if undo is not None:
            undo()
        run.restarted = True
        recovered = time.monotonic()
        world.start_daemon()
        return recovered

    def _image_scene(self, verb: str) -> Callable[[], None] | None:
        """What makes the daemon about to start pass an image verb (fault_images); what undoes it
        once the point is passed. Without a registry (the CI sample) the point is not reached."""
        world, side = self.world, self.world.images
        if side is None:
            return None
        if verb != "remove_image":
            booked = world.book_image(side.template_for(verb))
            return lambda: world.calendar.delete(booked.uid)
        # An image of gpubook's that no booking needs: prepared by a daemon, its booking then cancelled;
        # the next daemon starts under a free-space floor above any disk, with a booking to prepare for.
        template = side.template_for("pull")
        booked = world.book_image(template)
        daemon = world.start_daemon()
        deadline = time.monotonic() + self.reach_timeout
        ready = f"template {template}: its image is ready"  # pulled, in the ledger, its warm-up done
        while ready not in daemon.log.read_text(errors="replace") and time.monotonic() < deadline:
            time.sleep(0.2)
        if side.run_image(template) not in side.ledger(world.state_db.parent):
            world.log(f"{side.run_image(template)} not prepared in {self.reach_timeout:.0f} s: nothing to remove")
        world.calendar.delete(booked.uid)
        world.kill_daemon()
        good = world.config.read_text()
        world.config.write_text(good.replace("[images]\n", f"[images]\nmin_free_gb = {fault_images.HUGE_FLOOR_GB}\n"))
        wanting = world.book_image("debian-ssh")

        def undo() -> None:
            world.config.write_text(good)
            world.calendar.delete(wanting.uid)

        return undo

    def _calendar(self, fault: Fault, run: Run) -> float:
        self.world.front.fault(fault.what)
        time.sleep(fault.seconds)
        self.world.front.lift()
        return time.monotonic()

    def _engine(self, fault: Fault, run: Run) -> float:
        how, verb = fault.what.split("-", 1)
        before = len(self.faulty_engine.hits())
        self.faulty_engine.arm(how, verbs=(verb,), count=1)
        deadline = time.monotonic() + self.reach_timeout
        while len(self.faulty_engine.hits()) == before and time.monotonic() < deadline:
            time.sleep(0.1)
        run.reached = len(self.faulty_engine.hits()) > before
        if how == "hang":
            time.sleep(fault.seconds)
        self.faulty_engine.lift()
        return time.monotonic()

    def _disk(self, fault: Fault, run: Run) -> float:
        disk_full.fill(self.disk)
        time.sleep(fault.seconds)
        disk_full.unfill(self.disk)
        return time.monotonic()

    def _clock(self, fault: Fault, run: Run) -> float:
        # A booking with two minutes left, running: a step forward passes its end, a step back puts
        # its start ahead again; when the clock is right again it must run (for the rest of its time).
        world = self.world
        start = now().replace(microsecond=0)
        probe = world.book_turnover(start, start + timedelta(seconds=120))
        deadline = time.monotonic() + self.reach_timeout
        while probe is not None and probe.uid not in world._running() and time.monotonic() < deadline:
            time.sleep(0.2)
        self.clock.step(int(fault.what))
        # Held two of the daemon's clock readings (5 s apart) at least, as a wrong clock is until
        # NTP corrects it: a step and its undo between two readings is no step to anyone.
        time.sleep(max(fault.seconds, CLOCK_HOLD))
        self.clock.reset()
        return time.monotonic()

    def _sighup(self, fault: Fault, run: Run) -> float:
        """SIGHUP with a broken config in the middle of a pass: the pass is held in its `podman ps`
        (a hung engine command) while the config is broken and the signal comes."""
        world = self.world
        good = world.config.read_text()
        before = len(self.faulty_engine.hits())
        self.faulty_engine.arm("hang", verbs=("ps",), count=1)
        deadline = time.monotonic() + self.reach_timeout
        while len(self.faulty_engine.hits()) == before and time.monotonic() < deadline:
            time.sleep(0.05)
        world.config.write_text(good + "\n[daemon]\npoll_seconds = -1\n")  # a second [daemon]: broken
        assert world.daemon is not None
        world.daemon.signal(1)
        time.sleep(fault.seconds)
        self.faulty_engine.lift()  # the pass goes on
        time.sleep(1)
        alive = world.daemon.process is not None and world.daemon.process.poll() is None
        world.config.write_text(good)
        if not alive:
            world._violate("a broken config is refused", "the daemon died on SIGHUP with a broken config",
                           into=run.violations)
            world.start_daemon()
        else:
            world.daemon.signal(1)
        return time.monotonic()


def campaign(world: World, injector: Injector, faults: list[Fault], *, settle: float = 1.0,
             out: Path | None = None) -> list[Run]:
    """Each fault in turn: inject, recover, converge, check. The sampler's violations go to the
    fault under way when they were seen. The first waits for the bookers' bookings to run. `out`:
    the runs so far as JSON, written after each (a run cut short keeps them)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not any(not b.long and b.uid in world._running()
                                                  for b in world.calendar.live()):
        time.sleep(0.5)
    runs = []
    for number, fault in enumerate(faults, 1):
        run = Run(fault.name)
        before = len(world.violations)
        recovered = injector.inject(fault, run)
        world.fault = fault.name + " (recovering)"
        world.converge(recovered, run)
        run.violations += world.violations[before:]
        runs.append(run)
        if out is not None:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(to_json(runs))
        world.log(f"[{number}/{len(faults)}] {fault.name}: reached={run.reached} recovery="
                  f"{'-' if run.recovery is None else f'{run.recovery:.2f} s'} violations={len(run.violations)}")
        time.sleep(settle)
    return runs


def table(runs: list[Run]) -> str:
    """Fault kind → runs, reached, invariant violations, recovery median and worst."""
    kinds: dict[str, list[Run]] = {}
    for run in runs:
        kind = run.fault.split(":")[0]
        if kind == "calendar" or kind == "engine" or kind == "clock":
            kind = run.fault.split("-")[0] if kind == "engine" else run.fault
        kinds.setdefault(kind, []).append(run)
    lines = ["| fault | runs | reached | violations | recovery median (s) | recovery worst (s) |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for kind in sorted(kinds):
        group = kinds[kind]
        times = [r.recovery for r in group if r.recovery is not None and r.reached]
        lines.append(f"| {kind} | {len(group)} | {sum(r.reached for r in group)} | "
                     f"{sum(len(r.violations) for r in group)} | "
                     f"{statistics.median(times):.2f} | {max(times):.2f} |" if times else
                     f"| {kind} | {len(group)} | {sum(r.reached for r in group)} | "
                     f"{sum(len(r.violations) for r in group)} | - | - |")
    return "\n".join(lines)


def to_json(runs: list[Run]) -> str:
    return json.dumps([{"fault": r.fault, "reached": r.reached, "recovery": r.recovery,
                        "violations": [v.__dict__ for v in r.violations]} for r in runs], indent=1)


def wait_until_running(world: World, *, timeout: float) -> None:
    """Setup: the long bookings run and their SSH sessions are open."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        # Each long booking logged into as soon as it runs, not once all of them do: the world's
        # no-show time is 0.4 min, and on a loaded machine (a clean clone's first image pull) the
        # second started 20 s after the first, which was released as a no-show meanwhile.
        world._check_sessions(Run("setup"))
        if len(world.sessions) == LONG:
            return
        time.sleep(0.5)
    raise AssertionError("the long bookings never ran with SSH\n" + (world.daemon.tail() if world.daemon else ""))
