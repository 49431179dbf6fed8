"""One Slurm job step of a booking: start the booking's container on this node, say where SSH is,
and keep it until the booking's end (`python -m gpubook.runtime.slurm.step REQUEST.json`).

The daemon (gpubook/scheduler/hosts/slurm/jobs.py) writes the request from validated values only and
submits a job into the booking's reservation; Slurm runs this on each allocated node (one task
per node), as the daemon's account, with the GPUs it granted in SLURM_STEP_GPUS / SLURM_JOB_GPUS
(the node's own indices) or CUDA_VISIBLE_DEVICES. The container is made by the same code as on
the local backend (runtime.booking.launch.booking_spec, runtime.engines, the NVIDIA injection where the node
has a driver), for exactly those GPUs; its SSH host key is made in the node's own cache, never on
the shared storage. The step proves SSH answers with a probe key of its own,
then writes `result-<node>.json` (node, port, host key) next to the request: the daemon reads it
from the shared folder, and asks its commands for the container there too (`serve_execs`).
SIGTERM (scancel, or Slurm's time limit) or the booking's end stops and removes the container;
nothing is left behind by a failed start (launch.start_booking removes it; a SIGTERM during the start
ends the start and removes it too).

A start again after one whose step was killed (Slurm's SIGKILL after KillWait, a node that stopped
answering) finds that start's container still running (conmon is not one of the job's processes).
The spec depends only on what the booking asks for: its probe key is kept in the node's cache, like
its host key, so a leftover with the same spec is adopted (only the SSH probe is left), and one with
another spec (another port) is removed before the start. Each node's step writes what it does,
with times, to `step-<node>.log` beside the request: a job that ends before its step said anything
(a step killed) still tells where it was.
"""

from __future__ import annotations

import json
import os
import pwd
import re
import secrets
import signal
import stat
import subprocess
import sys
import threading
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

import paramiko

from gpubook.runtime import engines, private
from gpubook.runtime.booking import launch, ssh
from gpubook.runtime.data import storage
from gpubook.runtime.engines import ContainerSpec, Engine, EngineSettings, container_name, make_engine
from gpubook.runtime.errors import GpubookError
from gpubook.runtime.mounts import Mount
from gpubook.runtime.private import write_private
from gpubook.runtime.slurm import pause as slurm_pause
from gpubook.runtime.templates.catalog import get_template

if TYPE_CHECKING:
    from gpubook.runtime.nvidia.model import Gpu

EXEC_POLL = 1.0  # seconds between the step's looks for the daemon's commands (and for the end)
HOSTFILE = "/etc/gpubook/hostfile"  # in a multi-node booking's containers: "ADDRESS slots=GPUS" per node
MAX_FILE = 1 << 20  # bytes read at most from a file of the job folder (a request, a result, an order)
# Engines a request may name: the built-in ones only. A `package.module:Class` from a request would
# import whatever its writer wants, as the daemon's account, on every node.
BUILTIN_ENGINES = ("docker", "podman")
PROGRAM_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,63}$")  # a program looked up on PATH (runc, crun)
REQUEST_KEYS = frozenset({"booking_id", "user", "uid", "gid", "ssh_keys", "template", "templates_dir", "port",
                          "end", "engine", "data_root", "multi_node", "placement"})


@dataclass(frozen=True)
class StepRequest:
    """What the daemon asks of every node of one booking's job (request.json)."""

    booking_id: str
    user: str
    uid: int
    gid: int
    ssh_keys: tuple[str, ...]
    template: str
    templates_dir: Path | None
    port: int
    end: datetime
    engine: EngineSettings  # the daemon's whole [engine]
    data_root: Path | None
    multi_node: bool
    # The daemon's plan: each node and the GPUs it counts there (Slurm picks which of the node's GPUs).
    placement: tuple[tuple[str, tuple[int, ...]], ...] = ()

    @classmethod
    def read(cls, path: Path, *, owners: frozenset[int] | None = None) -> StepRequest:
        """The request in a job folder, once the folder and the file are the account's own (or
        `owners`': root and the account) and nobody else may change them (checked on the open file);
        its engine only a built-in one, running programs nobody else may change."""
        check_private_dir(path.parent.parent, what="shared_dir", owners=owners, ancestors=True)
        check_private_dir(path.parent, what="job folder", owners=owners)
        try:
            data = json.loads(read_private(path, what="request.json", owners=owners))
        except ValueError as error:
            raise GpubookError(f"{path} is not JSON: {error}") from None
        if not isinstance(data, dict):
            raise GpubookError(f"{path} is not a JSON object")
        unknown = set(data) - REQUEST_KEYS
        if unknown:
            raise GpubookError(f"{path}: unknown keys {', '.join(sorted(unknown))}")
        storage.check_user_name(data["user"])
        end = datetime.fromisoformat(data["end"])
        if end.tzinfo is None:
            raise GpubookError(f"{path}: end {data['end']!r} has no time zone")
        uid, gid = int(data["uid"]), int(data["gid"])
        if not (1 <= uid < 2**31 and 1 <= gid < 2**31):
            raise GpubookError(f"{path}: uid {uid} and gid {gid} must be between 1 and 2147483647 (not root)")
        engine = engine_settings_from(data.get("engine") or {}, source=path)
        check_engine(engine, source=path, owners=owners)
        templates_dir = Path(data["templates_dir"]) if data.get("templates_dir") else None
        data_root = Path(data["data_root"]) if data.get("data_root") else None
        for folder, what in ((templates_dir, "templates_dir"), (data_root, "data_root")):
            if folder is not None:
                check_trusted_path(folder, what=what, owners=owners)
        return cls(booking_id=str(data["booking_id"]), user=data["user"], uid=uid, gid=gid,
                   ssh_keys=tuple(str(k) for k in data["ssh_keys"]), template=str(data["template"]),
                   templates_dir=templates_dir, port=int(data["port"]), end=end, engine=engine,
                   data_root=data_root,
                   multi_node=bool(data.get("multi_node")),
                   placement=tuple((str(node), tuple(int(g) for g in gpus))
                                   for node, gpus in data.get("placement", ())))

    def write(self, path: Path) -> None:
        data = {"booking_id": self.booking_id, "user": self.user, "uid": self.uid, "gid": self.gid,
                "ssh_keys": list(self.ssh_keys), "template": self.template,
                "templates_dir": str(self.templates_dir) if self.templates_dir else "", "port": self.port,
                "end": self.end.isoformat(), "engine": engine_settings_data(self.engine),
                "data_root": str(self.data_root) if self.data_root else "", "multi_node": self.multi_node,
                "placement": [[node, list(gpus)] for node, gpus in self.placement]}
        write_atomic(path, json.dumps(data, indent=1))


def granted_gpus(env: dict[str, str]) -> tuple[int, ...]:
    """The node's GPU indices Slurm gave this job (its own numbering, as gres.conf lists them)."""
    for key in ("SLURM_STEP_GPUS", "SLURM_JOB_GPUS", "CUDA_VISIBLE_DEVICES"):
        value = env.get(key, "").strip()
        if value:
            if not all(part.isdigit() for part in value.split(",")):
                raise GpubookError(f"{key}={value!r} is not a list of GPU indices")
            return tuple(int(part) for part in value.split(","))
    return ()


def job_addresses(nodelist: str) -> list[str]:
    """Each node of the job by the address Slurm reaches it at (NodeAddr), in Slurm's order."""
    names = _scontrol("show", "hostnames", nodelist).split()
    listing = _scontrol("show", "node", ",".join(names), "--oneliner")
    address = {m.group(1): m.group(2) for m in re.finditer(r"NodeName=(\S+) .*?NodeAddr=(\S+)", listing)}
    return [address.get(name, name) for name in names]


def _scontrol(*args: str) -> str:
    done = subprocess.run(["scontrol", *args], capture_output=True, text=True, timeout=30, check=False)
    if done.returncode != 0:
        raise GpubookError(f"scontrol {' '.join(args)}: {done.stderr.strip() or done.returncode}")
    return done.stdout


def write_atomic(path: Path, text: str, *, mode: int = 0o644) -> None:
    """`text` as `path`, whole or not at all: written to a new file of its own (O_EXCL, O_NOFOLLOW:
    never through a link someone put there) and renamed over `path`, which replaces a link at
    `path` itself, never its target. Nodes may write the same file at once: each its own name."""
    partial = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.part")
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        with os.fdopen(fd, "w") as file:
            os.fchmod(file.fileno(), mode)  # whatever the umask
            file.write(text)
        partial.replace(path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise


class UnsafeFile(GpubookError):
    """A file or folder of the job that someone other than the account (or root) could have written."""


def trusted_owners() -> frozenset[int]:
    """Who may own what the step and the daemon trust: root and the account they run as."""
    return frozenset({0, os.geteuid()})


def _owner(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


def _check_stat(info: os.stat_result, path: Path, *, what: str, owners: frozenset[int] | None,
                kind: int) -> None:
    owners = owners if owners is not None else trusted_owners()
    if stat.S_ISLNK(info.st_mode):
        raise UnsafeFile(f"{what} {path} is a symbolic link; gpubook follows none there")
    if stat.S_IFMT(info.st_mode) != kind:
        raise UnsafeFile(f"{what} {path} is not a {'folder' if kind == stat.S_IFDIR else 'plain file'}")
    if info.st_uid not in owners:
        names = " or ".join(sorted({_owner(uid) for uid in owners}))
        raise UnsafeFile(f"{what} {path} is owned by {_owner(info.st_uid)}, not {names}; it is not used")
    if info.st_mode & 0o022:
        raise UnsafeFile(f"{what} {path} is writable by {'others' if info.st_mode & 0o002 else 'its group'} "
                         f"(mode {stat.S_IMODE(info.st_mode):04o}); only its owner may write it")


def check_private_dir(path: Path, *, what: str, owners: frozenset[int] | None = None,
                      ancestors: bool = False) -> None:
    """`path` is a real folder of the account's (or root's) that nobody else may write; with
    `ancestors`, no folder above it can be replaced by anybody else either."""
    try:
        info = os.lstat(path)
    except OSError as error:
        raise UnsafeFile(f"{what} {path}: {error.strerror}") from None
    _check_stat(info, path, what=what, owners=owners, kind=stat.S_IFDIR)
    if ancestors:
        _check_ancestors(path, what=what, owners=owners)


def _check_ancestors(path: Path, *, what: str, owners: frozenset[int] | None) -> None:
    """Each folder above `path` owned by root or the account, and writable by nobody else unless
    sticky (/tmp: others may not rename what is not theirs there)."""
    for parent in Path(os.path.abspath(path)).parents:
        info = os.stat(parent)
        if info.st_uid not in (owners if owners is not None else trusted_owners()):
            raise UnsafeFile(f"{what} {path} is inside {parent}, owned by {_owner(info.st_uid)}; "
                             "anybody but root and gpubook's account could replace it")
        if info.st_mode & 0o022 and not info.st_mode & stat.S_ISVTX:
            raise UnsafeFile(f"{what} {path} is inside {parent}, which others may write "
                             f"(mode {stat.S_IMODE(info.st_mode):04o}, not sticky)")


def check_trusted_path(path: Path, *, what: str, kind: int = stat.S_IFDIR,
                       owners: frozenset[int] | None = None) -> None:
    """A folder or program named in a request: the account's or root's, nobody else's to change,
    and so is every folder above it."""
    try:
        info = os.lstat(path)
    except OSError as error:
        raise UnsafeFile(f"{what} {path}: {error.strerror}") from None
    _check_stat(info, path, what=what, owners=owners, kind=kind)
    _check_ancestors(path, what=what, owners=owners)


def read_private(path: Path, *, what: str, owners: frozenset[int] | None = None, tail: int = 0) -> str:
    """A file of the job folder, opened without following a link and checked on the open file
    (fstat: no swap between the check and the read): the account's or root's, nobody else's to write.
    `tail`: only its last so many bytes (a log), whatever its size."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as error:
        if os.path.islink(path):
            raise UnsafeFile(f"{what} {path} is a symbolic link; gpubook follows none there") from None
        raise UnsafeFile(f"{what} {path}: {error.strerror}") from None
    with os.fdopen(fd, "rb") as file:
        info = os.fstat(fd)
        _check_stat(info, path, what=what, owners=owners, kind=stat.S_IFREG)
        if tail:
            file.seek(max(0, info.st_size - tail))
            return file.read(tail).decode("utf-8", errors="replace")
        data = file.read(MAX_FILE + 1)
    if len(data) > MAX_FILE:
        raise UnsafeFile(f"{what} {path} is larger than {MAX_FILE} bytes")
    return data.decode("utf-8", errors="replace")


def check_engine(settings: EngineSettings, *, source: object, owners: frozenset[int] | None = None) -> None:
    """The engine a request may name: a built-in one, its programs (binary, OCI runtime) names
    looked up on PATH or files nobody but root or the account may change."""
    if settings.name not in BUILTIN_ENGINES:
        raise GpubookError(f"{source}: engine {settings.name!r} is not one of gpubook's engines "
                           f"({', '.join(BUILTIN_ENGINES)}); a job runs no other")
    for program, what in ((settings.binary, "engine binary"), (settings.runtime, "engine runtime")):
        if not program or PROGRAM_NAME.fullmatch(program):
            continue
        if not program.startswith("/"):
            raise GpubookError(f"{source}: {what} {program!r} is neither a program name nor an absolute path")
        try:
            check_trusted_path(Path(program), what=what, kind=stat.S_IFREG, owners=owners)
        except UnsafeFile as error:
            raise GpubookError(f"{source}: {error}") from None


def engine_settings_data(settings: EngineSettings) -> dict[str, object]:
    """`[engine]` as the request's JSON: every field of EngineSettings, so none is left out."""
    return {name: list(value) if isinstance(value, tuple) else value for name, value in asdict(settings).items()}


def engine_settings_from(data: Mapping[str, object], *, source: object = "the request") -> EngineSettings:
    """EngineSettings back from `engine_settings_data`, each value checked against its field's type.
    A request written by gpubook 0.2.0 (every value a string, ulimits comma-separated) reads too:
    a job running across the daemon's upgrade is still listed."""
    hints = typing.get_type_hints(EngineSettings)
    unknown = set(data) - set(hints)
    if unknown:
        raise GpubookError(f"{source}: unknown engine settings {', '.join(sorted(unknown))}")
    values: dict[str, typing.Any] = {name: _typed(hints[name], value, name=name, source=source)
                                     for name, value in data.items()}
    return EngineSettings(**values)


def _typed(hint: object, value: object, *, name: str, source: object) -> object:
    options = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    if value is None or (value == "" and type(None) in options):  # 0.2.0 wrote "" for an unset one
        if type(None) in options:
            return None
        raise GpubookError(f"{source}: engine setting {name} may not be empty")
    if typing.get_origin(hint) is tuple:
        items = value.split(",") if isinstance(value, str) else value  # 0.2.0: comma-separated
        if not isinstance(items, list | tuple) or not all(isinstance(item, str) for item in items):
            raise GpubookError(f"{source}: engine setting {name} is not a list of strings")
        return tuple(item for item in items if item)
    kind = next(option for option in options if option is not type(None))
    if isinstance(value, str) and kind in (int, float):
        try:
            return kind(value)  # 0.2.0 wrote numbers as strings
        except ValueError:
            raise GpubookError(f"{source}: engine setting {name} is not a number: {value!r}") from None
    if kind is float and type(value) is int:
        return float(value)
    if type(value) is not kind:  # strictly: True is no pids_limit
        raise GpubookError(f"{source}: engine setting {name} should be of type {getattr(kind, '__name__', kind)}, "
                           f"not {value!r}")
    return value


@dataclass(frozen=True)
class _Prepared:
    engine: Engine
    spec: ContainerSpec
    probe: paramiko.PKey
    cache_dir: Path


def _prepare(request: StepRequest, *, folder: Path, node: str, gpus: tuple[int, ...],
             env: dict[str, str]) -> _Prepared:
    """The booking's container spec on this node, with the local backend's code."""
    engine = make_engine(request.engine)
    template = get_template(request.template, request.templates_dir)
    # One container per node, named with its node: on a cluster each node has its own engine
    # storage, but nodes sharing one (the tests' nodes, a home on NFS) must never take another
    # node's container (a failed node's leftover) for their own.
    booking_id = f"{request.booking_id}@{node}"
    name = container_name(booking_id)
    # The node's own cache (the account's ~/.cache/gpubook there): the booking's private host key
    # stays on the node's disk, never on the shared storage.
    cache_dir = private.default_cache_dir()
    cache_dir.mkdir(parents=True, exist_ok=True)
    folders = _folders(request, engine)
    gpu = _injection(gpus, cache_dir)
    owner, chown = engines.ownership(engine, 0, 0)
    host_key = ssh.booking_host_key(cache_dir, name, owner=owner, chown=chown)
    probe = booking_probe_key(cache_dir, name)
    spec = launch.booking_spec(
        template,
        launch.Tenancy(booking_id=booking_id, user=request.user, uid=request.uid, gid=request.gid,
                        ssh_keys=tuple(request.ssh_keys), port=request.port, end=request.end, gpus=gpus, gpu=gpu),
        launch.HostFiles(probe_key=probe, cache_dir=cache_dir, host_key=host_key, folders=folders))
    if request.multi_node:  # MPI/NCCL programs find the other nodes in the hostfile
        hostfile = folder / "hostfile"
        write_atomic(hostfile, "".join(f"{address} slots={len(gpus) or 1}\n"
                                        for address in job_addresses(env.get("SLURM_JOB_NODELIST", node))))
        spec = replace(spec, mounts=(*spec.mounts, Mount(hostfile, HOSTFILE)))
    return _Prepared(engine=engine, spec=spec, probe=probe, cache_dir=cache_dir)


class _Stopped(BaseException):  # noqa: N818 - not an error: Slurm ends the job
    """SIGTERM (or SIGINT) while the container starts: the start ends, and removes what it made."""


def run(request_path: Path, *, env: dict[str, str]) -> int:
    """Start, report, wait for the end or SIGTERM, stop. The exit status is the job's. Whatever
    keeps the container from starting is written as this node's result: the daemon says it."""
    request = StepRequest.read(request_path)
    folder = request_path.parent
    node = env.get("SLURMD_NODENAME") or os.uname().nodename.split(".")[0]
    say = StepLog(folder / f"step-{node}.log")
    stopping, starting = threading.Event(), threading.Event()
    starting.set()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stopping.set()
        if starting.is_set():  # a start may take minutes (an image, a slow node): end it now
            starting.clear()
            raise _Stopped(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    made: _Prepared | None = None
    try:
        gpus = granted_gpus(env)
        say(f"step {os.getpid()} of job {env.get('SLURM_JOB_ID', '?')}: preparing booking {request.booking_id}'s "
            f"container on {node} (GPUs {','.join(map(str, gpus)) or 'none'})")
        if request.engine.name == "podman":  # before its first podman command (round 3, M4)
            where = slurm_pause.check_outside_jobs(job=env.get("SLURM_JOB_ID"), node=node)
            if where is not None:
                say(where)
        made = _prepare(request, folder=folder, node=node, gpus=gpus, env=env)
        clear_leftover(made.engine, made.spec, say=say)
        say(f"starting {made.spec.name} (spec {made.spec.spec_hash}) on port {request.port}")
        ready = launch.start_booking(made.engine, made.spec, probe_key=made.probe, timeout=90)
        starting.clear()
    except (GpubookError, _Stopped) as error:
        starting.clear()
        problem = f"the step was sent {error} before SSH answered" if isinstance(error, _Stopped) else str(error)
        if made is not None and isinstance(error, _Stopped):  # start_booking removes its own on an error
            _remove(made.engine, made.spec.name, say=say)
        write_atomic(folder / f"result-{node}.json", json.dumps({"node": node, "error": problem}))
        say(f"its container did not start: {problem}")
        print(f"booking {request.booking_id}: its container did not start on {node}: {problem}", file=sys.stderr)
        return 1
    engine, name, cache_dir = made.engine, made.spec.name, made.cache_dir
    write_atomic(folder / f"result-{node}.json", json.dumps(
        {"node": node, "port": request.port, "host_key": ready.host_key, "container": name,
         "gpus": list(gpus), "seconds_to_ssh": round(ready.seconds, 3),
         "hostfile": HOSTFILE if request.multi_node else ""}))
    say(f"SSH answers on port {request.port}, {ready.seconds:.2f} s after the start")
    print(f"booking {request.booking_id}: SSH answers on {node} port {request.port}", flush=True)
    try:
        while not stopping.wait(max(0.0, min(EXEC_POLL, (request.end - datetime.now(UTC)).total_seconds()))):
            if datetime.now(UTC) >= request.end:
                break
            serve_execs(folder, node=node, engine=engine, name=name)
    finally:
        # Within Slurm's KillWait (its SIGKILL follows SIGTERM after it): the README asks for a
        # KillWait longer than [engine] stop_grace_seconds, else the container outlives its step.
        _remove(engine, name, say=say, grace=request.engine.stop_grace_seconds)
        ssh.forget_host_key(cache_dir, name)
        forget_probe_key(cache_dir, name)
        print(f"booking {request.booking_id}: its container on {node} stopped", flush=True)
    return 0


class StepLog:
    """What a node's step does, one timed line each, appended to `step-<node>.log` in the job folder
    at once: a step killed midway (nothing on its stderr) still tells where it was."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __call__(self, line: str) -> None:
        try:  # never through a link put in its place
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
            with os.fdopen(fd, "a") as file:
                file.write(f"{datetime.now(UTC).isoformat(timespec='milliseconds')} {line}\n")
        except OSError as error:  # the shared folder full or gone: the step goes on without its log
            print(f"{self.path}: {error}", file=sys.stderr)


def clear_leftover(engine: Engine, spec: ContainerSpec, *, say: StepLog) -> None:
    """The container an earlier start of this booking left on this node (its step killed before
    it could remove it): adopted by the start when it runs with this very spec, else removed. The
    name is the booking's and the node's own, so no other booking's container is ever touched."""
    current = engine.inspect(spec.name)
    if current is None:
        return
    if current.running and current.spec_hash == spec.spec_hash:
        say(f"{spec.name} runs already with this spec (an earlier start's): it is adopted")
        return
    say(f"{spec.name} is left {current.state} by an earlier start (spec {current.spec_hash or 'unknown'}, "
        f"this start's {spec.spec_hash}): it is removed")
    engine.stop(spec.name, 0)


def _remove(engine: Engine, name: str, *, say: StepLog, grace: float = 0.0) -> None:
    for _ in range(3):  # a signal to the step's processes may end a podman call midway: again
        try:
            engine.stop(name, grace)
        except GpubookError as error:
            say(f"stopping {name}: {error}")
        if engine.inspect(name) is None:
            say(f"{name} is stopped and removed")
            return


def serve_execs(folder: Path, *, node: str, engine: Engine, name: str) -> None:
    """The daemon's commands for this node's container (its end warning, its idle notice), asked
    in the job folder (`exec-NODE-TOKEN.json`: an argv list and a time limit) and answered there
    (`done-NODE-TOKEN.json`): the way into a node needs no Slurm step of its own, so it works while
    slurmctld is away too. Only an order in a folder nobody else may write, in a file of the step's
    own account (the daemon's), is run; argv is data run without a shell in the booking's own
    container, as the local backend's exec."""
    try:
        check_private_dir(folder, what="job folder")
    except UnsafeFile:
        return  # others may write there: an order could be anybody's (the README says who owns it)
    for asked in sorted(folder.glob(f"exec-{node}-*.json")):
        token = asked.name.removeprefix(f"exec-{node}-").removesuffix(".json")
        if not re.fullmatch(r"[0-9a-f]{1,64}", token):
            continue
        try:
            order = json.loads(read_private(asked, what="order", owners=frozenset({os.geteuid()})))
            asked.unlink()
            argv = [str(word) for word in order["argv"]]
            timeout = min(float(order.get("timeout", 30)), 120.0)
        except (OSError, ValueError, KeyError, TypeError, UnsafeFile):
            continue  # half-written, taken, or not the daemon's: the daemon's own time limit answers for it
        try:
            done = engine.exec(name, argv, timeout=timeout)
            answer = {"returncode": done.returncode, "stdout": done.stdout[-4000:], "stderr": done.stderr[-4000:]}
        except GpubookError as error:
            answer = {"returncode": 125, "stdout": "", "stderr": str(error)}
        write_atomic(folder / f"done-{node}-{token}.json", json.dumps(answer))


def booking_probe_key(cache_dir: Path, name: str) -> paramiko.PKey:
    """The key the step proves SSH with for container `name`, made on first use and kept in the
    node's cache (mode 600, never in the container's host key folder, which it mounts): its public
    line is in the container's spec, so a start again makes the same spec and may adopt the
    container an earlier start left running."""
    folder = cache_dir / "probe-keys"
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = folder / name
    if not path.is_file():
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

        write_private(path, Ed25519PrivateKey.generate().private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()))
    return paramiko.Ed25519Key.from_private_key_file(str(path))


def forget_probe_key(cache_dir: Path, name: str) -> None:
    (cache_dir / "probe-keys" / name).unlink(missing_ok=True)


def _folders(request: StepRequest, engine: Engine) -> storage.DataFolders:
    if request.data_root is None:
        return storage.no_folders(request.user)
    problem = storage.mount_problem(request.data_root)
    if problem is not None:
        raise GpubookError(problem)
    (owner_uid, owner_gid), chown = engines.ownership(engine, request.uid, request.gid)
    return storage.prepare(request.data_root, request.user, uid=owner_uid, gid=owner_gid, chown=chown)


def _injection(gpus: tuple[int, ...], cache_dir: Path) -> object | None:
    """The host driver's files and exactly these GPUs' devices, where this node has a driver."""
    if not gpus or not Path("/proc/driver/nvidia/version").exists():
        return None
    from gpubook.runtime import nvidia

    return nvidia.injection(nvidia_indices(gpus, nvidia.list_gpus()), cache_dir=cache_dir)


def nvidia_indices(granted: tuple[int, ...], gpus: Sequence[Gpu]) -> tuple[int, ...]:
    """Slurm's GRES indices as nvidia-smi's. Slurm numbers a node's GPUs in the order of its
    gres.conf `File=/dev/nvidia[0-7]`, that is by device minor; nvidia-smi (and the injection) by
    NVML's order. They differ where minors do not follow the PCI bus order: the i-th GRES GPU is
    the GPU with the i-th smallest minor."""
    by_minor = sorted(gpus, key=lambda gpu: (gpu.minor is None, gpu.minor or 0, gpu.index))
    out = []
    for index in granted:
        if index >= len(by_minor):
            raise GpubookError(f"Slurm granted GPU {index}, but this node's driver lists {len(by_minor)} GPUs; "
                               "check gres.conf against nvidia-smi")
        out.append(by_minor[index].index)
    return tuple(out)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m gpubook.runtime.slurm.step REQUEST.json", file=sys.stderr)
        return 2
    try:
        return run(Path(args[0]), env=dict(os.environ))
    except GpubookError as error:
        print(f"gpubook slurm step: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
