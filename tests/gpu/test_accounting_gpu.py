"""What gpubook shows and accounts of a GPU booking, on a GPU host, end to end: `gpubook run` as a
real process with `[web] enabled` (the status page and /metrics) and `[daemon] sample_seconds = 2`,
a real Radicale, podman with the host's driver injected, the booker logging in with paramiko.

The booker keeps the booked GPU busy (tests/gpu/cudacheck.c with CUDACHECK_BUSY_SECONDS) while the
test reads /metrics and the page's /api/status: NVML's utilisation of that GPU must show there. After
the booking's end, State holds the sampler's rows for it (busy ones among them), `gpubook report`
counts used GPU-hours for the booker and no no-show, and the GPU-hours counters of /metrics agree.

Same bundle and invocation as tests/gpu/test_daemon_gpu.py (whose fixtures it uses); one GPU is
enough. GPUBOOK_GPU_RESULTS names a folder for the figures.
"""

from __future__ import annotations

import csv
import io
import json
import os
import platform
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import paramiko
import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from gpubook.runtime.engines import Engine, container_name
from gpubook.runtime.nvidia.model import Gpu
from gpubook.scheduler.commands.embedded import free_port
from gpubook.scheduler.state import State
from tests.kits import servers
from tests.kits.daemon_kit import DaemonProcess, book, description, soon, try_login, wait_for, write_config
from tests.kits.gpu_daemon_kit import ENGINE_LINES, RUNNING_LINE, TEMPLATE, TEMPLATE_TOML
from tests.kits.web_kit import answers

pytestmark = [pytest.mark.gpu, pytest.mark.caldav, pytest.mark.slow]

LENGTH_SECONDS, BUSY_SECONDS, SAMPLE_SECONDS = 50, 20, 2


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def value(scraped: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float | None:
    for (found, pairs), number in scraped.items():
        if found == name and all(dict(pairs).get(k) == v for k, v in labels.items()):
            return number
    return None


def test_a_busy_gpu_booking_shows_on_the_page_in_metrics_and_in_the_report(
        tmp_path: Path, host_gpus: tuple[Gpu, ...], engine: Engine, data_mount: Path,  # noqa: F811
        radicale: servers.CalendarServer, bundle: Path) -> None:  # noqa: F811
    cudacheck = (bundle / "cudacheck").read_bytes()
    key = paramiko.ECDSAKey.generate(bits=256)
    calendar = radicale.new_calendar()
    templates = tmp_path / "templates"
    templates.mkdir()
    (templates / f"{TEMPLATE}.toml").write_text(TEMPLATE_TOML)
    config = write_config(tmp_path, str(calendar.url), keys={"alice": key}, gpus=len(host_gpus), poll_seconds=60,
                          warn_minutes=0.1, template=TEMPLATE, templates_dir=templates, engine_lines=ENGINE_LINES)
    web_port = free_port()
    text = config.read_text().replace("[daemon]\n", f"[daemon]\nsample_seconds = {SAMPLE_SECONDS}\n", 1)
    config.write_text(text + f'\n[web]\nenabled = true\nlisten = "127.0.0.1:{web_port}"\nauth = "none"\n')
    start = soon(15)
    end = start + timedelta(seconds=LENGTH_SECONDS)
    book(calendar, "busy@test", user="alice", start=start, end=end, gpus="1", description=f"template: {TEMPLATE}\n")
    daemon = DaemonProcess(config).start()
    figures: dict[str, object] = {}
    try:
        wait_for("the status page", lambda: answers(f"http://127.0.0.1:{web_port}/api/status"), timeout=60,
                 daemon=daemon)
        line = wait_for("the ssh line in the event", lambda: RUNNING_LINE.search(description(calendar, "busy@test")),
                        timeout=(start - datetime.now(UTC)).total_seconds() + 60, interval=0.2, daemon=daemon)
        client = wait_for("SSH login as alice", lambda: try_login(int(line.group(1)), "alice", key), timeout=30,
                          daemon=daemon)
        info = engine.inspect(container_name("busy@test"))
        assert info is not None and len(info.gpus) == 1, info
        gpu = info.gpus[0]
        uuid = next(g.uuid for g in host_gpus if g.index == gpu)
        with client:
            _busy(client, cudacheck)
            seen_metrics, seen_page, busy_until = 0.0, 0, time.monotonic() + BUSY_SECONDS
            while time.monotonic() < busy_until:
                ratio = value(scrape(web_port), "gpubook_gpu_utilisation_ratio", gpu=str(gpu))
                seen_metrics = max(seen_metrics, ratio or 0.0)
                page = requests.get(f"http://127.0.0.1:{web_port}/api/status", timeout=10).json()
                live = [g for host in page["hosts"] for g in (host.get("live") or {}).get("gpus", ())
                        if g["index"] == gpu]
                seen_page = max([seen_page, *(g["utilisation_percent"] or 0 for g in live)])
                time.sleep(1)
        figures.update(gpu=gpu, uuid=uuid, metrics_utilisation_max=seen_metrics, page_utilisation_max=seen_page)
        assert seen_metrics >= 0.5, f"/metrics never showed GPU {gpu} busy: {seen_metrics}"
        assert seen_page >= 50, f"the page's live view never showed GPU {gpu} busy: {seen_page}"
        wait_for("the stop at the end", lambda: engine.inspect(container_name("busy@test")) is None,
                 timeout=(end - datetime.now(UTC)).total_seconds() + 30, daemon=daemon)
        wait_for("ended in the event", lambda: "ended:" in description(calendar, "busy@test"), timeout=30,
                 daemon=daemon)
        scraped = scrape(web_port)
        used = value(scraped, "gpubook_used_gpu_seconds_total", user="alice") or 0.0
        booked = value(scraped, "gpubook_booked_gpu_seconds_total", user="alice") or 0.0
        figures.update(used_gpu_seconds=used, booked_gpu_seconds=booked)
        assert 0 < used < booked, (used, booked)
    finally:
        daemon.stop()
        engine.stop(container_name("busy@test"), 0)
    with State(tmp_path / "state" / "state.sqlite") as state:
        rows = state._query("SELECT utilisation FROM gpu_samples WHERE booking_id = ? AND gpu = ?",
                            ("busy@test", gpu))
    busy_rows = [r for r in rows if (r[0] or 0) >= 50]
    figures.update(samples=len(rows), busy_samples=len(busy_rows))
    assert len(busy_rows) >= 3, rows
    day = start.date()
    done = subprocess.run([sys.executable, "-m", "gpubook.scheduler.commands.cli", "report", "--config", str(config),
                           "--from", day.isoformat(), "--to", (day + timedelta(days=1)).isoformat(),
                           "--csv", str(tmp_path / "report.csv")], capture_output=True, text=True, timeout=120,
                          check=False)
    assert done.returncode == 0, done.stderr
    table = {row["user"]: row for row in csv.DictReader(io.StringIO((tmp_path / "report.csv").read_text()))}
    alice = table["alice"]
    figures.update(report_booked_gpu_hours=float(alice["booked_gpu_hours"]),
                   report_used_gpu_hours=float(alice["used_gpu_hours"]), report_no_shows=int(alice["no_shows"]))
    assert abs(float(alice["booked_gpu_hours"]) - LENGTH_SECONDS / 3600) < 1e-3, alice
    assert 0 < float(alice["used_gpu_hours"]) < float(alice["booked_gpu_hours"]), alice
    assert alice["no_shows"] == "0", alice
    _report(figures, host_gpus, daemon.log, done.stdout)


def _busy(client: paramiko.SSHClient, cudacheck: bytes) -> None:
    """cudacheck uploaded and started in the background, keeping the booked GPU busy."""
    channel_in, stdout, _ = client.exec_command("cat > /tmp/cudacheck && chmod 755 /tmp/cudacheck")
    channel_in.write(cudacheck)
    channel_in.channel.shutdown_write()
    assert stdout.channel.recv_exit_status() == 0
    _, stdout, _ = client.exec_command(f"CUDACHECK_BUSY_SECONDS={BUSY_SECONDS + 5} setsid /tmp/cudacheck "
                                       "> /data/output/busy.txt 2>&1 < /dev/null &")
    assert stdout.channel.recv_exit_status() == 0


def _report(figures: dict[str, object], host_gpus: tuple[Gpu, ...], log: Path, report_text: str) -> None:
    podman = "rootful" if os.geteuid() == 0 else "rootless"
    machine = f"{len(host_gpus)} x {host_gpus[0].name or 'NVIDIA GPU'}, {platform.platform()}, {podman} podman"
    print(f"machine: {machine}\nfigures: {json.dumps(figures)}\n{report_text}", flush=True)
    results = os.environ.get("GPUBOOK_GPU_RESULTS")
    if results:
        out = Path(results)
        out.mkdir(parents=True, exist_ok=True)
        (out / "accounting-gpu-figures.json").write_text(json.dumps({"machine": machine, **figures}, indent=2))
        (out / "report.txt").write_text(report_text)
        if log.exists():
            (out / "accounting-daemon.log").write_text(log.read_text(errors="replace"))
