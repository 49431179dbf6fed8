"""A GPU booking through a real Slurm on the GPU host: single-node Slurm 22.05 whose GRES gpu are the
host's REAL GPUs (gres.conf `File=/dev/nvidia[0-N]`, AutoDetect off; tests/kits/slurm_kit.py's real-GPU
mode), end to end with gpubook's own Slurm backend.

SlurmCluster.sync makes the booking's advance reservation; SlurmHost.start submits its job into it
asking for 1 GPU (of 2 on a 2-GPU host: "exactly its GPUs" then means something); the job's step
(runtime.slurm.step) starts the container with rootful podman and the host driver injected for the
GPU Slurm granted. The booker logs in over SSH (paramiko, only the host key the step reported) and
must see exactly that GPU: `nvidia-smi -L` lists the UUID the host's NVML gives the granted
/dev/nvidiaN, a CUDA kernel (tests/gpu/cudacheck.c) runs on it and sees 1 device, the other GPU's
device node cannot be opened. scancel (SlurmHost.stop) then removes the container.

Slurm and munge travel in the bundle (tests/gpu/prepare_slurm_bundle.sh); there, as root:

    source .bundle/podman-on-gpuhost.sh .bundle && source .bundle/install-daemon-deps.sh .bundle
    source .bundle/install-slurm.sh .bundle
    python3 -m pytest tests/gpu/test_slurm_gpu.py -m gpu -v -s --confcutdir=tests/gpu

GPUBOOK_GPU_RESULTS names a folder for the figures (submit -> SSH) and what was seen.
Slurm confines nothing by cgroup here (task/none: no device cgroup); the container's confinement
to the granted GPU is gpubook's injection of that GPU's device only, which is what is checked.
"""

from __future__ import annotations

import base64
import json
import lzma
import os
import platform
import re
import shutil
import socket
import sys
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import paramiko
import pytest

from gpubook.runtime.engines import Engine, EngineSettings, container_name, engine_from
from gpubook.runtime.errors import EngineError
from gpubook.runtime.nvidia.model import Gpu
from gpubook.runtime.templates.catalog import get_template
from gpubook.scheduler.core.bookings import Booking
from gpubook.scheduler.core.plan import Accepted
from gpubook.scheduler.hosts import Booker, StartRequest
from gpubook.scheduler.hosts.slurm import Scontrol, SlurmCluster
from gpubook.scheduler.hosts.slurm.host import SlurmHost
from gpubook.scheduler.hosts.slurm.jobs import SlurmJobs
from tests.kits import booker, hostroot, servers, slurm_kit
from tests.kits.daemon_kit import DaemonProcess, book, description, port_range, wait_for

pytestmark = [pytest.mark.gpu, pytest.mark.slurm,
              pytest.mark.skipif(slurm_kit.available(real_gpus=True) is not None,
                                 reason=str(slurm_kit.available(real_gpus=True)))]

BUNDLE, TEMPLATE, IMAGE, TEMPLATE_TOML, ULIMITS = (hostroot.BUNDLE, hostroot.SSHD_TEMPLATE, hostroot.SSHD_IMAGE,
                                                  hostroot.SSHD_TEMPLATE_TOML, hostroot.ULIMITS)
# The step's engine (runtime.slurm.step reads these): rootful podman, runc, overlay, the host network.
STEP_ENGINE = EngineSettings(name="podman", runtime="runc", storage_driver="overlay", network="host",
                             ulimits=tuple(ULIMITS))
PREFIX = "gpubook-"
BOOKING = "slurm-gpu@test"


@pytest.fixture(scope="module")
def engine() -> Engine:
    """The step's engine with the bundle's sshd image imported (overlay: the driver the step passes)."""
    if not (BUNDLE / "gpu-sshd.tar.xz").is_file() or not (BUNDLE / "cudacheck").is_file():
        pytest.skip(f"no GPU-host bundle at {BUNDLE}: run tests/gpu/prepare_daemon_bundle.sh and "
                    "tests/gpu/prepare_slurm_bundle.sh .bundle on the build machine and carry .bundle")
    made = engine_from("podman", runtime="runc", storage_driver="overlay", ulimits=ULIMITS, network="host")
    try:
        made.ensure_image(IMAGE)
    except EngineError:
        tarball = Path("/tmp") / f"gpu-sshd-{os.getpid()}.tar"
        with lzma.open(BUNDLE / "gpu-sshd.tar.xz") as packed, tarball.open("wb") as plain:
            shutil.copyfileobj(packed, plain, 1 << 20)
        made.import_rootfs(tarball, IMAGE)
        tarball.unlink()
    return made


@pytest.fixture
def cluster(host_gpus: tuple[Gpu, ...]) -> Iterator[slurm_kit.Cluster]:
    """Slurm on this host as root (SlurmUser root: rootful podman is what runs on the GPU host)."""
    made = slurm_kit.make(user="root", real_gpus=len(host_gpus), gpu_type="nvidia")
    try:
        yield made
    finally:
        results = os.environ.get("GPUBOOK_GPU_RESULTS")
        if results:  # the device tool brings back 8 files: the two daemons' logs and the job's output
            out = Path(results)
            out.mkdir(parents=True, exist_ok=True)
            for log in [made.root / "log" / "slurmctld.log", made.root / "log" / "slurmd-node1.log",
                        *(made.root / "shared").glob("*/slurm.out")]:
                if log.exists():
                    shutil.copy(log, out / ("job-slurm.out" if log.name == "slurm.out" else log.name))
        made.stop()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_a_slurm_gpu_booking_sees_exactly_the_gpu_slurm_granted(
        cluster: slurm_kit.Cluster, engine: Engine, host_gpus: tuple[Gpu, ...], tmp_path: Path) -> None:
    every = host_gpus
    scontrol = Scontrol(conf=cluster.conf)
    now = datetime.now(UTC).replace(microsecond=0)
    start = now - timedelta(minutes=1)
    item = Booking(id=BOOKING, uid=BOOKING, user="alice", template=TEMPLATE, gpu_count=1, gpu_indices=None,
                   start=start, end=start + timedelta(minutes=20), created=None, dtstamp=None,
                   calendar_url="http://calendar/", href="/e.ics")
    synced = SlurmCluster(scontrol=scontrol, prefix=PREFIX, users=["root"]).sync(
        [Accepted(item, (0,), item.end, "node1")], now=now)
    assert not synced.refused and [c.kind for c in synced.changes] == ["create"], synced
    reservation = scontrol("show", "reservation", "--oneliner").strip()
    assert "Nodes=node1" in reservation, reservation
    templates = tmp_path / "templates"
    templates.mkdir()
    (templates / f"{TEMPLATE}.toml").write_text(TEMPLATE_TOML)
    shared = cluster.root / "shared"
    shared.mkdir()
    jobs = SlurmJobs(scontrol=scontrol, prefix=PREFIX, shared_dir=shared, user="root", python=sys.executable)
    node = SlurmHost(name="node1", gpus=range(len(every)), jobs=jobs, engine=STEP_ENGINE, templates_dir=templates,
                     start_timeout=180)
    key = paramiko.ECDSAKey.generate(bits=256)
    request = StartRequest(booking_id=BOOKING, booker=Booker(name="alice", uid=2001, gid=2001,
                                                             ssh_keys=(f"{key.get_name()} {key.get_base64()} test",)),
                           template=get_template(TEMPLATE, templates), gpus=(0,), port=_free_port(), end=item.end)
    submitted = time.monotonic()
    try:
        started = node.start(request)
    except EngineError as error:
        raise AssertionError(f"{error}\nslurm.out:\n{jobs.log(BOOKING)}\nslurmd log:\n"
                             f"{cluster.log('slurmd-node1')[-3000:]}") from None
    step_said_ssh = time.monotonic() - submitted
    result = jobs.results(BOOKING)["node1"]
    job = jobs.jobs()[jobs.name(BOOKING)]
    job_line = scontrol("show", "job", job.job_id, "--oneliner").strip()
    assert job.state == "RUNNING" and f"Reservation={jobs.name(BOOKING)}" in job_line, job_line
    granted = result.gpus
    assert len(granted) == 1 and len(started.info.gpus) == 1, (result, started.info, job_line)
    # Slurm's GRES index k is /dev/nvidia<k> (gres.conf File=/dev/nvidia[0-N]): the host's NVML view
    mine = [gpu for gpu in every if gpu.device_minor in granted]
    assert len(mine) == 1, (granted, every)
    client = paramiko.SSHClient()
    algorithm, blob = result.host_key.split()[:2]
    client.get_host_keys().add(f"[127.0.0.1]:{request.port}", algorithm,
                               paramiko.PKey.from_type_string(algorithm, base64.b64decode(blob)))
    client.connect("127.0.0.1", port=request.port, username="alice", pkey=key, timeout=10,
                   look_for_keys=False, allow_agent=False)  # RejectPolicy: only the host key the step reported
    logged_in = time.monotonic() - submitted
    try:
        seen = booker.look(client, cudacheck=(BUNDLE / "cudacheck").read_bytes(), every=every,
                           output="/tmp/cudacheck.txt")
        _, smi = booker.run(client, "nvidia-smi -L")
        _, env = booker.run(client, "env | grep -E '^(CUDA_VISIBLE_DEVICES|NVIDIA_VISIBLE_DEVICES)=' || true")
    finally:
        client.close()
    figures = {"submit_to_step_ssh_s": round(step_said_ssh, 3), "submit_to_login_s": round(logged_in, 3),
               "container_start_to_ssh_s": result.seconds_to_ssh}
    report(every=every, granted=granted, mine=mine, seen=seen, smi=smi, env=env, figures=figures,
           reservation=reservation, job_line=job_line)
    booker.assert_exactly(seen, mine=mine, every=every, booking_id=BOOKING)
    # scancel (the host's stop): the step stops and removes the container, the job ends
    stopping = time.monotonic()
    node.stop(result.container, 10)
    deadline = time.monotonic() + 60
    while (jobs.name(BOOKING) in jobs.jobs() or engine.inspect(result.container) is not None) \
            and time.monotonic() < deadline:
        time.sleep(0.2)
    assert jobs.name(BOOKING) not in jobs.jobs(), jobs.log(BOOKING)
    assert engine.inspect(result.container) is None, jobs.log(BOOKING)
    assert node.list() == []
    figures["scancel_to_container_gone_s"] = round(time.monotonic() - stopping, 3)
    write("slurm-gpu-figures.json", {"figures": figures})
    print(f"figures: {json.dumps(figures)}", flush=True)


def report(*, every: tuple[Gpu, ...], granted: tuple[int, ...], mine: list[Gpu], seen: booker.Seen, smi: str,
           env: str, figures: dict[str, float], reservation: str, job_line: str) -> None:
    machine = (f"{len(every)} x {every[0].name or 'NVIDIA GPU'}, {platform.platform()}, {os.cpu_count()} cores, "
               "Slurm 22.05 (Debian 12 debs) single node, rootful podman (runc)")
    said = {"machine": machine, "granted_gres_indices": list(granted),
            "host_nvml": [{"index": g.index, "minor": g.device_minor, "uuid": g.uuid} for g in every],
            "granted_uuid": [g.uuid for g in mine], "nvidia_smi_L_inside": smi.strip().splitlines(),
            "kernel_output": seen.kernel_output.strip().splitlines(), "opened_minors": sorted(seen.opened),
            "refused_minors": sorted(seen.refused), "proc_driver_nvidia_gpus": sorted(seen.proc_gpus),
            "env_inside": env.strip().splitlines(), "figures": figures, "reservation": reservation,
            "job": job_line}
    print(json.dumps(said, indent=1), flush=True)
    write("slurm-gpu-seen.json", said)


def write(name: str, data: object) -> None:
    results = os.environ.get("GPUBOOK_GPU_RESULTS")
    if results:
        Path(results).mkdir(parents=True, exist_ok=True)
        (Path(results) / name).write_text(json.dumps(data, indent=2) + "\n")


def test_the_daemon_runs_a_gpu_booking_through_slurm(
        cluster: slurm_kit.Cluster, engine: Engine, host_gpus: tuple[Gpu, ...],
        radicale: servers.CalendarServer, tmp_path: Path) -> None:  # noqa: F811 - the fixture imported above
    """`gpubook run` with `[backend] kind = "slurm"` on this host's single-node Slurm (real GPU GRES):
    a booking in the calendar becomes a reservation and, at its start, a job whose container sees
    exactly the GPU Slurm granted; the event gives the ssh line on the node; deleting the event ends it."""
    every = host_gpus
    templates = tmp_path / "templates"
    templates.mkdir()
    (templates / f"{TEMPLATE}.toml").write_text(TEMPLATE_TOML)
    shared = cluster.root / "daemon-shared"
    shared.mkdir()
    key = paramiko.ECDSAKey.generate(bits=256)
    calendar = radicale.new_calendar()
    low, high = port_range()
    config = tmp_path / "gpubook.toml"
    config.write_text("\n".join([
        '[host]', 'name = "gpuhost"', 'timezone = "UTC"', '',
        '[backend]', 'kind = "slurm"', f'slurm_conf = "{cluster.conf}"', f'shared_dir = "{shared}"', '',
        '[[calendar]]', f'url = "{calendar.url}"', 'username = "test"', '',
        '[templates]', f'dir = "{templates}"', '',
        '[defaults]', f'template = "{TEMPLATE}"', 'gpus = 1', 'warn_minutes = 0.1', '',
        '[engine]', 'name = "podman"', 'runtime = "runc"', 'storage_driver = "overlay"', 'network = "host"',
        f'ulimits = {json.dumps(list(ULIMITS))}', 'stop_grace_seconds = 1', '',
        '[ssh]', f'port_min = {low}', f'port_max = {high}', '',
        '[daemon]', 'poll_seconds = 2', f'state_dir = "{tmp_path / "state"}"', 'notice_seconds = 3', '',
        '[users.alice]', 'uid = 2001', f'ssh_keys = ["{key.get_name()} {key.get_base64()} test"]', '']))
    daemon = DaemonProcess(config).start()
    uid = "gpu-slurm-daemon@test"
    try:
        start = datetime.now(UTC).replace(microsecond=0) + timedelta(seconds=15)
        book(calendar, uid, user="alice", start=start, end=start + timedelta(minutes=20), gpus="1",
             description=f"template: {TEMPLATE}\n")
        line = wait_for("the ssh line on node1", lambda: re.search(r"running: ssh -p (\d+) alice@node1",
                                                                   description(calendar, uid)),
                        timeout=120, daemon=daemon)
        line_after = (datetime.now(UTC) - start).total_seconds()
        (folder,) = [p for p in shared.iterdir() if p.is_dir()]
        result = json.loads((folder / "result-node1.json").read_text())
        mine = [gpu for gpu in every if gpu.device_minor in result["gpus"]]
        assert len(result["gpus"]) == 1 and len(mine) == 1, (result, every)
        client = paramiko.SSHClient()
        client.set_missing_host_key_policy(paramiko.AutoAddPolicy())  # noqa: S507 - compared below
        client.connect("127.0.0.1", port=int(line.group(1)), username="alice", pkey=key, timeout=10,
                       look_for_keys=False, allow_agent=False)
        login_after = (datetime.now(UTC) - start).total_seconds()
        try:
            shown = client.get_transport().get_remote_server_key()  # type: ignore[union-attr]
            assert f"{shown.get_name()} {shown.get_base64()}" == result["host_key"]
            seen = booker.look(client, cudacheck=(BUNDLE / "cudacheck").read_bytes(), every=every,
                               output="/tmp/cudacheck.txt")
        finally:
            client.close()
        booker.assert_exactly(seen, mine=mine, every=every, booking_id=uid)
        figures = {"start_to_ssh_line_s": round(line_after, 3), "start_to_login_s": round(login_after, 3),
                   "gres_index": result["gpus"], "uuid": mine[0].uuid}
        calendar.event_by_uid(uid).delete()  # the booking cancelled: warned, stopped, its job ends
        wait_for("the job and its container gone", lambda: engine.inspect(result["container"]) is None
                 and not Scontrol(conf=cluster.conf)("show", "job", "--oneliner").count("JobState=RUNNING"),
                 timeout=90, daemon=daemon)
        assert "inside the container failed" not in daemon.tail()
        write("slurm-daemon-gpu-figures.json", figures)
        print(f"daemon through Slurm: {json.dumps(figures)}", flush=True)
    finally:
        daemon.stop()
        engine.stop(container_name(f"{uid}@node1"), 0)  # the step's container, named with its node
