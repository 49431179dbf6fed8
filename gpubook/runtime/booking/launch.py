"""One booking's container: its spec (the template, the "local overlay" entrypoint, the booker's
account and keys, data folders, GPUs) and its start, which waits for SSH to let the probe in.

- Images without sshd/sudo run as a derived image with them (gpubook/runtime/templates/overlay_image.py builds it).
- At start a read-only bind-mounted entrypoint (overlay/entrypoint.sh) makes the account, keys,
  sudo and sshd on the booking's port; then the template's command (and JupyterLab, for a template
  with jupyter = true: gpubook/runtime/booking/jupyter.py) runs as the booker.
- The booking's SSH host key, the probe key and the probe itself are gpubook/runtime/booking/ssh.py's.
- The booking as the booker sees it inside: GPUBOOK_BOOKING, GPUBOOK_END (ISO 8601, the end at the
  container's start) and GPUBOOK_GPUS in the environment, and /run/gpubook/booking.json with the
  overlay's `gpubook-booking` command, kept up to date (gpubook/runtime/booking/booking_json.py).
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import paramiko

from gpubook.runtime.booking import jupyter
from gpubook.runtime.booking.booking_json import CARD_TARGET, gpus_text
from gpubook.runtime.booking.ssh import HostKey, probe_key_line, wait_ready
from gpubook.runtime.data.storage import DataFolders, check_user_name
from gpubook.runtime.engines import ContainerInfo, ContainerSpec, Engine, booker_digest
from gpubook.runtime.errors import EngineError
from gpubook.runtime.mounts import Mount
from gpubook.runtime.templates.catalog import Template
from gpubook.runtime.templates.overlay_image import run_image

log = logging.getLogger(__name__)

OVERLAY_SOURCE = Path(__file__).with_name("overlay")
ENTRYPOINT_SOURCE = OVERLAY_SOURCE / "entrypoint.sh"
OVERLAY_FILES = ("entrypoint.sh", "gpubook-booking")  # each executable, all bound at OVERLAY_TARGET
OVERLAY_TARGET = "/.gpubook"
HOST_KEY_TARGET = "/.gpubook-hostkey"  # the booking's host key folder, bound read-only
NOT_BEFORE = "GPUBOOK_NOT_BEFORE"  # the booking's start, epoch seconds: the entrypoint opens nothing before it
# The booking, for the booker's scripts: its id, its end at the container's start (ISO 8601 with
# offset; booking.json has the end as moved since), its GPUs (the host's indices, "0,1").
BOOKING_ENV, END_ENV, GPUS_ENV = "GPUBOOK_BOOKING", "GPUBOOK_END", "GPUBOOK_GPUS"


@dataclass(frozen=True)
class Tenancy:
    """One booking as its container sees it (the core's `Booking` is the calendar's; this is the
    runtime's, named apart): whose (the booker's account and keys), when and where
    (its port, its start and end) and on which GPUs (`gpu`: their injection, runtime.nvidia's)."""

    booking_id: str
    user: str
    uid: int
    gid: int
    ssh_keys: tuple[str, ...]
    port: int
    end: datetime
    start: datetime | None = None
    gpus: tuple[int, ...] = ()
    gpu: object | None = None
    # The host's time the entrypoint waits for (GPUBOOK_NOT_BEFORE), where the daemon's clock is told
    # another time than the host's (tests: gpubook/scheduler/clock.py); None: `start`.
    not_before: datetime | None = None


@dataclass(frozen=True)
class HostFiles:
    """What the host gives a booking's container: the probe's key (its public line goes in with the
    booker's), the cache folder of the entrypoint, the booking's own host key and data folders."""

    probe_key: paramiko.PKey
    cache_dir: Path
    host_key: HostKey
    folders: DataFolders
    card: Path | None = None  # the folder holding booking.json (booking_json.write_card); None: none


@dataclass(frozen=True)
class Ready:
    """A booking whose SSH answered: how long it took from start, and its host key."""

    info: ContainerInfo
    seconds: float
    host_key: str  # "ssh-ed25519 AAAA...", for the booker's known_hosts


def entrypoint_dir(cache_dir: Path) -> Path:
    """A folder holding the overlay's scripts (the entrypoint, `gpubook-booking`), named by their
    hash, readable by every user of the container."""
    texts = {name: (OVERLAY_SOURCE / name).read_bytes() for name in OVERLAY_FILES}
    digest = hashlib.sha256(b"".join(hashlib.sha256(text).digest() for text in texts.values()))
    folder = cache_dir / "overlay" / digest.hexdigest()[:16]
    for name, text in texts.items():
        script = folder / name
        if not script.is_file() or script.read_bytes() != text:
            folder.mkdir(parents=True, exist_ok=True)
            folder.chmod(0o755)
            # A partial file of this call's own: starts in parallel lanes share the pid (they raced on
            # ".NAME.PID", and all but one failed to rename it).
            handle, partial_name = tempfile.mkstemp(dir=folder, prefix=f".{name}.")
            partial = Path(partial_name)
            with os.fdopen(handle, "wb") as stream:
                stream.write(text)
            partial.chmod(0o755)
            partial.replace(script)
    return folder



def booking_spec(template: Template, booking: Tenancy, files: HostFiles) -> ContainerSpec:
    """The container for one booking of `template`: overlay entrypoint, data folders, keys.

    `booking.start`, the booking's start, goes in as GPUBOOK_NOT_BEFORE (epoch seconds): the
    entrypoint makes everything, then waits for that moment before sshd, JupyterLab or the
    template's command run. A container run before the start (armed) thus lets nobody in and runs
    nothing of the booker's until then; one run at or after it waits for nothing. The same spec
    either way."""
    check_user_name(booking.user)
    keys = "\n".join([*(k.strip() for k in booking.ssh_keys if k.strip()), probe_key_line(files.probe_key)])
    env = dict(template.env)
    env.update(
        {
            "GPUBOOK_USER": booking.user,
            "GPUBOOK_UID": str(booking.uid),
            "GPUBOOK_GID": str(booking.gid),
            "GPUBOOK_PORT": str(booking.port),
            "GPUBOOK_KEYS": keys,
            BOOKING_ENV: booking.booking_id,
            END_ENV: booking.end.isoformat(timespec="seconds"),
            GPUS_ENV: gpus_text(booking.gpus),
        }
    )
    if template.jupyter:
        env[jupyter.ENV] = "1"
    not_before = booking.not_before or booking.start
    if not_before is not None:
        env[NOT_BEFORE] = f"{not_before.timestamp():.3f}"
    overlay = Mount(entrypoint_dir(files.cache_dir), OVERLAY_TARGET, read_only=True)
    key_folder = Mount(files.host_key.folder, HOST_KEY_TARGET, read_only=True)
    card = (Mount(files.card, CARD_TARGET, read_only=True),) if files.card is not None else ()
    return ContainerSpec(
        booking_id=booking.booking_id,
        user=booking.user,
        uid=booking.uid,
        gid=booking.gid,
        image=run_image(template),
        port=booking.port,
        end=booking.end,
        gpus=booking.gpus,
        template=template.name,
        entrypoint=(f"{OVERLAY_TARGET}/entrypoint.sh",),
        command=template.command,
        env=tuple(sorted(env.items())),
        mounts=(overlay, key_folder, *card, *files.folders.mounts(), *template.mounts),
        shm_size=template.shm_size,
        memory=template.memory,
        gpu=booking.gpu,  # type: ignore[arg-type]
        host_key=files.host_key.public,
        start=booking.start,
        booker=booker_digest(booking.user, booking.uid, booking.gid, booking.ssh_keys),
    )


class Gates:
    """Bookings starting together on one host: one engine start per container at a time (an arm still
    at work when its start comes is waited for, so the start finds its container), and at most
    `limit` in all. A start's SSH probe holds none (`start_booking`), so a slow sshd never delays
    another booking."""

    def __init__(self, limit: int) -> None:
        self.starting = threading.BoundedSemaphore(limit)
        self._locks: dict[str, threading.Lock] = {}  # container name → its engine start in progress
        self._lock = threading.Lock()

    @contextmanager
    def of(self, name: str) -> Iterator[None]:
        with self._lock:
            lock = self._locks.setdefault(name, threading.Lock())
        with lock, self.starting:
            yield

    def forget(self, name: str) -> None:
        """Its container is gone: its lock too."""
        with self._lock:
            self._locks.pop(name, None)


def start_booking(
    engine: Engine,
    spec: ContainerSpec,
    *,
    probe_key: paramiko.PKey,
    timeout: float = 60.0,
    host: str = "127.0.0.1",
    gate: AbstractContextManager[object] | None = None,
    running: ContainerInfo | None = None,
) -> Ready:
    """Start (or adopt) the booking's container and wait until SSH logs the probe in.

    On failure nothing is left behind: the container is stopped and removed, and the error carries
    the end of its log. A server on the port with another host key fails the start at once.
    `gate` bounds the engine's start only (bookings starting together); the wait for SSH is
    outside it, so a booking whose sshd is slow holds no other booking up. `running`: the container
    already runs with this spec (run ahead of the booking's start): only the probe is left.
    """
    began = time.monotonic()
    if running is not None:
        info = running
    else:
        with gate or nullcontext():
            info = engine.start(spec)
    try:
        host_key = wait_ready(engine, spec, probe_key=probe_key, timeout=timeout, host=host)
    except EngineError as error:
        log_tail = _safe_logs(engine, spec.name)
        engine.stop(spec.name, 0)
        raise EngineError(f"{error}\ncontainer log:\n{log_tail}") from None
    return Ready(info=info, seconds=time.monotonic() - began, host_key=host_key)


def _safe_logs(engine: Engine, name: str) -> str:
    try:
        return engine.logs(name, tail=30).strip() or "(empty)"
    except EngineError as error:
        return f"(no log: {error})"
