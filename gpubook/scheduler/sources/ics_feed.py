"""ICS feed source: one iCalendar file over HTTP(S), fetched only when it changed.

Conditional GETs (If-None-Match with the feed's ETag, If-Modified-Since with its Last-Modified)
make an unchanged feed cost one small request answered 304. A feed that ignores both is still
parsed only when its bytes differ from last time. The download is streamed and refused past a
size cap, never held whole beyond it.

The feed is split by UID into whole VCALENDAR texts, each with the VTIMEZONEs its components use
and the feed's calendar properties (X-WR-TIMEZONE included, so bookings can apply it), so that a
RawObject from a feed looks like one from a CalDAV server.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Mapping
from types import MappingProxyType

import niquests
from icalendar import Calendar, Component

from gpubook.scheduler.sources import DEFAULT_TIMEOUT, BaseSource, PollStats, RawObject, Snapshot, https_url
from gpubook.scheduler.sources._http import (
    WireCounter,
    http_status_error,
    split_credentials,
    transport_error,
)
from gpubook.scheduler.sources.errors import CalendarDataError, CalendarError, short

log = logging.getLogger(__name__)

MIB = 1024 * 1024
DEFAULT_MAX_BYTES = 20 * MIB
CHUNK_BYTES = 64 * 1024


class IcsFeedSource(BaseSource):
    """An http(s) .ics feed. `max_bytes` caps the download (default 20 MiB); `timeout` bounds each
    network wait and ten times it the whole download. A feed is read-only: it offers no writer."""

    def __init__(
        self,
        url: str,
        *,
        username: str | None = None,
        password: str | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        max_bytes: int = DEFAULT_MAX_BYTES,
    ) -> None:
        clean_url, url_user, url_password = split_credentials(https_url(url))
        self.url = clean_url
        self.timeout = timeout
        self.max_bytes = max_bytes
        self._wire = WireCounter()
        self._session = niquests.Session()
        self._session.trust_env = False  # no ~/.netrc credentials or proxies picked up silently
        self._session.hooks["response"].append(self._wire.hook)
        user, secret = username or url_user, password or url_password
        if user is not None:
            self._session.auth = (user, secret or "")
        self._etag: str | None = None
        self._last_modified: str | None = None
        self._digest: str | None = None
        self._objects: Mapping[str, RawObject] = MappingProxyType({})

    def close(self) -> None:
        self._session.close()

    def poll(self) -> Snapshot:
        """The feed's complete current objects; `changed` is False when the feed did not change."""
        self._wire.reset()
        method, changed = self._poll_once()
        stats = PollStats(requests=self._wire.requests, bytes_received=self._wire.bytes_received,
                          bytes_sent=self._wire.bytes_sent, method=method)
        return Snapshot(calendar_url=self.url, objects=self._objects, changed=changed, stats=stats)

    def _poll_once(self) -> tuple[str, bool]:
        headers = {"Accept": "text/calendar, */*;q=0.5"}
        if self._etag:
            headers["If-None-Match"] = self._etag
        if self._last_modified:
            headers["If-Modified-Since"] = self._last_modified
        try:
            response = self._session.get(self.url, headers=headers, stream=True,
                                         timeout=self.timeout, allow_redirects=True)
        except niquests.RequestException as failure:
            raise self._transport(failure) from None
        with response:
            if response.status_code == 304 and self._digest is not None:
                return "ics-304", False
            if response.status_code != 200:
                raise http_status_error(self.url, response.status_code or 0, response.reason or "")
            body = self._read_capped(response)
            etag = response.headers.get("ETag")
            last_modified = response.headers.get("Last-Modified")
            content_type = response.headers.get("Content-Type", "")
        digest = hashlib.sha256(body).hexdigest()
        if digest == self._digest:
            self._etag, self._last_modified = etag, last_modified
            return "ics-same", False
        objects = split_feed(self.url, decode_feed(self.url, body, content_type))
        self._objects = MappingProxyType(objects)
        self._digest, self._etag, self._last_modified = digest, etag, last_modified
        return "ics-full", True

    def _read_capped(self, response: niquests.Response) -> bytes:
        declared = response.headers.get("Content-Length", "")
        if declared.isdigit() and int(declared) > self.max_bytes:
            raise CalendarDataError(
                f"{self.url}: feed of {int(declared) / MIB:.1f} MiB is larger than the "
                f"{self.max_bytes / MIB:g} MiB limit")
        deadline = time.monotonic() + self.timeout * 10
        chunks: list[bytes] = []
        size = 0
        try:
            for chunk in response.iter_content(CHUNK_BYTES):
                size += len(chunk)
                if size > self.max_bytes:
                    raise CalendarDataError(
                        f"{self.url}: feed is larger than the {self.max_bytes / MIB:g} MiB limit "
                        "(download stopped)")
                if time.monotonic() > deadline:
                    raise CalendarError(
                        f"{self.url}: download took longer than {self.timeout * 10:g} s (timeout)")
                chunks.append(chunk)
        except niquests.RequestException as failure:
            raise self._transport(failure) from None
        finally:
            self._wire.add_streamed(size)
        return b"".join(chunks)

    def _transport(self, failure: BaseException) -> CalendarError:
        mapped = transport_error(self.url, failure, timeout=self.timeout)
        return mapped or CalendarError(f"{self.url}: {type(failure).__name__}")


def decode_feed(url: str, body: bytes, content_type: str = "") -> str:
    """The feed as text; HTML or other non-iCalendar content is refused with what it looks like."""
    charset = "utf-8-sig"
    for part in content_type.split(";")[1:]:
        key, _, value = part.strip().partition("=")
        if key.lower() == "charset" and value.strip('"').lower() not in ("utf-8", "utf8"):
            charset = value.strip('"')
    try:
        text = body.decode(charset)
    except (UnicodeDecodeError, LookupError):
        raise CalendarDataError(f"{url}: feed is not valid {charset} text") from None
    start = text.lstrip()[:200]
    if start[:1] == "<" or "html" in content_type.lower():
        raise CalendarDataError(f"{url}: answered with HTML, not an iCalendar feed")
    if not start.upper().startswith("BEGIN:VCALENDAR"):
        if not start:
            raise CalendarDataError(f"{url}: not an iCalendar feed: the body is empty")
        shown = start.splitlines()[0][:60]
        raise CalendarDataError(f"{url}: not an iCalendar feed: starts with {shown!r}")
    return text


def split_feed(url: str, text: str) -> dict[str, RawObject]:
    """One whole VCALENDAR text per UID, keyed by `url#UID`; malformed input is refused."""
    try:
        feed = Calendar.from_ical(text)
    except Exception as failure:  # noqa: BLE001  # icalendar raises ValueError and others
        raise CalendarDataError(f"{url}: malformed iCalendar: {short(failure)}") from None
    if not isinstance(feed, Calendar) or feed.name != "VCALENDAR":
        raise CalendarDataError(f"{url}: malformed iCalendar: no VCALENDAR at the top")
    if feed.errors:
        log.warning("feed %s: icalendar skipped broken lines: %s", url, short(feed.errors))
    zones = {str(zone.get("TZID")): zone for zone in feed.walk("VTIMEZONE")}
    groups: dict[str, list[Component]] = {}
    for component in feed.subcomponents:
        if component.name == "VTIMEZONE":
            continue
        uid = component.get("UID")
        key = str(uid) if uid else "no-uid-" + _digest(component.to_ical())
        groups.setdefault(key, []).append(component)
    objects: dict[str, RawObject] = {}
    for uid, components in groups.items():
        ical = _calendar_text(feed, components, zones)
        href = f"{url}#{uid}"
        objects[href] = RawObject(href=href, etag=f'"{_digest(ical.encode())}"', ical=ical,
                                  calendar_url=url)
    return objects


def _calendar_text(feed: Calendar, components: list[Component],
                   zones: Mapping[str, Component]) -> str:
    calendar = Calendar()
    for name, value in feed.property_items(recursive=False, sorted=False)[1:-1]:
        calendar.add(name, value, encode=False)
    for component in components:
        calendar.add_component(component)
    for tzid in sorted(calendar.get_used_tzids()):
        if tzid in zones:
            calendar.subcomponents.insert(0, zones[tzid])
    return calendar.to_ical().decode("utf-8")


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:32]
