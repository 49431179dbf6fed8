"""The notices' servers (tests/kits/notify_kit.py) as fixtures: started for a test, stopped after it."""

from __future__ import annotations

import socketserver
import threading
from collections.abc import Iterator
from http.server import HTTPServer

import pytest

from tests.kits.notify_kit import HookHandler, SmtpHandler


@pytest.fixture
def smtp_server() -> Iterator[socketserver.ThreadingTCPServer]:
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), SmtpHandler)
    server.received = []  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture
def hook_server() -> Iterator[HTTPServer]:
    server = HTTPServer(("127.0.0.1", 0), HookHandler)
    server.received = []  # type: ignore[attr-defined]
    server.answer = 204  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()
