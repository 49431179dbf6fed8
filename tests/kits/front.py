"""Fronts for a real calendar server.

`CountingFront`: every request is passed on unchanged, counted (by method, with the moment it came)
and, where asked, answered `delay` seconds late (what a large calendar costs the server per
request). For the change check's tests and bench/book_now.py.

`FaultFront`: a CountingFront that can be made to fail the way a calendar server fails, until
lifted: answering 500s, hanging mid-answer, refusing connections, or partitioned. For the fault
harness (issue 26) and tests/test_fault_front.py.
"""

from __future__ import annotations

import contextlib
import errno
import select
import socket
import threading
import time
from collections.abc import Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import requests

from tests.kits.servers import _ThreadedHTTP

# Headers of the server's answer that the front sets itself (its body is passed on whole, unencoded).
_HOP_HEADERS = ("content-length", "content-encoding", "transfer-encoding", "connection")


class CountingFront(_ThreadedHTTP):
    """`base_url` + the path of the server's calendar reaches that calendar through the front."""

    def __init__(self, target: str, *, delay: float = 0.0) -> None:
        self.target = target.rstrip("/")
        self.delay = delay
        self.seen: list[tuple[float, str, bytes]] = []  # (time.monotonic(), method, body) of each request
        self.lose_once: set[str] = set()  # paths whose next GET is answered 404 (a listing ahead of its GET)
        self._lock = threading.Lock()
        self._upstream = requests.Session()
        self._upstream.trust_env = False
        super().__init__()

    def stop(self) -> None:
        super().stop()
        self._upstream.close()

    def requests(self, *, since: float = 0.0, method: str | None = None) -> list[tuple[float, str, bytes]]:
        with self._lock:
            return [r for r in self.seen if r[0] >= since and (method is None or r[1] == method)]

    def _respond(self, handler: BaseHTTPRequestHandler, body: bytes) -> None:
        """Answer one request (its `body` already read and counted)."""
        with self._lock:
            lost = handler.command == "GET" and handler.path in self.lose_once
            if lost:
                self.lose_once.discard(handler.path)
        if lost:
            self._send(handler, 404, {}, b"")
            return
        if self.delay:
            time.sleep(self.delay)
        self._send(handler, *self._fetch(handler, body))

    def _fetch(self, handler: BaseHTTPRequestHandler, body: bytes) -> tuple[int, dict[str, str], bytes]:
        """The server's answer to this request: status, the headers passed on, body."""
        headers = {k: v for k, v in handler.headers.items()
                   if k.lower() not in ("host", "content-length", "accept-encoding")}
        answer = self._upstream.request(handler.command, self.target + handler.path,
                                        data=body, headers=headers, timeout=30)
        kept = {k: v for k, v in answer.headers.items() if k.lower() not in _HOP_HEADERS}
        return answer.status_code, kept, answer.content

    def _send(self, handler: BaseHTTPRequestHandler, status: int, headers: Mapping[str, str],
              content: bytes) -> None:
        handler.send_response(status)
        for name, value in headers.items():
            handler.send_header(name, value)
        handler.send_header("Content-Length", str(len(content)))
        handler.end_headers()
        handler.wfile.write(content)

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        owner = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _forward(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                with owner._lock:
                    owner.seen.append((time.monotonic(), self.command, body))
                try:
                    owner._respond(self, body)
                except OSError:  # the client gave up, or a FaultFront dropped the connection
                    self.close_connection = True

            do_GET = do_PUT = do_DELETE = do_PROPFIND = do_REPORT = do_OPTIONS = _forward

        return Handler


FAULTS = ("error", "hang", "refuse", "partition")
HOLD_POLL = 0.1  # seconds between a held handler's looks at whether its client is still there
REOPEN_SECONDS = 10.0  # how long lift() retries binding the port again after "refuse"


class FaultFront(CountingFront):
    """A CountingFront that fails on demand. `fault(kind)` until `lift()`, kind one of:

    - "error": every request answered 500, never passed on;
    - "hang": the request is passed on (the server does its work: a PUT is stored), then the
      answer's status line and headers are sent (chunked) with half its body, and the rest never
      comes: a server stuck mid-answer, until lifted or the client gives up;
    - "refuse": the listening socket closed, open connections dropped: connections are refused
      until lift() listens on the same port again;
    - "partition": connections accepted and requests read, nothing ever answered; open keep-alive
      connections go silent too (an answer on its way from the server is held as well).

    At lift every held connection is dropped (its client sees the connection closed) and lift
    returns once every held handler thread has let go. `fault` during a fault lifts that one first.
    Thread-safe. `hits()`: (time.monotonic(), kind, "METHOD path") of each request a fault met.
    """

    def __init__(self, target: str, *, delay: float = 0.0) -> None:
        self._kind: str | None = None
        self._lifted = threading.Event()
        self._changing = threading.Lock()  # one fault() / lift() / stop() at a time
        self._released = threading.Condition()  # notified as held handlers let go
        self._holding = 0
        self._connections: set[socket.socket] = set()
        self._hits: list[tuple[float, str, str]] = []
        self._serving = False
        super().__init__(target, delay=delay)
        self._server.block_on_close = False  # stop() drops the connections itself
        self._port = self._server.server_address[1]

    @property
    def kind(self) -> str | None:
        """The fault in force, or None."""
        with self._lock:
            return self._kind

    @property
    def holding(self) -> int:
        """How many handler threads hold a connection unanswered now."""
        with self._released:
            return self._holding

    def hits(self, kind: str | None = None) -> list[tuple[float, str, str]]:
        with self._lock:
            return [h for h in self._hits if kind is None or h[1] == kind]

    def start(self) -> FaultFront:
        super().start()
        self._serving = True
        return self

    def fault(self, kind: str) -> None:
        if kind not in FAULTS:
            raise ValueError(f"fault kind {kind!r} is not one of {', '.join(FAULTS)}")
        with self._changing:
            self._lift_now()
            with self._lock:
                self._kind, self._lifted = kind, threading.Event()
            if kind == "refuse":
                self._close_listener()
                self._drop_connections()

    def lift(self, *, timeout: float = 10.0) -> None:
        """End the fault; held connections are dropped, and a refused port listens again."""
        with self._changing:
            self._lift_now(timeout=timeout)

    def stop(self) -> None:
        with self._changing:
            with self._lock:
                self._kind = None
                self._lifted.set()
            self._drop_connections()
            if self._serving:
                self._serving = False
                super().stop()
            else:
                self._upstream.close()

    def _lift_now(self, *, timeout: float = 10.0) -> None:
        with self._lock:
            kind, self._kind = self._kind, None
            self._lifted.set()
        if kind == "refuse":
            self._reopen()
        with self._released:
            if not self._released.wait_for(lambda: self._holding == 0, timeout=timeout):
                raise RuntimeError(f"fault front: {self._holding} held connections not let go "
                                   f"within {timeout} s of lifting {kind!r}")

    def _close_listener(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._serving = False

    def _reopen(self) -> None:
        """Listen on the same port again (a connection of this host may have taken it meanwhile)."""
        handler = self._server.RequestHandlerClass
        deadline = time.monotonic() + REOPEN_SECONDS
        while True:
            try:
                server = ThreadingHTTPServer(("127.0.0.1", self._port), handler)
                break
            except OSError as error:
                if error.errno != errno.EADDRINUSE or time.monotonic() > deadline:
                    raise RuntimeError(f"fault front: port {self._port} cannot listen again: {error}") from None
                time.sleep(0.1)
        server.daemon_threads = True
        server.block_on_close = False
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, daemon=True)
        self._thread.start()
        self._serving = True

    def _drop_connections(self) -> None:
        with self._lock:
            connections = list(self._connections)
        for connection in connections:
            _drop(connection)

    def _respond(self, handler: BaseHTTPRequestHandler, body: bytes) -> None:
        with self._lock:
            kind, lifted = self._kind, self._lifted
            if kind is not None:
                self._hits.append((time.monotonic(), kind, f"{handler.command} {handler.path}"))
        if kind is None:
            super()._respond(handler, body)
        elif kind == "error":
            CountingFront._send(self, handler, 500, {"Content-Type": "text/plain"}, b"fault front: error\n")
        elif kind == "hang":
            self._hang(handler, *self._fetch(handler, body), lifted=lifted)
        elif kind == "partition":
            self._hold(handler, lifted)
        else:  # "refuse": a request that slipped in as the listener closed meets a dropped connection
            handler.close_connection = True
            _drop(handler.connection)

    def _send(self, handler: BaseHTTPRequestHandler, status: int, headers: Mapping[str, str],
              content: bytes) -> None:
        with self._lock:
            kind, lifted = self._kind, self._lifted
        if kind == "partition":  # the answer came back from the server after the partition began
            self._hold(handler, lifted)
            return
        super()._send(handler, status, headers, content)

    def _hang(self, handler: BaseHTTPRequestHandler, status: int, headers: Mapping[str, str],
              content: bytes, *, lifted: threading.Event) -> None:
        handler.send_response(status)
        for name, value in headers.items():
            handler.send_header(name, value)
        handler.send_header("Transfer-Encoding", "chunked")  # an answer whose end never comes
        handler.end_headers()
        half = content[: len(content) // 2]
        if half:
            handler.wfile.write(b"%x\r\n%s\r\n" % (len(half), half))
        handler.wfile.flush()
        self._hold(handler, lifted)

    def _hold(self, handler: BaseHTTPRequestHandler, lifted: threading.Event) -> None:
        """Answer nothing more until the fault is lifted or the client gives up; then drop the
        connection."""
        with self._released:
            self._holding += 1
        try:
            while not lifted.wait(HOLD_POLL) and not _client_gone(handler.connection):
                pass
        finally:
            handler.close_connection = True
            _drop(handler.connection)
            with self._released:
                self._holding -= 1
                self._released.notify_all()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        owner = self
        base = super()._handler()

        class Handler(base):  # type: ignore[valid-type,misc]
            def setup(self) -> None:
                super().setup()
                with owner._lock:
                    owner._connections.add(self.connection)

            def finish(self) -> None:
                with owner._lock:
                    owner._connections.discard(self.connection)
                with contextlib.suppress(OSError):
                    super().finish()

        return Handler


def _client_gone(connection: socket.socket) -> bool:
    """Whether the client closed its end (a read would see the end of the stream)."""
    try:
        readable, _, _ = select.select([connection], [], [], 0)
        if not readable:
            return False
        return connection.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except (OSError, ValueError):  # reset, or already closed here
        return True


def _drop(connection: socket.socket) -> None:
    with contextlib.suppress(OSError):
        connection.shutdown(socket.SHUT_RDWR)
