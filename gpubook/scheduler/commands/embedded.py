"""An embedded Radicale on loopback, for `gpubook demo` (and the tests' calendar fixtures).

It runs as a child process with its own temporary storage and no authentication, listens on
127.0.0.1 only, and is stopped (and its storage removed) when the context ends.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType

import niquests

from gpubook.runtime.errors import GpubookError


def end_process(process: subprocess.Popen[bytes], *, timeout: float) -> int:
    """SIGTERM, `timeout` seconds to exit, then SIGKILL; the exit status. Nothing if it has exited."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    return process.returncode


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class RadicaleServer:
    """`with RadicaleServer() as server: server.url` — a throw-away CalDAV server."""

    def __init__(self, *, storage: Path | None = None, port: int | None = None,
                 start_timeout: float = 20.0) -> None:
        self._temporary = None if storage else tempfile.TemporaryDirectory(prefix="gpubook-radicale-")
        self.storage = storage or Path(self._temporary.name)  # type: ignore[union-attr]
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}/"
        self._start_timeout = start_timeout
        self._process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> RadicaleServer:
        argv = [sys.executable, "-m", "radicale", "--auth-type", "none",
                "--storage-filesystem-folder", str(self.storage / "collections"),
                "--server-hosts", f"127.0.0.1:{self.port}", "--logging-level", "warning"]
        self._process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + self._start_timeout
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                error = self._process.stderr.read().decode(errors="replace") if self._process.stderr else ""
                raise GpubookError(f"Radicale did not start: {error.strip()[-500:] or 'it exited'}")
            try:
                niquests.get(self.url, timeout=1)
                return self
            except niquests.ConnectionError:
                time.sleep(0.05)
        self.__exit__(None, None, None)
        raise GpubookError(f"Radicale did not answer on {self.url} within {self._start_timeout:.0f} s")

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        if self._process is not None:
            end_process(self._process, timeout=10)
            if self._process.stderr:
                self._process.stderr.close()
            self._process = None
        if self._temporary is not None:
            self._temporary.cleanup()
