"""Real calendar servers for tests and benchmarks: Radicale and Xandikos as subprocesses.

Each server listens on a free 127.0.0.1 port with its own temporary storage, is started with the
interpreter running the tests (the venv's python has radicale and xandikos) and is waited for
until it answers HTTP. `stop()` ends exactly the process it started.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import caldav
from caldav.lib.http_sync import HTTPBasicAuth

STARTUP_SECONDS = 20.0


def free_port() -> int:
    """A port nobody listens on right now (the server binds it a moment later)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def wait_until_answering(port: int, process: subprocess.Popen[bytes], *, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server on port {port} exited with {process.returncode} at start")
        try:
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=1)
            connection.request("OPTIONS", "/")
            connection.getresponse().read()
            connection.close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"server on port {port} did not answer within {timeout} s")


@dataclass
class CalendarServer:
    """One running server; `calendar_root` is where `new_calendar` creates collections."""

    name: str
    argv: list[str]
    port: int
    storage: Path
    calendar_root: str  # path under which new calendars are made, ending in "/"
    username: str | None = None
    password: str | None = None
    process: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    log_path: Path | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> CalendarServer:
        self.log_path = self.storage / f"{self.name}.log"
        log = self.log_path.open("wb")
        self.process = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL)
        log.close()
        try:
            wait_until_answering(self.port, self.process, timeout=STARTUP_SECONDS)
        except RuntimeError as error:
            self.stop()
            raise RuntimeError(f"{self.name}: {error}; log: {self.log_tail()}") from None
        return self

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None

    def log_tail(self) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return self.log_path.read_text(errors="replace")[-2000:]

    def client(self) -> caldav.DAVClient:
        # Basic auth up front: Radicale with auth "none" never asks for it, yet needs the user name
        # to find the owner's collections.
        auth = HTTPBasicAuth(self.username, self.password) if self.username else None
        return caldav.get_davclient(url=self.base_url + self.calendar_root, username=self.username,
                                    password=self.password, auth=auth, check_config_file=False,
                                    environment=False, timeout=10)

    def new_calendar(self, name: str | None = None) -> caldav.Calendar:
        """Create an empty calendar collection (MKCALENDAR through the caldav client)."""
        cal_id = name or "cal-" + uuid.uuid4().hex[:12]
        url = f"{self.base_url}{self.calendar_root}{cal_id}/"
        client = self.client()
        response = client.mkcalendar(url)
        if response.status not in (200, 201):
            raise RuntimeError(f"MKCALENDAR {url} answered {response.status}")
        return client.calendar(url=url)


def radicale(storage: Path, *, htpasswd: dict[str, str] | None = None,
             port: int | None = None) -> CalendarServer:
    """Radicale with filesystem storage in `storage`; auth none, or htpasswd (plain) users."""
    port = port or free_port()
    argv = [sys.executable, "-m", "radicale", "--server-hosts", f"127.0.0.1:{port}",
            "--storage-filesystem-folder", str(storage / "collections"),
            "--logging-level", "warning"]
    username = password = None
    if htpasswd:
        users_file = storage / "htpasswd"
        users_file.write_text("".join(f"{u}:{p}\n" for u, p in htpasswd.items()))
        argv += ["--auth-type", "htpasswd", "--auth-htpasswd-filename", str(users_file),
                 "--auth-htpasswd-encryption", "plain", "--rights-type", "owner_only"]
        username, password = next(iter(htpasswd.items()))
        root = f"/{username}/"
    else:
        # Radicale 3.5+ refuses anonymous writes; with auth none any user name is accepted as is.
        argv += ["--auth-type", "none", "--rights-type", "owner_only"]
        username, password = "test", "any"
        root = "/test/"
    return CalendarServer(name="radicale", argv=argv, port=port, storage=storage,
                          calendar_root=root, username=username, password=password)


def xandikos(storage: Path, *, port: int | None = None) -> CalendarServer:
    """Xandikos with its default single-user layout; calendars live under /user/calendars/."""
    port = port or free_port()
    xandikos_bin = Path(sys.executable).with_name("xandikos")
    command = [str(xandikos_bin)] if xandikos_bin.exists() else [sys.executable, "-m", "xandikos"]
    argv = [*command, "serve", "--defaults", "-d", str(storage / "data"),
            "-l", "127.0.0.1", "-p", str(port)]
    return CalendarServer(name="xandikos", argv=argv, port=port, storage=storage,
                          calendar_root="/user/calendars/")


@contextlib.contextmanager
def running(make, **kwargs):  # type: ignore[no-untyped-def]
    """Start a server in a fresh temporary folder; stop it and remove the folder afterwards."""
    storage = Path(tempfile.mkdtemp(prefix="gpubook-caldav-"))
    server = make(storage, **kwargs)
    try:
        yield server.start()
    finally:
        server.stop()
        if not os.environ.get("GPUBOOK_KEEP_SERVER_DATA"):
            shutil.rmtree(storage, ignore_errors=True)
