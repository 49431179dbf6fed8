"""A front for a real calendar server: every request is passed on unchanged, counted (by method, with
the moment it came) and, where asked, answered `delay` seconds late (what a large calendar costs
the server per request). For the change check's tests and bench/book_now.py."""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler

import requests

from tests.kits.servers import _ThreadedHTTP


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
                    lost = self.command == "GET" and self.path in owner.lose_once
                    if lost:
                        owner.lose_once.discard(self.path)
                if lost:
                    self.send_response(404)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                if owner.delay:
                    time.sleep(owner.delay)
                headers = {k: v for k, v in self.headers.items()
                           if k.lower() not in ("host", "content-length", "accept-encoding")}
                answer = owner._upstream.request(self.command, owner.target + self.path,
                                                 data=body, headers=headers, timeout=30)
                kept = {k: v for k, v in answer.headers.items()
                        if k.lower() not in ("content-length", "content-encoding", "transfer-encoding",
                                             "connection")}
                self.send_response(answer.status_code)
                for name, value in kept.items():
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(answer.content)))
                self.end_headers()
                self.wfile.write(answer.content)

            do_GET = do_PUT = do_DELETE = do_PROPFIND = do_REPORT = do_OPTIONS = _forward

        return Handler
