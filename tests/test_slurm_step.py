"""The booking's job as gpubook writes it, without a cluster: what reaches sbatch and the job's
shell, and what a job step accepts from its request and from Slurm's environment."""

from __future__ import annotations

import dataclasses
import json
import shlex
import types
import typing
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from gpubook.runtime.engines import EngineSettings
from gpubook.runtime.errors import GpubookError
from gpubook.runtime.slurm.step import StepRequest, _prepare, engine_settings_from, granted_gpus
from gpubook.scheduler.hosts.slurm import Scontrol
from gpubook.scheduler.hosts.slurm.cluster import SlurmError
from gpubook.scheduler.hosts.slurm.jobs import JobRequest, SlurmJobs

NOW = datetime(2026, 11, 23, 10, 0, tzinfo=UTC)
HOSTILE_ID = "x'; touch /tmp/pwned; echo '$(id)`id`\n--reservation=other"


class Recorded(Scontrol):
    """Slurm's clients as a list of argv lists: squeue lists nothing, sbatch answers a job id."""

    def __init__(self, log: list[list[str]]) -> None:
        super().__init__()
        self.log = log

    def __call__(self, *args: str) -> str:
        self.log.append([self.program, *args])
        return "42\n" if self.program == "sbatch" else ""


def step(booking_id: str = "b1", **changes: object) -> StepRequest:
    values: dict[str, object] = dict(booking_id=booking_id, user="alice", uid=2001, gid=2001, ssh_keys=("k",),
                                     template="debian-ssh", templates_dir=None, port=22001,
                                     end=NOW + timedelta(hours=1), engine=EngineSettings(), data_root=None,
                                     multi_node=False)
    values.update(changes)
    return StepRequest(**values)  # type: ignore[arg-type]


def test_a_hostile_booking_id_reaches_neither_the_script_nor_sbatch_as_anything_but_a_checked_name(
        tmp_path: Path) -> None:
    shared = tmp_path / "shared $(touch pwned) dir"  # the admin's path, with a shell's specials
    log: list[list[str]] = []
    jobs = SlurmJobs(scontrol=Recorded(log), prefix="gpubook-", shared_dir=shared, user="gpubook",
                     python="/opt/gpubook venv/bin/python")
    job = jobs.submit(JobRequest(step=step(HOSTILE_ID), nodes=2, gpus_per_node=8), now=NOW)
    assert job.job_id == "42"
    folder = jobs.folder(HOSTILE_ID)
    assert folder.parent == shared and set(folder.name) <= set("abcdefghijklmnopqrstuvwxyz0123456789-_.")
    (sbatch,) = [argv for argv in log if argv[0] == "sbatch"]
    assert sbatch[1:] == ["--parsable", "--no-requeue", f"--job-name={folder.name}", f"--reservation={folder.name}",
                          "--nodes=2", "--ntasks-per-node=1", "--time=62", f"--output={folder / 'slurm.out'}",
                          "--chdir=/", "--gres=gpu:8", str(folder / "job.sh")]
    lines = (folder / "job.sh").read_text().splitlines()
    assert lines[0] == "#!/bin/sh" and all(line.startswith("#") for line in lines[1:-1])
    assert shlex.split(lines[-1]) == ["exec", "srun", "--kill-on-bad-exit=1", "--chdir=/",
                                      "/opt/gpubook venv/bin/python",
                                      "-P", "-m", "gpubook.runtime.slurm.step", str(folder / "request.json")]
    assert json.loads((folder / "request.json").read_text())["booking_id"] == HOSTILE_ID  # data, never code


def test_a_booking_with_a_pending_or_running_job_is_never_submitted_twice(tmp_path: Path) -> None:
    log: list[list[str]] = []

    class Listed(Recorded):
        def __call__(self, *args: str) -> str:
            if self.program == "squeue":
                self.log.append([self.program, *args])
                return "7|gpubook-b1-{}|RUNNING|node1|None\n".format(jobs.name("b1").rsplit("-", 1)[1])
            return super().__call__(*args)

    jobs = SlurmJobs(scontrol=Listed(log), prefix="gpubook-", shared_dir=tmp_path, user="gpubook")
    assert jobs.submit(JobRequest(step=step(), nodes=1, gpus_per_node=1), now=NOW).job_id == "7"
    assert [argv[0] for argv in log] == ["squeue"]


def test_a_job_that_ends_between_the_listing_and_the_cancel_is_cancelled_not_an_error(tmp_path: Path) -> None:
    """CI of issue 35's lanes: a step that failed on its node ended its job while the host cancelled
    it; squeue had listed it, scancel answered "Invalid job id specified", and the start failed with
    that instead of the node's reason. slurmctld's words, as it says them."""
    log: list[list[str]] = []

    class Ended(Recorded):
        def __call__(self, *args: str) -> str:
            self.log.append([self.program, *args])
            if self.program == "squeue":
                return "7|gpubook-b1-{}|RUNNING|node1|None\n".format(jobs.name("b1").rsplit("-", 1)[1])
            if self.program == "scancel":
                raise SlurmError("error: Kill job error on job id 7: Invalid job id specified")
            return ""

    jobs = SlurmJobs(scontrol=Ended(log), prefix="gpubook-", shared_dir=tmp_path, user="gpubook")
    assert jobs.cancel("b1", grace=1) is True
    assert jobs.cancel("b1") is True
    assert [argv[0] for argv in log] == ["squeue", "scancel", "squeue", "scancel"]

    class Refused(Ended):
        def __call__(self, *args: str) -> str:
            if self.program == "scancel":
                raise SlurmError("error: Kill job error on job id 7: Access/permission denied")
            return super().__call__(*args)

    jobs = SlurmJobs(scontrol=Refused([]), prefix="gpubook-", shared_dir=tmp_path, user="gpubook")
    with pytest.raises(SlurmError, match="permission denied"):
        jobs.cancel("b1")  # any other refusal is still one


def test_a_step_takes_its_gpus_from_slurm_and_refuses_anything_but_indices() -> None:
    assert granted_gpus({"SLURM_STEP_GPUS": "2,3", "CUDA_VISIBLE_DEVICES": "0,1"}) == (2, 3)
    assert granted_gpus({"CUDA_VISIBLE_DEVICES": "0,1"}) == (0, 1)
    assert granted_gpus({}) == ()
    with pytest.raises(GpubookError, match="is not a list of GPU indices"):
        granted_gpus({"SLURM_JOB_GPUS": "0,1;rm -rf /"})


def _other_value(name: str, hint: object, default: object) -> object:
    """A value of a field's type unlike its default, for any EngineSettings field there is."""
    options = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    kind = next(option for option in options if option is not type(None))
    if typing.get_origin(kind) is tuple:
        return ("nofile=1024:1024", "nproc=77:77")
    samples: dict[object, object] = {str: {"name": "docker", "network": "host"}.get(name, f"{name}-set"),
                                     bool: not default, int: 777, float: 2.5}
    if kind not in samples:
        raise AssertionError(f"EngineSettings.{name}: no sample value of type {kind} here; add one, and make sure "
                             f"runtime.slurm.step carries it to the step")
    return samples[kind]


def test_every_engine_setting_reaches_the_step(tmp_path: Path) -> None:
    """Each field of [engine], changed from its default, comes back from the step's request as
    it was written: a field added to EngineSettings cannot be dropped on the way to the nodes."""
    hints = typing.get_type_hints(EngineSettings)
    changed = {f.name: _other_value(f.name, hints[f.name], f.default) for f in dataclasses.fields(EngineSettings)}
    settings = EngineSettings(**changed)  # type: ignore[arg-type]
    assert all(getattr(settings, name) != getattr(EngineSettings(), name) for name in changed)
    path = tmp_path / "request.json"
    step(engine=settings).write(path)
    read = StepRequest.read(path).engine
    for f in dataclasses.fields(EngineSettings):
        assert getattr(read, f.name) == getattr(settings, f.name), f.name
    assert read == settings


def test_a_request_written_by_the_earlier_daemon_still_reads() -> None:
    """0.2.0 wrote [engine] as strings (ulimits comma-separated): a job running across the daemon's
    upgrade is still read, and so still listed."""
    old = {"name": "podman", "runtime": "", "storage_driver": "overlay", "network": "host",
           "ulimits": "nofile=1024:1024,nproc=4096:4096", "stop_grace_seconds": "3"}
    assert engine_settings_from(old) == EngineSettings(runtime=None, storage_driver="overlay", network="host",
                                                       ulimits=("nofile=1024:1024", "nproc=4096:4096"),
                                                       stop_grace_seconds=3.0)


@pytest.mark.parametrize(("engine", "message"), [
    ({"pids_limit": "many"}, "pids_limit is not a number"),
    ({"pids_limit": True}, "pids_limit should be of type int, not True"),
    ({"ulimits": [1]}, "ulimits is not a list of strings"),
    ({"name": None}, "name may not be empty"),
    ({"cgroup": "x"}, "unknown engine settings cgroup"),
])
def test_a_step_refuses_engine_settings_of_the_wrong_kind(engine: dict[str, object], message: str) -> None:
    with pytest.raises(GpubookError, match=message):
        engine_settings_from(engine)


@pytest.mark.podman
def test_a_start_again_of_the_same_booking_makes_the_same_spec(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The spec hash of a booking's container on a node depends only on what the booking asks for:
    a start again after one whose step was killed (its container left running) makes the same
    spec, so it adopts that container instead of failing on "already runs with another spec"."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    request = step("again@test", engine=EngineSettings(name="podman", runtime="runc", storage_driver="overlay"))
    attempts = [_prepare(request, folder=tmp_path, node="node1", gpus=(0,), env={}) for _ in range(2)]
    first, second = (made.spec for made in attempts)
    assert first.spec_hash == second.spec_hash, [
        (a, b) for a, b in zip(dataclasses.astuple(first), dataclasses.astuple(second), strict=True) if a != b]
    assert attempts[0].probe.get_base64() == attempts[1].probe.get_base64()
    # A key of its own for each booking's container, kept private on the node, out of the container's mounts.
    other = _prepare(step("other@test", engine=request.engine), folder=tmp_path, node="node1", gpus=(), env={})
    assert other.probe.get_base64() != attempts[0].probe.get_base64()
    kept = tmp_path / "cache" / "gpubook" / "probe-keys" / first.name
    assert kept.stat().st_mode & 0o777 == 0o600
    assert all(not str(kept).startswith(str(mount.source)) for mount in first.mounts)


@pytest.mark.parametrize(("change", "message"), [
    ({"user": "root;id"}, "user name"),
    ({"end": "2026-11-23T10:00:00"}, "has no time zone"),
    ({"extra": "x"}, "unknown keys extra"),
])
def test_a_step_refuses_a_request_it_was_not_written_to_run(tmp_path: Path, change: dict[str, str],
                                                             message: str) -> None:
    path = tmp_path / "request.json"
    step().write(path)
    data = json.loads(path.read_text())
    data.update(change)
    path.write_text(json.dumps(data))
    with pytest.raises(GpubookError, match=message):
        StepRequest.read(path)


def test_slurms_gres_indices_are_read_as_nvidia_smis_through_the_device_minors() -> None:
    from gpubook.runtime.nvidia.model import Gpu
    from gpubook.runtime.slurm.step import nvidia_indices

    # nvidia-smi's order (PCI bus) against the minors: GPU 0 is /dev/nvidia1, GPU 1 is /dev/nvidia0.
    crossed = (Gpu(index=0, minor=1, bus_id="0000:01:00.0"), Gpu(index=1, minor=0, bus_id="0000:02:00.0"))
    assert nvidia_indices((0,), crossed) == (1,)  # GRES 0 = File /dev/nvidia0 = nvidia-smi's GPU 1
    assert nvidia_indices((1, 0), crossed) == (0, 1)
    same = (Gpu(index=0, minor=0), Gpu(index=1, minor=1))
    assert nvidia_indices((1,), same) == (1,)
    with pytest.raises(GpubookError, match="Slurm granted GPU 2, but this node's driver lists 2 GPUs"):
        nvidia_indices((2,), same)


class _Recording:
    """The engine's exec, recorded (the step's only call here)."""

    def __init__(self) -> None:
        self.ran: list[list[str]] = []

    def exec(self, name: str, argv: list[str], *, user: str | None = None, timeout: float | None = None) -> object:
        from gpubook.runtime.engines import ExecResult

        self.ran.append([name, *argv])
        return ExecResult(0, "done\n", "")


def _order(folder: Path, token: str, argv: list[str]) -> Path:
    path = folder / f"exec-node1-{token}.json"
    path.write_text(json.dumps({"argv": argv, "timeout": 5}))
    return path


def test_the_step_runs_the_daemons_orders_and_answers_them(tmp_path: Path) -> None:
    from gpubook.runtime.slurm.step import serve_execs

    folder = tmp_path / "job"
    folder.mkdir(mode=0o755)
    engine = _Recording()
    _order(folder, "a1", ["sh", "-c", "echo $(id -u); touch /x"])
    serve_execs(folder, node="node1", engine=engine, name="gpubook-b")  # type: ignore[arg-type]
    assert engine.ran == [["gpubook-b", "sh", "-c", "echo $(id -u); touch /x"]]  # argv as data, no shell here
    assert json.loads((folder / "done-node1-a1.json").read_text()) == {"returncode": 0, "stdout": "done\n",
                                                                       "stderr": ""}
    assert not (folder / "exec-node1-a1.json").exists()


def test_orders_anybody_could_have_written_are_not_run(tmp_path: Path) -> None:
    """Hostile: an order in a folder others may write, or a file of another account, runs nothing
    (it would run as root in a booker's container)."""
    import os

    from gpubook.runtime.slurm.step import serve_execs

    open_folder = tmp_path / "open"
    open_folder.mkdir()
    open_folder.chmod(0o777)
    engine = _Recording()
    _order(open_folder, "b1", ["reboot"])
    serve_execs(open_folder, node="node1", engine=engine, name="gpubook-b")  # type: ignore[arg-type]
    folder = tmp_path / "job"
    folder.mkdir(mode=0o755)
    foreign = _order(folder, "c1", ["reboot"])
    if os.geteuid() == 0:
        os.chown(foreign, 65534, 65534)  # nobody's file
    else:
        foreign.unlink()
        foreign.symlink_to(tmp_path / "elsewhere.json")
        (tmp_path / "elsewhere.json").write_text(json.dumps({"argv": ["reboot"]}))
    serve_execs(folder, node="node1", engine=engine, name="gpubook-b")  # type: ignore[arg-type]
    assert engine.ran == []
    assert not list(folder.glob("done-*")) and not list(open_folder.glob("done-*"))


def _result(folder: Path, name: str, **values: object) -> Path:
    path = folder / f"result-{name}.json"
    path.write_text(json.dumps({"node": name, "port": 22001, "gpus": [0], **values}))
    return path


def test_results_anybody_could_have_written_are_refused_and_a_host_key_is_one_parsed_key(tmp_path: Path) -> None:
    """Hostile (issue 22, finding 3): a node's result is what the booker's known_hosts line and the
    event's ssh line are made of. One that is not the account's (a link, another account's file),
    one naming another node, or one whose host key is not one SSH public key (a second line, a
    `@cert-authority` marker) is never handed on: its node reports a refused result instead."""
    import os

    import paramiko

    from gpubook.runtime.booking import ssh
    from gpubook.scheduler.hosts.slurm.jobs import SlurmJobs

    key = paramiko.ECDSAKey.generate()
    line = f"{key.get_name()} {key.get_base64()}"
    jobs = SlurmJobs(scontrol=Recorded([]), prefix="gpubook-", shared_dir=tmp_path / "shared", user="gpubook")
    folder = jobs._make_folder("b1")
    _result(folder, "node1", host_key=line)
    injected = f"{line}\n@cert-authority * {line}"
    _result(folder, "node2", host_key=injected)
    _result(folder, "node3", node="node1", host_key=line)
    _result(folder, "node4", error="no template\nrunning: ssh -p 1 alice@evil")
    elsewhere = _result(tmp_path, "node5", host_key=line)
    (folder / "result-node5.json").symlink_to(elsewhere)
    foreign = _result(folder, "node6", host_key=line)
    if os.geteuid() == 0:
        os.chown(foreign, 65534, 65534)  # nobody's
    else:
        foreign.chmod(0o666)  # anybody's to write
    found = jobs.results("b1")
    assert found["node1"].host_key == line and found["node1"].error == ""
    assert "host key is not one 'TYPE BASE64' SSH public key" in found["node2"].error
    assert found["node2"].host_key == ""
    assert "names node 'node1' in the file of node 'node3'" in found["node3"].error
    assert found["node4"].error == "no template running: ssh -p 1 alice@evil"  # one line in the event
    assert "node5" not in found and "node6" not in found
    assert "\n" not in ssh.known_hosts_line(host="node1", port=22001, host_key=found["node1"].host_key)
    # A folder others may write: none of its results is read.
    folder.chmod(0o777)
    assert jobs.results("b1") == {}
