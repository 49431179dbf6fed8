"""Processes on a booked GPU outside its booking, on a GPU host with the real NVML: `gpubook run` as
a real process with `[daemon] sample_seconds = 2` (`[policy] foreign_processes` at its default,
"report"), a real Radicale, podman with the host's driver injected, the booker logging in with
paramiko.

The booker runs tests/gpu/cudacheck.c inside the booking (CUDACHECK_BUSY_SECONDS); once NVML lists
it on the booked GPU, the test waits a few sample intervals: it must never be reported. Then the
test starts the same program OUTSIDE the booking, on the host, on the same GPU
(CUDA_VISIBLE_DEVICES): once NVML lists it, State, the status file and the booking's event must
report it ("foreign: GPU N is also used by pid P (cudacheck, root) ..."). The figures are the
seconds from NVML first listing it to each of those, against the sample interval.

Same bundle and invocation as tests/gpu/test_accounting_gpu.py (the fixtures of test_daemon_gpu.py);
one GPU is enough. As root, from the project root:

    source .bundle/podman-on-gpuhost.sh .bundle && source .bundle/install-daemon-deps.sh .bundle
    GPUBOOK_GPU_RESULTS=bench/results/foreign-gpu-h100-DATE \\
      python3 -m pytest tests/gpu/test_foreign_gpu.py -m gpu -v -s --confcutdir=tests/gpu
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

import paramiko
import pytest

from gpubook.runtime.engines import Engine, container_name
from gpubook.runtime.nvidia import nvml
from gpubook.runtime.nvidia.model import Gpu
from gpubook.scheduler.state import ForeignRow, State
from tests.kits import servers
from tests.kits.daemon_kit import DaemonProcess, book, description, soon, try_login, wait_for, write_config
from tests.kits.gpu_daemon_kit import ENGINE_LINES, RUNNING_LINE, TEMPLATE, TEMPLATE_TOML

pytestmark = [pytest.mark.gpu, pytest.mark.caldav, pytest.mark.slow]

LENGTH_SECONDS, SAMPLE_SECONDS, QUIET_ROUNDS = 90, 2, 4
BOOKING = "foreign@test"


def nvml_pids(gpu: int) -> set[int]:
    view = nvml.read(status=True)
    return {p.pid for g in view.gpus if g.index == gpu for p in g.processes}


def test_a_cuda_process_outside_the_booking_is_reported_and_the_bookings_own_never(
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
    config.write_text(config.read_text().replace("[daemon]\n", f"[daemon]\nsample_seconds = {SAMPLE_SECONDS}\n", 1))
    start = soon(15)
    end = start + timedelta(seconds=LENGTH_SECONDS)
    book(calendar, BOOKING, user="alice", start=start, end=end, gpus="1", description=f"template: {TEMPLATE}\n")
    database = tmp_path / "state" / "state.sqlite"
    daemon = DaemonProcess(config).start()
    outside: subprocess.Popen[bytes] | None = None
    figures: dict[str, object] = {"sample_seconds": SAMPLE_SECONDS}
    state: State | None = None

    def rows() -> list[ForeignRow]:
        return state.foreign(current=False, booking_ids=[BOOKING]) if state is not None else []

    try:
        line = wait_for("the ssh line in the event", lambda: RUNNING_LINE.search(description(calendar, BOOKING)),
                        timeout=(start - datetime.now(UTC)).total_seconds() + 60, interval=0.2, daemon=daemon)
        client = wait_for("SSH login as alice", lambda: try_login(int(line.group(1)), "alice", key), timeout=30,
                          daemon=daemon)
        state = State(database)  # one reader beside the daemon (WAL) for the whole test
        info = engine.inspect(container_name(BOOKING))
        assert info is not None and len(info.gpus) == 1, info
        gpu = info.gpus[0]
        before = nvml_pids(gpu)
        with client:
            _busy_inside(client, cudacheck, seconds=LENGTH_SECONDS)
            inside = wait_for("the booking's own CUDA process in NVML", lambda: (nvml_pids(gpu) - before) or None,
                              timeout=60, interval=0.2, daemon=daemon)
            time.sleep(QUIET_ROUNDS * SAMPLE_SECONDS)
            assert not {r.pid for r in rows()} & inside, "the booking's own process was reported as foreign"
            assert "foreign:" not in description(calendar, BOOKING)
            program = tmp_path / "cudacheck"
            program.write_bytes(cudacheck)
            program.chmod(0o755)
            env = {**os.environ, "CUDA_VISIBLE_DEVICES": str(gpu), "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
                   "CUDACHECK_BUSY_SECONDS": str(LENGTH_SECONDS)}
            with (tmp_path / "outside.txt").open("wb") as said:
                outside = subprocess.Popen([str(program)], env=env, stdout=said, stderr=subprocess.STDOUT)
            pid = outside.pid
            listed = wait_for("the outside process in NVML", lambda: pid in nvml_pids(gpu) or None, timeout=60,
                              interval=0.1, daemon=daemon)
            listed_at = time.monotonic()
            figures.update(gpu=gpu, inside_pids=sorted(inside), outside_pid=pid, listed=listed)
            latency = _seconds_until(listed_at, daemon, {
                "state": lambda: any(r.pid == pid for r in rows()),
                "status": lambda: pid in {f["pid"] for f in _status(tmp_path).get("foreign", ())},
                "event": lambda: f"foreign: GPU {gpu} is also used by pid {pid} (" in description(calendar, BOOKING)})
            figures.update({f"seconds_to_{k}": v for k, v in latency.items()})
            text = description(calendar, BOOKING)
            figures["event_lines"] = [x for x in text.splitlines() if x.startswith("foreign:")]
            reported = rows()
            assert not {r.pid for r in reported} & inside, reported  # the booking's own: never
            mine = [r for r in reported if r.pid == pid]
            assert mine and mine[0].booking_id == BOOKING and mine[0].container is None, reported
            figures["others_reported"] = sorted({r.pid for r in reported} - {pid})  # on a shared host: anyone's
            assert not any(f"pid {p} " in text for p in inside)
    finally:
        figures["nvidia_smi_compute_apps"] = _compute_apps()  # what the driver itself listed, for the record
        if outside is not None:
            outside.kill()
            outside.wait()
        daemon.stop()
        engine.stop(container_name(BOOKING), 0)
        final = rows()
        if state is not None:
            state.close()
        outside_said = tmp_path / "outside.txt"
        figures["outside_output"] = outside_said.read_text(errors="replace") if outside_said.exists() else None
        _report(figures, host_gpus, daemon.log, final)  # also when it failed: the log says why


def _busy_inside(client: paramiko.SSHClient, cudacheck: bytes, *, seconds: int) -> None:
    """cudacheck uploaded and started in the background in the booking, keeping its GPU busy."""
    channel_in, stdout, _ = client.exec_command("cat > /tmp/cudacheck && chmod 755 /tmp/cudacheck")
    channel_in.write(cudacheck)
    channel_in.channel.shutdown_write()
    assert stdout.channel.recv_exit_status() == 0
    _, stdout, _ = client.exec_command(f"CUDACHECK_BUSY_SECONDS={seconds} setsid /tmp/cudacheck "
                                       "> /data/output/busy.txt 2>&1 < /dev/null &")
    assert stdout.channel.recv_exit_status() == 0


def _compute_apps() -> str:
    try:
        return subprocess.run(["nvidia-smi", "--query-compute-apps=gpu_uuid,pid,process_name,used_memory",
                               "--format=csv"], capture_output=True, text=True, timeout=30, check=False).stdout
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"nvidia-smi: {error}"


def _status(folder: Path) -> dict[str, object]:
    try:
        return json.loads((folder / "state" / "daemon-status.json").read_text())  # type: ignore[no-any-return]
    except (OSError, ValueError):
        return {}  # being replaced this moment


def _seconds_until(since: float, daemon: DaemonProcess, checks: dict[str, Callable[[], bool]]) -> dict[str, float]:
    """Seconds from `since` until each check first holds (each must, within 60 s)."""
    found: dict[str, float] = {}
    deadline = time.monotonic() + 60
    while len(found) < len(checks):
        for name, check in checks.items():
            if name not in found and check():
                found[name] = round(time.monotonic() - since, 2)
        if time.monotonic() > deadline:
            raise AssertionError(f"not reported within 60 s in {sorted(set(checks) - set(found))}; so far {found}\n"
                                 f"{daemon.tail()}")
        time.sleep(0.2)
    return found


def _report(figures: dict[str, object], host_gpus: tuple[Gpu, ...], log: Path, rows: list[ForeignRow]) -> None:
    podman = "rootful" if os.geteuid() == 0 else "rootless"
    machine = f"{len(host_gpus)} x {host_gpus[0].name or 'NVIDIA GPU'}, {platform.platform()}, {podman} podman"
    print(f"machine: {machine}\nfigures: {json.dumps(figures)}", flush=True)
    results = os.environ.get("GPUBOOK_GPU_RESULTS")
    if results:
        out = Path(results)
        out.mkdir(parents=True, exist_ok=True)
        (out / "foreign-gpu-figures.json").write_text(json.dumps({"machine": machine, **figures}, indent=2))
        (out / "foreign-rows.json").write_text(json.dumps([{**r.__dict__, "first_seen": r.first_seen.isoformat(),
                                                            "last_seen": r.last_seen.isoformat(),
                                                            "gone_at": r.gone_at and r.gone_at.isoformat()}
                                                           for r in rows], indent=2))
        if log.exists():
            (out / "foreign-daemon.log").write_text(log.read_text(errors="replace"))
