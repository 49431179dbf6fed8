"""One page for the lab's servers ([web] lab): this page's own data beside each other server's
`/api/status` (and `/api/usage` for the lab's month), fetched server-side and merged by host.

How the servers trust each other: one secret shared by the lab ([web] lab_secret_file) signs each
request, with the name of the viewer this page authenticated (lab_sign.py; access.py believes the
name only with a right signature, and the secret itself never travels). The other server then
answers as it would answer that viewer directly (the same ssh-line rule, the same refusals), so the
lab page never shows more than each server would.
No password leaves the page it was typed into, and no server needs another's address in its
trusted_proxies.

Each fetch: a few seconds' timeout, no redirect followed (the signed request would go with it), no proxy
from the environment, an answer of at most `ANSWER_LIMIT` bytes, JSON only. A server that fails is
one sentence on the page, never the page's failure. Answers are kept `CACHE_SECONDS` per viewer
(never shared between viewers: each one's ssh lines are their own).
"""

from __future__ import annotations

import json
import logging
import ssl
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as wait_all
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from urllib.parse import urlencode, urlsplit

from gpubook.runtime.errors import GpubookError
from gpubook.scheduler.outbox.report import merge_usage
from gpubook.scheduler.outbox.web.lab_sign import signed_headers

log = logging.getLogger(__name__)

TIMEOUT_SECONDS = 4.0  # each server's connect and each read; the whole fetch waits at most a second more
CACHE_SECONDS = 5.0
ANSWER_LIMIT = 4 * 1024 * 1024  # a 1000-booking fortnight's /api/status is about 400 kB
_CACHED = 256  # (viewer, what) entries kept at most


class LabFetchError(GpubookError):
    """One server of the lab could not be asked (one sentence)."""

    temporary = True


@dataclass(frozen=True)
class Answer:
    """One server's answer: its data, or the sentence saying why there is none."""

    server: str  # the address as configured
    data: Mapping[str, Any] | None
    problem: str | None = None

    @property
    def label(self) -> str:
        return server_label(self.server)


def server_label(url: str) -> str:
    """host[:port] of a configured address (the lab's URLs carry no credentials: settings checks)."""
    return urlsplit(url).netloc or url


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None  # urllib then raises the 3xx as an HTTPError, which names where it pointed


_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}), _NoRedirect(),
                                      urllib.request.HTTPSHandler(context=ssl.create_default_context()))


def _read_by(answer: Any, limit: int, *, deadline: float, where: str) -> bytes:
    """At most `limit` bytes of the answer, all of them by `deadline` (time.monotonic()): each read
    has the socket's timeout, and a peer sending a byte now and then would keep its fetch thread
    for as long as it liked (round 3, L3)."""
    chunks: list[bytes] = []
    size = 0
    while size < limit:
        if time.monotonic() > deadline:
            raise LabFetchError(f"{where} took too long to send its answer; not shown")
        chunk = answer.read1(min(65536, limit - size))
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)


def fetch_json(base: str, path: str, *, viewer: str | None, secret: str | None,
               timeout: float = TIMEOUT_SECONDS, limit: int = ANSWER_LIMIT) -> Any:
    """GET base+path as `viewer` (the lab secret with their name); LabFetchError naming the server."""
    where = server_label(base)
    headers = {"Accept": "application/json", "User-Agent": "gpubook-lab"}
    if secret:  # signed, never sent (lab_sign.py)
        headers.update(signed_headers(secret, target=path, viewer=viewer))
    request = urllib.request.Request(base.rstrip("/") + path, headers=headers)  # noqa: S310 - http(s) checked
    try:
        with _OPENER.open(request, timeout=timeout) as answer:
            body = _read_by(answer, limit + 1, deadline=time.monotonic() + 2 * timeout, where=where)
            kind = answer.headers.get_content_type()
    except urllib.error.HTTPError as error:
        raise LabFetchError(_http_problem(where, error)) from None
    except urllib.error.URLError as error:
        reason = error.reason
        text = getattr(reason, "strerror", None) or str(reason)
        raise LabFetchError(f"{where} cannot be reached: {text}") from None
    except (TimeoutError, OSError) as error:
        raise LabFetchError(f"{where} did not answer within {timeout:g} s ({error})") from None
    if len(body) > limit:
        raise LabFetchError(f"{where} answered more than {limit // 1024 // 1024} MiB; not shown")
    if kind != "application/json":
        raise LabFetchError(f"{where} answered {kind}, not JSON: is it a gpubook page?")
    try:
        return json.loads(body)
    except ValueError:
        raise LabFetchError(f"{where} answered JSON that cannot be read") from None


def _http_problem(where: str, error: urllib.error.HTTPError) -> str:
    code = error.code
    if 300 <= code < 400:
        target = server_label(error.headers.get("Location") or "") or "elsewhere"
        return (f"{where} answered with a redirect (HTTP {code}) to {target}; none is followed: "
                f"write the final address in [web] lab")
    if code in (401, 403):
        return (f"{where} refused this page's request (HTTP {code}): is [web] lab_secret_file the same on both "
                f"servers, and does it know this viewer?")
    if code == 404:
        return f"{where} has no such page (HTTP 404): is it a gpubook page of this version?"
    return f"{where} answered HTTP {code}"


class Lab:
    """The lab's other servers as one page sees them: `answers(viewer, path)` asks each of them in
    parallel (kept CACHE_SECONDS per viewer and path)."""

    def __init__(self, servers: Sequence[str], *, secret: str | None, timeout: float = TIMEOUT_SECONDS,
                 fetch: Callable[..., Any] = fetch_json, clock: Callable[[], float] = time.monotonic) -> None:
        self.servers = tuple(servers)
        self.secret = secret
        self.timeout = timeout
        self._fetch = fetch
        self._clock = clock
        self._cache: dict[tuple[str | None, str], tuple[float, tuple[Answer, ...]]] = {}
        self._lock = threading.Lock()

    def answers(self, viewer: str | None, path: str) -> tuple[Answer, ...]:
        key = (viewer, path)
        now = self._clock()
        with self._lock:
            kept = self._cache.get(key)
            if kept is not None and now - kept[0] < CACHE_SECONDS:
                return kept[1]
        found = self._ask_all(viewer, path)
        with self._lock:
            if len(self._cache) >= _CACHED:
                self._cache.clear()
            self._cache[key] = (self._clock(), found)
        return found

    def _ask_all(self, viewer: str | None, path: str) -> tuple[Answer, ...]:
        if not self.servers:
            return ()
        pool = ThreadPoolExecutor(max_workers=min(8, len(self.servers)), thread_name_prefix="gpubook-lab")
        futures = [pool.submit(self._fetch, server, path, viewer=viewer, secret=self.secret, timeout=self.timeout)
                   for server in self.servers]
        wait_all(futures, timeout=self.timeout * 2 + 1)
        pool.shutdown(wait=False, cancel_futures=True)
        found = []
        for server, future in zip(self.servers, futures, strict=True):
            if not future.done():
                found.append(Answer(server, None, f"{server_label(server)} did not answer within "
                                                  f"{self.timeout * 2 + 1:g} s"))
                continue
            error = future.exception()
            if isinstance(error, LabFetchError):
                found.append(Answer(server, None, str(error)))
            elif error is not None:
                log.warning("lab: asking %s failed: %s", server_label(server), error)
                found.append(Answer(server, None, f"{server_label(server)} could not be asked ({error})"))
            else:
                found.append(Answer(server, future.result()))
        return tuple(found)


# -- the merged status -------------------------------------------------------------------------------

def lab_status(own: Mapping[str, Any], answers: Sequence[Answer], *, own_label: str, now: datetime
               ) -> dict[str, Any]:
    """This page's data (`own`, page.page_data's) and the others' answers, as one view: each server
    with its summary or its problem, and every host's GPUs (free now, and until when), running,
    held and next bookings, with the server it is on."""
    servers = [_server(own_label, own, None, page="./")]
    hosts = [_host(own_label, host, now=now) for host in own.get("hosts") or ()]
    for answer in answers:
        data = answer.data
        problem = answer.problem
        if problem is None and not (isinstance(data, Mapping) and isinstance(data.get("hosts"), list)):
            problem = f"{answer.label} answered something that is not a gpubook status"
        if problem is not None or data is None:
            servers.append(_server(answer.label, {}, problem, page=answer.server))
            continue
        servers.append(_server(answer.label, data, None, page=answer.server))
        hosts.extend(_host(answer.label, host, now=now) for host in data["hosts"] if isinstance(host, Mapping))
    hosts.sort(key=lambda h: (h["name"], h["server"]))
    free = sum(len(h["free"]) for h in hosts)
    reachable = sum(1 for s in servers if s["problem"] is None)
    return {"now": now.isoformat(), "viewer": own.get("viewer"), "servers": servers, "hosts": hosts,
            "summary": f"{free} GPU(s) free now on {len(hosts)} host(s); {reachable} of {len(servers)} server(s) "
                       f"answered"}


def _server(label: str, data: Mapping[str, Any], problem: str | None, *, page: str) -> dict[str, Any]:
    """`page`: the server's own page, where its bookers book (the configured address; "./": this one)."""
    return {"server": label, "page": page, "problem": problem, "summary": _text(data.get("summary")),
            "updated": _text(data.get("updated")), "stale": _text(data.get("stale")),
            "outage": _text(data.get("outage"))}


def _host(server: str, host: Mapping[str, Any], *, now: datetime) -> dict[str, Any]:
    """One host's part of the lab view, every field checked for its type (another server's answer
    is data, never markup: the template escapes it, and nothing unexpected passes here)."""
    found = host.get("gpus")
    gpus: Mapping[str, Any] = found if isinstance(found, Mapping) else {}
    lanes = _rows(host.get("timeline"))
    return {
        "server": server, "name": _text(host.get("name")) or "?",
        "count": _int(gpus.get("count")) or 0, "source": _text(gpus.get("source")),
        "free": _free(lanes, now=now),
        "running": [{"booking": _text(r.get("booking")), "user": _text(r.get("user")), "gpus": _ints(r.get("gpus")),
                     "end": _text(r.get("end")), "state": _text(r.get("state")), "ssh": _text(r.get("ssh")) or None}
                    for r in _rows(host.get("running"))],
        "held": [{"booking": _text(r.get("booking")), "user": _text(r.get("user")), "gpus": _ints(r.get("gpus")),
                  "reason": _text(r.get("reason"))} for r in _rows(host.get("held"))],
        "next": [{"booking": _text(r.get("id")), "user": _text(r.get("user")), "gpus": _ints(r.get("gpus")),
                  "start": _text(r.get("start")), "end": _text(r.get("end"))} for r in _rows(host.get("next"))],
    }


def _free(lanes: Sequence[Mapping[str, Any]], *, now: datetime) -> list[dict[str, Any]]:
    """The GPUs with nothing booked, running or held now, each with when its next booking starts."""
    free = []
    for lane in lanes:
        busy_now, next_start = False, None
        for segment in _rows(lane.get("segments")):
            if segment.get("kind") == "ended":
                continue
            try:
                start, end = datetime.fromisoformat(str(segment["start"])), datetime.fromisoformat(str(segment["end"]))
            except (KeyError, ValueError):
                continue
            if start.tzinfo is None or end.tzinfo is None:  # a peer's time without offset: not comparable
                continue  # (round 3, L3: it made the whole page fail)
            if start <= now < end:
                busy_now = True
            elif start > now and (next_start is None or start < next_start):
                next_start = start
        if not busy_now and _int(lane.get("gpu")) is not None:
            free.append({"gpu": _int(lane.get("gpu")), "until": next_start.isoformat() if next_start else None})
    return free


def _rows(value: Any) -> list[Mapping[str, Any]]:
    return [item for item in value if isinstance(item, Mapping)] if isinstance(value, list) else []


def _text(value: Any) -> str:
    return value[:500] if isinstance(value, str) else ""


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _ints(value: Any) -> list[int]:
    return [v for v in value if _int(v) is not None] if isinstance(value, list) else []


# -- the merged usage ---------------------------------------------------------------------------------

def usage_path(*, start: str, end: str, by: str) -> str:
    return "/api/usage?" + urlencode({"from": start, "to": end, "by": by})


def lab_usage(own: Mapping[str, Any], answers: Sequence[Answer], *, own_label: str,
              own_problem: str | None = None) -> dict[str, Any]:
    """The lab's report: this server's (`own`, report.to_json's) and the others', rows summed by key;
    a server that did not answer (or this one, `own_problem`) is named, and its hours are missing
    from the sums (said so)."""
    servers = [{"server": own_label, "problem": own_problem}]
    reports = [own]
    for answer in answers:
        data = answer.data
        problem = answer.problem
        if problem is None and not (isinstance(data, Mapping) and isinstance(data.get("rows"), list)):
            problem = f"{answer.label} answered something that is not a gpubook report"
        servers.append({"server": answer.label, "problem": problem})
        if problem is None and data is not None:
            reports.append(data)
    return {**merge_usage(reports), "servers": servers,
            "complete": all(s["problem"] is None for s in servers)}
