"""A booking's SSH: its host key, the daemon's probe key, and the readiness probe.

(The container itself, with the overlay entrypoint that makes the account and runs sshd, is
gpubook/runtime/booking/launch.py's.)
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
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import paramiko
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from gpubook.runtime.engines import ContainerSpec, Engine
from gpubook.runtime.errors import EngineError
from gpubook.runtime.private import check_private_key, write_private

log = logging.getLogger(__name__)

HOST_KEY_FILE = "ssh_host_ed25519_key"


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
