"""The page's availability calendar: `/free.ics` (every GPU of the host) and `/free/<model>.ics`
(one GPU model's, where NVML names the models), behind the page's own access rules
(web/access.py): the same login, and names only as outbox/free_feed.py gives them."""

from __future__ import annotations

from datetime import UTC, datetime

from flask import Response

from gpubook.scheduler.core.plan import LOCAL
from gpubook.scheduler.outbox import free_feed
from gpubook.scheduler.outbox.status import Status
from gpubook.scheduler.outbox.web.live import LiveGpus

MEDIA_TYPE = "text/calendar"  # Flask adds "; charset=utf-8"


def answer(status: Status | None, *, model: str, viewer: str | None, host_name: str,
           live: LiveGpus | None) -> Response:
    """The feed, or 404 with one sentence naming the models there are."""
    found = free_feed.blocks_of(status)
    name = ""
    if model:
        models = free_feed.model_gpus({gpu.index: gpu.name for gpu in live.gpus} if live is not None else {})
        if model not in models:
            known = ", ".join(f"/free/{name}.ics" for name in sorted(models)) or "none: NVML names no GPU model here"
            return Response(f"there is no GPU model {model!r} on {host_name} (feeds per model: {known})\n",
                            status=404, mimetype="text/plain")
        found = free_feed.only_gpus(found, models[model], host=LOCAL)
        name = next(gpu.name for gpu in live.gpus if free_feed.slug(gpu.name) == model) if live else model
    body = free_feed.feed(found, host_name=host_name, viewer=viewer, now=_updated(status), model=name)
    response = Response(body, mimetype=MEDIA_TYPE)
    # A viewer's own name may be in it: kept by their client, by no shared cache.
    response.headers["Cache-Control"] = "private, max-age=60"
    return response


def _updated(status: Status | None) -> datetime:
    """DTSTAMP: when the daemon wrote the status (the feed's data is that old)."""
    if status is not None and status.updated:
        return datetime.fromisoformat(status.updated)
    return datetime.now(UTC)
