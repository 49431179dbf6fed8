"""What one booking's container is (`ContainerSpec`), and what an engine reports back
(`ContainerInfo`): plain values every engine shares, rebuilt from labels after a crash.

A `ContainerSpec` says everything about one booking's container; its hash travels in a label, so
`list()` rebuilds the truth after a crash with no state file, and starting a booking that already
runs with the same hash changes nothing.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

from gpubook.runtime.errors import EngineError
from gpubook.runtime.mounts import Mount

if TYPE_CHECKING:
    from gpubook.runtime.nvidia.model import GpuInjection

LABEL_PREFIX = "gpubook."
LABEL_BOOKING = "gpubook.booking"
LABEL_USER = "gpubook.user"
LABEL_GPUS = "gpubook.gpus"
LABEL_END = "gpubook.end"
LABEL_HASH = "gpubook.spec-hash"
LABEL_PORT = "gpubook.port"
LABEL_TEMPLATE = "gpubook.template"
LABEL_START = "gpubook.start"  # the booking's start: an armed container opens SSH only then
LABEL_HOST_KEY = "gpubook.host-key"  # the public half of the booking's SSH host key
LABEL_BOOKER = "gpubook.booker"  # who the container lets in: `booker_digest` of its account and keys
LABEL_SERVICE = "gpubook.service"  # a service container of gpubook's own (the SFTP service): no booking

# What sshd and sudo need (and what a booker's `sudo apt-get install` needs); everything else,
# MKNOD and NET_RAW included, is dropped. MKNOD also keeps NVML from creating other GPUs' nodes.
KEEP_CAPABILITIES = (
    "CHOWN",
    "DAC_OVERRIDE",
    "FOWNER",
    "FSETID",
    "KILL",
    "SETGID",
    "SETUID",
    "SYS_CHROOT",
    "AUDIT_WRITE",
    "NET_BIND_SERVICE",
)
DROP_CAPABILITIES = ("ALL", "MKNOD")

_SIZE = re.compile(r"^[1-9][0-9]*[bkmg]?$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_HOST_KEY = re.compile(r"^(ssh-ed25519 [A-Za-z0-9+/]+={0,2})?$")


@dataclass(frozen=True)
class ContainerSpec:
    """One booking's container, complete: equal specs give equal hashes.

    `uid`/`gid` are the booker's: the engine maps them onto host ids (`host_owner`: Docker the same
    number, rootless podman a subordinate id of the daemon user, never its own uid), which the
    booker's files in bound folders get. `entrypoint` and `command` are argv lists.
    """

    booking_id: str
    user: str
    uid: int
    gid: int
    image: str
    port: int
    end: datetime
    gpus: tuple[int, ...] = ()
    template: str = ""
    entrypoint: tuple[str, ...] = ()
    command: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    mounts: tuple[Mount, ...] = ()
    shm_size: str | None = None  # like "1g"; None: the engine's default
    memory: str | None = None  # like "16g"; None: no limit
    gpu: GpuInjection | None = None
    host_key: str = ""  # "ssh-ed25519 AAAA...": the public host key gpubook made for this booking
    start: datetime | None = None  # the booking's start: nothing opens inside before it (armed containers)
    booker: str = ""  # `booker_digest` of the account made inside and its keys ("": not a booking's)

    def __post_init__(self) -> None:
        problem = booking_id_problem(self.booking_id)
        if problem:
            raise EngineError(problem)
        if self.end.tzinfo is None:
            raise EngineError(f"booking {self.booking_id}: end time {self.end} has no time zone")
        if self.start is not None and self.start.tzinfo is None:
            raise EngineError(f"booking {self.booking_id}: start time {self.start} has no time zone")
        if not 1024 <= self.port <= 65535:
            raise EngineError(
                f"booking {self.booking_id}: port {self.port} is not between 1024 and 65535"
            )
        for size in (self.shm_size, self.memory):
            if size is not None and not _SIZE.match(size):
                raise EngineError(
                    f"booking {self.booking_id}: size {size!r} is not like '512m' or '8g'"
                )
        if not _HOST_KEY.match(self.host_key):
            raise EngineError(
                f"booking {self.booking_id}: host key {self.host_key[:40]!r} is not an ed25519 public key"
            )
        for name, _ in self.env:
            if not _ENV_NAME.match(name):
                raise EngineError(
                    f"booking {self.booking_id}: environment name {name!r} is invalid"
                )

    @property
    def name(self) -> str:
        return container_name(self.booking_id)

    @property
    def spec_hash(self) -> str:
        data = json.dumps(dataclasses.asdict(self), default=str, sort_keys=True)
        return hashlib.sha256(data.encode()).hexdigest()[:16]

    def labels(self) -> dict[str, str]:
        start = {LABEL_START: self.start.astimezone(UTC).isoformat()} if self.start is not None else {}
        return {
            **start,
            LABEL_BOOKING: self.booking_id,
            LABEL_USER: self.user,
            LABEL_GPUS: ",".join(str(gpu) for gpu in self.gpus),
            LABEL_END: self.end.astimezone(UTC).isoformat(),
            LABEL_HASH: self.spec_hash,
            LABEL_PORT: str(self.port),
            LABEL_TEMPLATE: self.template,
            LABEL_HOST_KEY: self.host_key,
            **({LABEL_BOOKER: self.booker} if self.booker else {}),
        }


@dataclass(frozen=True)
class ServiceSpec:
    """A long-running container of gpubook's own beside the bookings (the SFTP service).

    Its root is the engine's own user (rootless podman: the daemon user), so that folders the
    daemon owns are root's inside; every other id maps as in the bookings, so that a booker's files
    have the same owner in both. `capabilities` are all it keeps; `seccomp` is a profile file.
    """

    name: str
    service: str  # the LABEL_SERVICE value
    image: str
    port: int
    listen: str  # the host address the port is published on
    command: tuple[str, ...]
    mounts: tuple[Mount, ...] = ()
    capabilities: tuple[str, ...] = ()
    seccomp: Path | None = None
    pids_limit: int | None = None
    memory: str | None = None  # the engines' size ("1g"): memory and memory+swap, at most
    host_network: bool = False  # the host's network (the process binds `listen` itself); else published

    def __post_init__(self) -> None:
        if not 1024 <= self.port <= 65535:
            raise EngineError(f"service {self.service}: port {self.port} is not between 1024 and 65535")
        if not self.command:
            raise EngineError(f"service {self.service}: no command")

    @property
    def spec_hash(self) -> str:
        data = json.dumps(dataclasses.asdict(self), default=str, sort_keys=True)
        return hashlib.sha256(data.encode()).hexdigest()[:16]

    def labels(self) -> dict[str, str]:
        return {LABEL_SERVICE: self.service, LABEL_HASH: self.spec_hash, LABEL_PORT: str(self.port)}


@dataclass(frozen=True)
class ContainerInfo:
    """A gpubook container as the engine reports it, rebuilt from its labels."""

    name: str
    id: str
    state: str  # the engine's word: "running", "exited", "created", ...
    image: str
    booking_id: str
    user: str
    gpus: tuple[int, ...]
    end: datetime | None
    spec_hash: str
    port: int | None
    template: str
    host: str = ""  # which host backend listed it (the scheduler's hosts dimension); "" until one does
    host_key: str = ""  # "ssh-ed25519 AAAA...", from its label: what the booker's known_hosts gets
    pid: int = 0  # its first process on the host, where the engine says (0: not running or not told)
    start: datetime | None = None  # its booking's start, from its label: SSH opens inside only then
    booker: str = ""  # `booker_digest` of who it lets in, from its label ("": not labelled)
    # A multi-node booking (a Slurm cluster) is listed once, by its first node: the other nodes and
    # the GPUs it holds there.
    others: tuple[tuple[str, tuple[int, ...]], ...] = ()

    @property
    def running(self) -> bool:
        return self.state == "running"


@dataclass(frozen=True)
class ExecResult:
    returncode: int
    stdout: str
    stderr: str


class SpecTaken(EngineError):
    """The booking's container name runs with another spec (`current`): no retry cures it; the caller
    decides whether that container may go (one run ahead whose start has not come: hosts/start.py)."""

    temporary = False

    def __init__(self, spec: ContainerSpec, current: ContainerInfo) -> None:
        super().__init__(f"booking {spec.booking_id}: {spec.name} already runs with another spec (hash "
                         f"{current.spec_hash}, wanted {spec.spec_hash}); stop it first")
        self.current = current


def permanent(message: str) -> EngineError:
    """An EngineError that no retry will cure (a missing image, a port in use by something else)."""
    error = EngineError(message)
    error.temporary = False
    return error


_CONTROL = re.compile("[\x00-\x1f\x7f]")


def booking_id_problem(booking_id: str) -> str | None:
    """None for a booking id a container can carry in its labels, else the sentence saying why not.
    Checked before anything is taken for a start (its SSH port), so a bad UID costs nothing."""
    if not booking_id or _CONTROL.search(booking_id):
        return f"booking id {booking_id!r} is empty or has control characters"
    return None


CONTAINER_PREFIX = "gpubook-"  # every booking's container name begins so


def container_name(booking_id: str) -> str:
    """A readable, engine-safe name that stays unique for any booking id (UIDs are free text)."""
    readable = re.sub(r"[^a-zA-Z0-9_.-]+", "-", booking_id).strip("-.")[:40]
    digest = hashlib.sha256(booking_id.encode()).hexdigest()[:10]
    return f"{CONTAINER_PREFIX}{readable}-{digest}" if readable else f"{CONTAINER_PREFIX}{digest}"


def info_from_labels(
    *, name: str, id: str, state: str, image: str, labels: Mapping[str, str], pid: int = 0
) -> ContainerInfo:
    end, start = _time_label(labels, LABEL_END), _time_label(labels, LABEL_START)
    gpus = tuple(int(g) for g in labels.get(LABEL_GPUS, "").split(",") if g.strip().isdigit())
    port_text = labels.get(LABEL_PORT, "")
    return ContainerInfo(
        name=name.lstrip("/"),
        id=id,
        state=state.lower(),
        image=image,
        booking_id=labels.get(LABEL_BOOKING, ""),
        user=labels.get(LABEL_USER, ""),
        gpus=gpus,
        end=end,
        spec_hash=labels.get(LABEL_HASH, ""),
        port=int(port_text) if port_text.isdigit() else None,
        template=labels.get(LABEL_TEMPLATE, ""),
        host_key=labels.get(LABEL_HOST_KEY, ""),
        pid=pid,
        start=start,
        booker=labels.get(LABEL_BOOKER, ""),
    )


def booker_digest(user: str, uid: int, gid: int, ssh_keys: Sequence[str]) -> str:
    """Who a booking's container lets in (its account, ids and SSH keys), as a short digest: a
    container run ahead of its start whose digest is not its booking's now must not open."""
    keys = sorted(key.strip() for key in ssh_keys if key.strip())
    data = json.dumps([user, uid, gid, keys])
    return hashlib.sha256(data.encode()).hexdigest()[:16]


def _time_label(labels: Mapping[str, str], key: str) -> datetime | None:
    text = labels.get(key, "")
    try:
        return datetime.fromisoformat(text) if text else None
    except ValueError:
        return None
