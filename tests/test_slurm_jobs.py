"""A booking's job on a real Slurm 22.05 cluster (tests/kits/slurm_kit.py): submitted into its
reservation, its step runs the booking's container with rootless podman on the chosen node (inside
that node's network namespace), and the booker logs in over SSH at the node's address.

The job runs as the daemon's account (the cluster's SlurmUser: GPUBOOK_SLURM_TEST_USER, default
gpubook-test), whose rootless podman storage holds the test image (built once, as that account, by
the podman suites' route).
"""

from __future__ import annotations

import base64
import json
import os
import pwd
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path

import paramiko
import pytest

from gpubook.runtime.booking import ssh
from gpubook.runtime.engines import container_name
from gpubook.runtime.errors import EngineError
from gpubook.runtime.slurm.step import StepRequest
from gpubook.runtime.templates.catalog import get_template
from gpubook.scheduler.hosts import Booker, StartRequest
from gpubook.scheduler.hosts.slurm import SlurmCluster, SlurmUnreachable
from gpubook.scheduler.hosts.slurm.host import SlurmHost
from gpubook.scheduler.hosts.slurm.jobs import JobRequest, SlurmJobs
from tests.kits import slurm_kit
from tests.kits.engine_suite import key_line, new_key
from tests.kits.slurm_jobs_kit import ENGINE, PREFIX, AsAccount, JobsOfAccount, accepted, booking
from tests.kits.slurm_kit import podman_as

pytestmark = [pytest.mark.slurm, pytest.mark.podman,
              pytest.mark.skipif(slurm_kit.available() is not None, reason=str(slurm_kit.available()))]


def _ssh_banner(address: str, port: int) -> str:
    with socket.create_connection((address, port), timeout=5) as sock:
        return sock.recv(7).decode()


@pytest.fixture
def leftover(cluster: slurm_kit.Cluster) -> Iterator[list[str]]:
    """Containers removed after the test, pass or fail: a step ended with its slurmd (the cluster's
    stop) has no chance to stop its container (conmon is not one of the job's processes)."""
    names: list[str] = []
    yield names
    for name in names:
        podman_as(cluster.user, "rm", "--force", "--time=0", name)


def test_a_booking_starts_as_a_job_in_its_reservation_and_the_booker_logs_in_on_its_node(
        cluster: slurm_kit.Cluster, account_image: None, leftover: list[str]) -> None:
    leftover.append(container_name("alice-run@node2"))
    shared = cluster.root / "shared"
    shared.mkdir()
    os.chown(shared, pwd.getpwnam(cluster.user).pw_uid, pwd.getpwnam(cluster.user).pw_gid)
    scontrol = AsAccount(cluster.user, conf=cluster.conf)
    now = datetime.now(UTC).replace(microsecond=0)
    item = accepted(booking("alice-run", start=now - timedelta(minutes=1), gpus=2), host="node2")
    assert not SlurmCluster(scontrol=scontrol, prefix=PREFIX, users=[cluster.user]).sync([item], now=now).refused
    jobs = JobsOfAccount(scontrol=scontrol, prefix=PREFIX, shared_dir=shared, user=cluster.user,
                     python=sys.executable)
    key = new_key()
    node1, node2 = (SlurmHost(name=n.name, gpus=range(n.gpus), jobs=jobs, engine=ENGINE, start_timeout=60)
                    for n in cluster.nodes)
    request = StartRequest(booking_id="alice-run", booker=Booker(name="alice", uid=2001, gid=2001,
                                                                 ssh_keys=(key_line(key),)),
                           template=get_template("debian-ssh"), gpus=(0, 1), port=22000 + os.getpid() % 1000,
                           end=item.booking.end)
    started = node2.start(request)
    result = jobs.results("alice-run")["node2"]
    assert (started.info.host, started.info.host_key, started.info.gpus) == ("node2", result.host_key, (0, 1))
    assert (result.port, result.error) == (request.port, "")
    # the booking's private host key stays on the node, never on the shared storage
    assert [p for p in shared.rglob("*") if p.name == ssh.HOST_KEY_FILE] == []
    listed = jobs.jobs()[jobs.name("alice-run")]
    assert (listed.state, listed.nodes) == ("RUNNING", "node2")
    assert result.container == container_name("alice-run@node2")  # each node's container named with its node
    assert [i.name for i in node2.list()] == [started.info.name] and node1.list() == []
    # a restarted daemon (kill -9: nothing in memory) finds the job and its container, submits nothing
    fresh = JobsOfAccount(scontrol=scontrol, prefix=PREFIX, shared_dir=shared, user=cluster.user,
                          python=sys.executable)
    again = SlurmHost(name="node2", gpus=range(4), jobs=fresh, engine=ENGINE).start(request)
    assert (again.info.name, again.info.host_key) == (started.info.name, started.info.host_key)
    assert list(fresh.jobs().values()) == [listed]
    node = cluster.nodes[1]
    client = paramiko.SSHClient()
    algorithm, blob = result.host_key.split()[:2]
    client.get_host_keys().add(f"[{node.address}]:{request.port}", algorithm,
                               paramiko.PKey.from_type_string(algorithm, base64.b64decode(blob)))
    client.connect(node.address, port=request.port, username="alice", pkey=key, timeout=10,
                   look_for_keys=False, allow_agent=False)  # RejectPolicy: only the host key the step reported
    try:
        _, out, _ = client.exec_command("id -un", timeout=20)
        assert out.read().decode().split() == ["alice"]
    finally:
        client.close()
    # A command in the container (the daemon's notices) is asked of the booking's step on its node.
    inside = node2.exec(started.info.name, ["sh", "-c", "id -un; hostname"], timeout=30)
    assert (inside.returncode, inside.stdout.split()[0]) == (0, "root"), inside.stderr
    with pytest.raises(EngineError, match="no job of gpubook's runs gpubook-other"):
        node2.exec("gpubook-other", ["true"])
    with pytest.raises(ConnectionRefusedError):  # the port is open on node2 only, not on node1
        socket.create_connection((cluster.nodes[0].address, request.port), timeout=5).close()
    # slurmctld restarted mid-booking: the booking goes on, the host says Slurm is unreachable meanwhile
    cluster.stop_slurmctld()
    jobs.squeue.timeout = 5
    with pytest.raises(SlurmUnreachable):
        node2.list()
    assert _ssh_banner(node.address, request.port) == "SSH-2.0"
    cluster.start_slurmctld()
    assert [i.name for i in node2.list()] == [started.info.name]
    assert jobs.jobs()[jobs.name("alice-run")].job_id == listed.job_id
    node2.stop(result.container, 10)
    deadline = time.monotonic() + 30
    while jobs.name("alice-run") in jobs.jobs() and time.monotonic() < deadline:
        time.sleep(0.3)
    assert jobs.name("alice-run") not in jobs.jobs() and node2.list() == []
    assert podman_as(cluster.user, "container", "exists", result.container) == 1  # stopped and removed
    assert json.loads((jobs.folder("alice-run") / "request.json").read_text())["user"] == "alice"


def test_a_two_node_booking_runs_one_container_per_node_and_they_reach_each_other(
        cluster: slurm_kit.Cluster, account_image: None, leftover: list[str]) -> None:
    leftover.extend(container_name(f"pair@{n.name}") for n in cluster.nodes)
    shared = cluster.root / "shared"
    shared.mkdir()
    os.chown(shared, pwd.getpwnam(cluster.user).pw_uid, pwd.getpwnam(cluster.user).pw_gid)
    scontrol = AsAccount(cluster.user, conf=cluster.conf)
    now = datetime.now(UTC).replace(microsecond=0)
    item = accepted(booking("pair", start=now - timedelta(minutes=1), gpus=2))
    slurm = SlurmCluster(scontrol=scontrol, prefix=PREFIX, users=[cluster.user])
    assert not slurm.sync([item], now=now, nodes_of={"pair": ("node1", "node2")}).refused
    jobs = JobsOfAccount(scontrol=scontrol, prefix=PREFIX, shared_dir=shared, user=cluster.user, python=sys.executable)
    key = new_key()
    step = StepRequest(booking_id="pair", user="alice", uid=2001, gid=2001, ssh_keys=(key_line(key),),
                       template="debian-ssh", templates_dir=None, port=23000 + os.getpid() % 1000,
                       end=item.booking.end, engine=ENGINE, data_root=None, multi_node=True)
    jobs.submit(JobRequest(step=step, nodes=2, gpus_per_node=2), now=now)
    deadline = time.monotonic() + 60
    while len(jobs.results("pair")) < 2 and time.monotonic() < deadline:
        time.sleep(0.3)
    results = jobs.results("pair")
    assert sorted(results) == ["node1", "node2"], jobs.log("pair")
    assert all((r.error, r.gpus, r.hostfile) == ("", (0, 1), "/etc/gpubook/hostfile") for r in results.values())
    first, second = cluster.nodes
    client = paramiko.SSHClient()
    client.set_missing_host_key_policy(paramiko.AutoAddPolicy())  # noqa: S507 - the key is compared below
    client.connect(first.address, port=step.port, username="alice", pkey=key, timeout=10,
                   look_for_keys=False, allow_agent=False)
    try:
        shown = client.get_transport().get_remote_server_key()  # type: ignore[union-attr]
        assert f"{shown.get_name()} {shown.get_base64()}" == results["node1"].host_key
        _, out, _ = client.exec_command("cat /etc/gpubook/hostfile", timeout=20)
        assert out.read().decode().splitlines() == [f"{first.address} slots=2", f"{second.address} slots=2"]
        # node1's container reaches node2's container (its sshd answers) at the hostfile's address
        _, out, _ = client.exec_command(f"bash -c 'exec 3<>/dev/tcp/{second.address}/{step.port}; head -c 7 <&3'",
                                        timeout=20)
        assert out.read().decode() == "SSH-2.0"
    finally:
        client.close()
    assert jobs.cancel("pair")
    deadline = time.monotonic() + 30
    while jobs.name("pair") in jobs.jobs() and time.monotonic() < deadline:
        time.sleep(0.3)
    assert all(podman_as(cluster.user, "container", "exists", r.container) == 1 for r in results.values())


def test_a_start_that_fails_on_the_node_says_why_and_leaves_no_job(cluster: slurm_kit.Cluster,
                                                                   tmp_path: Path) -> None:
    shared = cluster.root / "shared"
    shared.mkdir()
    os.chown(shared, pwd.getpwnam(cluster.user).pw_uid, pwd.getpwnam(cluster.user).pw_gid)
    scontrol = AsAccount(cluster.user, conf=cluster.conf)
    now = datetime.now(UTC).replace(microsecond=0)
    item = accepted(booking("broken", start=now - timedelta(minutes=1), gpus=1), host="node1")
    assert not SlurmCluster(scontrol=scontrol, prefix=PREFIX, users=[cluster.user]).sync([item], now=now).refused
    jobs = JobsOfAccount(scontrol=scontrol, prefix=PREFIX, shared_dir=shared, user=cluster.user, python=sys.executable)
    node1 = SlurmHost(name="node1", gpus=range(4), jobs=jobs, engine=ENGINE, start_timeout=60)
    missing = replace(get_template("debian-ssh"), name="not-on-the-nodes")
    request = StartRequest(booking_id="broken", booker=Booker(name="alice", uid=2001, gid=2001), template=missing,
                           gpus=(0,), port=22999, end=item.booking.end)
    with pytest.raises(EngineError, match="its container did not start on node1: no template 'not-on-the-nodes'"):
        node1.start(request)
    deadline = time.monotonic() + 30
    while jobs.name("broken") in jobs.jobs() and time.monotonic() < deadline:
        time.sleep(0.3)
    assert jobs.jobs() == {} and node1.list() == []  # the job ended with its step


def _step_pids(folder: Path) -> list[int]:
    """The processes of a booking's step (`python -m gpubook.runtime.slurm.step FOLDER/request.json`),
    not the srun that started it."""
    wanted = [b"gpubook.runtime.slurm.step", str(folder / "request.json").encode()]
    found = []
    for entry in Path("/proc").iterdir():
        try:
            words = (entry / "cmdline").read_bytes().split(b"\0") if entry.name.isdigit() else []
        except OSError:
            continue
        if all(word in words for word in wanted) and not words[0].endswith(b"srun"):  # the step, not its srun
            found.append(int(entry.name))
    return found


def _kill_step(jobs: SlurmJobs, booking_id: str, *, freeze_at: str = "") -> None:
    """The booking's step killed (SIGKILL), as Slurm does after KillWait or as a node's failure does:
    it has no chance to remove its container. With `freeze_at`: first stopped (SIGSTOP) as soon as its
    log has that line, so that it cannot get further (report SSH) before it is killed."""
    folder, log = jobs.folder(booking_id), jobs.folder(booking_id) / "step-node1.log"
    deadline = time.monotonic() + 120
    while not (pids := _step_pids(folder)) or (freeze_at and freeze_at not in (
            log.read_text() if log.exists() else "")):
        assert time.monotonic() < deadline, f"no step of {booking_id} said {freeze_at!r}: {jobs.log(booking_id)}"
        time.sleep(0.02)
    for signal_number in (signal.SIGSTOP, signal.SIGKILL):
        for pid in pids:
            os.kill(pid, signal_number)
    while jobs.name(booking_id) in jobs.jobs():
        assert time.monotonic() < deadline, f"{booking_id}'s job outlived its killed step"
        time.sleep(0.3)


def _inspect(user: str, name: str, template: str = "{{.Id}}") -> str:
    account = pwd.getpwnam(user)
    return subprocess.run(["runuser", "-u", user, "--", "env", f"HOME={account.pw_dir}",
                           f"XDG_RUNTIME_DIR=/run/user/{account.pw_uid}", "podman", "inspect", "--format", template,
                           name], cwd="/tmp", capture_output=True, text=True, timeout=60).stdout.strip()


def test_a_start_again_after_its_step_was_killed_adopts_or_replaces_the_container_left_behind(
        cluster: slurm_kit.Cluster, account_image: None, leftover: list[str]) -> None:
    """The fresh-machine failure of issue 21: a booking's first start ended with its job (its step
    killed before SSH answered) and every later start then failed on the container it left running
    ("already runs with another spec", a spec that changed at every start). Now: the ended start says
    why (Slurm's state, what the step was doing), a start again adopts a leftover of the same spec
    and replaces one of another spec (another port); the step's engine has the whole [engine]."""
    name = container_name("again@node1")
    leftover.append(name)
    shared = cluster.root / "shared"
    shared.mkdir()
    os.chown(shared, pwd.getpwnam(cluster.user).pw_uid, pwd.getpwnam(cluster.user).pw_gid)
    scontrol = AsAccount(cluster.user, conf=cluster.conf)
    now = datetime.now(UTC).replace(microsecond=0)
    item = accepted(booking("again", start=now - timedelta(minutes=1), gpus=1), host="node1")
    assert not SlurmCluster(scontrol=scontrol, prefix=PREFIX, users=[cluster.user]).sync([item], now=now).refused
    jobs = JobsOfAccount(scontrol=scontrol, prefix=PREFIX, shared_dir=shared, user=cluster.user, python=sys.executable)
    limited = replace(ENGINE, memory="300m", pids_limit=321)  # passed on, though cgroup v1 rootless ignores them
    node1 = SlurmHost(name="node1", gpus=range(4), jobs=jobs, engine=limited, start_timeout=120)
    key = new_key()
    request = StartRequest(booking_id="again", booker=Booker(name="alice", uid=2001, gid=2001,
                                                             ssh_keys=(key_line(key),)),
                           template=get_template("debian-ssh"), gpus=(0,), port=24000 + os.getpid() % 1000,
                           end=item.booking.end)
    # 1. The step killed before SSH answered: the start says the job ended, and why.
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(node1.start, request)
        _kill_step(jobs, "again", freeze_at="preparing")
        with pytest.raises(EngineError) as ended:
            first.result(timeout=60)
    said = str(ended.value)
    print(said)  # shown with -s: what the daemon logs for a step killed before SSH answered
    assert "the booking's job ended" in said and "Slurm says JobState=" in said and "ExitCode=" in said, said
    assert "its nodes now: node1 " in said, said
    assert "step-node1.log" in said and "preparing booking again's container on node1" in said, said
    # 2. Started; its step killed after SSH answered (its container left running): the start again adopts it.
    started = node1.start(request)
    kept = _inspect(cluster.user, name)
    # The step's podman run got [engine] memory and pids_limit (podman records its argv; on this
    # cgroup-v1 host rootless podman drops both, HostConfig says 0), and the nproc ulimit from pids_limit.
    argv = _inspect(cluster.user, name, "{{json .Config.CreateCommand}}")
    assert '"--memory","300m"' in argv and '"--pids-limit","321"' in argv, argv
    limits = _inspect(cluster.user, name, "{{range .HostConfig.Ulimits}}{{.Name}} {{.Soft}} {{.Hard}},{{end}}")
    assert "NPROC 321 321" in limits.upper(), limits
    _kill_step(jobs, "again")
    assert _inspect(cluster.user, name) == kept  # left behind, running
    again = node1.start(request)
    assert _inspect(cluster.user, name) == kept and again.info.host_key == started.info.host_key
    assert "runs already with this spec (an earlier start's): it is adopted" in (
        jobs.folder("again") / "step-node1.log").read_text()
    # 3. Left behind again, and the start again has another port: the leftover is replaced.
    _kill_step(jobs, "again")
    moved = node1.start(replace(request, port=request.port + 1))
    assert _ssh_banner(cluster.nodes[0].address, request.port + 1) == "SSH-2.0"
    assert _inspect(cluster.user, name) not in ("", kept)
    assert "left running by an earlier start" in (jobs.folder("again") / "step-node1.log").read_text()
    node1.stop(moved.info.name, 5)
    assert jobs.wait_ended("again", seconds=60)
    assert podman_as(cluster.user, "container", "exists", name) == 1  # stopped and removed
