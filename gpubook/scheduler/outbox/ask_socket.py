"""The daemon's local socket for `gpubook free`, `bookings` and `mine`: any account on the server
asks, with no config and no secret, and gets the view its host login may see (outbox/asking.py).

- **Where**: the abstract Unix socket `@gpubook-ask-UID` (UID: the daemon's account), in the host's
  network namespace. It has no file, so no folder's mode decides who reaches it: every account may
  connect, and what it gets depends only on who it is.
- **Who asks**: the kernel's peer credentials of the connection (SO_PEERCRED), never anything the
  request says. The uid's login is the gpubook user whose `[users.NAME] account` (default: NAME)
  it is; any other account sees busy time only. The daemon's own uid is no one special here (the
  root of a rootless container is the daemon's uid on the host): the admin reads the status file.
- **Whom to believe**: an abstract name can be bound first by anyone. The client knows the
  daemon's account on its own (`--daemon-account`, $GPUBOOK_DAEMON_ACCOUNT, else the owner of the
  installed gpubook, else the account `gpubook`) and believes an answer only from a server whose
  peer uid is that account's. A squatter holding the name is refused by every client, and the
  daemon says in its log who holds it and binds it as soon as it is free.
- **Bounds**: a request is one JSON line of at most MAX_REQUEST bytes, read within READ_SECONDS;
  at most MAX_CONNECTIONS served at once, MAX_PER_UID of one account, each on its own thread
  apart from the passes; an answer is written within WRITE_SECONDS or dropped. The request
  names only what to ask (kind, and gpus, hours, days, model, from, to; for `book`, `extend`, `end`
  and `cancel` also at, template, title, id, by, as: outbox/desk.py): nothing of it reaches a shell
  or a file name.
"""

from __future__ import annotations

import json
import logging
import os
import pwd
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

PREFIX = "gpubook-ask-"
MAX_REQUEST = 4096  # bytes of one request line
MAX_ANSWER = 16 * 1024 * 1024  # bytes of one answer a client reads
READ_SECONDS = 2.0  # a request must arrive whole within this
WRITE_SECONDS = 5.0  # an answer must be taken within this
MAX_CONNECTIONS = 8
MAX_PER_UID = 2
RETRY_BIND_SECONDS = 30.0
_CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def address(uid: int) -> str:
    """The abstract socket name of the daemon of account `uid`."""
    return f"\0{PREFIX}{uid}"


@dataclass(frozen=True)
class Peer:
    pid: int
    uid: int
    gid: int

    @property
    def login(self) -> str | None:
        try:
            return pwd.getpwuid(self.uid).pw_name
        except KeyError:
            return None


def peer(connection: socket.socket) -> Peer:
    """The kernel's credentials of the process at the other end (as they were at connect/listen)."""
    pid, uid, gid = _CRED.unpack(connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))
    return Peer(pid=pid, uid=uid, gid=gid)


Answerer = Callable[[Mapping[str, Any], Peer], dict[str, Any]]


class AskServer:
    """The listening socket and its threads. `answerer(request, peer)` gives the answer (or raises
    ValueError with the sentence to answer); it runs on a connection's thread, never a pass's."""

    def __init__(self, answerer: Answerer, *, uid: int | None = None, event: Callable[[str], None] | None = None
                 ) -> None:
        self.answerer = answerer
        self.uid = os.getuid() if uid is None else uid
        self.event = event or (lambda line: None)
        self._stop = threading.Event()
        self._listener: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._per_uid: dict[int, int] = {}
        self._lock = threading.Lock()
        self._said_taken: int | None = None  # the squatter's uid, said once
        # The accept loop sleeps in the kernel until a connection comes or `stop` writes here: an
        # idle daemon is not woken to look at a flag (as it was twice a second).
        self._wake_read, self._wake_write = socket.socketpair()

    def start(self) -> AskServer:
        self._thread = threading.Thread(target=self._run, name="gpubook-ask", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        try:
            self._wake_write.send(b"\0")
        except OSError:
            pass  # stopped before
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._listener is not None:
            self._listener.close()
        self._wake_read.close()
        self._wake_write.close()

    @property
    def listening(self) -> bool:
        return self._listener is not None

    def _bind(self) -> socket.socket | None:
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(address(self.uid))
        except OSError:
            listener.close()
            self._taken()
            return None
        listener.listen(16)
        listener.setblocking(False)  # accepted when the selector says one waits (`_run`)
        if self._said_taken is not None:
            log.warning("the ask socket @%s%d is ours again", PREFIX, self.uid)
        self._said_taken = None
        return listener

    def _taken(self) -> None:
        """The name is held: say once by whom (another account squatting it: nobody believes it)."""
        holder = None
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
                probe.settimeout(1.0)
                probe.connect(address(self.uid))
                holder = peer(probe)
        except OSError:
            pass
        who = f"uid {holder.uid} (pid {holder.pid})" if holder is not None else "another process"
        if self._said_taken != (holder.uid if holder else -1):
            self._said_taken = holder.uid if holder else -1
            message = (f"the ask socket @{PREFIX}{self.uid} is held by {who}: `gpubook free`, `bookings` and "
                       f"`mine` refuse it and cannot reach this daemon; trying again every "
                       f"{RETRY_BIND_SECONDS:g} s")
            log.warning("%s", message)
            self.event(message)

    def _run(self) -> None:
        with selectors.DefaultSelector() as selector:
            selector.register(self._wake_read, selectors.EVENT_READ)
            while not self._stop.is_set():
                if self._listener is None:
                    self._listener = self._bind()
                    if self._listener is None:
                        selector.select(RETRY_BIND_SECONDS)  # or woken by `stop`
                        continue
                    selector.register(self._listener, selectors.EVENT_READ)
                if any(key.fileobj is self._listener for key, _ in selector.select()):
                    self._accept(self._listener)

    def _accept(self, listener: socket.socket) -> None:
        """Every connection waiting, each admitted or answered busy (none: nothing more waits)."""
        while True:
            try:
                connection, _ = listener.accept()
            except BlockingIOError:
                return
            except OSError as error:
                log.warning("the ask socket: accept failed: %s", error)
                self._stop.wait(0.5)
                return
            connection.setblocking(True)  # the connection's own timeouts bound it (`_serve`)
            self._admit(connection)

    def _admit(self, connection: socket.socket) -> None:
        try:
            who = peer(connection)
        except OSError:
            connection.close()
            return
        with self._lock:
            if self._per_uid.get(who.uid, 0) >= MAX_PER_UID or not self._slots.acquire(blocking=False):
                busy = True
            else:
                busy = False
                self._per_uid[who.uid] = self._per_uid.get(who.uid, 0) + 1
        if busy:
            _send(connection, {"error": "the daemon is answering other requests; ask again in a moment"}, seconds=0.2)
            connection.close()
            return
        threading.Thread(target=self._serve, args=(connection, who), name="gpubook-ask-conn", daemon=True).start()

    def _serve(self, connection: socket.socket, who: Peer) -> None:
        try:
            try:
                request = _read_request(connection)
                answer = self.answerer(request, who)
            except ValueError as error:
                answer = {"error": str(error)}
            except Exception:  # a defect costs this answer, never the daemon
                log.exception("the ask socket: answering uid %d failed", who.uid)
                answer = {"error": "the daemon could not answer (a defect: see its log)"}
            _send(connection, answer)
        finally:
            connection.close()
            with self._lock:
                self._per_uid[who.uid] -= 1
                if not self._per_uid[who.uid]:
                    del self._per_uid[who.uid]
                self._slots.release()


def _read_request(connection: socket.socket) -> dict[str, Any]:
    """One JSON object on one line, whole within READ_SECONDS and MAX_REQUEST bytes."""
    deadline = time.monotonic() + READ_SECONDS
    data = b""
    while b"\n" not in data:
        left = deadline - time.monotonic()
        if left <= 0:
            raise ValueError(f"the request did not arrive within {READ_SECONDS:g} s")
        connection.settimeout(left)
        try:
            chunk = connection.recv(MAX_REQUEST + 1 - len(data))
        except TimeoutError:
            raise ValueError(f"the request did not arrive within {READ_SECONDS:g} s") from None
        if not chunk:
            break
        data += chunk
        if len(data) > MAX_REQUEST and b"\n" not in data[:MAX_REQUEST]:
            raise ValueError(f"the request is longer than {MAX_REQUEST} bytes")
    line = data.split(b"\n", 1)[0]
    try:
        request = json.loads(line)
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise ValueError("the request is not one JSON object on one line") from None
    if not isinstance(request, dict):
        raise ValueError("the request is not one JSON object on one line")
    return request


def _send(connection: socket.socket, answer: Mapping[str, Any], *, seconds: float = WRITE_SECONDS) -> None:
    try:
        connection.settimeout(seconds)
        connection.sendall(json.dumps(answer).encode() + b"\n")
    except OSError as error:
        log.info("the ask socket: an answer was not taken: %s", error)


class NotBelieved(Exception):
    """The socket's server is not the daemon's account (a squatter)."""


class NoDaemon(Exception):
    """Nothing listens on the daemon's socket."""


def ask(request: Mapping[str, Any], *, uid: int, timeout: float = 60.0) -> dict[str, Any]:
    """The daemon of account `uid`'s answer to `request`. NoDaemon when nothing listens; NotBelieved
    when the server's peer uid is not `uid` (then nothing is sent to it, nothing read from it)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
        connection.settimeout(timeout)
        try:
            connection.connect(address(uid))
        except (ConnectionRefusedError, FileNotFoundError):
            raise NoDaemon() from None
        server = peer(connection)
        if server.uid != uid:
            raise NotBelieved(server.uid, server.pid)
        connection.sendall(json.dumps(dict(request)).encode() + b"\n")
        data = b""
        deadline = time.monotonic() + timeout
        while not data.endswith(b"\n"):
            connection.settimeout(max(0.1, deadline - time.monotonic()))
            chunk = connection.recv(65536)
            if not chunk:
                break
            data += chunk
            if len(data) > MAX_ANSWER:
                raise ValueError(f"the daemon's answer is longer than {MAX_ANSWER} bytes")
    answer = json.loads(data) if data else {"error": "the daemon closed the connection without an answer"}
    if not isinstance(answer, dict):
        raise ValueError("the daemon's answer is not a JSON object")
    return answer
