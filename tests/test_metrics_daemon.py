"""/metrics scraped over HTTP while the real daemon starts a booking: real Radicale, real rootless
podman, the booker's SSH login with paramiko, Prometheus's own text parser.

The daemon is built in this process (its scheduler running its boundary jobs; the test calls its
polls) so that the test can serve `wsgi_app(daemon.metrics)` the way the web app mounts it.
"""

from __future__ import annotations

import shutil
import threading
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

import gpubook
from gpubook.scheduler.config import load as load_config
from gpubook.scheduler.daemon import Daemon
from gpubook.scheduler.outbox.metrics import wsgi_app
from gpubook.scheduler.sdnotify import Notifier
from gpubook.scheduler.sources.errors import redact_urls
from tests.kits.daemon_kit import book, running_container, soon, try_login, wait_for, write_config
from tests.kits.promtool import problems

pytestmark = [
    pytest.mark.podman, pytest.mark.caldav, pytest.mark.slow,
    pytest.mark.skipif(shutil.which("podman") is None, reason="podman is not installed"),
]


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base class's name
        pass


@pytest.fixture
def served() -> Iterator[list[WSGIServer]]:
    servers: list[WSGIServer] = []
    yield servers
    for server in servers:
        server.shutdown()
        server.server_close()


def serve(daemon: Daemon, servers: list[WSGIServer]) -> str:
    """/metrics of `daemon` on a free loopback port, as the web app's mount serves it."""
    server = make_server("127.0.0.1", 0, wsgi_app(daemon.metrics), handler_class=_Quiet)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    servers.append(server)
    return f"http://127.0.0.1:{server.server_port}/metrics"


def scrape(url: str) -> dict[str, list[Sample]]:
    answer = requests.get(url, timeout=10)
    answer.raise_for_status()
    return {family.name: family.samples for family in text_string_to_metric_families(answer.text)}


def sample(families: dict[str, list[Sample]], family: str, name: str, **labels: str) -> float:
    found = [s.value for s in families.get(family, ()) if s.name == name
             and all(s.labels.get(k) == v for k, v in labels.items())]
    return found[0] if len(found) == 1 else -1.0


def test_scrape_through_a_start_and_a_calendar_outage(tmp_path: Path, radicale, engine, keys, cleanup,
                                                      served) -> None:
    calendar = radicale.new_calendar()
    config = write_config(tmp_path, str(calendar.url), keys=keys, poll_seconds=60)
    start = soon(8)
    book(calendar, "scrape@test", user="alice", start=start, end=start + timedelta(seconds=120))
    cleanup.append("scrape@test")
    daemon = Daemon(load_config(config), engine=engine, notifier=Notifier(None))
    url = serve(daemon, served)
    daemon.scheduler.start()  # the boundary job starts the booking at its start
    try:
        daemon.poll()
        families = scrape(url)
        assert sample(families, "gpubook_bookings", "gpubook_bookings", state="upcoming") == 1
        assert sample(families, "gpubook_start_ssh_seconds", "gpubook_start_ssh_seconds_count") == 0

        info = wait_for("the container", lambda: running_container(engine, "scrape@test"), timeout=60,
                        interval=0.1)
        client = wait_for("SSH login as the booker", lambda: try_login(info.port, "alice", keys["alice"]),
                          timeout=30, interval=0.1)
        client.close()
        families = wait_for("the booking counted as running", lambda: (f := scrape(url)) and sample(
            f, "gpubook_bookings", "gpubook_bookings", state="running") == 1 and f, timeout=30, interval=0.2)
        assert sample(families, "gpubook_containers_running", "gpubook_containers_running",
                      host="127.0.0.1") == 1  # its [host] name (daemon_kit.write_config)
        assert sample(families, "gpubook_bookings", "gpubook_bookings", state="now") == 1
        assert sample(families, "gpubook_start_ssh_seconds", "gpubook_start_ssh_seconds_count") == 1
        assert sample(families, "gpubook_start_ssh_seconds", "gpubook_start_ssh_seconds_sum") > 0
        assert sample(families, "gpubook_poll_duration_seconds", "gpubook_poll_duration_seconds_count") == 1
        assert sample(families, "gpubook_failed_starts", "gpubook_failed_starts_total", reason="engine") == 0
        assert not [name for name in families if name.startswith("gpubook_gpu_")]  # no GPU on this machine
        # `curl /metrics | promtool check metrics`: the daemon's scrape as Prometheus reads it.
        assert problems(requests.get(url, timeout=10).text) == ""
        assert sample(families, "gpubook_build_info", "gpubook_build_info", version=gpubook.__version__) == 1
        assert sample(families, "gpubook_calendar_outage", "gpubook_calendar_outage") == 0
        # The change checks between polls (every second here): counted, each with the server's answer time.
        checked = wait_for("a change check counted", lambda: (f := scrape(url)) and sample(
            f, "gpubook_check_duration_seconds", "gpubook_check_duration_seconds_count") >= 1 and f, timeout=60,
            interval=0.2)
        assert sample(checked, "gpubook_check_duration_seconds", "gpubook_check_duration_seconds_sum") > 0

        radicale.stop()
        daemon.poll()
        families = scrape(url)
        assert sample(families, "gpubook_calendar_errors", "gpubook_calendar_errors_total",
                      calendar=redact_urls(str(calendar.url)), cause="unreachable") == 1
        assert sample(families, "gpubook_calendar_outage", "gpubook_calendar_outage") == 1
        assert sample(families, "gpubook_poll_duration_seconds", "gpubook_poll_duration_seconds_count") == 2
        assert sample(families, "gpubook_bookings", "gpubook_bookings", state="running") == 1  # kept running
    finally:
        daemon.scheduler.shutdown(wait=True)
        daemon.passes.close()
        if daemon.images is not None:
            daemon.images.close()
        daemon.state.close()
