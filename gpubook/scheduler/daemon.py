"""The daemon: APScheduler wakes a pass (gpubook/scheduler/apply) on a poll interval and exactly at each boundary.

- A poll job every `[daemon] poll_seconds` reads the calendars (outside the pass lock, so a slow
  server never delays a start), then runs a pass.
- One date job, replaced after every pass, wakes at the next start, warning, end or recheck: a
  booking starts within a second of its start time. Jobs coalesce and have no misfire limit, so a
  job missed during a suspend runs once, late.
- Calendar unreachable: the last known bookings are kept; running containers go on to their known
  end; nothing starts from data older than `stale_after_minutes`; the outage is logged once with
  its cause and once when it ends.
- SIGTERM/SIGINT: the scheduler stops, containers keep running (KillMode=process in the unit).
  SIGHUP: the config and templates are read again; an invalid config is refused and the old one kept.
- Under systemd: READY=1 after the first pass (at most 120 s; until then EXTEND_TIMEOUT_USEC every
  5 s, so a long first pass never meets systemd's 90 s start timeout), WATCHDOG=1, a STATUS line.
- The wall clock stepping back (NTP, `date -s`) would leave APScheduler's next poll in the future by
  the size of the step: the main loop compares the wall clock with the monotonic one every few
  seconds and, on a step back, polls at once and every poll interval from there.
- One daemon per state folder: `gpubook run` holds an flock on `daemon.lock` there for its whole
  life; a second one exits at once, naming the pid that holds it (two daemons would start, stop
  and remove each other's containers).
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

from apscheduler.executors.pool import ThreadPoolExecutor
from apscheduler.schedulers.background import BackgroundScheduler

from gpubook import extras
from gpubook.runtime import engines, ssh
from gpubook.runtime import gpus as gpu_inventory
from gpubook.runtime.engines import ContainerInfo, Engine
from gpubook.runtime.errors import ConfigError, GpubookError
from gpubook.runtime.images import Ledger
from gpubook.runtime.nvidia import nvml
from gpubook.runtime.private import private_folder, write_private
from gpubook.runtime.templates import TemplateSet, load_all
from gpubook.scheduler import config as config_module
from gpubook.scheduler.apply.passes import Pass, PassResult, World
from gpubook.scheduler.core.bookings import Booking, Rejection
from gpubook.scheduler.core.plan import LOCAL
from gpubook.scheduler.hosts import backend as backends
from gpubook.scheduler.hosts import sftp as sftp_host
from gpubook.scheduler.hosts import usage
from gpubook.scheduler.hosts.foreign import ForeignWatch
from gpubook.scheduler.hosts.images import ImagePreparer
from gpubook.scheduler.outbox import foreign, metrics, notices, status, timeline
from gpubook.scheduler.sdnotify import Notifier
from gpubook.scheduler.service import Calendars
from gpubook.scheduler.sources.errors import CalendarError, redact_url
from gpubook.scheduler.state import State, StateError
from gpubook.scheduler.state.records import ContainerRecord

if TYPE_CHECKING:
    from gpubook.scheduler.outbox.web.serve import WebServer

log = logging.getLogger(__name__)

STATUS_FILE = "daemon-status.json"
LOCK_FILE = "daemon.lock"


class AlreadyRunning(GpubookError):
    """Another gpubook daemon holds this state folder."""


def hold_lock(folder: Path) -> int:
    """Take the state folder's daemon lock (kept until this process ends); give its descriptor.
    Raises AlreadyRunning with the holder's pid when another daemon has it."""
    private_folder(folder)
    path = folder / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise AlreadyRunning(f"another gpubook daemon (pid {holder}) already runs on the state folder {folder} "
                             f"(it holds {path}); stop it first") from None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd


def account_lock_path() -> Path:
    """The lock of this account on this host: two daemons of one account, whatever their state
    folders, would fight over the gpubook-sftp container and the booking ports. In the account's
    runtime folder (per host, per uid, a tmpfs), else in its home with the host's name (a home on
    NFS is shared by hosts)."""
    runtime = Path(os.environ.get("XDG_RUNTIME_DIR") or f"/run/user/{os.getuid()}")
    try:
        info = runtime.stat()
        if info.st_uid == os.getuid() and not info.st_mode & 0o022:
            return runtime / "gpubook-daemon.lock"
    except OSError:
        pass
    return private_folder(Path.home() / ".local" / "state") / f"gpubook-daemon-{socket.gethostname()}.lock"


def hold_account_lock(folder: Path, path: Path | None = None) -> int:
    """Take the account's daemon lock besides the state folder's; it names the holder's pid and
    state folder. Raises AlreadyRunning naming both when another daemon of this account has it."""
    path = path or account_lock_path()
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        pid, _, other = os.read(fd, 4096).decode(errors="replace").strip().partition(" ")
        os.close(fd)
        raise AlreadyRunning(f"another gpubook daemon (pid {pid or 'unknown'}, state folder {other or 'unknown'}) "
                             f"already runs as this account on this host (it holds {path}): two would fight over "
                             f"the SFTP service and the booking ports; stop it first") from None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()} {folder}\n".encode())
    return fd


def state_dir(config: config_module.Config) -> Path:
    if config.daemon.state_dir is not None:
        return config.daemon.state_dir
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "gpubook"


def make_engine(config: config_module.Config) -> Engine:
    return engines.make_engine(config.engine)


class ClockWatch:
    """Notices the wall clock stepping back between two readings: the monotonic clock says how much
    time passed; the wall clock passing less than that (by more than `tolerance` seconds, beyond
    NTP's slewing) is a step back, given as its size."""

    def __init__(self, *, tolerance: float = 1.0) -> None:
        self.tolerance = timedelta(seconds=tolerance)
        self._last: tuple[datetime, float] | None = None

    def stepped_back(self, *, wall: datetime, monotonic: float) -> timedelta | None:
        last, self._last = self._last, (wall, monotonic)
        if last is None:
            return None
        behind = timedelta(seconds=monotonic - last[1]) - (wall - last[0])
        return behind if behind > self.tolerance else None


@dataclass
class _Calendar:
    """What the daemon knows of the calendars between polls."""

    occurrences: Sequence[Booking | Rejection] = ()
    etags: dict[str, str | None] = field(default_factory=dict)
    last_poll: datetime | None = None
    last_ok: datetime | None = None
    outage: str | None = None
    outage_since: datetime | None = None
    problems: list[str] = field(default_factory=list)
    read_at: dict[str, datetime] = field(default_factory=dict)  # calendar url → its last good read
    failing: dict[str, tuple[str, datetime]] = field(default_factory=dict)  # url → (cause, since)


def _runnable(config: config_module.Config) -> None:
    """What the daemon refuses to start with, in one sentence (the config's own checks came first)."""
    if problem := backends.config_problem(config):
        raise ConfigError(problem)


class Daemon:
    def __init__(self, config: config_module.Config, *, notifier: Notifier | None = None,
                 engine: Engine | None = None, exclusive: bool = False) -> None:
        """`exclusive`: this is the daemon (`gpubook run`), not a command borrowing its parts: take
        the state folder's lock first, before the state database is opened."""
        self.state_dir = private_folder(state_dir(config))  # 0700: history, probe key, status
        # 0700 and the daemon's own: the entrypoint every container runs as root, the NVIDIA link
        # folders and the bookings' host keys are made there (issue 22, finding 12).
        private_folder(ssh.default_cache_dir(), own=True)
        self.lock_fd = hold_lock(self.state_dir) if exclusive else None
        self.account_lock_fd = hold_account_lock(self.state_dir) if exclusive else None
        self.config = config
        self.notifier = notifier or Notifier.from_environment()
        self.engine = engine or make_engine(config)
        self.state = State(self.state_dir / "state.sqlite")
        self.probe_key = ssh.load_probe_key(self.state_dir / "probe-key")
        self.calendar = _Calendar()
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._reload = threading.Event()
        self._last_pass: datetime | None = None
        self._woken = threading.Event()  # the first pass done, or a signal to stop
        self._clock = ClockWatch()
        self.sftp: sftp_host.SftpService | None = None
        self.images: ImagePreparer | None = None
        self.last_status: status.Status | None = None  # the last pass's, for the metrics and the web page
        self.web: WebServer | None = None
        self.gpu_view = nvml.CachedView(self._gpu_view)  # one live view for the page and the metrics
        self.metrics = metrics.Metrics(status=lambda: self.last_status, usage=self.state,
                                       users=lambda: self.config.users.keys(), gpus=self.gpu_view.view)
        self._world: World | None = None  # the containers as the last pass saw them (the sampler reads them)
        _runnable(config)
        self._build(config)
        self.scheduler = BackgroundScheduler(
            executors={"default": ThreadPoolExecutor(3)}, timezone=UTC,
            job_defaults={"coalesce": True, "misfire_grace_time": None, "max_instances": 1})

    def _build(self, config: config_module.Config) -> None:
        inventory = gpu_inventory.inventory(static_count=config.gpu_count)
        if inventory.source != "nvml":
            line = (f"no NVIDIA driver here ({inventory.problem or 'NVML lists no GPU'}): bookings run on "
                    f"the [gpus] count of {inventory.count} without driver injection")
            log.warning("%s", line)
            self._event(line)
        templates = load_all(config.templates_dir)
        for name, problem in templates.errors.items():
            log.warning("template %s is broken and skipped: %s", name, problem.splitlines()[0])
        old = getattr(self, "passes", None)
        if old is not None:
            old.close()
        self.inventory = inventory
        self.monitor = nvml.monitor(config.gpu_monitor)  # loaded once; the config checked that it loads
        if self.images is not None:
            self.images.close()
        self.images = ImagePreparer(engine=self.engine, ledger=Ledger(self.state_dir / "images.json"),
                                    auth_file=config.images.auth_file, min_free_gb=config.images.min_free_gb,
                                    workers=config.images.workers, on_done=self._soon)
        self.images.on_pull = self.metrics.image_pulled
        self.backend = backends.make(config, backends.Parts(engine=self.engine, probe_key=self.probe_key,
                                                            images=self.images, inventory=inventory))
        self.passes = Pass(config, backend=self.backend, state=self.state, templates=templates,
                           notices=notices.Notices.from_config(config), metrics=self.metrics,
                           logged_in=self._logged_in)
        # A booking's work that outlasted its pass (an image prepared in the background: on_done above).
        self.passes.on_settled = self._soon
        self.calendars = Calendars(config, topology=self.backend.topology)
        self.config = config
        # What runs on this machine, as the backend says (a cluster's bookings run on its nodes: nothing here).
        sampling = self.backend.sampling(lambda: self._world.actual() if self._world is not None else [])
        self.sampler = usage.Sampler(state=self.state, host=LOCAL, interval=config.daemon.sample_seconds,
                                     running=sampling.running,
                                     logs=sampling.logs, probe_fingerprint=self.probe_key.fingerprint,
                                     read=self.gpu_view.view)
        self.foreign = ForeignWatch(state=self.state, host=LOCAL, read=self.gpu_view.view,
                                    running=sampling.running, mode=config.policy.foreign_processes,
                                    on_change=self._soon, inspect=self.engine.inspect,
                                    grace=timedelta(minutes=config.policy.foreign_grace_minutes))
        self._build_sftp(config, templates, self.images)

    def _logged_in(self, info: ContainerInfo) -> bool:
        """A release's last look for the booker's login in the container's log (as the sampler looks)."""
        return usage.booker_logged_in(self.engine.logs(info.name), user=info.user,
                                      probe_fingerprint=self.probe_key.fingerprint)

    def _build_sftp(self, config: config_module.Config, templates: TemplateSet, images: ImagePreparer) -> None:
        """The SFTP data service: made once, given each reloaded config (its users and keys)."""
        settings = sftp_host.settings_of(config)
        image = sftp_host.image_of(config, templates, images.ready)
        if settings is None:
            if self.sftp is not None:
                log.warning("SFTP service switched off by the config: stopping it")
                self.sftp.stop(grace=config.engine.stop_grace_seconds)
            self.sftp = None
        elif self.sftp is None:
            self.sftp = sftp_host.SftpService(engine=self.engine, settings=settings,
                                              etc_dir=private_folder(self.state_dir / "sftp") / "etc", image=image)
        else:
            self.sftp.configure(settings, image=image)
        service = self.sftp
        self.passes.writeback.sftp_host_key = service.public_key if service is not None else lambda: ""

    def check_sftp(self) -> None:
        """The SFTP watch: folders, quotas, sshd's files, the container (started again if gone)."""
        service = self.sftp
        if service is not None:
            service.check()

    # -- passes --------------------------------------------------------------------------------

    def _gpu_view(self) -> nvml.NvmlView:
        """The GPUs' live view ([gpus] monitor) for the sampler, the metrics and the page; with NVML,
        nothing to read (and no NVML call) without a driver."""
        if self.config.gpu_monitor == "nvml" and self.inventory.source != "nvml":
            return nvml.NvmlView(None, problem="no NVIDIA driver")
        return self.monitor()

    def poll(self) -> None:
        """Read the calendars, then run a pass. A CalendarError keeps the last known bookings."""
        began = time.monotonic()
        try:
            self._poll()
        finally:
            self.metrics.polled(seconds=time.monotonic() - began)

    def _poll(self) -> None:
        now = datetime.now(UTC)
        try:
            reading = self.calendars.read(now=now)
        except CalendarError as error:
            for calendar in self.config.calendars:  # read() raises only when every calendar failed
                self.metrics.calendar_failed(url=calendar.url, cause=str(error))
            self._outage(str(error), now)
        else:
            for url, cause in reading.failures.items():
                self.metrics.calendar_failed(url=url, cause=cause)
            with self._lock:
                self.calendar.occurrences = reading.occurrences
                self.calendar.etags = reading.etags
                self.calendar.problems = [f"{p.uid or p.href}: {p.reason}" for p in reading.problems]
                self.calendar.last_ok = now
                self.calendar.read_at = reading.read_at
                self._calendar_failures(reading.failures, now)
                if self.calendar.outage is not None:
                    since = self.calendar.outage_since or now
                    message = (f"calendar reachable again after {_duration(now - since)} "
                               f"(was: {self.calendar.outage})")
                    log.warning("%s", message)
                    self._event(message, now)
                    self.calendar.outage = self.calendar.outage_since = None
        self.calendar.last_poll = now
        self.reconcile()

    def _outage(self, cause: str, now: datetime) -> None:
        with self._lock:
            if self.calendar.outage is None:
                self.calendar.outage, self.calendar.outage_since = cause, now
                message = (f"calendar unreachable: {cause}; keeping the last known bookings, "
                           f"nothing starts from data older than {self.config.daemon.stale_after_minutes:g} min")
                log.warning("%s", message)
                self._event(message, now)

    def _event(self, message: str, now: datetime | None = None, *, level: str = "warning") -> None:
        """A line for the event log; a database that cannot be written costs the line, never the daemon."""
        try:
            self.state.log_event(message, level=level, at=now)
        except StateError as error:
            log.warning("not in the event log: %s", error)

    def _calendar_failures(self, failures: dict[str, str], now: datetime) -> None:
        """One calendar failing while others read: logged once when it starts and once when it ends."""
        for url, cause in failures.items():
            if url not in self.calendar.failing:
                self.calendar.failing[url] = (cause, now)
                message = (f"calendar {redact_url(url)} cannot be read: {cause}; its last good reading is kept, "
                           "the other calendars go on")
                log.warning("%s", message)
                self._event(message, now)
        for url in [u for u in self.calendar.failing if u not in failures]:
            cause, since = self.calendar.failing.pop(url)
            message = f"calendar {redact_url(url)} readable again after {_duration(now - since)} (was: {cause})"
            log.warning("%s", message)
            self._event(message, now)

    def _stale_calendars(self, now: datetime) -> dict[str, str]:
        """Calendars whose own data is too old to start anything from (the others start as usual)."""
        bound = timedelta(minutes=self.config.daemon.stale_after_minutes)
        stale = {}
        for calendar in self.config.calendars:
            read = self.calendar.read_at.get(calendar.url)
            cause = self.calendar.failing.get(calendar.url, ("unknown", now))[0]
            if read is None or now - read > bound:
                age = "never read" if read is None else f"{_duration(now - read)} old"
                stale[calendar.url] = f"its calendar's data is {age} (calendar {redact_url(calendar.url)}: {cause})"
        return stale

    def reconcile(self) -> None:
        """One pass with the bookings known now; schedules the next boundary."""
        with self._lock:
            now = datetime.now(UTC)
            may_start, stale_reason = self._fresh(now)
            began = time.monotonic()
            try:
                result = self.passes.run(self.calendar.occurrences, now=now, may_start=may_start,
                                         stale_reason=stale_reason, etags=self.calendar.etags,
                                         stale_calendars=self._stale_calendars(now) if may_start else {},
                                         complete=all(c.url in self.calendar.read_at for c in self.config.calendars))
                self.metrics.passed(seconds=time.monotonic() - began)
            except GpubookError as error:  # the engine itself failing: try again soon
                log.error("reconcile pass failed: %s; retrying in 10 s", error)
                self._wake_at(now + timedelta(seconds=10))
                return
            self._last_pass = now
            self._world = result.world
            self._woken.set()
            if result.wake_at is not None:
                self._wake_at(result.wake_at)
            self._report(result, now)

    def _fresh(self, now: datetime) -> tuple[bool, str]:
        last_ok = self.calendar.last_ok
        if last_ok is None:
            return False, "no calendar data read yet"
        age = now - last_ok
        if age > timedelta(minutes=self.config.daemon.stale_after_minutes):
            return False, (f"the calendar data is {_duration(age)} old (calendar unreachable: "
                           f"{self.calendar.outage or 'unknown'})")
        return True, ""

    def _ports(self) -> dict[str, int]:
        try:
            return self.state.ports()
        except StateError:
            return {}  # the status file shows no ports this time; the next pass writes them

    def _records(self) -> list[ContainerRecord]:
        try:
            return self.state.containers()
        except StateError:
            return []  # the timelines show no ended runs this time

    def _serve_web(self) -> WebServer | None:
        """The status page, when [web] enabled: Flask is imported only then (the daemon's memory).
        A page that cannot start costs the page, never the bookings."""
        if not self.config.web.enabled:
            return None
        try:
            extras.require("web")
        except extras.MissingExtra as error:
            log.error("the status page does not start: %s", error)
            self._event(f"the status page does not start: {error}", level="error")
            return None
        from gpubook.scheduler.outbox.web import serve

        try:
            mounts = {"/metrics": metrics.wsgi_app(self.metrics)} if self.config.web.metrics else None
            return serve.start(self.config, status=lambda: self.last_status, mounts=mounts, gpus=self.gpu_view)
        except GpubookError as error:
            log.error("the status page does not start: %s", error)
            self._event(f"the status page does not start: {error}", level="error")
            return None

    def _restart_web(self) -> None:
        """SIGHUP: the page served again with the reloaded [web] (its htpasswd file read again)."""
        if self.web is not None:
            self.web.stop()
        self.web = self._serve_web()

    def _soon(self) -> None:
        """A pass now, as a job of its own: the pass running meanwhile replaces only "boundary"."""
        if self.scheduler.running:
            self.scheduler.add_job(self.reconcile, "date", run_date=datetime.now(UTC), id="settled",
                                   replace_existing=True)

    def _wake_at(self, moment: datetime) -> None:
        if self.scheduler.running:
            self.scheduler.add_job(self.reconcile, "date", run_date=moment, id="boundary", replace_existing=True)

    def _report(self, result: PassResult, now: datetime) -> None:
        containers = result.world.actual() if result.world is not None else []
        report = status.Status(
            hosts=status.hosts_status(self._gpu_summaries(), plan=result.plan, now=now,
                                      containers=containers, ports=self._ports(),
                                      held=timeline.held_reasons(result.actions), records=self._records(),
                                      previous=self.last_status),
            updated=now.isoformat(), pid=os.getpid(), last_poll=status.iso(self.calendar.last_poll),
            last_poll_ok=status.iso(self.calendar.last_ok), outage=self.calendar.outage,
            outage_since=status.iso(self.calendar.outage_since),
            problems=(*self.calendar.problems, *(f"{k}: {v}" for k, v in result.failures.items())),
            counts=status.counts(result.plan, now=now), findings=status.setup_findings(self.config.engine),
            sftp=self.sftp.status.to_json() if self.sftp is not None else None,
            images=self.images.snapshot() if self.images is not None else None,
            rejected=timeline.rejected_bookings(result.plan), foreign=self._foreign_items())
        self.last_status = report
        self.notifier.status(report.line())
        write_private(self.state_dir / STATUS_FILE, json.dumps(report.to_json(), indent=2).encode())

    def _gpu_summaries(self) -> dict[str, status.GpuSummary]:
        """Each host's GPUs for the status, as the backend gives them (this machine's, or each cluster node's)."""
        return {name: status.GpuSummary(source=gpus.source, count=gpus.count, driver=gpus.driver, note=gpus.note,
                                        indices=gpus.indices) for name, gpus in self.backend.gpus().items()}

    def _foreign_items(self) -> tuple[dict[str, object], ...]:
        try:
            return foreign.status_items(self.state.foreign())
        except StateError:
            return ()  # the status file shows none this time; the next pass reads them again

    def sample(self) -> None:
        """The sampling job: the GPUs' samples and first logins, then the processes outside bookings."""
        try:
            self.sampler()
        finally:  # one half failing never silences the other
            self.foreign()

    # -- signals and the main loop -------------------------------------------------------------

    def reload(self) -> bool:
        """SIGHUP: read config and templates again; an invalid config is refused, the old one kept."""
        self.notifier.reloading()
        try:
            new = config_module.load(self.config.path)
            _runnable(new)
        except ConfigError as error:
            message = f"reload refused, keeping the running config: {error}"
            log.error("%s", message)
            self._event(message, level="error")
            self.notifier.ready()
            return False
        with self._lock:
            self._build(new)
            self.scheduler.reschedule_job("poll", trigger="interval", seconds=new.daemon.poll_seconds)
            self._schedule_sftp()
            self._schedule_sampling()
        self._restart_web()
        log.warning("config %s and templates reloaded", new.path)
        self._event(f"config {new.path} and templates reloaded", level="info")
        self.notifier.ready()
        self.poll()
        return True

    def _signal(self, number: int, frame: FrameType | None) -> None:
        if number == signal.SIGHUP:
            self._reload.set()
        else:
            self._stop.set()
            self._woken.set()

    def run(self) -> int:
        for number in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(number, self._signal)
        self._event(f"daemon started (pid {os.getpid()}), config {self.config.path}", level="info")
        self.scheduler.start()
        self.web = self._serve_web()
        self._schedule_sftp()
        self._schedule_sampling()
        self._schedule_polls(first=datetime.now(UTC))
        first = self._wait_first_pass()
        # After a first pass, STATUS= is already its status line (written with daemon-status.json): READY
        # alone keeps it, where "first pass done" hid it until the next poll (seen under real systemd).
        self.notifier.ready(status=None if first else "started; first pass still running")
        interval = self.notifier.watchdog_interval or 5.0
        try:
            while not self._stop.wait(min(interval, 5.0)):
                self._watch_clock(wall=datetime.now(UTC), monotonic=time.monotonic())
                if self._reload.is_set():
                    self._reload.clear()
                    self.reload()
                if self.scheduler.running:
                    self.notifier.watchdog()
        finally:
            self.notifier.stopping()
            if self.web is not None:
                self.web.stop()
            self.scheduler.shutdown(wait=True)
            self.passes.close()
            if self.images is not None:
                self.images.close()
            self._event("daemon stopped; containers keep running", level="info")
            log.warning("gpubook daemon stopped; running containers keep running")
            self.state.close()
        return 0

    def _schedule_polls(self, *, first: datetime) -> None:
        """The poll job: at `first`, then every poll interval (replacing the one there was)."""
        self.scheduler.add_job(self.poll, "interval", seconds=self.config.daemon.poll_seconds, id="poll",
                               next_run_time=first, replace_existing=True)

    def _schedule_sftp(self) -> None:
        """The SFTP watch job: now, then every [sftp] check_seconds; none while the service is off.
        A reload runs it at once, so that a removed user is refused from then on."""
        if self.sftp is None:
            if self.scheduler.get_job("sftp") is not None:
                self.scheduler.remove_job("sftp")
            return
        self.scheduler.add_job(self.check_sftp, "interval", seconds=self.config.sftp.check_seconds, id="sftp",
                               next_run_time=datetime.now(UTC), replace_existing=True)

    def _schedule_sampling(self) -> None:
        """The sampler's job (GPU samples, first logins) every [daemon] sample_seconds; none at 0."""
        seconds = self.config.daemon.sample_seconds
        if seconds <= 0:
            if self.scheduler.get_job("sample") is not None:
                self.scheduler.remove_job("sample")
            return
        self.scheduler.add_job(self.sample, "interval", seconds=seconds, id="sample", replace_existing=True)

    def _watch_clock(self, *, wall: datetime, monotonic: float) -> None:
        """Called every few seconds by the main loop with both clocks' readings: on a step back of
        the wall clock, the next poll (which APScheduler keeps in wall-clock time) is now."""
        step = self._clock.stepped_back(wall=wall, monotonic=monotonic)
        if step is None or not self.scheduler.running:
            return
        message = (f"the wall clock stepped back by {_duration(step)}; polling now and every "
                   f"{self.config.daemon.poll_seconds:g} s from here")
        log.warning("%s", message)
        self._event(message, level="info")
        self._schedule_polls(first=wall)

    def _wait_first_pass(self, *, timeout: float = 120.0, extend_every: float = 5.0) -> bool:
        """Wait for the first pass, at most `timeout` s: READY=1 waits for it, so `gpubook status`
        and systemd agree on what runs. Meanwhile EXTEND_TIMEOUT_USEC, as sd_notify(3) provides for
        a start that takes long: systemd's start timeout (90 s by default) never ends a first pass
        that is still working, and a daemon that hangs before this loop still meets it."""
        deadline = time.monotonic() + timeout
        while self._last_pass is None and not self._stop.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self.notifier.extend_timeout(3 * extend_every)
            self._woken.wait(min(extend_every, left))
        return self._last_pass is not None


def _duration(span: timedelta) -> str:
    seconds = int(span.total_seconds())
    if seconds < 120:
        return f"{seconds} s"
    if seconds < 7200:
        return f"{seconds // 60} min"
    return f"{seconds / 3600:.1f} h"
