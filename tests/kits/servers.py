"""Real calendar servers for tests and benchmarks: Radicale and Xandikos as subprocesses.

Each server listens on a free 127.0.0.1 port with its own temporary storage, is started with the
interpreter running the tests (the venv's python has radicale and xandikos) and is waited for
until it answers HTTP. `stop()` ends exactly the process it started.
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Self

import caldav
import requests
from caldav.lib.http_sync import HTTPBasicAuth

from gpubook.scheduler.commands.embedded import end_process, free_port

STARTUP_SECONDS = 20.0
CLIENT_SECONDS = 120  # a test client's read: a bound on a hung server, never on a slow one
RADICALE_USER = ("alice", "correct horse battery")  # the htpasswd Radicale's user and password



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
        if self.process is not None:
            end_process(self.process, timeout=10)
        self.process = None

    def log_tail(self) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return self.log_path.read_text(errors="replace")[-2000:]

    def client(self) -> caldav.DAVClient:
        # Basic auth up front: Radicale with auth "none" never asks for it, yet needs the user name
        # to find the owner's collections.
        # The tests' own reads wait for the server, not for its speed: with six lanes on two cores a
        # REPORT of a busy calendar took Radicale more than 10 s once (a clean-clone run of dac8a91,
        # test_faults' check after a fault), and the test failed on its own client's timeout.
        auth = HTTPBasicAuth(self.username, self.password) if self.username else None
        return caldav.get_davclient(url=self.base_url + self.calendar_root, username=self.username,
                                    password=self.password, auth=auth, check_config_file=False,
                                    environment=False, timeout=CLIENT_SECONDS)

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
    # "--config" with no file: ignore /etc/radicale/config, ~/.config/radicale and $RADICALE_CONFIG
    argv = [sys.executable, "-m", "radicale", "--config", "--server-hosts", f"127.0.0.1:{port}",
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


@dataclass
class Reply:
    """What the local HTTP server answers on one path (any method)."""

    status: int = 200
    body: bytes | Callable[[], Iterator[bytes]] = b""
    headers: dict[str, str] = field(default_factory=dict)
    delay: float = 0.0  # seconds to wait before answering (a server that never answers)
    honour_validators: bool = True  # answer 304 to a matching If-None-Match / If-Modified-Since


class _ThreadedHTTP:
    """An HTTP server of this process on a free 127.0.0.1 port, served by a thread."""

    def __init__(self) -> None:
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def start(self) -> Self:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        raise NotImplementedError


class FeedServer(_ThreadedHTTP):
    """A plain HTTP server in a thread for ICS feeds and for misbehaving "calendar" servers
    (HTML pages, 500s, silence) that a real CalDAV server cannot be made to produce.

    `replies` maps a path to a Reply; every request is recorded as (method, path, headers).
    """

    def __init__(self) -> None:
        self.replies: dict[str, Reply] = {}
        self.requests: list[tuple[str, str, dict[str, str]]] = []
        self.auth: tuple[str, str] | None = None
        super().__init__()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        owner = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _answer(self) -> None:
                try:
                    self._answer_once()
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up (a timeout test): nothing to answer

            def _answer_once(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                if length:
                    self.rfile.read(length)
                owner.requests.append((self.command, self.path, dict(self.headers.items())))
                reply = owner.replies.get(self.path.split("?", 1)[0], Reply(status=404))
                if reply.delay:
                    time.sleep(reply.delay)
                if owner.auth and not self._authorised():
                    return self._send(401, b"", {"WWW-Authenticate": 'Basic realm="feed"'})
                if reply.status == 200 and reply.honour_validators and self._not_modified(reply):
                    return self._send(304, b"", {k: v for k, v in reply.headers.items()
                                                 if k in ("ETag", "Last-Modified")})
                self._send(reply.status, reply.body, reply.headers)

            def _authorised(self) -> bool:
                assert owner.auth is not None
                expected = base64.b64encode(":".join(owner.auth).encode()).decode()
                return self.headers.get("Authorization", "") == f"Basic {expected}"

            def _not_modified(self, reply: Reply) -> bool:
                etag = reply.headers.get("ETag")
                if etag and self.headers.get("If-None-Match") == etag:
                    return True
                modified = reply.headers.get("Last-Modified")
                return bool(modified) and self.headers.get("If-Modified-Since") == modified

            def _send(self, status: int, body: bytes | Callable[[], Iterator[bytes]],
                      headers: dict[str, str]) -> None:
                self.send_response(status)
                for name, value in headers.items():
                    self.send_header(name, value)
                if callable(body):  # streamed without a length: the client must cap it itself
                    self.send_header("Connection", "close")
                    self.end_headers()
                    try:
                        for chunk in body():
                            self.wfile.write(chunk)
                    except (BrokenPipeError, ConnectionResetError):
                        pass
                    self.close_connection = True
                    return
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            do_GET = do_HEAD = do_PROPFIND = do_REPORT = do_OPTIONS = do_PUT = _answer

        return Handler


class NoSyncProxy(_ThreadedHTTP):
    """Puts a real server behind a front that lacks sync-collection (like many older servers):
    such REPORTs get 403 DAV:supported-report; with `refuse_listing` a Depth: 1 PROPFIND gets
    403 too. Everything else is passed to the real server unchanged."""

    REFUSAL = (b'<?xml version="1.0" encoding="utf-8"?>'
               b'<D:error xmlns:D="DAV:"><D:supported-report/></D:error>')

    def __init__(self, target: str, *, refuse_listing: bool = False) -> None:
        self.target = target.rstrip("/")
        self.refuse_listing = refuse_listing
        self.refused: list[str] = []
        self._upstream = requests.Session()
        self._upstream.trust_env = False
        super().__init__()

    def stop(self) -> None:
        super().stop()
        self._upstream.close()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        owner = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _forward(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                refuse = (self.command == "REPORT" and b"sync-collection" in body) or (
                    owner.refuse_listing and self.command == "PROPFIND"
                    and self.headers.get("Depth") == "1")
                if refuse:
                    owner.refused.append(self.command)
                    return self._send(403, owner.REFUSAL, {"Content-Type": "application/xml"})
                headers = {k: v for k, v in self.headers.items()
                           if k.lower() not in ("host", "content-length", "accept-encoding")}
                answer = owner._upstream.request(self.command, owner.target + self.path,
                                                 data=body, headers=headers, timeout=30)
                kept = {k: v for k, v in answer.headers.items()
                        if k.lower() not in ("content-length", "content-encoding",
                                             "transfer-encoding", "connection")}
                self._send(answer.status_code, answer.content, kept)

            def _send(self, status: int, body: bytes, headers: dict[str, str]) -> None:
                self.send_response(status)
                for name, value in headers.items():
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_PUT = do_DELETE = do_PROPFIND = do_REPORT = do_OPTIONS = _forward

        return Handler
