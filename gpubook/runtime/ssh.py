"""The "local overlay" on a template: the booker's account, SSH with keys only, sudo; and readiness.

- Images without sshd/sudo run as a derived image with them (gpubook/runtime/overlay_image.py builds it).
- At start a read-only bind-mounted entrypoint (overlay/entrypoint.sh) makes the account, keys,
  sudo and sshd on the booking's port; then the template's command (and JupyterLab, for a template
  with jupyter = true: gpubook/runtime/jupyter.py) runs as the booker.
- gpubook makes each booking's SSH host key itself (ed25519, kept mode 600 under the cache folder,
  bound read-only into the container), so it knows the key before sshd runs: the probe trusts only
  that key, and the booker gets it as a known_hosts line, with no trust on first use.
- A booking is ready only when a paramiko client logs in with the daemon's probe key (restricted
  in authorized_keys to running `true`, with no forwarding or pty) to a server that showed the
  booking's own host key. Any other server on the port (a booker squatting it) is refused at once.
"""

from __future__ import annotations

import base64
import hashlib
import io
import logging
import os
import socket
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import paramiko
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from gpubook.runtime import jupyter
from gpubook.runtime.engines import ContainerInfo, ContainerSpec, Engine, booker_digest
from gpubook.runtime.errors import EngineError
from gpubook.runtime.mounts import Mount
from gpubook.runtime.overlay_image import run_image
from gpubook.runtime.private import check_private_key, write_private
from gpubook.runtime.storage import DataFolders, check_user_name
from gpubook.runtime.templates import Template

log = logging.getLogger(__name__)

ENTRYPOINT_SOURCE = Path(__file__).with_name("overlay") / "entrypoint.sh"
OVERLAY_TARGET = "/.gpubook"
HOST_KEY_TARGET = "/.gpubook-hostkey"  # the booking's host key folder, bound read-only
HOST_KEY_FILE = "ssh_host_ed25519_key"
NOT_BEFORE = "GPUBOOK_NOT_BEFORE"  # the booking's start, epoch seconds: the entrypoint opens nothing before it


@dataclass(frozen=True)
class Ready:
    """A booking whose SSH answered: how long it took from start, and its host key."""

    info: ContainerInfo
    seconds: float
    host_key: str  # "ssh-ed25519 AAAA...", for the booker's known_hosts


@dataclass(frozen=True)
class HostKey:
    """One booking's SSH host key: the folder bound into its container (private key, mode 600)
    and the public line ("ssh-ed25519 AAAA...") that the probe pins and the booker trusts."""

    folder: Path
    public: str


class ForeignHostKey(EngineError):
    """The server on a booking's port showed another host key than the one gpubook made for it."""


def host_key_folder(cache_dir: Path, name: str) -> Path:
    return cache_dir / "host-keys" / name


def booking_host_key(cache_dir: Path, name: str, *, owner: tuple[int, int] | None = None,
                     chown: Callable[[Path, int, int], None] | None = None) -> HostKey:
    """The host key of container `name`, made on first use and kept for its restarts.

    Made here, not inside the container, so the daemon knows it before sshd runs. The folder is the
    daemon's, mode 711 (sshd inside, whose root is never the daemon's uid, may pass it, nobody may
    list it); the private key is mode 600 and handed to `owner` (the host ids of the container's
    root) through `chown`, the engine's own way (rootless podman: only its namespace can), so that
    sshd reads it and no other container or host user does. The daemon may still remove it: the
    folder is its own.
    """
    folder = host_key_folder(cache_dir, name)
    private, public = folder / HOST_KEY_FILE, folder / f"{HOST_KEY_FILE}.pub"
    folder.mkdir(parents=True, exist_ok=True, mode=0o711)
    folder.chmod(0o711)  # also a folder an earlier start (or version) left with another mode
    line = host_key_pair(private, public)
    held = private.stat()
    if owner is not None and chown is not None and (held.st_uid, held.st_gid) != owner:
        chown(private, *owner)
    return HostKey(folder=folder, public=line)


def host_key_pair(private: Path, public: Path) -> str:
    """An ed25519 host key pair kept in `private` (mode 600) and `public`, made if either is
    missing; its public line ("ssh-ed25519 AAAA...")."""
    if private.is_file() and public.is_file():
        return public.read_text().strip()
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                            serialization.NoEncryption())
    line = key.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                         serialization.PublicFormat.OpenSSH).decode()
    write_private(private, pem)
    public.write_text(line + "\n")
    public.chmod(0o644)
    return line


def forget_host_key(cache_dir: Path, name: str) -> None:
    """Remove a stopped container's host key: the next booking on its port gets a new one."""
    folder = host_key_folder(cache_dir, name)
    for path in (folder / HOST_KEY_FILE, folder / f"{HOST_KEY_FILE}.pub"):
        path.unlink(missing_ok=True)
    try:
        folder.rmdir()
    except OSError:
        pass


def known_hosts_line(*, host: str, port: int, host_key: str) -> str:
    """The booker's known_hosts line for a booking: `[host]:port ssh-ed25519 AAAA...`."""
    return f"[{host}]:{port} {host_key}" if port != 22 else f"{host} {host_key}"


def fingerprint(key_line: str) -> str:
    """OpenSSH's SHA256 fingerprint of a public key line ("ssh-ed25519 AAAA...")."""
    blob = base64.b64decode(key_line.split()[1])
    return "SHA256:" + base64.b64encode(hashlib.sha256(blob).digest()).decode().rstrip("=")


def entrypoint_dir(cache_dir: Path) -> Path:
    """A folder holding the entrypoint, named by its hash, readable by the container's root."""
    text = ENTRYPOINT_SOURCE.read_bytes()
    folder = cache_dir / "overlay" / hashlib.sha256(text).hexdigest()[:16]
    script = folder / "entrypoint.sh"
    if not script.is_file() or script.read_bytes() != text:
        folder.mkdir(parents=True, exist_ok=True)
        folder.chmod(0o755)
        partial = folder / f".entrypoint.{os.getpid()}"
        partial.write_bytes(text)
        partial.chmod(0o755)
        partial.replace(script)
    return folder


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "gpubook"


def load_probe_key(path: Path) -> paramiko.PKey:
    """The daemon's own key for readiness probes; made (ECDSA P-256, mode 600, in a 0700 folder) on
    first use. An existing key others can read, or someone else's, is refused (UnsafePath): whoever
    read it could answer the probe's login in a booking's place."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)  # the daemon checks its state folder itself
    if path.exists() or path.is_symlink():
        check_private_key(path)
        return paramiko.ECDSAKey.from_private_key_file(str(path))
    key = paramiko.ECDSAKey.generate(bits=256)
    text = io.StringIO()
    key.write_private_key(text)
    write_private(path, text.getvalue().encode())
    return key


def probe_key_line(key: paramiko.PKey) -> str:
    # `restrict` (OpenSSH >= 7.2): no pty, no forwarding; and the probe can only run `true`.
    return f'restrict,command="true" {key.get_name()} {key.get_base64()} gpubook-probe'



def booking_spec(
    template: Template,
    *,
    booking_id: str,
    user: str,
    uid: int,
    gid: int,
    ssh_keys: Sequence[str],
    probe_key: paramiko.PKey,
    port: int,
    end: datetime,
    folders: DataFolders,
    cache_dir: Path,
    host_key: HostKey,
    gpus: tuple[int, ...] = (),
    gpu: object | None = None,
    start: datetime | None = None,
) -> ContainerSpec:
    """The container for one booking of `template`: overlay entrypoint, data folders, keys.

    `start`, the booking's start, goes in as GPUBOOK_NOT_BEFORE (epoch seconds): the entrypoint
    makes everything, then waits for that moment before sshd, JupyterLab or the template's command
    run. A container run before the start (armed) thus lets nobody in and runs nothing of the
    booker's until then; one run at or after it waits for nothing. The same spec either way."""
    check_user_name(user)
    keys = "\n".join([*(k.strip() for k in ssh_keys if k.strip()), probe_key_line(probe_key)])
    env = dict(template.env)
    env.update(
        {
            "GPUBOOK_USER": user,
            "GPUBOOK_UID": str(uid),
            "GPUBOOK_GID": str(gid),
            "GPUBOOK_PORT": str(port),
            "GPUBOOK_KEYS": keys,
        }
    )
    if template.jupyter:
        env[jupyter.ENV] = "1"
    if start is not None:
        env[NOT_BEFORE] = f"{start.timestamp():.3f}"
    overlay = Mount(entrypoint_dir(cache_dir), OVERLAY_TARGET, read_only=True)
    key_folder = Mount(host_key.folder, HOST_KEY_TARGET, read_only=True)
    return ContainerSpec(
        booking_id=booking_id,
        user=user,
        uid=uid,
        gid=gid,
        image=run_image(template),
        port=port,
        end=end,
        gpus=gpus,
        template=template.name,
        entrypoint=(f"{OVERLAY_TARGET}/entrypoint.sh",),
        command=template.command,
        env=tuple(sorted(env.items())),
        mounts=(overlay, key_folder, *folders.mounts(), *template.mounts),
        shm_size=template.shm_size,
        memory=template.memory,
        gpu=gpu,  # type: ignore[arg-type]
        host_key=host_key.public,
        start=start,
        booker=booker_digest(user, uid, gid, ssh_keys),
    )


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


def wait_ready(
    engine: Engine,
    spec: ContainerSpec,
    *,
    probe_key: paramiko.PKey,
    timeout: float,
    host: str = "127.0.0.1",
) -> str:
    """Log in as the booker with the probe key until it works; give the server's host key.

    Only the server showing `spec.host_key` is trusted: another one (something that took the port
    before sshd could) raises ForeignHostKey at once, so no booker is ever sent to it.
    """
    if not spec.host_key:
        raise EngineError(f"booking {spec.booking_id}: no host key to check its SSH server against")
    deadline = time.monotonic() + timeout
    next_check = time.monotonic() + 1.0
    last_problem = "no answer yet"
    while time.monotonic() < deadline:
        try:
            return probe_login(host, spec.port, spec.user, probe_key, host_key=spec.host_key)
        except ForeignHostKey as error:
            raise ForeignHostKey(f"booking {spec.booking_id}: {error}") from None
        except (OSError, paramiko.SSHException, EOFError) as error:
            last_problem = str(error) or type(error).__name__
        if time.monotonic() >= next_check:  # a dead container never answers: say so at once
            info = engine.inspect(spec.name)
            if info is None or not info.running:
                state = info.state if info else "gone"
                raise EngineError(
                    f"booking {spec.booking_id}: container {spec.name} is {state} "
                    f"before SSH answered"
                )
            next_check = time.monotonic() + 1.0
        time.sleep(0.02)
    raise EngineError(
        f"booking {spec.booking_id}: SSH on port {spec.port} did not let the probe in "
        f"within {timeout:.0f} s ({last_problem})"
    )


def probe_login(
    host: str, port: int, user: str, key: paramiko.PKey, *, host_key: str, timeout: float = 5.0
) -> str:
    """One SSH login with `key` to the server whose host key is `host_key`; raises if it fails
    (ForeignHostKey before any authentication when the server shows another key); gives the key."""
    with socket.create_connection((host, port), timeout=timeout) as sock:
        # A published port's proxy (rootlessport) accepts at once and hangs up while sshd is not
        # listening yet: say so here, before paramiko's transport thread logs it as an error.
        if not sock.recv(4, socket.MSG_PEEK):
            raise EOFError(f"port {port} is open but no SSH server answers behind it yet")
        transport = paramiko.Transport(sock)
        try:
            transport.banner_timeout = timeout
            transport.start_client(timeout=timeout)
            server_key = transport.get_remote_server_key()
            shown = f"{server_key.get_name()} {server_key.get_base64()}"
            if shown != " ".join(host_key.split()[:2]):
                raise ForeignHostKey(
                    f"the SSH server on port {port} showed host key {fingerprint(shown)}, not the "
                    f"booking's own {fingerprint(host_key)}: another program holds the port, and "
                    f"gpubook neither logs in to it nor sends the booker there"
                )
            transport.auth_publickey(user, key)
            if not transport.is_authenticated():
                raise paramiko.AuthenticationException("probe key refused")
            return shown
        finally:
            transport.close()


def _safe_logs(engine: Engine, name: str) -> str:
    try:
        return engine.logs(name, tail=30).strip() or "(empty)"
    except EngineError as error:
        return f"(no log: {error})"
