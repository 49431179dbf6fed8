"""The page's availability calendar: `/free.ics` (every GPU of the host) and `/free/<model>.ics`
(one GPU model's, where NVML names the models), behind the page's own access rules
(web/access.py): the same login, and names only as outbox/free_feed.py gives them."""

from __future__ import annotations

import threading
from datetime import datetime

from flask import Response

from gpubook.scheduler import clock
from gpubook.scheduler.core.plan import LOCAL
from gpubook.scheduler.outbox import free_feed
from gpubook.scheduler.outbox.status import Status
from gpubook.scheduler.outbox.web.live import LiveGpus

MEDIA_TYPE = "text/calendar"  # Flask adds "; charset=utf-8"
KEPT = 64  # feeds remembered (per status, viewer and model)


class FreeFeeds:
    """One page's feeds. Each is built once per status (its `updated` time), viewer and model:
    every subscriber's client fetches every few minutes, and a thousand bookings take about 0.1 s
    to write out."""

    def __init__(self) -> None:
        self._built: dict[tuple[str, str | None, str], bytes] = {}
        self._lock = threading.Lock()

    def answer(self, status: Status | None, *, model: str, viewer: str | None, host_name: str,
               live: LiveGpus | None) -> Response:
        """The feed, or 404 with one sentence naming the models there are."""
        names = {gpu.index: gpu.name for gpu in live.gpus} if live is not None else {}
        models = free_feed.model_gpus(names)
        if model and model not in models:
            known = ", ".join(f"/free/{name}.ics" for name in sorted(models)) or "none: NVML names no GPU model here"
            return Response(f"there is no GPU model {model!r} on {host_name} (feeds per model: {known})\n",
                            status=404, mimetype="text/plain")
        key = (status.updated or "", viewer, model) if status is not None else None
        with self._lock:
            body = self._built.get(key) if key is not None else None
        if body is None:
            found = free_feed.blocks_of(status)
            if model:
                found = free_feed.only_gpus(found, models[model], host=LOCAL)
            name = next((text for text in names.values() if free_feed.slug(text) == model), "") if model else ""
            body = free_feed.feed(found, host_name=host_name, viewer=viewer, now=_updated(status), model=name)
            with self._lock:
                if len(self._built) >= KEPT:
                    self._built.clear()
                if key is not None:
                    self._built[key] = body
        response = Response(body, mimetype=MEDIA_TYPE)
        # A viewer's own name may be in it: kept by their client, by no shared cache.
        response.headers["Cache-Control"] = "private, max-age=60"
        return response


def _updated(status: Status | None) -> datetime:
    """DTSTAMP: when the daemon wrote the status (the feed's data is that old)."""
    if status is not None and status.updated:
        return datetime.fromisoformat(status.updated)
    return clock.now()
