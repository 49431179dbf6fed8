"""A tiny sd_notify(3) client: tell systemd READY=1, WATCHDOG=1, EXTEND_TIMEOUT_USEC and a STATUS line.

The protocol is one datagram of newline-separated `KEY=value` lines sent to the AF_UNIX socket
named in $NOTIFY_SOCKET (a path, or a name in the abstract namespace when it starts with '@').
Outside systemd the variable is unset and every call is a no-op that returns False, so the daemon
calls these unconditionally.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping

log = logging.getLogger(__name__)


class Notifier:
    """`Notifier.from_environment()` under systemd; `Notifier(None)` where there is no manager."""

    def __init__(self, address: str | None, *, watchdog_usec: int | None = None) -> None:
        self.address = address
        self._watchdog_usec = watchdog_usec

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None) -> Notifier:
        """Read NOTIFY_SOCKET, WATCHDOG_USEC and WATCHDOG_PID (the watchdog is ours only when the
        PID is ours or unset). The variables are left in place: children never see them anyway,
        since containers are started with an explicit environment."""
        env = os.environ if environ is None else environ
        usec: int | None = None
        if env.get("WATCHDOG_USEC", "").isdigit() and env.get("WATCHDOG_PID", str(os.getpid())) == str(os.getpid()):
            usec = int(env["WATCHDOG_USEC"]) or None
        return cls(env.get("NOTIFY_SOCKET") or None, watchdog_usec=usec)

    @property
    def enabled(self) -> bool:
        return self.address is not None

    @property
    def watchdog_interval(self) -> float | None:
        """Seconds between WATCHDOG=1 pings: half the manager's WatchdogSec, as sd_watchdog_enabled(3) advises."""
        return None if self._watchdog_usec is None else self._watchdog_usec / 2_000_000

    def notify(self, **fields: str | int) -> bool:
        """Send `KEY=value` lines (`notify(READY=1, STATUS="...")`); True when the datagram went out."""
        if self.address is None:
            return False
        lines = []
        for key, value in fields.items():
            text = str(value)
            if "\n" in text:  # one field per line: a newline would forge another field
                text = " ".join(text.splitlines())
            lines.append(f"{key}={text}")
        return self._send("\n".join(lines).encode())

    def ready(self, status: str | None = None) -> bool:
        return self.notify(READY=1, **({"STATUS": status} if status else {}))

    def watchdog(self) -> bool:
        return self.notify(WATCHDOG=1)

    def status(self, text: str) -> bool:
        return self.notify(STATUS=text)

    def extend_timeout(self, seconds: float) -> bool:
        """EXTEND_TIMEOUT_USEC: the start (or stop) may take `seconds` more from now; sent again
        before they pass, it keeps a long start from meeting TimeoutStartSec."""
        return self.notify(EXTEND_TIMEOUT_USEC=int(seconds * 1_000_000))

    def extend_until(self, done: Callable[[], bool], *, woken: threading.Event, timeout: float = 120.0,
                     every: float = 5.0) -> bool:
        """Wait until `done()` (looked at when `woken` is set, else every `every` s), at most `timeout`
        s; whether it came. Meanwhile EXTEND_TIMEOUT_USEC, as sd_notify(3) provides for a start that
        takes long: systemd's start timeout (90 s by default) never ends a start that is still
        working, and one that hangs before this wait still meets it."""
        deadline = time.monotonic() + timeout
        while not done():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self.extend_timeout(3 * every)
            woken.wait(min(every, left))
        return True

    def reloading(self) -> bool:
        return self.notify(RELOADING=1)

    def stopping(self) -> bool:
        return self.notify(STOPPING=1)

    def _send(self, payload: bytes) -> bool:
        assert self.address is not None
        target = "\0" + self.address[1:] if self.address.startswith("@") else self.address
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
                sock.connect(target)
                sock.sendall(payload)
        except OSError as error:
            # systemd going away must never take the daemon with it; the watchdog will say so.
            log.warning("sd_notify to %s failed: %s", self.address, error)
            return False
        return True
