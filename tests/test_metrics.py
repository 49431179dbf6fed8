"""The Prometheus metrics (gpubook/scheduler/outbox/metrics.py) without the daemon: names, types, labels
and values as Prometheus's own text parser reads them, bounded label values, and instrumentation
that never raises. The daemon end to end is tests/test_metrics_daemon.py."""

from __future__ import annotations

import json
import logging
import re
import threading
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from wsgiref.simple_server import WSGIRequestHandler, make_server

import paramiko
import pytest
import requests
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

import gpubook
from gpubook.runtime.booking.ssh import ForeignHostKey
from gpubook.runtime.errors import EngineError, StorageError, TemplateError
from gpubook.runtime.nvidia import nvml
from gpubook.runtime.nvidia.model import Gpu
from gpubook.runtime.nvidia.nvml import NvmlView
from gpubook.runtime.templates.catalog import get_template
from gpubook.runtime.templates.images import Ledger, PullError
from gpubook.scheduler.daemon import Daemon
from gpubook.scheduler.hosts.images import ImagePreparer
from gpubook.scheduler.outbox import metrics
from gpubook.scheduler.outbox.status import GpuSummary, HostStatus, RunningBooking, Status
from gpubook.scheduler.state import State, StateError
from tests.kits.daemon_kit import IdleEngine, in_process_daemon
from tests.kits.images_kit import lab_preparer, recording
from tests.kits.promtool import problems

USERS = frozenset({"alice", "bob"})
ROOT = Path(__file__).resolve().parents[1]


class UsageState(State):
    """State with the accounting methods H-usage adds (gpubook/scheduler/state/usage.py), fixed figures."""

    booked: dict[str, float] = {"alice": 2.5, "bob": 1.0}  # noqa: RUF012 - read only

    def gpu_hours_booked_by_user(self) -> dict[str, float]:
        return dict(self.booked)

    def gpu_hours_used_by_user(self) -> dict[str, float]:
        return {"alice": 1.25}


def two_gpus() -> NvmlView:
    """NVML's view as nvml.read(status=True) gives it on a two-GPU host (there is no GPU here)."""
    return NvmlView("580.65.06", gpus=(
        Gpu(index=0, uuid="GPU-aaaa", memory_total_mib=81920, memory_used_mib=2048, utilisation_percent=37),
        Gpu(index=1, uuid="GPU-bbbb", memory_total_mib=81920, memory_used_mib=0, utilisation_percent=0)))


def no_gpu() -> NvmlView:
    return NvmlView(None, problem="nvidia-ml-py (pynvml) is not installed")


def status() -> Status:
    running = (RunningBooking(booking="a@lab", user="alice", gpus=(0,), state="running", port=20001, end=None,
                              container="gpubook-a"),
               RunningBooking(booking="b@lab", user="bob", gpus=(1,), state="armed: SSH opens at 10:00:00 UTC",
                              port=20002, end=None, container="gpubook-b"))
    return Status(hosts=(HostStatus(name="local", gpus=GpuSummary(source="nvml", count=2), running=running),),
                  last_poll="2026-11-22T10:00:00+00:00", last_poll_ok="2026-11-22T09:59:00+00:00",
                  counts={"now": 2, "upcoming": 3, "rejected": 1},
                  images={"preparations": [{"state": "ready"}, {"state": "ready"}, {"state": "failed"},
                                           {"state": "pulling", "template": "pytorch", "done": 4_100_000_000,
                                            "total": 9_300_000_000}],
                          "free_bytes": 5_000_000_000})


@pytest.fixture
def usage(tmp_path: Path) -> Iterator[UsageState]:
    with UsageState(tmp_path / "state.sqlite") as state:
        yield state


def scrape(made: metrics.Metrics) -> dict[str, list[Sample]]:
    """Family name → its samples, as Prometheus's text parser reads the exposition."""
    text = generate_latest(made.registry).decode()
    return {family.name: family.samples for family in text_string_to_metric_families(text)}


def value(samples: list[Sample], name: str, **labels: str) -> float:
    found = [s.value for s in samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(found) == 1, (name, labels, samples)
    return found[0]


def test_every_family_is_named_and_labelled_after_prometheus_conventions(usage: UsageState) -> None:
    made = metrics.Metrics(status=status, usage=usage, users=lambda: USERS, gpus=two_gpus)
    made.started(seconds_to_ssh=1.5)
    made.polled(seconds=0.2)
    made.passed(seconds=0.1)
    made.calendar_failed(url="https://bob:secret@cal.lab/dav/gpus/", cause="https://...: connection refused")
    made.released()
    made.promoted()
    text = generate_latest(made.registry).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert value(families["gpubook_released_bookings"].samples, "gpubook_released_bookings_total") == 1
    assert value(families["gpubook_standby_promotions"].samples, "gpubook_standby_promotions_total") == 1
    assert set(families) == {
        "gpubook_bookings", "gpubook_containers_running", "gpubook_gpus", "gpubook_last_poll_timestamp_seconds",
        "gpubook_last_poll_success_timestamp_seconds", "gpubook_calendar_outage", "gpubook_image_preparations",
        "gpubook_image_storage_free_bytes", "gpubook_image_pull_downloaded_bytes", "gpubook_image_pull_size_bytes",
        "gpubook_booked_gpu_seconds", "gpubook_gpu_booking_info",
        "gpubook_used_gpu_seconds",
        "gpubook_gpu_utilisation_ratio", "gpubook_gpu_memory_used_bytes", "gpubook_gpu_memory_total_bytes",
        "gpubook_start_ssh_seconds", "gpubook_poll_duration_seconds", "gpubook_pass_duration_seconds",
        "gpubook_check_duration_seconds", "gpubook_calendar_errors", "gpubook_failed_starts", "gpubook_image_pulls",
        "gpubook_released_bookings",
        "gpubook_standby_promotions",
        "gpubook_foreign_processes", "gpubook_build_info"}
    # gpubook_build_info{version} 1: Prometheus's info convention, the version the package says
    assert value(families["gpubook_build_info"].samples, "gpubook_build_info", version=gpubook.__version__) == 1
    for family in families.values():
        assert family.documentation, family.name
        if family.type == "counter":
            assert {s.name for s in family.samples} <= {f"{family.name}_total", f"{family.name}_created"}
        if family.type == "histogram":
            assert family.name.endswith("_seconds")
    assert "secret" not in text  # a calendar label is its redacted URL
    assert value(families["gpubook_calendar_errors"].samples, "gpubook_calendar_errors_total",
                 calendar="https://cal.lab/…", cause="unreachable") == 1


def test_promtool_checks_every_family_as_prometheus_reads_it(usage: UsageState) -> None:
    """Prometheus's own linter over a scrape with every family in it, the GPU join included (a booking
    running on GPU 0 of the fake NVML's two)."""
    made = metrics.Metrics(status=status, usage=usage, users=lambda: USERS, gpus=two_gpus, host_name=lambda: "gpu1")
    made.started(seconds_to_ssh=1.5)
    made.polled(seconds=0.2)
    made.passed(seconds=0.1)
    made.calendar_failed(url="https://cal.lab/", cause="connection refused")
    text = generate_latest(made.registry).decode()
    assert "gpubook_gpu_booking_info{" in text and "gpubook_build_info{" in text
    assert problems(text) == ""
    # The check can fail: a family without its help line, as promtool reads it.
    broken = re.sub(r"^# HELP gpubook_calendar_outage .*\n", "", text, flags=re.M)
    assert broken != text
    assert "gpubook_calendar_outage no help text" in problems(broken)


def test_calendar_labels_carry_no_path_or_query_token(usage: UsageState) -> None:
    """Finding 9 of issue 22: a private feed's secret is its path (Google) or its `?token=`; the
    scrape (often open to a whole network) shows scheme and host only, as the page does."""
    made = metrics.Metrics(status=status, usage=usage, users=lambda: USERS, gpus=two_gpus)
    google = ("https://calendar.google.com/calendar/ical/lab%40group.calendar.google.com/"
              "private-0123456789abcdef0123456789abcdef/basic.ics")
    made.calendar_failed(url=google, cause="HTTP 404")
    made.calendar_failed(url="https://cal.lab:8443/feed.ics?token=s3cr3tT0ken", cause="timed out")
    text = generate_latest(made.registry).decode()
    assert "private-0123" not in text
    assert "s3cr3tT0ken" not in text
    assert "lab%40group" not in text
    samples = text_string_to_metric_families(text)
    labels = {s.labels["calendar"] for f in samples if f.name == "gpubook_calendar_errors" for s in f.samples}
    assert labels == {"https://calendar.google.com/…", "https://cal.lab:8443/…"}


def test_values_read_at_scrape_time(usage: UsageState) -> None:
    made = metrics.Metrics(status=status, usage=usage, users=lambda: USERS, gpus=two_gpus, host_name=lambda: "gpu1")
    families = scrape(made)
    bookings = families["gpubook_bookings"]
    assert {s.labels["state"]: s.value for s in bookings} == {
        "now": 2, "upcoming": 3, "rejected": 1, "armed": 1, "running": 1}
    # Each host by its [host] name, never the planner's internal "local" (a lab's servers' series stay apart).
    assert value(families["gpubook_containers_running"], "gpubook_containers_running", host="gpu1") == 2
    assert value(families["gpubook_booked_gpu_seconds"], "gpubook_booked_gpu_seconds_total", user="alice") == 9000
    assert value(families["gpubook_used_gpu_seconds"], "gpubook_used_gpu_seconds_total", user="alice") == 4500
    gpu0 = {"host": "gpu1", "gpu": "0", "uuid": "GPU-aaaa"}
    assert value(families["gpubook_gpu_utilisation_ratio"], "gpubook_gpu_utilisation_ratio", **gpu0) == 0.37
    assert value(families["gpubook_gpu_memory_used_bytes"], "gpubook_gpu_memory_used_bytes", **gpu0) == 2048 * 2**20
    assert value(families["gpubook_gpu_memory_total_bytes"], "gpubook_gpu_memory_total_bytes",
                 host="gpu1", gpu="1", uuid="GPU-bbbb") == 80 * 2**30
    assert {s.labels["state"]: s.value for s in families["gpubook_image_preparations"]} == {
        "queued": 0, "pulling": 1, "warming": 0, "building": 0, "ready": 2, "failed": 1}
    # Downloaded and in all: two families (a sum over one `bytes` label meant nothing; issue 41).
    assert value(families["gpubook_image_pull_downloaded_bytes"], "gpubook_image_pull_downloaded_bytes",
                 template="pytorch") == 4_100_000_000
    assert value(families["gpubook_image_pull_size_bytes"], "gpubook_image_pull_size_bytes",
                 template="pytorch") == 9_300_000_000
    # The join for dcgm-exporter's series: each GPU of a running booking with its UUID and booker (an armed
    # one, whose SSH is still closed, is nobody's yet).
    assert [(s.labels, s.value) for s in families["gpubook_gpu_booking_info"]] == [
        ({"host": "gpu1", "gpu": "0", "uuid": "GPU-aaaa", "user": "alice", "booking": "a@lab"}, 1)]
    assert {s.labels["host"] for s in bookings} == {"gpu1"}
    assert value(families["gpubook_last_poll_timestamp_seconds"], "gpubook_last_poll_timestamp_seconds") \
        == 1795341600
    # Failed starts by every reason from zero, so rate() sees the first one.
    assert {s.labels["reason"] for s in families["gpubook_failed_starts"]
            if s.name.endswith("_total")} == set(metrics.START_FAILURES)


def test_no_gpu_means_no_gpu_series_and_no_status_means_no_booking_series(usage: UsageState) -> None:
    families = scrape(metrics.Metrics(status=lambda: None, usage=usage, users=lambda: USERS, gpus=no_gpu))
    assert not [name for name in families if name.startswith("gpubook_gpu")]
    assert "gpubook_bookings" not in families
    assert "gpubook_booked_gpu_seconds" in families and "gpubook_start_ssh_seconds" in families
    families = scrape(metrics.Metrics(status=status, users=lambda: USERS))  # no NVML reader, no accounting
    assert "gpubook_bookings" in families and "gpubook_gpu_utilisation_ratio" not in families
    assert "gpubook_booked_gpu_seconds" not in families


def test_user_labels_are_bounded_by_the_configured_users(usage: UsageState) -> None:
    """Hostile: whatever names reach State's accounting (a calendar's organizers, a stale record's
    empty user), the `user` label takes only the lab's users and one OTHER_USER: a calendar cannot
    make Prometheus store a series per name it invents."""
    usage.booked = {"alice": 1.0, "": 2.0, **{f"intruder{n}": 0.5 for n in range(1000)}}
    families = scrape(metrics.Metrics(status=status, usage=usage, users=lambda: USERS))
    booked = {s.labels["user"]: s.value for s in families["gpubook_booked_gpu_seconds"] if s.name.endswith("_total")}
    assert booked == {"alice": 3600.0, metrics.OTHER_USER: (2.0 + 500.0) * 3600}


def test_a_source_failing_leaves_out_its_families_only(usage: UsageState, caplog: pytest.LogCaptureFixture) -> None:
    def broken() -> NvmlView:
        raise RuntimeError("NVML went away")

    class LockedState(UsageState):
        def gpu_hours_used_by_user(self) -> dict[str, float]:
            raise StateError("database is locked")

    with caplog.at_level(logging.WARNING):
        families = scrape(metrics.Metrics(status=status, usage=LockedState(usage.path), users=lambda: USERS,
                                          gpus=broken))
    assert "gpubook_bookings" in families and "gpubook_start_ssh_seconds" in families
    assert "gpubook_gpu_utilisation_ratio" not in families and "gpubook_used_gpu_seconds" not in families
    assert "NVML left out of this scrape: NVML went away" in caplog.text
    assert "GPU-hours left out of this scrape: database is locked" in caplog.text


def test_instrumentation_never_raises_into_the_pass(caplog: pytest.LogCaptureFixture) -> None:
    class Broken:
        def observe(self, amount: float) -> None:
            raise ValueError("histogram broken")

    made = metrics.Metrics(status=lambda: None)
    made.start_ssh = Broken()  # type: ignore[assignment]
    with caplog.at_level(logging.WARNING):
        made.started(seconds_to_ssh=1.0)
    assert "metrics: started not recorded: histogram broken" in caplog.text
    made.start_failed(reason="made up by a caller")  # an unknown reason is counted as "other", never a new label
    assert value(scrape(made)["gpubook_failed_starts"], "gpubook_failed_starts_total", reason="other") == 1


def test_nvml_is_read_at_most_every_two_seconds() -> None:
    reads: list[int] = []
    clock = [100.0]

    def read() -> NvmlView:
        reads.append(1)
        return two_gpus()

    cache = nvml.CachedView(read, clock=lambda: clock[0])
    for _ in range(5):
        cache.view()
    clock[0] += nvml.CACHE_SECONDS
    cache.view()
    assert len(reads) == 2


@pytest.mark.parametrize(("error", "reason"), [
    (PullError("not found", "x"), "image"), (ForeignHostKey("x"), "ssh_host_key"), (EngineError("x"), "engine"),
    (StorageError("x"), "storage"), (TemplateError("x"), "template"), (StateError("x"), "state"),
    (paramiko.AuthenticationException("x"), "ssh"), (EOFError("x"), "ssh"), (OSError("x"), "os"),
    (RuntimeError("x"), "other")])
def test_failed_start_reasons_come_from_the_error_kind(error: BaseException, reason: str) -> None:
    assert metrics.start_failure_reason(error) == reason
    assert reason in metrics.START_FAILURES


@pytest.mark.parametrize(("sentence", "cause"), [
    ("http://127.0.0.1:9/cal/: connection refused", "unreachable"),
    ("https://cal.lab/: host name not found", "unreachable"),
    ("https://cal.lab/: no answer within 30 s (timeout)", "timeout"),
    ("https://cal.lab/: credentials refused (HTTP 401)", "auth"),
    ("https://cal.lab/: TLS failed: certificate verify failed", "tls"),
    ("https://cal.lab/: server error (HTTP 503 Service Unavailable)", "server"),
    ("https://cal.lab/: no such calendar (HTTP 404)", "data"),
    ("https://cal.lab/: not a CalDAV calendar: REPORT answered 405", "data"),
    ("something new", "other")])
def test_calendar_causes_are_classes_of_the_sources_sentences(sentence: str, cause: str) -> None:
    assert metrics.calendar_cause(sentence) == cause


def test_the_image_preparer_tells_each_pull(tmp_path: Path) -> None:
    """An engine that cannot pull (the Engine protocol only): its image is present, and said so."""
    made = metrics.Metrics(status=lambda: None)
    done = threading.Event()
    preparer = ImagePreparer(engine=IdleEngine(), ledger=Ledger(tmp_path / "images.json"), on_done=done.set)
    preparer.on_pull = made.image_pulled
    try:
        preparer.want({"b1@lab": get_template("debian-ssh")}, now=datetime.now(UTC))
        assert done.wait(30)
    finally:
        preparer.close()
    pulls = scrape(made)["gpubook_image_pulls"]
    assert value(pulls, "gpubook_image_pulls_total", outcome="present") == 1
    made.image_pulled("registry refused")
    made.image_pulled("an outcome nobody planned")
    pulls = scrape(made)["gpubook_image_pulls"]
    assert value(pulls, "gpubook_image_pulls_total", outcome="refused") == 1
    assert value(pulls, "gpubook_image_pulls_total", outcome="failed") == 1


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base class's name
        pass


def test_wsgi_app_serves_the_text_format_over_http(usage: UsageState) -> None:
    made = metrics.Metrics(status=status, usage=usage, users=lambda: USERS, gpus=two_gpus)
    server = make_server("127.0.0.1", 0, metrics.wsgi_app(made), handler_class=_Quiet)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        answer = requests.get(f"http://127.0.0.1:{server.server_port}/metrics", timeout=10)
    finally:
        server.shutdown()
        server.server_close()
    assert answer.status_code == 200
    assert answer.headers["Content-Type"].startswith("text/plain; version=0.0.4")
    names = {f.name for f in text_string_to_metric_families(answer.text)}
    assert {"gpubook_bookings", "gpubook_gpu_utilisation_ratio", "gpubook_start_ssh_seconds"} <= names


class GpuDaemon(Daemon):
    """The daemon on a host with two GPUs, as NVML would show them (there is no GPU here)."""

    def _gpu_view(self) -> NvmlView:
        return two_gpus()


def test_the_daemon_observes_polls_and_calendar_errors_and_reads_no_gpu(tmp_path: Path) -> None:
    """The daemon's own wiring, in-process on an idle engine: its calendar (port 9) never answers."""
    daemon = in_process_daemon(tmp_path)
    try:
        daemon.poll()
        daemon.poll()
        families = scrape(daemon.metrics)
    finally:
        daemon.passes.close()
        daemon.state.close()
    assert value(families["gpubook_calendar_errors"], "gpubook_calendar_errors_total",
                 calendar="http://127.0.0.1:9/…", cause="unreachable") == 2
    assert value(families["gpubook_poll_duration_seconds"], "gpubook_poll_duration_seconds_count") == 2
    assert value(families["gpubook_pass_duration_seconds"], "gpubook_pass_duration_seconds_count") == 2
    assert value(families["gpubook_calendar_outage"], "gpubook_calendar_outage") == 1
    assert {s.labels["state"]: s.value for s in families["gpubook_bookings"]} == dict.fromkeys(
        metrics.BOOKING_STATES, 0)
    assert not [name for name in families if name.startswith("gpubook_gpu_")]  # no GPU here: no GPU series


def test_the_daemon_serves_each_gpu_where_nvml_lists_some(tmp_path: Path) -> None:
    daemon = in_process_daemon(tmp_path, kind=GpuDaemon)
    try:
        daemon.poll()
        families = scrape(daemon.metrics)
    finally:
        daemon.passes.close()
        daemon.state.close()
    assert {s.labels["uuid"]: s.value for s in families["gpubook_gpu_utilisation_ratio"]} == {
        "GPU-aaaa": 0.37, "GPU-bbbb": 0.0}


def dashboard_exprs() -> list[str]:
    data = json.loads((ROOT / "docs" / "grafana-dashboard.json").read_text())
    exprs = [target["expr"] for panel in data["panels"] for target in panel.get("targets", ())]
    exprs += [v["definition"] for v in data["templating"]["list"] if v["type"] == "query"]
    return exprs


def test_the_grafana_dashboard_names_only_metrics_the_registry_exposes(usage: UsageState) -> None:
    data = json.loads((ROOT / "docs" / "grafana-dashboard.json").read_text())
    variables = {v["name"]: v for v in data["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    panels = [p for p in data["panels"] if p["type"] != "row"]
    assert len({p["id"] for p in data["panels"]}) == len(data["panels"])
    assert all(p["datasource"] == {"type": "prometheus", "uid": "${datasource}"} for p in panels)
    made = metrics.Metrics(status=status, usage=usage, users=lambda: USERS, gpus=two_gpus)
    made.started(seconds_to_ssh=1.0)
    made.polled(seconds=0.1)
    made.passed(seconds=0.1)
    made.calendar_failed(url="http://cal.lab/", cause="connection refused")
    exposed = {sample.name for samples in scrape(made).values() for sample in samples}
    named = {name for expr in dashboard_exprs() for name in re.findall(r"\bgpubook_[a-z_]+", expr)}
    assert named and named <= exposed, named - exposed
    wanted = ("gpubook_gpu_utilisation_ratio", "gpubook_gpu_memory_used_bytes", "gpubook_bookings",
              "gpubook_booked_gpu_seconds_total", "gpubook_used_gpu_seconds_total", "gpubook_calendar_errors_total",
              "gpubook_poll_duration_seconds_bucket", "gpubook_failed_starts_total", "gpubook_gpu_booking_info")
    assert set(wanted) <= named
    assert any("histogram_quantile" in e and "gpubook_start_ssh_seconds_bucket" in e for e in dashboard_exprs())


def test_each_pull_is_counted_by_its_outcome(tmp_path: Path) -> None:
    """The real PodmanEngine with only its process runner recorded (tests/test_images_prepare.py):
    a pull that works, then one the registry refuses."""
    made = metrics.Metrics(status=lambda: None)
    for folder, fails in (("ok", None), ("refused", "Error: reading manifest 1 in registry.example/lab/x: "
                                                    "unauthorized: authentication required")):
        (tmp_path / folder).mkdir()
        engine = recording()
        engine.answers.pull_fails = fails
        template, done, preparer = lab_preparer(tmp_path / folder, engine)
        preparer.on_pull = made.image_pulled
        try:
            preparer.want({"b": template}, now=datetime.now(UTC))
            assert done.acquire(timeout=30)
        finally:
            preparer.close()
    pulls = scrape(made)["gpubook_image_pulls"]
    assert {s.labels["outcome"]: s.value for s in pulls if s.value} == {"pulled": 1, "refused": 1}
