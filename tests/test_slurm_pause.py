"""Round 3, M4: a booker who ends their own booking cannot take down the others' on their node.

On a real Slurm 22.05 cluster (tests/kits/slurm_kit.py) whose jobs are tracked by cgroup
(proctrack/cgroup, on this machine's cgroup v1 freezer: each job's processes end with it). The
account's rootless podman keeps one pause process per node, holding the user namespace of all its
containers there. Before the fix, the first booking's step started it inside its own job's cgroup,
so the end of that job (its booker deletes the event) ended the pause process and with it the
namespaces of every other booking on the node. Now a step in a job cgroup refuses to start while the
pause process is missing or inside a job, and Slurm's Prolog (`python -m gpubook.runtime.slurm.pause
ACCOUNT`, as root, outside the job) starts it before the step: then a second booking outlives the
end of the first, its container the same one, and SSH still answers in it.
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import sys
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from gpubook.runtime.engines import container_name
from gpubook.runtime.errors import EngineError
from gpubook.runtime.slurm.pause import job_of
from gpubook.runtime.templates.catalog import get_template
from gpubook.scheduler.hosts import Booker, StartRequest
from gpubook.scheduler.hosts.slurm import SlurmCluster
from gpubook.scheduler.hosts.slurm.host import SlurmHost
from tests.kits import slurm_kit
from tests.kits.engine_suite import key_line, new_key
from tests.kits.slurm_jobs_kit import ENGINE, PREFIX, REPO, AsAccount, JobsOfAccount, accepted, booking
from tests.kits.slurm_kit import podman_as

pytestmark = [pytest.mark.slurm, pytest.mark.podman, pytest.mark.ends_pause,
              pytest.mark.skipif(slurm_kit.available() is not None, reason=str(slurm_kit.available())),
              pytest.mark.skipif(not Path("/sys/fs/cgroup/freezer").is_dir() and not slurm_kit.CGROUP_V2.exists(),
                                 reason="no cgroup freezer for proctrack/cgroup")]


@pytest.fixture(scope="module")
def tracked() -> Iterator[slurm_kit.Cluster]:
    """A cluster tracking jobs by cgroup, whose Prolog runs gpubook's when the flag file is there."""
    folder = Path(os.environ.get("TMPDIR", "/tmp")) / f"gpubook-prolog-{os.getpid()}"
    folder.mkdir(exist_ok=True)
    folder.chmod(0o755)
    script = folder / "prolog.sh"
    script.write_text(f"#!/bin/sh\n[ -e {folder}/on ] || exit 0\n"
                      f"PYTHONPATH={REPO} exec {sys.executable} -m gpubook.runtime.slurm.pause "
                      f"{slurm_kit.DEFAULT_USER} 2>>{folder}/prolog.log\n")
    script.chmod(0o755)
    try:
        with slurm_kit.running(proctrack="cgroup", prolog=str(script)) as made:
            made.prolog_folder = folder  # type: ignore[attr-defined]
            yield made
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _account() -> pwd.struct_passwd:
    return pwd.getpwnam(slurm_kit.DEFAULT_USER)


def _pause_pid() -> int | None:
    try:
        pid = int(Path(f"/run/user/{_account().pw_uid}/libpod/tmp/pause.pid").read_text())
        return pid if Path(f"/proc/{pid}").stat().st_uid == _account().pw_uid else None
    except (OSError, ValueError):
        return None


def _no_pause() -> None:
    """The account's pause process ended (and its containers with it): the next podman command starts one."""
    pid = _pause_pid()
    if pid is not None:
        os.kill(pid, signal.SIGKILL)
    podman_as(slurm_kit.DEFAULT_USER, "system", "migrate")
    pid = _pause_pid()
    if pid is not None:  # migrate's own podman started a new one
        os.kill(pid, signal.SIGKILL)
    assert _pause_pid() is None


def _job_cgroups(job: str) -> list[Path]:
    """The cgroups Slurm made for `job` that are still there (v1: under each controller)."""
    return [path for path in Path("/sys/fs/cgroup").glob(f"**/job_{job}") if path.is_dir()]


def _host(cluster: slurm_kit.Cluster, tag: str) -> tuple[SlurmHost, JobsOfAccount, AsAccount]:
    shared = cluster.root / f"shared-{tag}"
    shared.mkdir()
    os.chown(shared, _account().pw_uid, _account().pw_gid)
    scontrol = AsAccount(cluster.user, conf=cluster.conf)
    jobs = JobsOfAccount(scontrol=scontrol, prefix=PREFIX, shared_dir=shared, user=cluster.user,
                         python=sys.executable)
    node = cluster.nodes[0]
    return SlurmHost(name=node.name, gpus=range(node.gpus), jobs=jobs, engine=ENGINE, start_timeout=60), jobs, scontrol


def _request(booking_id: str, port: int, end: datetime) -> StartRequest:
    return StartRequest(booking_id=booking_id, booker=Booker(name="alice", uid=2001, gid=2001,
                                                             ssh_keys=(key_line(new_key()),)),
                        template=get_template("debian-ssh"), gpus=(0,), port=port, end=end)


def _reserve(scontrol: AsAccount, *ids: str) -> list[object]:
    now = datetime.now(UTC).replace(microsecond=0)
    items = [accepted(booking(i, start=now - timedelta(minutes=1), gpus=1), host="node1") for i in ids]
    # two bookings of one GPU each, side by side on node1's GPUs 0 and 1
    items = [type(item)(item.booking, (index,), item.warn_at, item.host) for index, item in enumerate(items)]
    assert not SlurmCluster(scontrol=scontrol, prefix=PREFIX, users=[slurm_kit.DEFAULT_USER]).sync(
        items, now=now).refused
    return items


def test_a_step_in_a_job_cgroup_refuses_to_start_the_pause_process_in_its_job(
        tracked: slurm_kit.Cluster, account_image: None) -> None:
    (tracked.prolog_folder / "on").unlink(missing_ok=True)  # type: ignore[attr-defined]
    _no_pause()
    host, jobs, scontrol = _host(tracked, "refused")
    (item,) = _reserve(scontrol, "pause-refused")
    request = _request("pause-refused", 22000 + os.getpid() % 500, item.booking.end)  # type: ignore[attr-defined]
    with pytest.raises(EngineError) as refused:
        host.start(request)
    said = str(refused.value)
    assert "podman's pause process of this account does not run on node1" in said, said
    assert "this step runs in the cgroup of job" in said and "python -m gpubook.runtime.slurm.pause" in said, said
    assert _pause_pid() is None  # the step ran no podman command: nothing started in its job


def test_with_the_prolog_a_booking_outlives_the_end_of_the_first_on_its_node(
        tracked: slurm_kit.Cluster, account_image: None) -> None:
    (tracked.prolog_folder / "on").touch()  # type: ignore[attr-defined]
    _no_pause()
    host, jobs, scontrol = _host(tracked, "prolog")
    first_item, second_item = _reserve(scontrol, "pause-first", "pause-second")
    port = 22500 + os.getpid() % 400
    first = host.start(_request("pause-first", port, first_item.booking.end))  # type: ignore[attr-defined]
    try:
        pause = _pause_pid()
        assert pause is not None, (tracked.prolog_folder / "prolog.log").read_text()  # type: ignore[attr-defined]
        assert job_of(Path(f"/proc/{pause}/cgroup").read_text()) is None  # outside every job
        second = host.start(_request("pause-second", port + 1, second_item.booking.end))  # type: ignore[attr-defined]
        first_job = jobs.jobs()[jobs.name("pause-first")].job_id
        # the first booker ends their booking: Slurm ends their job and every process in its cgroup
        host.stop(first.info.name, 5)
        deadline = time.monotonic() + 60
        while jobs.name("pause-first") in jobs.jobs() or _job_cgroups(first_job):
            # squeue forgets the job before slurmstepd has ended the processes left in its cgroup
            # and removed it: only then is the job's end complete
            assert time.monotonic() < deadline, f"job {first_job} did not end: {_job_cgroups(first_job)}"
            time.sleep(0.5)
        assert _pause_pid() == pause
        listed = {info.name: info for info in host.list()}
        assert listed[second.info.name].id == second.info.id  # the same container, never restarted
        assert podman_as(slurm_kit.DEFAULT_USER, "ps") == 0  # the account's podman still works
        node = tracked.nodes[0]
        with socket.create_connection((node.address, port + 1), timeout=10) as sock:
            assert sock.recv(7) == b"SSH-2.0"
    finally:
        for name in (container_name("pause-first@node1"), container_name("pause-second@node1")):
            podman_as(slurm_kit.DEFAULT_USER, "rm", "--force", "--time=0", name)
