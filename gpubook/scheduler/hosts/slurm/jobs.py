"""A booking's Slurm job: submitted into its reservation at its start, found again after a restart,
cancelled at its stop.

The job is named like the booking's reservation (prefix + hashed booking id): `squeue` by that
name finds it after a restart, so a booking's job is never submitted twice while one is pending
or running. Its folder under `[backend] shared_dir` (seen by every node) holds the request the
job's steps read (`runtime.slurm.step`), the script, Slurm's log and each node's result (where
SSH answers). The script is made by gpubook from validated values only: quoted paths and the
interpreter; the request is JSON. sbatch gets an argv list: `--reservation`, `--nodes`,
`--ntasks-per-node=1`, `--gres=gpu:N` (Slurm confines the job to N GPUs per node) and `--time`
up to the booking's end (Slurm's backstop; the step itself stops the container at the end).
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import pwd
import re
import secrets
import shlex
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import paramiko

from gpubook.runtime.engines import ExecResult
from gpubook.runtime.errors import EngineError
from gpubook.runtime.slurm.step import (
    EXEC_POLL,
    StepRequest,
    UnsafeFile,
    check_private_dir,
    read_private,
    trusted_owners,
    write_atomic,
)
from gpubook.scheduler.hosts.slurm.cluster import Scontrol, SlurmError
from gpubook.scheduler.hosts.slurm.sync import reservation_name

ACTIVE = ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED", "RESIZING")
STOP_MARGIN = 20.0  # seconds past the stop grace a step has to stop its container before scancel
GRACE_MINUTES = 2  # past the booking's end before Slurm's time limit ends the job (the step stops first)


@dataclass(frozen=True)
class Job:
    """One of gpubook's jobs as squeue lists it."""

    job_id: str
    name: str
    state: str
    nodes: str  # Slurm's node list expression ("node[1-2]"); empty while pending
    reason: str = ""


@dataclass(frozen=True)
class NodeResult:
    """What a node's step wrote: where SSH answers, or why its container did not start."""

    node: str
    port: int = 0
    host_key: str = ""
    container: str = ""
    seconds_to_ssh: float = 0.0
    gpus: tuple[int, ...] = ()  # the node's GPU indices Slurm granted, as the container got them
    hostfile: str = ""  # a multi-node booking's hostfile path inside the container
    error: str = ""


@dataclass(frozen=True)
class JobRequest:
    """One booking's job: where (its reservation, nodes, GPUs per node) and what (the step request)."""

    step: StepRequest
    nodes: int
    gpus_per_node: int
    partition: str = ""


class SlurmJobs:
    """gpubook's jobs on the cluster, run with the same account and settings as its scontrol."""

    def __init__(self, *, scontrol: Scontrol, prefix: str, shared_dir: Path, user: str,
                 python: str = sys.executable) -> None:
        self.scontrol = scontrol
        self.sbatch, self.squeue, self.scancel = (scontrol.tool(p) for p in ("sbatch", "squeue", "scancel"))
        self.prefix, self.shared_dir, self.user, self.python = prefix, shared_dir, user, python

    def name(self, booking_id: str) -> str:
        return reservation_name(booking_id, prefix=self.prefix)

    def folder(self, booking_id: str) -> Path:
        return self.shared_dir / self.name(booking_id)

    def jobs(self) -> dict[str, Job]:
        """gpubook's pending and running jobs, by name (one squeue call)."""
        out = self.squeue("--noheader", f"--user={self.user}", "--states=all", "--format=%i|%j|%T|%N|%r")
        found: dict[str, Job] = {}
        for line in out.splitlines():
            parts = line.strip().split("|")
            if len(parts) != 5 or not parts[1].startswith(self.prefix) or parts[2] not in ACTIVE:
                continue
            found[parts[1]] = Job(job_id=parts[0], name=parts[1], state=parts[2], nodes=parts[3], reason=parts[4])
        return found

    def submit(self, request: JobRequest, *, now: datetime) -> Job:
        """The booking's job, submitted into its reservation unless one is pending or running already
        (a restarted daemon adopts it). Its folder starts empty of old results."""
        step = request.step
        name = self.name(step.booking_id)
        running = self.jobs().get(name)
        if running is not None:
            return running
        if request.nodes < 1 or request.gpus_per_node < 0:
            raise SlurmError(f"booking {step.booking_id}: {request.nodes} nodes with {request.gpus_per_node} GPUs "
                             f"each is not a job")
        folder = self._make_folder(step.booking_id)
        for old in (*folder.glob("result-*.json"), *folder.glob("step-*.log")):
            old.unlink()
        step.write(folder / "request.json")
        script = folder / "job.sh"
        # -P and / (sbatch --chdir): the step's imports come from gpubook's install only, never from
        # the job folder or whatever folder a node starts it in.
        write_atomic(script, "#!/bin/sh\n# gpubook: one step per node runs the booking's container "
                      "(runtime.slurm.step)\n"
                      f"exec srun --kill-on-bad-exit=1 --chdir=/ {shlex.quote(self.python)} -P -m "
                      f"gpubook.runtime.slurm.step {shlex.quote(str(folder / 'request.json'))}\n")
        minutes = max(1, math.ceil((step.end - now).total_seconds() / 60)) + GRACE_MINUTES
        # --no-requeue: a job whose node failed ends (gpubook sees the death and places the booking
        # again), rather than waiting in its reservation for a node that may not come back.
        argv = ["--parsable", "--no-requeue", f"--job-name={name}", f"--reservation={name}", f"--nodes={request.nodes}",
                "--ntasks-per-node=1", f"--time={minutes}", f"--output={folder / 'slurm.out'}", "--chdir=/"]
        if request.gpus_per_node:
            argv.append(f"--gres=gpu:{request.gpus_per_node}")
        if request.partition:
            argv.append(f"--partition={request.partition}")
        job_id = self.sbatch(*argv, str(script)).strip().split(";")[0]
        return Job(job_id=job_id, name=name, state="PENDING", nodes="")

    @property
    def owners(self) -> frozenset[int]:
        """Who may own the shared folder and what is in it: root and the daemon's account (`user` is
        the account's name; where the jobs are managed as root for it, as the tests do, its uid too)."""
        try:
            return trusted_owners() | {pwd.getpwnam(self.user).pw_uid}
        except KeyError:
            return trusted_owners()

    def _make_folder(self, booking_id: str) -> Path:
        """The booking's job folder, made by the daemon's account (its job writes there) in a shared
        folder nobody else may write. One that is there already is used only if it is the account's
        own (an earlier start's) and nobody else may write it: another's could hold anything."""
        try:
            self.shared_dir.mkdir(mode=0o755, exist_ok=True)  # its parent is the admin's to make
            check_private_dir(self.shared_dir, what="[backend] shared_dir", owners=self.owners, ancestors=True)
        except (UnsafeFile, OSError) as error:
            raise SlurmError(str(error)) from None
        folder = self.folder(booking_id)
        try:
            folder.mkdir(mode=0o700)  # the account's alone: its nodes' steps run as it
        except FileExistsError:
            pass
        try:
            check_private_dir(folder, what="job folder", owners=self.owners)
        except UnsafeFile as error:
            raise SlurmError(str(error)) from None
        return folder

    def _write_order(self, path: Path, text: str) -> None:
        """An order for a node's step, written by the daemon's account (the step runs no other's)."""
        write_atomic(path, text)

    def _read(self, path: Path, *, what: str) -> str:
        """A file of a job folder the daemon's account (or root) wrote, never through a link."""
        return read_private(path, what=what, owners=self.owners)

    def results(self, booking_id: str) -> dict[str, NodeResult]:
        """Each node's result so far (a node not yet written is absent)."""
        found: dict[str, NodeResult] = {}
        folder = self.folder(booking_id)
        try:
            check_private_dir(folder, what="job folder", owners=self.owners)
        except UnsafeFile:
            return found  # anybody could have written its results
        for path in sorted(folder.glob("result-*.json")):
            node = path.name.removeprefix("result-").removesuffix(".json")
            try:
                data = json.loads(self._read(path, what="result"))
            except (ValueError, UnsafeFile):
                continue  # half-written (it is renamed into place whole), or not the account's
            try:
                found[node] = node_result(data, node=node)
            except (ValueError, TypeError, KeyError) as error:
                found[node] = NodeResult(node=node, error=f"its step's result {path.name} is refused: {error}")
        return found

    def log(self, booking_id: str) -> str:
        return self._tail(self.folder(booking_id) / "slurm.out", 2000)

    def _tail(self, path: Path, size: int) -> str:
        """The end of a job's log, if it is the account's own plain file (a link planted there could
        show the daemon's private files in an event)."""
        if not path.exists() and not path.is_symlink():
            return ""
        try:
            return read_private(path, what="log", owners=self.owners, tail=size)
        except UnsafeFile as error:
            return f"({error})"

    def why_ended(self, booking_id: str, job_id: str) -> str:
        """Why a job ended, as far as can be told: Slurm's state, reason and exit code for it (while
        slurmctld keeps it, MinJobAge) and its nodes' state (a node that stopped answering ends its
        jobs: NODE_FAIL), what each node's step wrote it was doing, and the job's output."""
        folder = self.folder(booking_id)
        steps = [f"{path.name}:\n{self._tail(path, 1500).rstrip()}"
                 for path in sorted(folder.glob("step-*.log"))] or ["no node's step wrote a line (none began)"]
        output = self.log(booking_id).rstrip()
        if output:
            said = f"its output: {output}"
        elif (folder / "slurm.out").exists():
            said = "its output (slurm.out) is empty"
        else:
            said = "it wrote no output (no slurm.out: its batch step never began)"
        return "\n".join([f"{self._slurm_says(job_id)}; its steps' logs:", *steps, said])

    def _slurm_says(self, job_id: str) -> str:
        try:
            shown = self.scontrol("show", "job", job_id, "--oneliner")
            job = dict(re.findall(r"\b(JobState|Reason|ExitCode|RunTime|NodeList)=(\S+)", shown))
            listed = job.get("NodeList", "(null)") != "(null)"  # "(null)": it never ran on a node
            nodes = self.scontrol("show", "node", job["NodeList"], "--oneliner") if listed else ""
        except SlurmError as error:
            return f"Slurm no longer says why ({error})"
        said = " ".join(f"{key}={value}" for key, value in job.items()) or shown.strip()[:300]
        states = [f"{m.group(1)} {m.group(2)}" + (f" ({m.group(3)})" if m.group(3) else "")
                  for m in re.finditer(r"NodeName=(\S+) .*?\bState=(\S+)(?: .*?\bReason=(.*?)(?= \w+=|$))?",
                                       nodes, flags=re.MULTILINE)]
        return f"Slurm says {said}" + (f"; its nodes now: {', '.join(states)}" if states else "")

    def exec(self, booking_id: str, node: str, argv: Sequence[str], *, timeout: float) -> ExecResult:
        """`argv` in the booking's container on `node`, asked of that node's step through the job
        folder (runtime.slurm.step.serve_execs) and waited for at most `timeout` seconds."""
        folder = self.folder(booking_id)
        token = secrets.token_hex(8)
        asked = folder / f"exec-{node}-{token}.json"
        partial = folder / f".exec-{node}-{token}.part"
        self._write_order(partial, json.dumps({"argv": list(argv), "timeout": timeout}))
        partial.replace(asked)
        answer = folder / f"done-{node}-{token}.json"
        deadline = time.monotonic() + timeout + EXEC_POLL + 1
        while time.monotonic() < deadline:
            if answer.exists():
                try:
                    data = json.loads(self._read(answer, what="answer"))
                except (UnsafeFile, ValueError) as error:
                    raise EngineError(f"booking {booking_id}: its step on {node} answered with {error}") from None
                answer.unlink()
                return ExecResult(int(data["returncode"]), str(data["stdout"]), str(data["stderr"]))
            time.sleep(0.1)
        asked.unlink(missing_ok=True)
        raise EngineError(f"booking {booking_id}: its step on {node} did not answer within {timeout:g} s")

    def cancel(self, booking_id: str, *, grace: float | None = None) -> bool:
        """End the booking's job; False: it has none. With a `grace`, first SIGTERM to its steps
        only (`scancel --signal=TERM`: each stops its container, exits, and the job ends by itself),
        then scancel if it still runs after the grace and a margin. A plain scancel at once may
        SIGKILL a step in the middle of stopping its container (after KillWait), and the container
        (conmon is not one of the job's processes) would be left running."""
        name = self.name(booking_id)
        job = self.jobs().get(name)
        if job is None:
            return False
        if grace is not None and job.state == "RUNNING":
            if not self._scancel("--signal=TERM", job.job_id):
                return True
            if self.wait_ended(booking_id, seconds=grace + STOP_MARGIN):
                return True
        self._scancel(job.job_id)
        return True

    def _scancel(self, *args: str) -> bool:
        """scancel; False when the job ended between squeue's listing and this call (slurmctld no
        longer knows its id: "Invalid job id specified"), which is what a cancel wants."""
        try:
            self.scancel(*args)
        except SlurmError as error:
            if GONE_JOB in str(error):
                return False
            raise
        return True

    def wait_ended(self, booking_id: str, *, seconds: float) -> bool:
        """Whether the booking's job ended within `seconds` (polled every 0.5 s)."""
        name, deadline = self.name(booking_id), time.monotonic() + seconds
        while name in self.jobs():
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.5)
        return True


GONE_JOB = "Invalid job id specified"  # scancel of a job slurmctld has forgotten (it ended)
HOST_KEY_TYPES = frozenset({"ssh-ed25519", "ecdsa-sha2-nistp256", "ecdsa-sha2-nistp384", "ecdsa-sha2-nistp521",
                            "ssh-rsa"})
NODE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
MAX_ERROR = 500  # characters of a node's error in the event


def node_result(data: object, *, node: str) -> NodeResult:
    """A node's `result-NODE.json`, every value checked: its host key must be an SSH public key (it
    goes into the booker's known_hosts line) and is written back in its canonical form; its error
    is one line of printable text."""
    if not isinstance(data, dict):
        raise TypeError("not a JSON object")
    if not NODE_NAME.fullmatch(node) or str(data.get("node")) != node:
        raise ValueError(f"it names node {str(data.get('node'))[:64]!r} in the file of node {node[:64]!r}")
    gpus = data.get("gpus", ())
    if not isinstance(gpus, list | tuple) or not all(type(g) is int and 0 <= g < 4096 for g in gpus):
        raise ValueError("its GPUs are not a list of indices")
    port = int(data.get("port", 0))
    if not 0 <= port < 65536:
        raise ValueError(f"port {port} is not a port")
    return NodeResult(node=node, port=port, host_key=host_key_line(str(data.get("host_key", ""))),
                      container=_one_line(str(data.get("container", "")), 128),
                      seconds_to_ssh=float(data.get("seconds_to_ssh", 0.0)), gpus=tuple(gpus),
                      hostfile="/etc/gpubook/hostfile" if data.get("hostfile") else "",
                      error=_one_line(str(data.get("error", "")), MAX_ERROR))


def host_key_line(text: str) -> str:
    """`TYPE BASE64` of an SSH public key of an allowed type, parsed, as the booker's known_hosts
    gets it ("" for none); anything else (a second line, a marker, options) is refused."""
    if not text:
        return ""
    words = text.split(" ")
    if len(words) != 2 or words[0] not in HOST_KEY_TYPES:
        raise ValueError("its host key is not one 'TYPE BASE64' SSH public key of type "
                         f"{', '.join(sorted(HOST_KEY_TYPES))}")
    try:
        key = paramiko.PKey.from_type_string(words[0], base64.b64decode(words[1], validate=True))
    except (binascii.Error, paramiko.SSHException, ValueError) as error:
        raise ValueError(f"its host key does not parse as an SSH public key ({error})") from None
    return f"{key.get_name()} {key.get_base64()}"


def _one_line(text: str, limit: int) -> str:
    """Text for an event: control characters (newlines too) made spaces, at most `limit` characters."""
    return "".join(c if c.isprintable() else " " for c in text)[:limit]
