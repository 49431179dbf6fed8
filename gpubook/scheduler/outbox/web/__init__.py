"""The read-only status web page (Flask + Jinja2, served by waitress): app.py the app, page.py what
one viewer sees, access.py who may see it, live.py NVML's reading, serve.py the server thread.
Imported only where the page is served (Flask stays out of a daemon that does not serve it):
`serve_daemon_page` imports them only when [web] enabled."""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Mapping
from typing import TYPE_CHECKING, Any

from gpubook import extras
from gpubook.runtime.errors import GpubookError

if TYPE_CHECKING:
    from gpubook.runtime.nvidia import nvml
    from gpubook.scheduler.config import Config
    from gpubook.scheduler.outbox.metrics import Metrics
    from gpubook.scheduler.outbox.status import Status
    from gpubook.scheduler.outbox.web.serve import WebServer
    from gpubook.scheduler.state import State

log = logging.getLogger(__name__)


def serve_daemon_page(config: Config, *, status: Callable[[], Status | None], metrics: Metrics,
                      gpus: nvml.CachedView, event: Callable[[str], None], state: State | None = None,
                      members: Callable[[], Collection[str]] | None = None,
                      book: Callable[[Mapping[str, Any], str], dict[str, Any]] | None = None,
                      templates: Callable[[], list[str]] = list) -> WebServer | None:
    """The daemon's page, when [web] enabled (with /metrics when [web] metrics). A page that cannot
    start costs the page, never the bookings: said in the log and through `event`, and None.
    `members`: gpubook's users now (the directory is read again while the page runs); `book`: the
    desk for the page's booking forms, with the `templates` they offer (web/book_route.py)."""
    if not config.web.enabled:
        return None
    try:
        extras.require("web")
    except extras.MissingExtra as error:
        _not_started(error, event)
        return None
    from gpubook.scheduler.outbox import metrics as metrics_module
    from gpubook.scheduler.outbox.web import serve

    try:
        mounts = {"/metrics": metrics_module.wsgi_app(metrics)} if config.web.metrics else None
        return serve.start(config, status=status, mounts=mounts, gpus=gpus, state=state, members=members,
                           book=book, templates=templates)
    except GpubookError as error:
        _not_started(error, event)
        return None


def _not_started(error: Exception, event: Callable[[str], None]) -> None:
    log.error("the status page does not start: %s", error)
    event(f"the status page does not start: {error}")
