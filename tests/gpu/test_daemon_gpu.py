"""The daemon on a GPU host, end to end: `gpubook run` as a real process against a real Radicale
on 127.0.0.1, podman with the host's NVIDIA driver injected, the bookers logging in with paramiko.

Two one-GPU bookings start at the same second, then one two-GPU booking starts after they end.
Each booker reads the port from the `running: ssh -p PORT ...` line written back into the event,
logs in, runs a CUDA kernel (tests/gpu/cudacheck.c: PTX JIT-compiled by the injected driver, no
toolkit in the image) and `nvidia-smi -L`, and must see exactly the booked GPUs: their UUIDs, their
device nodes open, the other GPU's node refused, /proc/driver/nvidia/gpus showing no other GPU.
While the first two run, the daemon is killed with SIGKILL and started again: it adopts both
containers (same container, the booker's SSH session still alive). At the end each container is
stopped, the event says "ended", and the file the booker wrote to /data/output is kept.

Runs on the GPU test host with the bundle of tests/gpu/prepare_daemon_bundle.sh (sshd image,
wheels, cudacheck); skipped, with the reason, anywhere else. There, as root, from the project root:

    source .bundle/podman-on-gpuhost.sh .bundle && source .bundle/install-daemon-deps.sh .bundle
    NCCL_NVLS_ENABLE=0 python3 -m pytest tests/gpu/test_daemon_gpu.py -m gpu -v -s --confcutdir=tests/gpu

It prints, per booking, the time from its start to the written-back SSH line and to the booker's
login, and the daemon's own start-call-to-SSH figure; GPUBOOK_GPU_RESULTS names a folder for the
figures and the daemon's log (BENCHMARKS.md, "GPU host: the whole daemon").
"""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import signal
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import paramiko
import pytest

from gpubook.runtime.engines import Engine, container_name
from gpubook.runtime.nvidia.model import Gpu
from gpubook.scheduler.state import State
from tests.kits import booker, servers
from tests.kits.daemon_kit import (
    DaemonProcess,
    book,
    description,
    running_container,
    soon,
    try_login,
    wait_for,
    write_config,
)
from tests.kits.gpu_daemon_kit import ENGINE_LINES, RUNNING_LINE, TEMPLATE, TEMPLATE_TOML

pytestmark = [pytest.mark.gpu, pytest.mark.caldav, pytest.mark.slow]

FIRST_SECONDS, SECOND_SECONDS, GAP_SECONDS = 45, 30, 3
SSH_ANSWERED = re.compile(r"SSH answered after ([0-9.]+) s")


@dataclass(frozen=True)
class Figure:
    booking: str
    user: str
    gpus: tuple[int, ...]
    line_after_start_s: float  # the `running: ssh -p` line readable in the event
    login_after_start_s: float  # the booker's first SSH login with the port from that line
    daemon_ssh_after_container_start_s: float | None  # the daemon's own probe, from its event log


@dataclass(frozen=True)
class Booker:
    booking_id: str
    user: str
    key: paramiko.PKey
    start: datetime
    gpus: int


def test_daemon_runs_gpu_bookings_end_to_end(tmp_path: Path, two_gpus: tuple[Gpu, Gpu],
                                             host_gpus: tuple[Gpu, ...], engine: Engine, data_mount: Path,
                                             radicale: servers.CalendarServer, bundle: Path) -> None:
    every = host_gpus
    cudacheck = (bundle / "cudacheck").read_bytes()
    keys = {user: paramiko.ECDSAKey.generate(bits=256) for user in ("alice", "bob", "carol")}
    calendar = radicale.new_calendar()
    templates = tmp_path / "templates"
    templates.mkdir()
    (templates / f"{TEMPLATE}.toml").write_text(TEMPLATE_TOML)
    config = write_config(tmp_path, str(calendar.url), keys=keys, gpus=len(every), poll_seconds=60,
                          warn_minutes=0.1, template=TEMPLATE, templates_dir=templates,
                          engine_lines=ENGINE_LINES)
    first = soon(15)
    second = first + timedelta(seconds=FIRST_SECONDS + GAP_SECONDS)
    pair = [Booker("gpu-a@test", "alice", keys["alice"], first, 1),
            Booker("gpu-b@test", "bob", keys["bob"], first, 1)]
    both = Booker("gpu-ab@test", "carol", keys["carol"], second, 2)
    for one in [*pair, both]:
        length = FIRST_SECONDS if one.start == first else SECOND_SECONDS
        book(calendar, one.booking_id, user=one.user, start=one.start, end=one.start + timedelta(seconds=length),
             gpus=str(one.gpus), description=f"template: {TEMPLATE}\n")
    daemons: list[DaemonProcess] = [DaemonProcess(config).start()]
    figures: list[Figure] = []
    try:
        with ThreadPoolExecutor(len(pair)) as pool:
            logged_in = list(pool.map(lambda b: serve(b, radicale, calendar.url, engine, daemons[-1], every,
                                                      cudacheck, tmp_path), pair))
        figures += [figure for figure, _ in logged_in]
        adopt_after_kill_9(daemons, config, tmp_path, engine, pair, [client for _, client in logged_in])
        for client in (client for _, client in logged_in):
            client.close()
        ended(pair, calendar, engine, daemons[-1], tmp_path, first + timedelta(seconds=FIRST_SECONDS))
        figure, client = serve(both, radicale, calendar.url, engine, daemons[-1], every, cudacheck, tmp_path)
        client.close()
        figures.append(figure)
        ended([both], calendar, engine, daemons[-1], tmp_path, second + timedelta(seconds=SECOND_SECONDS))
        process = daemons[-1].process
        assert process is not None and process.poll() is None, daemons[-1].tail()
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0, daemons[-1].tail()
    finally:
        for daemon in daemons:
            daemon.stop()
        for one in [*pair, both]:
            engine.stop(container_name(one.booking_id), 0)
        report(figures, every, daemons, tmp_path)


def serve(one: Booker, server: servers.CalendarServer, calendar_url: object, engine: Engine,
          daemon: DaemonProcess, every: Sequence[Gpu], cudacheck: bytes,
          folder: Path) -> tuple[Figure, paramiko.SSHClient]:
    """One booker: the SSH line from the event, the login, the GPU checks. Logged in afterwards."""
    calendar = server.client().calendar(url=calendar_url)  # its own connection: one per thread
    while datetime.now(UTC) < one.start:
        time.sleep(0.01)
    line = wait_for(f"{one.booking_id}: the ssh line in the event",
                    lambda: RUNNING_LINE.search(description(calendar, one.booking_id)), timeout=60,
                    interval=0.05, daemon=daemon)
    line_after = (datetime.now(UTC) - one.start).total_seconds()
    assert line.group(2) == one.user, line.group(0)
    client = wait_for(f"{one.booking_id}: SSH login as {one.user}",
                      lambda: try_login(int(line.group(1)), one.user, one.key), timeout=30, interval=0.02,
                      daemon=daemon)
    login_after = (datetime.now(UTC) - one.start).total_seconds()
    info = running_container(engine, one.booking_id)
    assert info is not None and info.port == int(line.group(1)), info
    assert len(info.gpus) == one.gpus, info.gpus
    mine = [gpu for gpu in every if gpu.index in info.gpus]
    seen = booker.look(client, cudacheck=cudacheck, every=every)
    booker.assert_exactly(seen, mine=mine, every=every, booking_id=one.booking_id)
    with State(folder / "state" / "state.sqlite") as state:
        said = " ".join(event.message for event in state.events(booking_id=one.booking_id))
    probe = SSH_ANSWERED.search(said)
    figure = Figure(one.booking_id, one.user, tuple(info.gpus), round(line_after, 3), round(login_after, 3),
                    float(probe.group(1)) if probe else None)
    print(f"{one.booking_id} ({one.user}, GPU {','.join(map(str, info.gpus))}): ssh line in the event "
          f"{line_after:.3f} s after the start, login {login_after:.3f} s; the daemon's probe: SSH answered "
          f"{figure.daemon_ssh_after_container_start_s} s after its start call; kernel and nvidia-smi: "
          f"{sorted(seen.smi_uuids)}", flush=True)
    return figure, client


def adopt_after_kill_9(daemons: list[DaemonProcess], config: Path, folder: Path, engine: Engine,
                       pair: Sequence[Booker], clients: Sequence[paramiko.SSHClient]) -> None:
    """SIGKILL, a new daemon, its first pass: the same containers, the sessions still alive."""
    before = {one.booking_id: running_container(engine, one.booking_id) for one in pair}
    daemons[-1].kill()
    daemons.append(DaemonProcess(config).start())
    pid = daemons[-1].process.pid  # type: ignore[union-attr]
    status_file = folder / "state" / "daemon-status.json"
    wait_for("a pass of the restarted daemon",
             lambda: status_file.exists() and json.loads(status_file.read_text())["pid"] == pid,
             timeout=60, interval=0.05, daemon=daemons[-1])
    for one, client in zip(pair, clients, strict=True):
        first = before[one.booking_id]
        assert first is not None
        mine = [(c.id, c.state) for c in engine.list() if c.booking_id == one.booking_id]
        assert mine == [(first.id, "running")], (one.booking_id, mine)
        status, said = booker.run(client, "cat /data/output/cudacheck.txt")
        assert status == 0 and "kernel ok" in said, said
    print("kill -9 of the daemon and a restart: both containers adopted, the bookers' sessions alive", flush=True)


def ended(group: Sequence[Booker], calendar: object, engine: Engine, daemon: DaemonProcess, folder: Path,
          end: datetime) -> None:
    """Stopped at the end, "ended" in the event, the kernel's output kept in the booker's output/."""
    for one in group:
        wait_for(f"{one.booking_id}: the stop at the end",
                 lambda one=one: engine.inspect(container_name(one.booking_id)) is None,
                 timeout=max(0.0, (end - datetime.now(UTC)).total_seconds()) + 30, daemon=daemon)
        assert datetime.now(UTC) >= end
        wait_for(f"{one.booking_id}: ended in the event",
                 lambda one=one: "ended:" in description(calendar, one.booking_id),  # type: ignore[arg-type]
                 timeout=20, daemon=daemon)
        kept = (folder / "data" / one.user / "output" / "cudacheck.txt").read_text()
        assert "kernel ok" in kept and "WRONG" not in kept, kept


def report(figures: Sequence[Figure], every: Sequence[Gpu], daemons: Sequence[DaemonProcess],
           folder: Path) -> None:
    podman = "rootful" if os.geteuid() == 0 else "rootless"
    machine = (f"{len(every)} x {every[0].name or 'NVIDIA GPU'}, {platform.platform()}, {os.cpu_count()} cores, "
               f"{podman} podman (runc) with the bundle of tests/gpu/prepare_daemon_bundle.sh")
    print(f"machine: {machine}")
    for figure in figures:
        print(f"figure: {json.dumps(asdict(figure))}")
    results = os.environ.get("GPUBOOK_GPU_RESULTS")
    if results:
        out = Path(results)
        out.mkdir(parents=True, exist_ok=True)
        (out / "daemon-gpu-figures.json").write_text(json.dumps(
            {"machine": machine, "figures": [asdict(f) for f in figures]}, indent=2))
        if daemons and daemons[0].log.exists():  # every daemon of the test appends to this one log
            shutil.copy(daemons[0].log, out / "daemon.log")
        if (folder / "state" / "state.sqlite").exists():
            with State(folder / "state" / "state.sqlite") as state:
                (out / "daemon-events.txt").write_text(
                    "\n".join(f"{e.booking_id or '-'}: {e.message}" for e in state.events()))
