"""A real image registry for the tests: Debian's docker-registry (the CNCF distribution registry) on
127.0.0.1, over TLS with a CA made here and htpasswd (bcrypt) auth; and tiny images to push to it.

The CA goes where podman looks for the rootless user (~/.config/containers/certs.d/HOST:PORT/
ca.crt, read by podman 4.3's containers/image), so nothing is marked insecure. The registry's
storage is cached in ~/.cache/gpubook/registry, so a base image's layers are uploaded once, not on
every test session.
"""

from __future__ import annotations

import base64
import contextlib
import json
import secrets
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from gpubook.runtime.engines import Engine
from gpubook.scheduler.commands.embedded import free_port
from tests.kits import tls_kit
from tests.kits.engine_suite import CACHE_DIR

USER, PASSWORD = "lab", "registry-" + secrets.token_hex(6)


@dataclass(frozen=True)
class Registry:
    address: str  # 127.0.0.1:PORT
    auth_file: Path  # the right credentials, auth.json format
    wrong_auth_file: Path  # a wrong password for the same registry
    folder: Path


def _auth_file(path: Path, address: str, user: str, password: str) -> Path:
    token = base64.b64encode(f"{user}:{password}".encode()).decode()
    path.write_text(json.dumps({"auths": {address: {"auth": token}}}))
    path.chmod(0o600)
    return path


@contextmanager
def running() -> Iterator[Registry]:
    """`docker-registry serve` on a free port of 127.0.0.1, its CA trusted by podman, then stopped."""
    folder = Path(tempfile.mkdtemp(prefix="gpubook-registry-"))
    port = free_port()
    address = f"127.0.0.1:{port}"
    tls_kit.certificates(folder, ca_name="gpubook test registry CA", ca_file="ca.crt", cert_file="server.crt")
    htpasswd = subprocess.run(["htpasswd", "-Bbn", USER, PASSWORD], capture_output=True, text=True, check=True)
    (folder / "htpasswd").write_text(htpasswd.stdout)
    storage = CACHE_DIR / "registry"
    storage.mkdir(parents=True, exist_ok=True)
    (folder / "config.yml").write_text(json.dumps({  # YAML is a superset of JSON
        "version": 0.1, "log": {"level": "error"},
        "storage": {"filesystem": {"rootdirectory": str(storage)}, "delete": {"enabled": True}},
        "http": {"addr": address, "tls": {"certificate": str(folder / "server.crt"),
                                          "key": str(folder / "server.key")}},
        "auth": {"htpasswd": {"realm": "gpubook-test", "path": str(folder / "htpasswd")}},
    }))
    certs = Path.home() / ".config" / "containers" / "certs.d" / address
    certs.mkdir(parents=True, exist_ok=True)
    shutil.copy(folder / "ca.crt", certs / "ca.crt")
    log = (folder / "registry.log").open("wb")
    process = subprocess.Popen(["docker-registry", "serve", str(folder / "config.yml")], stdout=log, stderr=log,
                               stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or process.poll() is not None:
                    why = (folder / "registry.log").read_text()
                    raise RuntimeError(f"docker-registry did not start: {why}") from None
                time.sleep(0.1)
        yield Registry(address=address, folder=folder,
                       auth_file=_auth_file(folder / "auth.json", address, USER, PASSWORD),
                       wrong_auth_file=_auth_file(folder / "wrong.json", address, USER, "not-" + PASSWORD))
    finally:
        process.terminate()
        process.wait(timeout=10)
        log.close()
        shutil.rmtree(certs, ignore_errors=True)
        shutil.rmtree(folder, ignore_errors=True)


def podman(engine: Engine, *args: str) -> str:
    done = subprocess.run([*engine.global_argv(), *args], capture_output=True, text=True,  # type: ignore[attr-defined]
                          timeout=600, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"podman {args[0]}: {done.stderr.strip()[-2000:]}")
    return done.stdout


def tiny_image(engine: Engine, tag: str, *, base: str = "scratch") -> str:
    """An image of one small file of its own (so its id is its own), built without running anything."""
    with tempfile.TemporaryDirectory(prefix="gpubook-tiny-") as context:
        (Path(context) / "token").write_text(secrets.token_hex(16))
        (Path(context) / "Containerfile").write_text(f"FROM {base}\nCOPY token /gpubook-token\n")
        podman(engine, "build", "--quiet", "--tag", tag, context)
    return tag


def push(engine: Engine, registry: Registry, image: str, target: str) -> str:
    """Push `image` as `target` (under the registry's address); gives the manifest digest pushed."""
    with tempfile.TemporaryDirectory() as folder:
        digest_file = Path(folder) / "digest"
        podman(engine, "push", "--quiet", "--authfile", str(registry.auth_file), "--digestfile", str(digest_file),
               image, f"{registry.address}/{target}")
        return digest_file.read_text().strip()


def untag(engine: Engine, image: str) -> None:
    """Take the name away and keep the layers: the image is no longer present under that name (a pull
    by another name must fetch its manifest), and no layer is deleted. Deleting the layers of an
    image built a moment ago (`rmi --force`) once left an incomplete, still-mounted layer in a CI
    run's store, and every later podman command of that account failed on it."""
    subprocess.run([*engine.global_argv(), "untag", image],  # type: ignore[attr-defined]
                   capture_output=True, check=False)


def remove(engine: Engine, *images: str) -> None:
    for image in images:
        subprocess.run([*engine.global_argv(), "rmi", "--force", image],  # type: ignore[attr-defined]
                       capture_output=True, check=False)


@contextmanager
def slowed(registry: Registry, bytes_per_second: int) -> Iterator[Registry]:
    """The same registry behind a TCP proxy on another port that sends its answers at most
    `bytes_per_second` (all connections together: a slow link); TLS passes through untouched, its
    CA trusted for the proxy's address too. A pull through it takes long enough to be watched."""
    listener = socket.create_server(("127.0.0.1", 0))
    address = f"127.0.0.1:{listener.getsockname()[1]}"
    upstream = ("127.0.0.1", int(registry.address.rsplit(":", 1)[1]))
    bucket = threading.Lock()
    sent_at = [time.monotonic()]  # when the link is free again
    stop = threading.Event()
    chunk = 16384

    def pump(source: socket.socket, target: socket.socket, *, slow: bool) -> None:
        try:
            while not stop.is_set():
                data = source.recv(chunk)
                if not data:
                    break
                if slow:
                    with bucket:
                        sent_at[0] = max(sent_at[0], time.monotonic()) + len(data) / bytes_per_second
                        due = sent_at[0]
                    time.sleep(max(0.0, due - time.monotonic()))
                target.sendall(data)
        except OSError:
            pass
        finally:
            for end in (source, target):
                with contextlib.suppress(OSError):
                    end.shutdown(socket.SHUT_RDWR)

    def serve() -> None:
        while not stop.is_set():
            try:
                client, _ = listener.accept()
            except OSError:
                return
            server = socket.create_connection(upstream)
            threading.Thread(target=pump, args=(client, server), kwargs={"slow": False}, daemon=True).start()
            threading.Thread(target=pump, args=(server, client), kwargs={"slow": True}, daemon=True).start()

    certs = Path.home() / ".config" / "containers" / "certs.d" / address
    certs.mkdir(parents=True, exist_ok=True)
    shutil.copy(registry.folder / "ca.crt", certs / "ca.crt")
    folder = Path(tempfile.mkdtemp(prefix="gpubook-slowed-"))
    threading.Thread(target=serve, daemon=True).start()
    try:
        yield Registry(address=address, folder=registry.folder,
                       auth_file=_auth_file(folder / "auth.json", address, USER, PASSWORD),
                       wrong_auth_file=_auth_file(folder / "wrong.json", address, USER, "not-" + PASSWORD))
    finally:
        stop.set()
        listener.close()
        shutil.rmtree(certs, ignore_errors=True)
        shutil.rmtree(folder, ignore_errors=True)
