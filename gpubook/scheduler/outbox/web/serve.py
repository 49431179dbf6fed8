"""Serving the page with waitress in a thread of its own: the daemon's (`[web] enabled`, the last
Status from memory) or `gpubook web`'s (the status file the daemon writes, read again when it
changes). Starting refuses settings that would show the page to the network without a login."""

from __future__ import annotations

import functools
import json
import logging
import threading
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from waitress import wasyncore
from waitress.server import create_server

from gpubook.runtime.errors import ConfigError
from gpubook.runtime.nvidia import nvml
from gpubook.scheduler import clock
from gpubook.scheduler.outbox import report
from gpubook.scheduler.outbox.status import Status
from gpubook.scheduler.outbox.web import live
from gpubook.scheduler.outbox.web.app import create_app
from gpubook.scheduler.outbox.web.book_route import Booker
from gpubook.scheduler.outbox.web.directory_login import login_names
from gpubook.scheduler.outbox.web.settings import web_problem
from gpubook.scheduler.settings import Config
from gpubook.scheduler.state import State

if TYPE_CHECKING:
    from _typeshed.wsgi import WSGIApplication

log = logging.getLogger(__name__)


class StatusFile:
    """The daemon's status file, parsed again only when its modification time changes."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._seen: tuple[int, Status | None] = (-1, None)
        self._lock = threading.Lock()

    def __call__(self) -> Status | None:
        try:
            stamp = self.path.stat().st_mtime_ns
        except OSError:
            return None
        with self._lock:
            if stamp != self._seen[0]:
                try:
                    self._seen = (stamp, Status.from_json(json.loads(self.path.read_text())))
                except (OSError, ValueError, KeyError, TypeError) as error:  # half-written or from another version
                    log.warning("web: status file %s cannot be read (%s); showing the last one read", self.path, error)
            return self._seen[1]


@dataclass
class WebServer:
    """The page being served: `address` as bound (port 0 in the config: one chosen), `stop()`."""

    server: object
    thread: threading.Thread
    address: str

    def stop(self) -> None:
        """Close every socket from the server's own thread (closed from here, its select() would
        meet a closed descriptor), wait for it, then end the worker threads."""
        server: Any = self.server
        if self.thread.is_alive():
            try:
                server.trigger.pull_trigger(lambda: wasyncore.close_all(server._map))
            except OSError as error:  # its trigger already closed: the loop has ended or is ending
                log.warning("status page: stopping it found its wake-up pipe closed (%s)", error)
                wasyncore.close_all(server._map)
            self.thread.join(timeout=10)
        server.task_dispatcher.shutdown()


def _usage(state: State, *, host_name: str) -> Callable[[datetime, datetime, str], dict[str, Any]]:
    def usage(start: datetime, end: datetime, by: str) -> dict[str, Any]:
        built = report.build(state, start=start, end=end, now=clock.now(), by=by, host_name=host_name)
        return report.to_json(built, host_name=host_name)

    return usage


def start(config: Config, *, status: Callable[[], Status | None],
          mounts: Mapping[str, WSGIApplication] | None = None, gpus: nvml.CachedView | None = None,
          state: State | None = None, members: Callable[[], Collection[str]] | None = None,
          book: Booker | None = None, templates: Callable[[], list[str]] = list) -> WebServer:
    """Serve the page on [web] listen in a daemon thread; ConfigError when it must not start.
    `gpus`: the live NVML view to show (the daemon passes the one its metrics read; else its own);
    `state`: the daemon's State, whose report /api/usage serves (None: not served); `members`:
    gpubook's users now, the names auth "ldap" lets log in (default: those of `config`); `book`: the
    daemon's desk for the page's user, with the `templates` it offers (None: no booking forms)."""
    web = config.web
    if problem := web_problem(web):
        raise ConfigError(problem)
    app = create_app(status=status, web=web, host_name=config.host.name,
                     live=functools.partial(live.of, gpus or nvml.CachedView()), mounts=mounts,
                     stale_after=timedelta(seconds=max(300.0, 3 * config.daemon.poll_seconds)),
                     usage=_usage(state, host_name=config.host.name) if state is not None else None,
                     timezone=config.host.timezone, directory=config.directory,
                     members=members or (lambda: login_names(config)), book=book, templates=templates,
                     booker_names=lambda: set(config.users))
    host, _, port = web.listen.rpartition(":")
    try:
        # threads=4: a few browsers at once; the page is small. No trusted_proxy: REMOTE_ADDR stays the
        # peer's own address, which auth "header" checks against trusted_proxies.
        server = create_server(app, host=host.strip("[]"), port=int(port), threads=4, ident="gpubook")
    except OSError as error:
        raise ConfigError(f"[web] listen = \"{web.listen}\": cannot listen there: {error.strerror}") from None
    bound = f"{host}:{server.effective_port}"  # type: ignore[union-attr]
    thread = threading.Thread(target=server.run, name="gpubook-web", daemon=True)
    thread.start()
    log.warning("status page on http://%s/ (auth %s)", bound, web.auth)
    return WebServer(server=server, thread=thread, address=bound)
