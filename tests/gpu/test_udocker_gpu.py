"""The daemon with `[engine] name = "udocker"` on a GPU host, end to end, as an unprivileged account:
`gpubook run` as a real process against a real Radicale on 127.0.0.1, udocker (R1: the host's runc
in a user namespace of the account's one id) with the host's NVIDIA driver injected by gpubook
(not udocker's `setup --nvidia`), the bookers logging in with paramiko.

One one-GPU booking per GPU (at most two) starts at the same second. Each booker reads the port from
the `running: ssh -p PORT ...` line written back into the event, logs in, runs a CUDA kernel
(tests/gpu/cudacheck.c: PTX JIT-compiled by the injected driver, no toolkit in the image) and
`nvidia-smi -L`, and must see exactly the booked GPU: its UUID, its device node open, the other
GPU's node refused (it is not in the container at all: runc binds only the booked nodes, and a user
namespace cannot mknod), /proc/driver/nvidia/gpus showing no other GPU. udocker's one id: the
booker is their own uid inside, with no sudo. At the end each container is stopped, the event says
"ended", and the file the booker wrote to /data/output is kept.

The GPU host runs commands as root; udocker refuses root, so tests/gpu/run_udocker_gpu.sh makes an
account and runs this file as it (skipped as root, with the reason). There, from the project root:

    source .bundle/podman-on-gpuhost.sh .bundle && source .bundle/install-daemon-deps.sh .bundle
    NCCL_NVLS_ENABLE=0 bash tests/gpu/run_udocker_gpu.sh .bundle "$OUT"

GPUBOOK_UDOCKER_RUNC names the host's runc (the bundle's: /opt/pm/runc-wrap). Figures and the
daemon's log go to GPUBOOK_GPU_RESULTS (BENCHMARKS.md, "GPU host: udocker").
"""

from __future__ import annotations

import json
import lzma
import os
import platform
import shutil
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import paramiko
import pytest

from gpubook.runtime.engines import Engine, container_name, engine_from
from gpubook.runtime.errors import EngineError
from gpubook.runtime.nvidia.model import Gpu
from tests.kits import booker, servers
from tests.kits.daemon_kit import DaemonProcess, book, description, running_container, soon, try_login, wait_for
from tests.kits.daemon_kit import write_config as write_podman_config
from tests.kits.gpu_daemon_kit import IMAGE, RUNNING_LINE, TEMPLATE, TEMPLATE_TOML

pytestmark = [pytest.mark.gpu, pytest.mark.caldav, pytest.mark.slow, pytest.mark.udocker,
              pytest.mark.skipif(os.geteuid() == 0, reason="udocker refuses root: run it through "
                                 "tests/gpu/run_udocker_gpu.sh, which runs it as an account")]

SECONDS = 50
STAGGER = float(os.environ.get("GPUBOOK_UDOCKER_STAGGER", "12"))  # seconds between the bookings' starts
RUNC = os.environ.get("GPUBOOK_UDOCKER_RUNC", "runc")
PODMAN_ENGINE = 'name = "podman"\nruntime = "runc"\nstorage_driver = "overlay"\n'


@dataclass(frozen=True)
class Figure:
    booking: str
    user: str
    gpus: tuple[int, ...]
    line_after_start_s: float  # the `running: ssh -p` line readable in the event
    login_after_start_s: float  # the booker's first SSH login with the port from that line


def udocker_config(folder: Path, calendar_url: str, **settings: object) -> Path:
    """daemon_kit's config with udocker as the engine: the host's runc, the host's network."""
    path = write_podman_config(folder, calendar_url, **settings)  # type: ignore[arg-type]
    text = path.read_text()
    assert PODMAN_ENGINE in text, text
    path.write_text(text.replace(PODMAN_ENGINE, f'name = "udocker"\nruntime = "{RUNC}"\nnetwork = "host"\n'))
    return path


@pytest.fixture(scope="module")
def udocker(bundle: Path, tmp_path_factory: pytest.TempPathFactory) -> Engine:
    """The daemon's engine, as the daemon makes it, with the bundle's sshd image in udocker's store."""
    made = engine_from("udocker", runtime=RUNC, network="host")
    problem = made.mode_problem()  # type: ignore[attr-defined]
    assert problem is None, problem
    try:
        made.ensure_image(IMAGE)
    except EngineError:
        tarball = tmp_path_factory.mktemp("image") / "gpu-sshd.tar"
        with lzma.open(bundle / "gpu-sshd.tar.xz") as packed, tarball.open("wb") as plain:
            shutil.copyfileobj(packed, plain, 1 << 20)
        made.import_rootfs(tarball, IMAGE)
        tarball.unlink()
    return made


def test_udocker_gpu_bookings_end_to_end(tmp_path: Path, host_gpus: tuple[Gpu, ...], udocker: Engine,
                                         data_mount: Path, radicale: servers.CalendarServer,
                                         bundle: Path) -> None:
    every = host_gpus
    cudacheck = (bundle / "cudacheck").read_bytes()
    users = ("alice", "bob")[:min(2, len(every))]
    keys = {user: paramiko.ECDSAKey.generate(bits=256) for user in users}
    calendar = radicale.new_calendar()
    templates = tmp_path / "templates"
    templates.mkdir()
    (templates / f"{TEMPLATE}.toml").write_text(TEMPLATE_TOML)
    config = udocker_config(tmp_path, str(calendar.url), keys=keys, gpus=len(every), poll_seconds=60,
                            warn_minutes=0.1, template=TEMPLATE, templates_dir=templates)
    # The second booking starts while the first runs (so it gets the other GPU), not at the same
    # second: once, two udocker bookings started at once lost one container (build machine, not seen again).
    first = soon(15)
    starts = {user: first + timedelta(seconds=STAGGER * number) for number, user in enumerate(users)}
    end = first + timedelta(seconds=SECONDS)
    bookings = {user: f"gpu-ud-{user}@test" for user in users}
    for user, booking_id in bookings.items():
        book(calendar, booking_id, user=user, start=starts[user], end=end, gpus="1",
             description=f"template: {TEMPLATE}\n")
    daemon = DaemonProcess(config).start()
    figures: list[Figure] = []
    try:
        with ThreadPoolExecutor(len(users)) as pool:
            figures = list(pool.map(lambda user: serve(user, bookings[user], keys[user], starts[user], radicale,
                                                       calendar.url, udocker, daemon, every, cudacheck),
                                    users))
        for booking_id in bookings.values():
            wait_for(f"{booking_id}: the stop at the end",
                     lambda b=booking_id: udocker.inspect(container_name(b)) is None,
                     timeout=max(0.0, (end - datetime.now(UTC)).total_seconds()) + 30, daemon=daemon)
            assert datetime.now(UTC) >= end
            wait_for(f"{booking_id}: ended in the event", lambda b=booking_id: "ended:" in description(calendar, b),
                     timeout=20, daemon=daemon)
        for user in users:
            kept = tmp_path / "data" / user / "output" / "cudacheck.txt"
            assert "kernel ok" in kept.read_text() and "WRONG" not in kept.read_text(), kept.read_text()
            assert kept.stat().st_uid == os.getuid()  # one id: the daemon's user owns what bookers write
        assert not [c for c in udocker.list() if c.booking_id in bookings.values()], udocker.list()
        process = daemon.process
        assert process is not None and process.poll() is None, daemon.tail()
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0, daemon.tail()
    finally:
        daemon.stop()
        for booking_id in bookings.values():
            udocker.stop(container_name(booking_id), 0)
        report(figures, every, daemon, tmp_path)


def serve(user: str, booking_id: str, key: paramiko.PKey, start: datetime, server: servers.CalendarServer,
          calendar_url: object, engine: Engine, daemon: DaemonProcess, every: tuple[Gpu, ...],
          cudacheck: bytes) -> Figure:
    """One booker: the SSH line from the event, the login, one id and no sudo, the GPU checks."""
    calendar = server.client().calendar(url=calendar_url)  # its own connection: one per thread
    while datetime.now(UTC) < start:
        time.sleep(0.01)
    line = wait_for(f"{booking_id}: the ssh line in the event",
                    lambda: RUNNING_LINE.search(description(calendar, booking_id)), timeout=120,
                    interval=0.05, daemon=daemon)
    line_after = (datetime.now(UTC) - start).total_seconds()
    assert line.group(2) == user, line.group(0)
    client = wait_for(f"{booking_id}: SSH login as {user}", lambda: try_login(int(line.group(1)), user, key),
                      timeout=30, interval=0.02, daemon=daemon)
    login_after = (datetime.now(UTC) - start).total_seconds()
    try:
        info = running_container(engine, booking_id)
        assert info is not None and info.port == int(line.group(1)), info
        assert len(info.gpus) == 1, info.gpus
        status, said = booker.run(client, "id -un; sudo -n true 2>&1 && echo SUDO-WORKED; true")
        assert status == 0 and said.split()[0] == user and "SUDO-WORKED" not in said, said
        mine = [gpu for gpu in every if gpu.index in info.gpus]
        seen = booker.look(client, cudacheck=cudacheck, every=every)
        booker.assert_exactly(seen, mine=mine, every=every, booking_id=booking_id)
    finally:
        client.close()
    print(f"{booking_id} ({user}, GPU {','.join(map(str, info.gpus))}): ssh line in the event {line_after:.3f} s "
          f"after the start, login {login_after:.3f} s; kernel and nvidia-smi: {sorted(seen.smi_uuids)}; "
          f"/proc/driver/nvidia/gpus: {sorted(seen.proc_gpus)}; opened {sorted(seen.opened)}, refused "
          f"{sorted(seen.refused)}", flush=True)
    return Figure(booking_id, user, tuple(info.gpus), round(line_after, 3), round(login_after, 3))


def report(figures: list[Figure], every: tuple[Gpu, ...], daemon: DaemonProcess, folder: Path) -> None:
    machine = (f"{len(every)} x {every[0].name or 'NVIDIA GPU'}, {platform.platform()}, {os.cpu_count()} cores, "
               f"udocker R1 with the host's runc ({RUNC}) as uid {os.getuid()}")
    print(f"machine: {machine}")
    for figure in figures:
        print(f"figure: {json.dumps(asdict(figure))}")
    results = os.environ.get("GPUBOOK_GPU_RESULTS")
    if results:
        out = Path(results)
        out.mkdir(parents=True, exist_ok=True)
        (out / "udocker-gpu-figures.json").write_text(json.dumps(
            {"machine": machine, "figures": [asdict(f) for f in figures]}, indent=2))
        if daemon.log.exists():
            shutil.copy(daemon.log, out / "daemon.log")
        for name in ("gpubook.log", "udocker-run.log"):  # what the containers said, if any is left
            for found in Path(os.environ.get("UDOCKER_DIR", Path.home() / ".udocker")).glob(f"containers/*/{name}"):
                shutil.copy(found, out / f"{found.parent.name[:12]}-{name}")
