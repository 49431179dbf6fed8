"""The daemon: APScheduler wakes a pass (gpubook/scheduler/apply) on a poll interval and exactly at each boundary.

- A poll job every `[daemon] poll_seconds` reads the calendars (outside the pass lock, so a slow
  server never delays a start), then runs a pass.
- Between polls, a change check every `[daemon] check_seconds` polls the calendars that can tell
  cheaply whether they changed (CalDAV by sync token or ctag; never an ICS feed) and runs a pass
  only when one did: a booking saved for right now starts within seconds, and a check that finds
  nothing costs one small request per calendar and no pass. Its next run is set after each one
  (calendars.py `check_interval`: slower on a slow server, backing off while it fails), so checks
  never overlap and never pile up.
- One date job, replaced after every pass, wakes at the next start, warning, end or recheck: a
  booking starts within a second of its start time. Jobs coalesce and have no misfire limit, so a
  job missed during a suspend runs once, late.
- Calendar unreachable: the last known bookings are kept; running containers go on to their known
  end; nothing starts from data older than `stale_after_minutes` (calendars.py: `Freshness`).
- SIGTERM/SIGINT: the scheduler stops, containers keep running (KillMode=process in the unit).
  SIGHUP: the config and templates are read again; an invalid config is refused and the old one kept.
- Under systemd: READY=1 after the first pass (at most 120 s; until then EXTEND_TIMEOUT_USEC every
  5 s, so a long first pass never meets systemd's 90 s start timeout), WATCHDOG=1, a STATUS line.
  READY=1 waits for the first pass, so that `gpubook status` and systemd agree on what runs.
- The wall clock stepping back: a poll at once (clock.py). SIGUSR1: a pass at once on the daemon's
  clock, which a test may have told a new time (clock.py, `GPUBOOK_CLOCK_FILE`). One daemon per state
  folder and per account (locks.py). The parts it runs on are built by wiring.py, at start and at each reload.
- Researchers ask it, not the calendar: `gpubook free`, `bookings` and `mine` of any account on the
  server reach its local socket (outbox/ask_socket.py) and get views of its last status, the same
  model the page and the free feed read (outbox/asking.py), as their host login may see them.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Mapping
from contextlib import suppress
from datetime import UTC, datetime, timedelta
from types import FrameType
from typing import TYPE_CHECKING, Any
from zoneinfo import ZoneInfo

from apscheduler.executors.pool import ThreadPoolExecutor
from apscheduler.jobstores.base import JobLookupError
from apscheduler.schedulers.background import BackgroundScheduler

from gpubook.runtime.engines import Engine
from gpubook.runtime.errors import ConfigError, GpubookError
from gpubook.runtime.nvidia import nvml
from gpubook.scheduler import clock, directory, wiring
from gpubook.scheduler import config as config_module
from gpubook.scheduler.apply.passes import World
from gpubook.scheduler.calendars import Freshness, check_interval, duration
from gpubook.scheduler.clock import ClockWatch
from gpubook.scheduler.core import policy
from gpubook.scheduler.core.plan import LOCAL
from gpubook.scheduler.directory.settings import EXTERNAL
from gpubook.scheduler.outbox import asking, desk, metrics, status, status_file, web
from gpubook.scheduler.outbox.ask_socket import AskServer, Peer
from gpubook.scheduler.outbox.web.directory_login import login_names
from gpubook.scheduler.sdnotify import Notifier
from gpubook.scheduler.settings import CalendarConfig
from gpubook.scheduler.sources import open_writer
from gpubook.scheduler.sources.caldav_writer import CalendarWriter
from gpubook.scheduler.state import StateError

if TYPE_CHECKING:
    from gpubook.scheduler.apply.passes import Pass
    from gpubook.scheduler.hosts.images import ImagePreparer
    from gpubook.scheduler.outbox.web.serve import WebServer

log = logging.getLogger(__name__)


class Daemon:
    def __init__(self, config: config_module.Config, *, notifier: Notifier | None = None,
                 engine: Engine | None = None, exclusive: bool = False) -> None:
        """`exclusive`: this is the daemon (`gpubook run`), not a command borrowing its parts: take
        the state folder's lock first, before the state database is opened."""
        self.base = wiring.base(config, engine=engine, exclusive=exclusive)
        self.state = self.base.state
        self.config = config
        self.notifier = notifier or Notifier.from_environment()
        self.calendar = Freshness(event=self._event)  # what is known of the calendars between polls
        self._lock = threading.RLock()
        self._reading = threading.Lock()  # one read of the calendars at a time: the poll's or the check's
        self._checks_failed = 0  # change checks failed in a row (their pace backs off)
        self._stop = threading.Event()
        self._reload = threading.Event()
        self._told = threading.Event()  # SIGUSR1: look at the clock and the bookings now
        self._nudge = threading.Event()  # a signal came: the main loop's wait ends early
        self._last_pass: datetime | None = None
        self._woken = threading.Event()  # the first pass done, or a signal to stop
        self._clock = ClockWatch()
        self.last_status: status.Status | None = None  # the last pass's, for the metrics and the web page
        self.web: WebServer | None = None
        self.asked: AskServer | None = None  # the socket researchers' `gpubook free`, `bookings`, `mine` ask
        self.gpu_view = nvml.CachedView(self._gpu_view)  # one live view for the page and the metrics
        self.metrics = metrics.Metrics(status=lambda: self.last_status, usage=self.state,
                                       users=lambda: self.config.users.keys(), gpus=self.gpu_view.view,
                                       host_name=lambda: self.config.host.name)
        self._world: World | None = None  # the containers as the last pass saw them (the sampler reads them)
        # `gpubook book`, `extend`, `end`, `cancel` on the socket: events written into the booker's calendar
        self.desk = desk.Desk(lambda: self.config, writer=self._writer_for, mine=self._mine, nudge=self._check_now,
                              where=self._where, clock=clock.now, zone=ZoneInfo(config.host.timezone))
        self.hooks = wiring.Hooks(metrics=self.metrics, gpu_view=self.gpu_view, wake=self._soon, event=self._event,
                                  running=lambda: self._world.actual() if self._world is not None else [])
        wiring.runnable(config)
        self.parts = wiring.build(config, self.base, self.hooks)
        self.scheduler = BackgroundScheduler(
            # Four: a poll and a change check waiting on a dead server leave two for the boundaries.
            executors={"default": ThreadPoolExecutor(4)}, timezone=UTC,
            job_defaults={"coalesce": True, "misfire_grace_time": None, "max_instances": 1})

    @property
    def passes(self) -> Pass:
        return self.parts.passes

    @property
    def images(self) -> ImagePreparer:
        return self.parts.images

    def _gpu_view(self) -> nvml.NvmlView:
        """The GPUs' live view for the sampler, the metrics and the page (read by `gpu_view`, cached)."""
        return self.parts.gpu_view()

    # -- passes --------------------------------------------------------------------------------

    def poll(self) -> None:
        """Read the calendars, then run a pass. A CalendarError keeps the last known bookings."""
        began = time.monotonic()
        try:
            with self._reading:
                self.calendar.poll(self.parts.calendars, now=clock.now(), lock=self._lock,
                                   failed=self.metrics.calendar_failed)
            self._schedule_check(self.config.daemon.check_seconds)  # just read: the next check in a while
            self.reconcile()
        finally:
            self.metrics.polled(seconds=time.monotonic() - began)

    def check(self) -> None:
        """The change check between polls: a pass only when a calendar changed (read by the check
        itself). Skipped while a poll reads. The next one is set when this one ends, its pass
        included: a check set earlier would come due while this one still runs, and the scheduler
        would skip it (max_instances) and drop it, a date job, for good."""
        daemon = self.config.daemon
        pace = daemon.check_seconds  # after a defect (logged by the scheduler): the checks go on
        try:
            if not self._reading.acquire(blocking=False):
                return  # the poll reads now (and sets the next check too)
            try:
                checked = self.calendar.check(self.parts.calendars, now=clock.now(), lock=self._lock)
                self._checks_failed = self._checks_failed + 1 if checked.failures else 0
                if checked.checked:
                    self.metrics.checked(seconds=checked.seconds)
                # Paced by the server's answers only (a pass holding the lock meanwhile is no cost of
                # the server's). Nothing to check (ICS feeds only, or not loaded yet): the next poll sets it.
                pace = check_interval(check_seconds=daemon.check_seconds, poll_seconds=daemon.poll_seconds,
                                      took=checked.seconds, failed=self._checks_failed) \
                    if checked.checked else daemon.poll_seconds
            finally:
                self._reading.release()
            if checked.changed:
                self.reconcile()
        finally:
            self._schedule_check(pace)

    def _event(self, message: str, now: datetime | None = None, *, level: str = "warning") -> None:
        """A line for the event log; a database that cannot be written costs the line, never the daemon."""
        try:
            self.state.log_event(message, level=level, at=now)
        except StateError as error:
            log.warning("not in the event log: %s", error)

    def reconcile(self) -> None:
        """One pass with the bookings known now; schedules the next boundary."""
        with self._lock:
            now = clock.now()
            calendars, stale_after = self.config.calendars, self.config.daemon.stale_after_minutes
            may_start, stale_reason = self.calendar.fresh(now, stale_after_minutes=stale_after)
            began = time.monotonic()
            try:
                result = self.passes.run(
                    self.calendar.occurrences, now=now, may_start=may_start, stale_reason=stale_reason,
                    etags=self.calendar.etags, complete=self.calendar.complete(calendars),
                    stale_calendars=self.calendar.stale(now, calendars=calendars, stale_after_minutes=stale_after)
                    if may_start else {})
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
            self.last_status = report = self.parts.status_of(result, state=self.state, calendar=self.calendar,
                                                             previous=self.last_status, now=now)
            self.notifier.status(report.line())
            status_file.write(report, self.base.state_dir)
        self.desk.passed()

    def _soon(self) -> None:
        """A pass now, as a job of its own: the pass running meanwhile replaces only "boundary"."""
        if self.scheduler.running:
            self.scheduler.add_job(self.reconcile, "date", run_date=datetime.now(UTC), id="settled",
                                   replace_existing=True)  # the host's now: APScheduler's clock

    def _wake_at(self, moment: datetime) -> None:
        if self.scheduler.running:
            self.scheduler.add_job(self.reconcile, "date", run_date=clock.real(moment), id="boundary",
                                   replace_existing=True)

    def answer(self, request: Mapping[str, Any], who: Peer) -> dict[str, Any]:
        """One request on the ask socket, from the account `who` (its peer credentials: never
        anything the request says), answered from the last pass's status as that account may see it."""
        config = self.config
        viewer = asking.viewer_of(who.login, config.users)
        models = {LOCAL: {gpu.index: gpu.name or "" for gpu in self.gpu_view.view().gpus}} \
            if request.get("model") else {}
        context = asking.Context(host_name=config.host.name, timezone=config.host.timezone,
                                 reach_ahead=policy.reach_ahead(config), models=models)
        log.info("ask: %s from uid %d (%s)", str(request.get("kind"))[:16], who.uid, who.login or "no login")
        if request.get("kind") in desk.KINDS:
            return self.desk.answer(request, viewer, login=who.login or str(who.uid))
        return asking.answer(self.last_status, request, viewer=viewer, context=context, now=clock.now())

    def _page_desk(self, request: Mapping[str, Any], user: str) -> dict[str, Any]:
        """One booking form of the status page, sent by its logged-in user `user` (a gpubook user's
        name: the page's login, never a form field), answered by the desk as a terminal's would be."""
        log.info("page: %s from %s", str(request.get("kind"))[:16], user)
        viewer = asking.Viewer(users=frozenset({user}) & frozenset(self.config.users), login=user)
        return self.desk.answer(request, viewer, login=user, via="page")

    def _mine(self, viewer: asking.Viewer) -> dict[str, Any]:
        """The asker's own bookings in the last pass's status (the desk's answers)."""
        context = asking.Context(host_name=self.config.host.name, timezone=self.config.host.timezone,
                                 reach_ahead=policy.reach_ahead(self.config))
        return asking.answer(self.last_status, {"kind": "mine"}, viewer=viewer, context=context, now=clock.now())

    def _where(self, booking_id: str) -> tuple[str, str, str] | None:
        """The event of a booking as the last read knew it: (href, calendar URL, UID)."""
        for item in self.calendar.occurrences:
            if item.id == booking_id and item.href:
                return item.href, item.calendar_url, item.uid
        return None

    def _writer_for(self, calendar: CalendarConfig) -> CalendarWriter:
        """The calendar's writer, for the desk's new events and changes (CalDAV's only)."""
        writer = open_writer(calendar, timezone=self.config.host.timezone)
        if not isinstance(writer, CalendarWriter):
            raise asking.AskError(f"gpubook cannot write into the calendar {calendar.url}: book in your calendar")
        return writer

    def _check_now(self) -> None:
        """The desk wrote an event: read the calendars now (a change check, else a poll), not at the next tick."""
        if not self.scheduler.running:
            return
        if self.config.daemon.check_seconds > 0:
            self._schedule_check(0)
        else:
            self.scheduler.add_job(self.poll, "date", run_date=datetime.now(UTC), id="desk-poll",
                                   replace_existing=True)

    # -- signals and the main loop -------------------------------------------------------------

    def reload(self) -> bool:
        """SIGHUP: read config and templates again; an invalid config is refused, the old one kept."""
        self.notifier.reloading()
        try:
            new = config_module.load(self.config.path, directory="read")
            wiring.runnable(new)
        except ConfigError as error:
            message = f"reload refused, keeping the running config: {error}"
            log.error("%s", message)
            self._event(message, level="error")
            self.notifier.ready()
            return False
        with self._lock:
            self.parts = wiring.build(new, self.base, self.hooks, previous=self.parts)
            self.config = new
            self.scheduler.reschedule_job("poll", trigger="interval", seconds=new.daemon.poll_seconds)
            self._schedule_watches()
        self._serve_web()
        log.info("config %s and templates reloaded", new.path)
        self._event(f"config {new.path} and templates reloaded", level="info")
        self.notifier.ready()
        self.poll()
        return True

    def _serve_web(self) -> None:
        """The page with the current [web], served again after a reload (its htpasswd file read again)."""
        if self.web is not None:
            self.web.stop()
        self.web = web.serve_daemon_page(self.config, status=lambda: self.last_status, metrics=self.metrics,
                                         gpus=self.gpu_view, event=lambda line: self._event(line, level="error"),
                                         state=self.state, members=self._page_users, book=self._page_desk,
                                         templates=lambda: sorted(self.parts.templates.templates))

    def _page_users(self) -> frozenset[str]:
        """The names the page's auth "ldap" lets in: the users now (the directory is read again)."""
        return login_names(self.config)

    def _listen_for_signals(self) -> socket.socket:
        """SIGTERM, SIGINT, SIGHUP and SIGUSR1 reach `_signal` through a thread: the C handler writes each
        signal's number into a socket pair (signal.set_wakeup_fd) and the Python handler does nothing.
        `_signal` sets Events, which take a lock: run in the handler, a signal that came while the main
        thread held that lock (in its wait) blocked the handler on it for good, and each later signal
        stacked another handler on top until the stack overflowed (found by bench/soak.py, which sends
        SIGUSR1 twice a second). Returns the writing end, closed at the stop (the thread then ends)."""
        reading, writing = socket.socketpair()
        writing.setblocking(False)
        signal.set_wakeup_fd(writing.fileno(), warn_on_full_buffer=False)
        for number in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1):
            signal.signal(number, _noted)

        def relay() -> None:
            with reading:
                while received := reading.recv(256):
                    for number in received:
                        self._signal(number, None)

        threading.Thread(target=relay, name="signals", daemon=True).start()
        return writing

    def _signal(self, number: int, frame: FrameType | None) -> None:
        if number == signal.SIGHUP:
            self._reload.set()
        elif number == signal.SIGUSR1:
            self._told.set()
        else:
            self._stop.set()
            self._woken.set()
        self._nudge.set()  # the main loop acts now, not at its next turn

    def run(self) -> int:
        signals = self._listen_for_signals()
        self._event(f"daemon started (pid {os.getpid()}), config {self.config.path}", level="info")
        self.scheduler.start()
        self._serve_web()
        self.asked = AskServer(self.answer, event=lambda line: self._event(line, level="error")).start()
        self._schedule_watches()
        self._schedule_polls(first=clock.now())
        first = self.notifier.extend_until(lambda: self._last_pass is not None or self._stop.is_set(),
                                           woken=self._woken) and self._last_pass is not None
        # After a first pass, STATUS= is already its status line (written with daemon-status.json): READY
        # alone keeps it, where "first pass done" hid it until the next poll (seen under real systemd).
        self.notifier.ready(status=None if first else "started; first pass still running")
        interval = self.notifier.watchdog_interval or 5.0
        try:
            while not self._stop.is_set():
                self._nudge.wait(min(interval, 5.0))
                self._nudge.clear()
                if self._stop.is_set():
                    break
                self._watch_clock(wall=clock.now(), monotonic=time.monotonic())
                if self._told.is_set():  # SIGUSR1: the clock was told a new time (clock.py)
                    self._told.clear()
                    self._soon()
                if self._reload.is_set():
                    self._reload.clear()
                    self.reload()
                if self.scheduler.running:
                    self.notifier.watchdog()
        finally:
            self.notifier.stopping()
            if self.web is not None:
                self.web.stop()
            if self.asked is not None:
                self.asked.stop()
            self.scheduler.shutdown(wait=True)
            self.parts.close()
            self._event("daemon stopped; containers keep running", level="info")
            log.info("gpubook daemon stopped; running containers keep running")  # a normal stop: no warning
            self.state.close()
            signal.set_wakeup_fd(-1)
            signals.close()
        return 0

    def _schedule_polls(self, *, first: datetime) -> None:
        """The poll job: at `first`, then every poll interval (replacing the one there was)."""
        self._every("poll", self.poll, self.config.daemon.poll_seconds, first=first)

    def _schedule_check(self, seconds: float) -> None:
        """The change check in `seconds` (replacing the one set); none at [daemon] check_seconds = 0."""
        if not self.scheduler.running:
            return
        if self.config.daemon.check_seconds <= 0:
            with suppress(JobLookupError):  # none set, or it is running now (a date job is gone then)
                self.scheduler.remove_job("check")
            return
        # Two at once: the poll sets the next check while one may still be in its pass.
        self.scheduler.add_job(self.check, "date", run_date=datetime.now(UTC) + timedelta(seconds=seconds),
                               id="check", replace_existing=True, max_instances=2)

    def _schedule_watches(self) -> None:
        """The SFTP watch (now, then every [sftp] check_seconds; at once after a reload, so that a
        removed user is refused from then on) and the sampler (every [daemon] sample_seconds; none
        at 0). A reload schedules them again, on the reloaded parts."""
        parts, config = self.parts, self.config
        self._every("sftp", parts.sftp.check if parts.sftp is not None else None, config.sftp.check_seconds,
                    first=clock.now())
        self._every("sample", parts.sample if config.daemon.sample_seconds > 0 else None,
                    config.daemon.sample_seconds)
        # What ended more than [daemon] keep_days ago leaves the database: a minute after the start, then daily.
        self._every("prune", self._prune if config.daemon.keep_days > 0 else None, 86400,
                    first=clock.now() + timedelta(minutes=1))
        external = config.directory is not None and config.directory.source in EXTERNAL
        self._every("directory", self._refresh_users if external else None,
                    config.directory.refresh_minutes * 60 if config.directory is not None else 900)

    def _prune(self) -> None:
        """[daemon] keep_days: what bookings that ended before the horizon left behind, and older log
        lines and samples, are deleted (state/retention.py); said once in the log when there were any."""
        days = self.config.daemon.keep_days
        deleted = self.state.prune(before=clock.now() - timedelta(days=days))
        if deleted:
            log.info("state: forgot what ended more than %g days ago ([daemon] keep_days): %s", days,
                     ", ".join(f"{count} {table}" for table, count in deleted.items()))

    def _refresh_users(self) -> None:
        """The directory's users read again (every [directory] refresh_minutes); one that does not answer
        keeps the last good copy (scheduler.directory), so no running booking loses its user."""
        new = directory.with_users(self.config)
        if (new.users, new.departed_users) == (self.config.users, self.config.departed_users):
            return
        with self._lock:
            self.parts = wiring.build(new, self.base, self.hooks, previous=self.parts)
            self.config = new
        source = directory.source_name(new.directory or directory.DirectoryConfig())
        log.info("users read again from %s: %d user(s)", source, len(new.users))
        self._event(f"users read again from the directory: {len(new.users)} user(s)", level="info")

    def _every(self, job: str, run: Callable[[], object] | None, seconds: float, *,
               first: datetime | None = None) -> None:
        """Job `job`: `run` every `seconds`, from `first` (the daemon's clock; else after one interval);
        none without `run`."""
        if run is None:
            if self.scheduler.get_job(job) is not None:
                self.scheduler.remove_job(job)
            return
        when = {"next_run_time": clock.real(first)} if first is not None else {}
        self.scheduler.add_job(run, "interval", seconds=seconds, id=job, replace_existing=True, **when)

    def _watch_clock(self, *, wall: datetime, monotonic: float) -> None:
        """Called every few seconds by the main loop with both clocks' readings: on a step back of
        the wall clock, the next poll (which APScheduler keeps in wall-clock time) is now."""
        step = self._clock.stepped_back(wall=wall, monotonic=monotonic)
        if not self.scheduler.running:
            return
        if step is None and self._clock.forward is not None:
            # Forward (a clock put right after it was behind): APScheduler sleeps the wait it
            # computed on the old clock, so an end or a start due by now would come that much late.
            log.warning("the wall clock stepped forward by %s; looking at the bookings now",
                        duration(self._clock.forward))
            self._soon()
            return
        if step is None:
            return
        message = (f"the wall clock stepped back by {duration(step)}; polling now and every "
                   f"{self.config.daemon.poll_seconds:g} s from here")
        log.warning("%s", message)
        self._event(message, level="info")
        self._schedule_polls(first=wall)


def _noted(number: int, frame: FrameType | None) -> None:
    """The Python-level handler of the daemon's signals: nothing (the wakeup fd carries them to a thread)."""
