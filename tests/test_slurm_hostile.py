"""Issue 22, finding 3: the Slurm job folder gives no code execution as the daemon's account, on a
real Slurm 22.05 cluster (tests/kits/slurm_kit.py). The hostile one is another account of the cluster
(`nobody` here): what it could plant or swap in the shared folder is refused by the daemon or by
the job's step, and no planted code runs. Each job asks for a template the nodes do not have, so
its step ends at once with "no template" once it has read and trusted its request: no container
is needed to tell whether the step ran, and what it trusted.
"""

from __future__ import annotations

import json
import os
import pwd
import re
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from gpubook.runtime.engines import EngineSettings
from gpubook.runtime.slurm.step import StepRequest
from gpubook.scheduler.hosts.slurm import Scontrol, SlurmCluster, SlurmError
from gpubook.scheduler.hosts.slurm.jobs import JobRequest, SlurmJobs
from tests.kits import slurm_kit
from tests.kits.slurm_jobs_kit import AsAccount, JobsOfAccount, accepted, booking

pytestmark = [pytest.mark.slurm,
              pytest.mark.skipif(slurm_kit.available() is not None, reason=str(slurm_kit.available()))]
NOBODY = pwd.getpwnam("nobody")
TEMPLATE = "not-on-the-nodes"  # the step ends at once, after it read (and trusted) its request


@pytest.fixture(scope="module")
def cluster() -> Iterator[slurm_kit.Cluster]:
    with slurm_kit.running() as made:
        yield made


@pytest.fixture
def marks(cluster: slurm_kit.Cluster) -> Path:
    """Where planted code would leave its mark (anybody may write here)."""
    folder = cluster.root / f"marks-{time.monotonic_ns()}"
    folder.mkdir()
    folder.chmod(0o1777)
    return folder


def planted(marks: Path, name: str) -> str:
    """A module's code that marks `name` with the uid it ran as."""
    return f"import os\nopen({str(marks / name)!r}, 'w').write(str(os.getuid()))\n"


def _account(cluster: slurm_kit.Cluster) -> pwd.struct_passwd:
    return pwd.getpwnam(cluster.user)


def _give(path: Path, owner: pwd.struct_passwd) -> None:
    os.chown(path, owner.pw_uid, owner.pw_gid, follow_symlinks=False)


class Tampered(Scontrol):
    """sbatch, run after `tamper` changed the job folder: what another account could have done
    between the daemon's writes and the job's start."""

    def __init__(self, inner: Scontrol, tamper: Callable[[], None]) -> None:
        super().__init__(conf=inner.conf, program=inner.program)
        self.inner, self.tamper = inner, tamper

    def __call__(self, *args: str) -> str:
        self.tamper()
        return self.inner(*args)


def _jobs(cluster: slurm_kit.Cluster, prefix: str, booking_id: str, *, shared: Path | None = None) -> SlurmJobs:
    """Jobs under their own prefix (each test its own reservations), the booking's reservation made on node1."""
    if shared is None:
        shared = cluster.root / f"shared-{prefix}"
        shared.mkdir(mode=0o755)
        _give(shared, _account(cluster))
    scontrol = AsAccount(cluster.user, conf=cluster.conf)
    now = datetime.now(UTC).replace(microsecond=0)
    item = accepted(booking(booking_id, start=now - timedelta(minutes=1), gpus=1), host="node1")
    assert not SlurmCluster(scontrol=scontrol, prefix=prefix, users=[cluster.user]).sync([item], now=now).refused
    return JobsOfAccount(scontrol=scontrol, prefix=prefix, shared_dir=shared, user=cluster.user, python=sys.executable)


def _request(booking_id: str, **engine: object) -> JobRequest:
    settings = EngineSettings(name="podman", runtime="runc", storage_driver="overlay", **engine)  # type: ignore[arg-type]
    step = StepRequest(booking_id=booking_id, user="alice", uid=2001, gid=2001, ssh_keys=(), template=TEMPLATE,
                       templates_dir=None, port=22555, end=datetime.now(UTC) + timedelta(minutes=10),
                       engine=settings, data_root=None, multi_node=False)
    return JobRequest(step=step, nodes=1, gpus_per_node=1)


def _ran(jobs: SlurmJobs, booking_id: str) -> str:
    """What the job's step said, once its job ended: node1's result error, else the job's output."""
    assert jobs.wait_ended(booking_id, seconds=120), f"{booking_id}'s job did not end: {jobs.log(booking_id)}"
    result = jobs.folder(booking_id) / "result-node1.json"
    said = json.loads(result.read_text()).get("error", "") if result.exists() and not result.is_symlink() else ""
    return said or jobs.log(booking_id)


def test_a_module_in_the_job_folder_is_never_imported_by_the_step(cluster: slurm_kit.Cluster, marks: Path) -> None:
    """The step runs `python -P` from / (sbatch --chdir=/), not from the job folder: a `json.py` or
    `gpubook/` there (the daemon's own file, even) is not on its import path."""
    jobs = _jobs(cluster, "gbha-", "planted")
    folder = jobs._make_folder("planted")
    (folder / "json.py").write_text(planted(marks, "json"))
    _give(folder / "json.py", _account(cluster))
    jobs.submit(_request("planted"), now=datetime.now(UTC))
    said = _ran(jobs, "planted")
    assert not (marks / "json").exists(), "the step imported json.py from its job folder"
    assert f"no template {TEMPLATE!r}" in said, said


def test_a_job_folder_another_account_made_is_refused(cluster: slurm_kit.Cluster, marks: Path) -> None:
    jobs = _jobs(cluster, "gbhb-", "squatted")
    folder = jobs.folder("squatted")
    folder.mkdir(mode=0o777)  # made before the daemon, by another account of the cluster
    folder.chmod(0o777)
    (folder / "json.py").write_text(planted(marks, "json"))
    for path in (folder, folder / "json.py"):
        _give(path, NOBODY)
    with pytest.raises(SlurmError, match=r"job folder .*squatted.* is owned by nobody, not .*; it is not used"):
        jobs.submit(_request("squatted"), now=datetime.now(UTC))
    assert jobs.jobs() == {} and not (folder / "request.json").exists()
    assert not (marks / "json").exists()


def test_a_shared_dir_others_may_write_is_refused(cluster: slurm_kit.Cluster) -> None:
    shared = cluster.root / "shared-open"
    shared.mkdir()
    shared.chmod(0o1777)  # like /tmp: anybody may make the next booking's folder first
    jobs = _jobs(cluster, "gbhc-", "open", shared=shared)
    with pytest.raises(SlurmError, match=r"shared_dir .*shared-open is writable by others \(mode 1777\)"):
        jobs.submit(_request("open"), now=datetime.now(UTC))
    assert jobs.jobs() == {} and list(shared.iterdir()) == []


def test_the_daemon_writes_no_job_file_through_a_planted_symlink(cluster: slurm_kit.Cluster, tmp_path: Path) -> None:
    """A job folder left from an earlier start of the booking, with links where the daemon writes
    (put there while it was open, say): the links are replaced, their targets left alone."""
    jobs = _jobs(cluster, "gbhd-", "linked")
    folder = jobs._make_folder("linked")
    victim = cluster.root / "victim"
    victim.write_text("the daemon's own file\n")
    _give(victim, _account(cluster))
    for name in ("job.sh", "request.json"):
        (folder / name).symlink_to(victim)
    jobs.submit(_request("linked"), now=datetime.now(UTC))
    assert victim.read_text() == "the daemon's own file\n"
    assert not (folder / "job.sh").is_symlink() and (folder / "job.sh").read_text().startswith("#!/bin/sh")
    assert f"no template {TEMPLATE!r}" in _ran(jobs, "linked")


def _chown_request(folder: Path, marks: Path, cluster: slurm_kit.Cluster) -> str:
    _give(folder / "request.json", NOBODY)
    return r"request\.json .* is owned by nobody"


def _open_folder(folder: Path, marks: Path, cluster: slurm_kit.Cluster) -> str:
    folder.chmod(0o777)
    return r"job folder .* is writable by others \(mode 0777\)"


def _linked_request(folder: Path, marks: Path, cluster: slurm_kit.Cluster) -> str:
    elsewhere = marks / "request.json"
    shutil.copy(folder / "request.json", elsewhere)
    _give(elsewhere, _account(cluster))
    (folder / "request.json").unlink()
    (folder / "request.json").symlink_to(elsewhere)
    return r"request\.json .* is a symbolic link"


def _engine_module(folder: Path, marks: Path, cluster: slurm_kit.Cluster) -> str:
    """The request's engine a `module:Class` of the attacker's (next to the request: on the old
    step's import path)."""
    (folder / "hostile_engine.py").write_text(planted(marks, "engine") + "class Engine:\n    pass\n")
    data = json.loads((folder / "request.json").read_text())
    data["engine"]["name"] = "hostile_engine:Engine"
    (folder / "request.json").write_text(json.dumps(data))
    return r"engine 'hostile_engine:Engine' is not one of gpubook's engines \(docker, podman\)"


def _engine_runtime(folder: Path, marks: Path, cluster: slurm_kit.Cluster) -> str:
    """The request's OCI runtime a program anybody may change."""
    program = marks / "runtime"
    program.write_text(f"#!/bin/sh\nid -u > {marks / 'runtime-ran'}\n")
    program.chmod(0o777)
    data = json.loads((folder / "request.json").read_text())
    data["engine"]["runtime"] = str(program)
    (folder / "request.json").write_text(json.dumps(data))
    return r"engine runtime .*runtime is writable by others"


@pytest.mark.parametrize("tamper", [_chown_request, _open_folder, _linked_request, _engine_module,
                                    _engine_runtime])
def test_the_step_refuses_a_request_the_daemon_did_not_write(cluster: slurm_kit.Cluster, marks: Path,
                                                             tamper: Callable[[Path, Path, slurm_kit.Cluster], str]
                                                             ) -> None:
    booking_id = tamper.__name__.strip("_").replace("_", "-")
    jobs = _jobs(cluster, f"gbh{len(booking_id)}{booking_id[:3]}-", booking_id)
    folder = jobs.folder(booking_id)
    expected: list[str] = []
    jobs.sbatch = Tampered(jobs.sbatch, lambda: expected.append(tamper(folder, marks, cluster)))
    jobs.submit(_request(booking_id), now=datetime.now(UTC))
    said = _ran(jobs, booking_id)
    assert sorted(p.name for p in marks.iterdir() if p.name not in ("request.json", "runtime")) == []
    assert f"no template {TEMPLATE!r}" not in said, f"the step trusted the request: {said}"
    assert re.search(expected[0], said), said
