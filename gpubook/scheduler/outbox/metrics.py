"""Prometheus metrics: what the daemon is doing, for a lab's Prometheus and Grafana.

Two kinds of figures, in one CollectorRegistry of gpubook's own (never prometheus-client's global
one: nothing a library registers there mixes in, and tests build as many as they like):

- read at scrape time by `_Collector` from what the daemon already holds: the last pass's `Status`
  (bookings by state, running containers, images prepared ahead, the last poll), State's GPU-hours
  per user and NVML's live utilisation and memory (through the caller's `nvml.CachedView`, so that
  scrapes never hammer the driver; absent where there is no GPU);
- observed as they happen, through `Metrics`' methods, by the daemon (poll and pass durations,
  calendar errors), the apply stage (start-to-SSH latency, failed starts) and the image preparer.

Instrumentation never breaks or slows a pass: each method is a few in-memory additions that catch
their own errors and log them; a scrape that cannot read one source leaves out its families and
logs why, the others are still served. Label values are bounded: `user` by the lab's configured
users (anything else, say a stale record's empty user, is counted as `OTHER_USER`), `calendar` by
the configured calendars (scheme://host/… only: a private
address carries its secret in the path or query), `reason`, `cause` and `outcome` by the fixed sets below.
Units are Prometheus's base units: seconds, bytes, ratios (GPU-hours are exposed as GPU-seconds).
"""

from __future__ import annotations

import functools
import logging
import socket
from collections.abc import Callable, Collection, Iterator, Mapping
from datetime import datetime
from typing import Any, ParamSpec, Protocol, runtime_checkable
from wsgiref.types import WSGIApplication

import paramiko
from prometheus_client import CollectorRegistry, Counter, Histogram, Info, disable_created_metrics, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gpubook import __version__
from gpubook.runtime.booking.ssh import ForeignHostKey
from gpubook.runtime.errors import DriverError, EngineError, GpubookError, StorageError, TemplateError
from gpubook.runtime.nvidia.nvml import MIB, NvmlView
from gpubook.runtime.templates import images
from gpubook.scheduler.core.plan import LOCAL
from gpubook.scheduler.outbox.status import Status
from gpubook.scheduler.sources.errors import redact_urls
from gpubook.scheduler.state import StateError

log = logging.getLogger(__name__)

PREFIX = "gpubook"
OTHER_USER = "(other)"  # GPU-hours of a user not (or no longer) in the config
BOOKING_STATES = ("now", "upcoming", "rejected", "armed", "running")
START_FAILURES = ("refused", "image", "ssh_host_key", "engine", "driver", "storage", "template", "state",
                  "ssh", "os", "other")
CALENDAR_CAUSES = ("unreachable", "timeout", "auth", "tls", "server", "data", "other")
PULL_OUTCOMES = ("pulled", "present", "refused", "not_found", "no_space", "unreachable", "failed")
_PULL_WHY = {images.REFUSED: "refused", images.NOT_FOUND: "not_found", images.NO_SPACE: "no_space",
             images.UNREACHABLE: "unreachable", images.FAILED: "failed", "pulled": "pulled", "present": "present"}
PREPARATION_STATES = ("queued", "pulling", "warming", "building", "ready", "failed")
# Start-to-SSH: from the engine start to the probe's login (an armed container: from its opening).
SSH_BUCKETS = (0.25, 0.5, 1.0, 2.0, 3.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0)
POLL_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
CHECK_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

P = ParamSpec("P")

# No `_created` series: in the text format Prometheus stores each as a gauge of its own, doubling the
# series of every counter and histogram for no panel. (A process-wide switch; gpubook's process has no
# other metrics.)
disable_created_metrics()


@runtime_checkable
class UsageSource(Protocol):
    """State's accounting (gpubook/scheduler/state/usage.py): GPU-hours per user since the state file began."""

    def gpu_hours_booked_by_user(self) -> dict[str, float]: ...

    def gpu_hours_used_by_user(self) -> dict[str, float]: ...


def _guarded(method: Callable[P, None]) -> Callable[P, None]:
    """A metric that cannot be recorded costs its figure and one log line, never the caller's work."""

    @functools.wraps(method)
    def guarded(*args: P.args, **kwargs: P.kwargs) -> None:
        try:
            method(*args, **kwargs)
        except Exception as error:
            log.warning("metrics: %s not recorded: %s", method.__name__, error)

    return guarded


def start_failure_reason(error: BaseException) -> str:
    """A failed start's label: its error's kind, one of START_FAILURES (never its text: unbounded)."""
    kinds: tuple[tuple[type[BaseException], str], ...] = (
        (images.PullError, "image"), (ForeignHostKey, "ssh_host_key"), (EngineError, "engine"),
        (DriverError, "driver"), (StorageError, "storage"), (TemplateError, "template"), (StateError, "state"),
        (paramiko.SSHException, "ssh"), (EOFError, "ssh"), (OSError, "os"), (GpubookError, "other"))
    return next((label for kind, label in kinds if isinstance(error, kind)), "other")


def calendar_cause(text: str) -> str:
    """A calendar failure's class, one of CALENDAR_CAUSES, from the sources' one-line sentences."""
    lowered = text.lower()
    classes = (("auth", ("credentials refused", "http 401", "http 403")),
               ("timeout", ("timeout", "timed out")),
               ("tls", ("tls failed", "certificate")),
               ("unreachable", ("connection refused", "host name not found", "name or service not known",
                                "no route to host", "connection failed", "connection aborted")),
               ("server", ("server error",)),
               ("data", ("not a caldav calendar", "no such calendar", "not icalendar", "http 404", "not a calendar")))
    return next((cause for cause, words in classes if any(w in lowered for w in words)), "other")


class Metrics:
    """The daemon's metrics: made once per daemon (kept across reloads), observed by its parts,
    served by `wsgi_app` under the web page's /metrics."""

    def __init__(self, *, status: Callable[[], Status | None], usage: UsageSource | None = None,
                 users: Callable[[], Collection[str]] = frozenset, gpus: Callable[[], NvmlView] | None = None,
                 host_name: Callable[[], str] = socket.gethostname) -> None:
        """`status`: the last pass's Status (None before the first); `usage`: State's GPU-hours;
        `users`: the configured users (bounds the `user` label); `gpus`: NVML's view with status,
        cached by the caller (runtime.nvidia.nvml.CachedView.view), None where the daemon reads no GPU;
        `host_name`: this machine's [host] name, its `host` label (a lab's servers' series stay apart;
        the planner's internal name for it, "local", never leaves the daemon)."""
        self.registry = CollectorRegistry()
        self.start_ssh = Histogram(f"{PREFIX}_start_ssh_seconds", "Seconds from a booking's container start "
                                   "(an armed one: its opening) until its SSH server let the probe key in.",
                                   buckets=SSH_BUCKETS, registry=self.registry)
        self.poll_duration = Histogram(f"{PREFIX}_poll_duration_seconds", "Seconds of one poll: reading the "
                                       "calendars and the pass after it.", buckets=POLL_BUCKETS,
                                       registry=self.registry)
        self.check_duration = Histogram(f"{PREFIX}_check_duration_seconds", "Seconds of one change check's "
                                        "requests (the calendar server's answers): the count is the checks made, "
                                        "and the next check waits at least 10 times the last one.",
                                        buckets=CHECK_BUCKETS, registry=self.registry)
        self.pass_duration = Histogram(f"{PREFIX}_pass_duration_seconds", "Seconds of one pass (polls and "
                                       "boundary wake-ups).", buckets=POLL_BUCKETS, registry=self.registry)
        self.calendar_errors = Counter(f"{PREFIX}_calendar_errors", "Calendar reads that failed, by calendar "
                                       "(scheme://host/… only) and cause class.", ["calendar", "cause"],
                                       registry=self.registry)
        self.failed_starts = Counter(f"{PREFIX}_failed_starts", "Booking starts that failed or were refused, by "
                                     "the kind of error.", ["reason"], registry=self.registry)
        self.image_pulls = Counter(f"{PREFIX}_image_pulls", "Template images pulled ahead of their bookings, by "
                                   "outcome (present: nothing to pull).", ["outcome"], registry=self.registry)
        # gpubook_build_info{version="…"} 1: which gpubook answers (a dashboard's join key after an upgrade)
        self.build = Info(f"{PREFIX}_build", "The running gpubook's version.", registry=self.registry)
        self.build.info({"version": __version__})
        self.releases = Counter(f"{PREFIX}_released_bookings", "Running bookings released as no-shows (nobody "
                                "logged in, GPUs idle) or, with [policy] idle_action = \"release\", as idle.",
                                registry=self.registry)
        self.promotions = Counter(f"{PREFIX}_standby_promotions", "Bookings that waited on standby (standby: yes) "
                                  "and were accepted when their GPUs freed up.", registry=self.registry)
        for reason in START_FAILURES:  # zeros from the start: rate() and alerts see the first failure
            self.failed_starts.labels(reason=reason)
        for outcome in PULL_OUTCOMES:
            self.image_pulls.labels(outcome=outcome)
        self.registry.register(_Collector(status=status, usage=usage, users=users,
                                          gpus=gpus, host_name=host_name))

    @_guarded
    def started(self, *, seconds_to_ssh: float) -> None:
        self.start_ssh.observe(seconds_to_ssh)

    @_guarded
    def start_failed(self, *, reason: str) -> None:
        self.failed_starts.labels(reason=reason if reason in START_FAILURES else "other").inc()

    @_guarded
    def released(self) -> None:
        self.releases.inc()

    @_guarded
    def promoted(self) -> None:
        self.promotions.inc()

    @_guarded
    def polled(self, *, seconds: float) -> None:
        self.poll_duration.observe(seconds)

    @_guarded
    def checked(self, *, seconds: float) -> None:
        self.check_duration.observe(seconds)

    @_guarded
    def passed(self, *, seconds: float) -> None:
        self.pass_duration.observe(seconds)

    @_guarded
    def calendar_failed(self, *, url: str, cause: str) -> None:
        self.calendar_errors.labels(calendar=redact_urls(url), cause=calendar_cause(cause)).inc()

    @_guarded
    def image_pulled(self, outcome: str) -> None:
        """The image preparer's hook: "pulled", "present", or a failed pull's reason (runtime.templates.images)."""
        self.image_pulls.labels(outcome=_PULL_WHY.get(outcome, "failed")).inc()


def wsgi_app(metrics: Metrics) -> WSGIApplication:
    """/metrics in Prometheus's text format, for the web app's mounts (same access rules as the page)."""
    return make_wsgi_app(metrics.registry)


class _Collector(Collector):
    """The figures read at scrape time; each source on its own, so one failing leaves the rest."""

    def __init__(self, *, status: Callable[[], Status | None], usage: UsageSource | None,
                 users: Callable[[], Collection[str]], gpus: Callable[[], NvmlView] | None,
                 host_name: Callable[[], str]) -> None:
        self.status, self.usage, self.users, self.gpus, self.host_name = status, usage, users, gpus, host_name

    def describe(self) -> list[Metric]:
        return []  # families vary with what there is (no GPU: none of the GPU ones)

    def collect(self) -> Iterator[Metric]:
        for name, part in (("the status", self._status), ("GPU-hours", self._usage), ("NVML", self._gpus)):
            try:
                yield from list(part())
            except Exception as error:  # a scrape serves what it can; the daemon goes on
                log.warning("metrics: %s left out of this scrape: %s", name, error)

    def _status(self) -> Iterator[Metric]:
        report = self.status()
        if report is None:
            return
        name = self.host_name()
        bookings = GaugeMetricFamily(f"{PREFIX}_bookings", "Bookings at the last pass by state: now (its time is "
                                     "now), upcoming, rejected; armed and running (containers); `host`: the "
                                     "daemon's [host] name.", labels=["host", "state"])
        running = [item for host in report.hosts for item in host.running]
        armed = sum(1 for item in running if item.state.startswith("armed"))
        values = {**{s: report.counts.get(s, 0) for s in ("now", "upcoming", "rejected")},
                  "armed": armed, "running": sum(1 for item in running if item.state == "running")}
        for state in BOOKING_STATES:
            bookings.add_metric([name, state], values[state])
        yield bookings
        containers = GaugeMetricFamily(f"{PREFIX}_containers_running", "Booking containers running (armed ones "
                                       "included) at the last pass, by host.", labels=["host"])
        gpus = GaugeMetricFamily(f"{PREFIX}_gpus", "GPUs a host offers to bookings.", labels=["host", "source"])
        for host in report.hosts:
            containers.add_metric([_label(host.name, name)], len(host.running))
            gpus.add_metric([_label(host.name, name), host.gpus.source], host.gpus.count)
        yield containers
        yield gpus
        yield from _poll_families(report)
        yield from _image_families(report.images)
        yield _foreign_family(report, host_name=name)
        if (info := self._booking_info(report, host_name=name)).samples:  # no booking running: no series
            yield info

    def _booking_info(self, report: Status, *, host_name: str) -> Metric:
        """gpubook_gpu_booking_info{host,gpu,uuid,user,booking} 1 for each GPU of a running booking: the
        join that puts a booker's name on a dcgm-exporter series (by `uuid`, or by host and GPU). On this
        machine only the GPUs NVML lists (like every gpubook_gpu_ series); a cluster node's without UUID."""
        family = GaugeMetricFamily(f"{PREFIX}_gpu_booking_info", "1 for each GPU of a booking running at the last "
                                   "pass: its host, GPU index and UUID (NVML's, on this machine), booker and "
                                   "booking.", labels=["host", "gpu", "uuid", "user", "booking"])
        uuids: dict[int, str] = {}
        if self.gpus is not None:
            try:
                uuids = {gpu.index: gpu.uuid or "" for gpu in self.gpus().gpus}
            except Exception as error:  # the UUIDs left out, the bookers kept
                log.warning("metrics: GPU UUIDs left out of the bookings' series: %s", error)
        for host in report.hosts:
            for item in host.running:
                if item.state != "running":
                    continue
                for gpu in item.gpus:
                    if host.name == LOCAL and gpu not in uuids:
                        continue  # a GPU NVML does not list here (a [gpus] count without a driver): no GPU series
                    uuid = uuids.get(gpu, "") if host.name == LOCAL else ""
                    family.add_metric([_label(host.name, host_name), str(gpu), uuid, item.user, item.booking], 1)
        return family

    def _usage(self) -> Iterator[Metric]:
        if self.usage is None:
            return
        known = frozenset(self.users())
        for kind, read in (("booked", self.usage.gpu_hours_booked_by_user),
                           ("used", self.usage.gpu_hours_used_by_user)):
            family = CounterMetricFamily(f"{PREFIX}_{kind}_gpu_seconds", f"GPU-seconds {kind} by user since the "
                                         "state file began (GPU-hours × 3600).", labels=["user"])
            for user, hours in _bounded(read(), known).items():
                family.add_metric([user], hours * 3600.0)
            yield family

    def _gpus(self) -> Iterator[Metric]:
        if self.gpus is None:
            return
        view = self.gpus()
        if not view.gpus:
            return  # no GPU (or NVML unreadable): no GPU series at all, rather than zeros
        labels = ["host", "gpu", "uuid"]
        utilisation = GaugeMetricFamily(f"{PREFIX}_gpu_utilisation_ratio", "Share of NVML's last sample period in "
                                        "which the GPU was busy (0 to 1).", labels=labels)
        used = GaugeMetricFamily(f"{PREFIX}_gpu_memory_used_bytes", "GPU memory in use.", labels=labels)
        total = GaugeMetricFamily(f"{PREFIX}_gpu_memory_total_bytes", "GPU memory in all.", labels=labels)
        for gpu in view.gpus:
            key = [self.host_name(), str(gpu.index), gpu.uuid or ""]
            if gpu.utilisation_percent is not None:
                utilisation.add_metric(key, gpu.utilisation_percent / 100.0)
            if gpu.memory_used_mib is not None:
                used.add_metric(key, gpu.memory_used_mib * MIB)
            if gpu.memory_total_mib is not None:
                total.add_metric(key, gpu.memory_total_mib * MIB)
        yield from (utilisation, used, total)


def _bounded(hours: Mapping[str, float], known: Collection[str]) -> dict[str, float]:
    """Hours by user with every user the config does not know summed as OTHER_USER (bounded labels)."""
    kept: dict[str, float] = {}
    for user, value in hours.items():
        label = user if user in known else OTHER_USER
        kept[label] = kept.get(label, 0.0) + value
    return kept


def _poll_families(report: Status) -> Iterator[Metric]:
    for name, text, help_text in (("last_poll", report.last_poll, "the last poll"),
                                  ("last_poll_success", report.last_poll_ok, "the last poll that read a calendar")):
        if text:
            yield GaugeMetricFamily(f"{PREFIX}_{name}_timestamp_seconds", f"Unix time of {help_text}.",
                                    value=datetime.fromisoformat(text).timestamp())
    yield GaugeMetricFamily(f"{PREFIX}_calendar_outage", "1 while every calendar is unreachable (the last known "
                            "bookings are kept), else 0.", value=1.0 if report.outage else 0.0)


def _label(host: str, host_name: str) -> str:
    """A host's `host` label: the daemon's own machine by its [host] name, a cluster node by its own."""
    return host_name if host == LOCAL else host


def _foreign_family(report: Status, *, host_name: str) -> Metric:
    """Processes on each GPU outside its booking's container (or on a GPU nobody booked)."""
    family = GaugeMetricFamily(f"{PREFIX}_foreign_processes", "Processes on a GPU that are not its booking's "
                               "container's (or on an unbooked GPU), at the last pass.", labels=["host", "gpu"])
    counted = {(_label(host.name, host_name), str(gpu)): 0 for host in report.hosts for gpu in host.gpus.gpu_indices}
    for item in report.foreign:
        key = (_label(str(item.get("host") or LOCAL), host_name), str(item.get("gpu")))
        counted[key] = counted.get(key, 0) + 1
    for (host, gpu), count in sorted(counted.items()):
        family.add_metric([host, gpu], count)
    return family


def _image_families(snapshot: Mapping[str, Any] | None) -> Iterator[Metric]:
    if snapshot is None:
        return
    family = GaugeMetricFamily(f"{PREFIX}_image_preparations", "Template images prepared ahead, by state.",
                               labels=["state"])
    states = [item.get("state") for item in snapshot.get("preparations") or ()]
    for state in PREPARATION_STATES:
        family.add_metric([state], states.count(state))
    yield family
    # Two families, not one with a `bytes` label: a sum over such a label (downloaded + size) means nothing.
    downloaded = GaugeMetricFamily(f"{PREFIX}_image_pull_downloaded_bytes", "Bytes of an image being pulled "
                                   "downloaded so far.", labels=["template"])
    size = GaugeMetricFamily(f"{PREFIX}_image_pull_size_bytes", "Bytes of an image being pulled in all, where the "
                             "registry said.", labels=["template"])
    for item in snapshot.get("preparations") or ():
        if item.get("state") == "pulling":
            downloaded.add_metric([str(item["template"])], item.get("done") or 0)
            if item.get("total") is not None:
                size.add_metric([str(item["template"])], item["total"])
    yield downloaded
    yield size
    if snapshot.get("free_bytes") is not None:
        yield GaugeMetricFamily(f"{PREFIX}_image_storage_free_bytes", "Free space where the engine keeps images.",
                                value=snapshot["free_bytes"])
