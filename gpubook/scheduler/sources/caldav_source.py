"""CalDAV calendar source: RFC 6578 sync tokens, then ctag/ETag comparison, then a time-range query.

Ways to learn what changed, best first, picked once per source and kept:

- "sync-token": a sync-collection REPORT with the last token lists changed and deleted hrefs;
  nothing changed costs that one small request. An expired or unknown token (Radicale 403,
  Xandikos 412, precondition DAV:valid-sync-token) leads to a full listing compared by URL and
  ETag ("sync-resync"). caldav's own fallback is disabled on purpose: it silently switches to a
  fake token after which deletions are never reported again.
- "etag": for servers without sync: a PROPFIND of the collection's getctag (one small request);
  when it changed or the server has none, a PROPFIND of every member's ETag, and only changed hrefs
  are fetched.
- "time-range": last resort for servers that list nothing: a calendar-query REPORT for a window
  around now, downloaded whole every poll.

The first load and a resync send one sync-collection REPORT from no token themselves and read
its XML directly (the first load asks for calendar-data in it too; Radicale sends it, Xandikos
does not); incremental polls go through caldav's get_objects_by_sync_token. Changed objects are
fetched with one GET each when there are few, else with calendar-multiget in batches.

The snapshot's `objects` mapping is read-only and replaced only when something changed, so a
no-change poll hands back the very same object and costs no rebuilding.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from datetime import timedelta
from types import MappingProxyType
from typing import Any, TypeVar
from urllib.parse import quote, unquote, urlsplit
from xml.sax.saxutils import escape

from caldav.davclient import DAVClient, get_davclient
from caldav.elements import dav
from caldav.elements.base import ValuedBaseElement
from caldav.lib import error as dav_error

from gpubook.scheduler import clock
from gpubook.scheduler.sources import DEFAULT_TIMEOUT, BaseSource, PollStats, RawObject, Snapshot, Writer
from gpubook.scheduler.sources._http import (
    WireCounter,
    http_status_error,
    split_credentials,
    transport_error,
)
from gpubook.scheduler.sources.errors import CalendarDataError, CalendarError, short

log = logging.getLogger(__name__)

MULTISTATUS, RESPONSE, HREF, STATUS = "{DAV:}multistatus", "{DAV:}response", "{DAV:}href", \
    "{DAV:}status"
PROPSTAT, PROP, GETETAG = "{DAV:}propstat", "{DAV:}prop", "{DAV:}getetag"
GETCONTENTLENGTH = "{DAV:}getcontentlength"
SYNC_TOKEN = "{DAV:}sync-token"  # noqa: S105  # an XML tag, not a secret
CALENDAR_DATA = "{urn:ietf:params:xml:ns:caldav}calendar-data"

VALID_SYNC_TOKEN = "{DAV:}valid-sync-token"  # noqa: S105  # an XML tag, not a secret
SUPPORTED_REPORT = "{DAV:}supported-report"
MIB = 1024 * 1024
# One calendar object (an event with its time zones) is read up to this size; a larger one is
# refused with a sentence and never downloaded past it (issue 22, finding 15: a 5 MiB event cost
# every poll its download, parse and memory). The ICS feed's whole-feed cap is 20 MiB.
MAX_OBJECT_BYTES = 1 * MIB
# One PROPFIND or REPORT answer (many objects): an answer past it is dropped, and the objects are
# fetched in smaller parts, then one GET each.
MAX_ANSWER_BYTES = 64 * MIB
CHUNK_BYTES = 64 * 1024
FEW_CHANGES = 4  # up to this many changed objects are fetched with one GET each
MULTIGET_BATCH = 500  # hrefs per calendar-multiget: bounds each request's size and time
METHODS = ("auto", "sync-token", "etag", "time-range")
T = TypeVar("T")
_PROPS = "<D:prop><D:getetag/><D:getcontentlength/>{data}</D:prop>"
_SYNC = ('<?xml version="1.0" encoding="utf-8"?>'
         '<D:sync-collection xmlns:D="DAV:" xmlns:C="urn:ietf:params:xml:ns:caldav">'
         '<D:sync-token/><D:sync-level>1</D:sync-level>{props}</D:sync-collection>')
SYNC_ALL = _SYNC.format(props=_PROPS.format(data=""))
SYNC_ALL_WITH_DATA = _SYNC.format(props=_PROPS.format(data="<C:calendar-data/>"))
PROPFIND_ETAGS = ('<?xml version="1.0" encoding="utf-8"?>'
                  '<D:propfind xmlns:D="DAV:"><D:prop><D:getetag/><D:getcontentlength/></D:prop></D:propfind>')
QUERY_ALL = ('<?xml version="1.0" encoding="utf-8"?>'
             '<C:calendar-query xmlns:D="DAV:" xmlns:C="urn:ietf:params:xml:ns:caldav">'
             + _PROPS.format(data="<C:calendar-data/>")
             + '<C:filter><C:comp-filter name="VCALENDAR"/></C:filter></C:calendar-query>')
MULTIGET = ('<?xml version="1.0" encoding="utf-8"?>'
            '<C:calendar-multiget xmlns:D="DAV:" xmlns:C="urn:ietf:params:xml:ns:caldav">'
            + _PROPS.format(data="<C:calendar-data/>") + "{hrefs}</C:calendar-multiget>")


class GetCtag(ValuedBaseElement):
    """CalendarServer's collection tag: changes whenever any member changes."""

    tag = "{http://calendarserver.org/ns/}getctag"


class _NoSync(Exception):
    """The server cannot do sync-collection: use the next method."""


class _TooLarge(Exception):
    """An answer past its cap; the download was stopped there."""

    def __init__(self, method: str, size: int, *, declared: bool, etag: str | None) -> None:
        super().__init__(f"{method} answered more than {size} bytes")
        self.method, self.size, self.declared, self.etag = method, size, declared, etag


class CaldavSource(BaseSource):
    """One CalDAV calendar collection, polled incrementally.

    `url` is the collection's URL (credentials in it are moved out of it and never shown).
    `method` forces one way of polling ("sync-token", "etag" or "time-range"); "auto" starts with
    sync tokens and steps down only when the server cannot do them. `window` is the (past, future)
    span of the time-range query, used only by that last resort. Its write capability is the
    CalendarWriter (gpubook/scheduler/sources/caldav_writer.py).
    """

    multiget_batch = MULTIGET_BATCH
    max_object_bytes = MAX_OBJECT_BYTES
    max_answer_bytes = MAX_ANSWER_BYTES

    def __init__(
        self,
        url: str,
        *,
        username: str | None = None,
        password: str | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        method: str = "auto",
        window: tuple[timedelta, timedelta] = (timedelta(days=31), timedelta(days=366)),
    ) -> None:
        if method not in METHODS:
            raise ValueError(f"method must be one of {', '.join(METHODS)}, not {method!r}")
        clean_url, url_user, url_password = split_credentials(url)
        self.url = clean_url if clean_url.endswith("/") else clean_url + "/"
        self.timeout = timeout
        self.window = window
        self._username, self._password = username or url_user, password or url_password
        self._method = "sync-token" if method == "auto" else method
        self._may_step_down = method == "auto"
        self._wire = WireCounter()
        client = get_davclient(
            url=self.url, username=self._username, password=self._password,
            timeout=timeout, check_config_file=False, environment=False)
        if client is None:  # only when it has no URL, which it always has here
            raise CalendarError(f"{self.url}: caldav made no client for this URL")
        self._client: DAVClient = client
        self._client.session.hooks["response"].append(self._wire.hook)
        self._cap_answers()
        self._sizes: dict[str, int] = {}  # href -> size the server listed (getcontentlength)
        self._calendar = self._client.calendar(url=self.url)
        self._sync_token: str | None = None
        self._ctag: str | None = None
        self._loaded = False
        self._objects: Mapping[str, RawObject] = MappingProxyType({})
        self._vanished: set[str] = set()  # hrefs listed as changed whose fetch found nothing (this poll)
        self._said_vanished: set[str] = set()  # the last poll's, logged

    @property
    def method(self) -> str:
        """The way this source polls now ("sync-token", "etag" or "time-range")."""
        return self._method

    @property
    def sync_token(self) -> str | None:
        return self._sync_token

    @property
    def checks_cheaply(self) -> bool:
        """Loaded, and polled by sync token (a no-change poll: one sync-collection REPORT, the
        cheapest request a CalDAV server answers) or by a ctag the server keeps (one PROPFIND).
        A change is then read by the same poll: the REPORT lists what changed, and only that is
        fetched, so a check that finds one never lists the calendar a second time."""
        if not self._loaded:
            return False
        return self._method == "sync-token" or (self._method == "etag" and self._ctag is not None)

    def close(self) -> None:
        self._client.close()

    def open_writer(self, *, timezone: str) -> Writer:
        from gpubook.scheduler.sources.caldav_writer import CalendarWriter

        return CalendarWriter(self.url, username=self._username, password=self._password,
                              timezone=timezone, timeout=self.timeout)

    def poll(self) -> Snapshot:
        """The calendar's complete current objects; `changed` is False when nothing changed."""
        self._wire.reset()
        method, changed = self._guarded(self._poll_once)
        self._sizes = {href: size for href, size in self._sizes.items() if href in self._objects}
        changed = changed or not self._loaded  # the first snapshot is news, even when empty
        self._loaded = True
        stats = PollStats(requests=self._wire.requests, bytes_received=self._wire.bytes_received,
                          bytes_sent=self._wire.bytes_sent, method=method)
        return Snapshot(calendar_url=self.url, objects=self._objects, changed=changed, stats=stats)

    def _poll_once(self) -> tuple[str, bool]:
        if self._method == "sync-token":
            try:
                return self._poll_sync()
            except _NoSync as reason:
                if not self._may_step_down:
                    raise CalendarError(
                        f"{self.url}: sync tokens do not work here: {reason}") from None
                log.info("calendar %s: no sync-collection support (%s); comparing ETags instead",
                         self.url, reason)
                self._method = "etag"
        if self._method == "etag":
            try:
                return self._poll_etags()
            except _NoSync as reason:
                if not self._may_step_down:
                    raise CalendarError(
                        f"{self.url}: ETag listing does not work here: {reason}") from None
                log.info("calendar %s: cannot list ETags (%s); using a time-range query",
                         self.url, reason)
                self._method = "time-range"
        return self._poll_time_range()

    # -- sync tokens --------------------------------------------------------------------------

    def _sync_collection(self, token: str | None) -> Any:
        try:
            collection = self._calendar.get_objects_by_sync_token(
                sync_token=token, load_objects=False, disable_fallback=True)
        except dav_error.DAVError as failure:
            if VALID_SYNC_TOKEN in failure.preconditions:
                raise
            if _means_no_sync(failure):
                raise _NoSync(_dav_reason(failure)) from None
            raise
        self._wire.check_dav_answers(self.url)
        if not collection.sync_token:
            raise _NoSync("the sync-collection answer carried no sync-token")
        return collection

    def _poll_sync(self) -> tuple[str, bool]:
        if self._sync_token is None:
            return "sync-token", self._full_sync(with_data=not self._objects)
        try:
            collection = self._sync_collection(self._sync_token)
        except dav_error.DAVError as failure:
            if VALID_SYNC_TOKEN not in failure.preconditions:
                raise
            log.info("calendar %s: sync token no longer valid; comparing every ETag", self.url)
            return "sync-resync", self._full_sync(with_data=False)
        # A deleted member comes as a 404 response without an ETag (RFC 6578 section 3.5.2).
        deleted = {str(url) for url in collection.deleted_urls}
        listing = {str(obj.url.canonical()): _etag(obj.props) for obj in collection
                   if str(obj.url.canonical()) not in deleted}
        changed = self._apply_changes(self._differing(listing), deleted)
        if not self._vanished:
            self._sync_token = collection.sync_token
        elif self._vanished != self._said_vanished:  # asked again from the same token next time; said once
            log.info("calendar %s: %d changed object(s) not found when fetched; asking again at the next poll",
                     self.url, len(self._vanished))
        self._said_vanished = self._vanished
        return "sync-token", changed

    def _full_sync(self, *, with_data: bool) -> bool:
        """A sync-collection REPORT from no token: every member, compared by URL and ETag.

        The first load asks for calendar-data in the same REPORT (one request for everything);
        a resync asks only for ETags and fetches what differs. The answer is read straight from
        the XML tree: caldav's per-object bookkeeping costs about 1 ms per member, too much for
        10,000 of them.
        """
        body = SYNC_ALL_WITH_DATA if with_data else SYNC_ALL
        try:
            response = self._report(body, depth=1)
        except _TooLarge:
            if not with_data:
                raise
            log.warning("calendar %s: the whole calendar is larger than %d MiB in one answer; listing it "
                        "and fetching its objects in parts", self.url, self.max_answer_bytes // MIB)
            return self._full_sync(with_data=False)
        members, deleted, token = self._members(response)
        if not token:
            raise _NoSync("the sync-collection answer carried no sync-token")
        fresh = {href: RawObject(href=href, etag=etag or _hash(data), ical=data,
                                 calendar_url=self.url)
                 for href, (etag, data) in members.items() if data is not None}
        listing = {href: etag for href, (etag, _data) in members.items()}
        wanted = {href: etag for href, etag in self._differing(listing).items()
                  if href not in fresh}
        if len(wanted) > self.multiget_batch:
            # Many to fetch (Xandikos' first load): one calendar-query for the whole collection
            # costs a few seconds less than batches of calendar-multiget (10,000 events: 1-5 s
            # against 6 s); whatever it lacks is then fetched by href.
            fresh.update(self._query_all(wanted))
            wanted = {href: etag for href, etag in wanted.items() if href not in fresh}
        fetched = self._fetch(wanted) if wanted else {}
        objects = {href: known for href, known in self._objects.items() if href in listing}
        objects.update(fresh)
        objects.update(fetched)
        for href in wanted.keys() - fetched.keys():  # gone between the listing and the fetch
            objects.pop(href, None)
        # A listing from no token is complete: whatever it lacks is gone, and the 404s it may
        # carry (Radicale lists members deleted long ago) need no handling of their own.
        del deleted
        self._sync_token = token
        if objects == self._objects:
            return False
        self._objects = MappingProxyType(objects)
        return True

    def _query_all(self, wanted: Mapping[str, str | None]) -> dict[str, RawObject]:
        try:
            response = self._report(QUERY_ALL, depth=1)
        except _TooLarge:
            return {}  # fetched in parts instead
        members, _deleted, _token = self._members(response)
        return {href: RawObject(href=href, etag=etag or _hash(data), ical=data,
                                calendar_url=self.url)
                for href, (etag, data) in members.items() if data is not None and href in wanted}

    def _report(self, body: str, *, depth: int | None) -> Any:
        try:
            response = self._client.report(self.url, body, depth=depth)
        except dav_error.DAVError as failure:  # caldav raises on 401/403 itself
            if _means_no_sync(failure):
                raise _NoSync(_dav_reason(failure)) from None
            raise
        self._wire.check_dav_answers(self.url)
        if response.status == 207 and response.tree is not None:
            if response.tree.tag != MULTISTATUS:
                raise CalendarDataError(f"{self.url}: not a CalDAV calendar: REPORT answered "
                                        f"with <{response.tree.tag}> instead of a multistatus")
            return response
        if response.status in (400, 403, 405, 415, 501):
            preconditions = dav_error.parse_preconditions(getattr(response, "_raw", None))
            if response.status != 403 or SUPPORTED_REPORT in preconditions:
                raise _NoSync(f"HTTP {response.status}")
        if response.status >= 300:
            raise http_status_error(self.url, response.status)
        raise CalendarDataError(f"{self.url}: not a CalDAV calendar: REPORT answered "
                                f"{response.status} without a WebDAV multistatus")

    # -- ctag and ETags -------------------------------------------------------------------------

    def _poll_etags(self) -> tuple[str, bool]:
        ctag = self._read_ctag()
        if ctag is not None and ctag == self._ctag and self._loaded:
            return "ctag", False
        try:
            response = self._client.propfind(self.url, PROPFIND_ETAGS, depth=1)
        except dav_error.AuthorizationError as failure:
            if ctag is None and not self._loaded:
                raise  # nothing answered yet: most likely the credentials
            raise _NoSync(f"PROPFIND of member ETags answered HTTP {failure.status}") from None
        self._wire.check_dav_answers(self.url)
        if response.status in (400, 403, 405, 501):
            raise _NoSync(f"PROPFIND of member ETags answered HTTP {response.status}")
        if response.status != 207 or response.tree is None or response.tree.tag != MULTISTATUS:
            if response.status >= 300:
                raise http_status_error(self.url, response.status)
            raise CalendarDataError(f"{self.url}: not a CalDAV calendar: PROPFIND answered "
                                    f"{response.status} without a WebDAV multistatus")
        members, _deleted, _token = self._members(response)
        listing = {href: etag for href, (etag, _data) in members.items()}
        changed = self._apply_listing(listing)
        self._ctag = ctag
        return "etag", changed

    def _read_ctag(self) -> str | None:
        try:
            props = self._calendar.get_properties([GetCtag()])
        except dav_error.DAVError as failure:
            if failure.status in (400, 403, 405, 501):
                return None
            raise
        self._wire.check_dav_answers(self.url)
        value = props.get(GetCtag.tag)
        return str(value) if value else None

    # -- time range --------------------------------------------------------------------------------

    def _poll_time_range(self) -> tuple[str, bool]:
        now = clock.now()
        past, future = self.window
        found = self._calendar.search(start=now - past, end=now + future, event=True, expand=False)
        self._wire.check_dav_answers(self.url)
        objects: dict[str, RawObject] = {}
        for obj in found:
            href = str(obj.url.canonical())
            text = _text(obj.data)
            if len(text.encode()) > self.max_object_bytes:  # within the answer's cap
                objects[href] = self._too_large(href, _etag(obj.props), len(text.encode()), declared=True)
                continue
            objects[href] = RawObject(href=href, etag=_etag(obj.props) or _hash(text), ical=text,
                                      calendar_url=self.url)
        changed = objects != dict(self._objects)
        if changed:
            self._objects = MappingProxyType(objects)
        return "time-range", changed

    # -- shared --------------------------------------------------------------------------------

    def _apply_listing(self, listing: Mapping[str, str | None]) -> bool:
        """Compare a full href -> ETag listing with what we hold; fetch only what differs."""
        deleted = set(self._objects) - set(listing)
        return self._apply_changes(self._differing(listing), deleted)

    def _differing(self, listing: Mapping[str, str | None]) -> dict[str, str | None]:
        known = self._objects
        return {href: etag for href, etag in listing.items()
                if href not in known or etag is None or known[href].etag != etag}

    def _apply_changes(self, updated: Mapping[str, str | None], deleted: Iterable[str]) -> bool:
        """`_vanished`: the updated hrefs whose fetch found nothing. A server's listing can run ahead
        of its GET (Xandikos under concurrent writes); a sync poll then keeps its old token, or the
        object would be lost until it changes again."""
        deleted = set(deleted) & set(self._objects)
        self._vanished = set()
        if not updated and not deleted:
            return False
        fetched = self._fetch(updated)
        self._vanished = set(updated) - set(fetched)
        objects = dict(self._objects)
        for href in deleted:
            objects.pop(href, None)
        for href in updated:
            if href in fetched:
                objects[href] = fetched[href]
            else:  # gone between the listing and the fetch
                objects.pop(href, None)
        if objects == self._objects:
            return False
        self._objects = MappingProxyType(objects)
        return True

    def _fetch(self, wanted: Mapping[str, str | None]) -> dict[str, RawObject]:
        """The objects at `wanted` (href -> listed ETag); one listed past the cap is not downloaded."""
        fetched = {href: self._too_large(href, etag, self._sizes[href], declared=True)
                   for href, etag in wanted.items() if self._sizes.get(href, 0) > self.max_object_bytes}
        hrefs = [href for href in wanted if href not in fetched]
        if len(hrefs) <= FEW_CHANGES:
            fetched.update({href: obj for href in hrefs if (obj := self._get(href)) is not None})
            return fetched
        for batch in self._batches(hrefs):
            hrefs_xml = "".join(f"<D:href>{escape(urlsplit(h).path)}</D:href>" for h in batch)
            try:
                # RFC 4791 section 7.9: no Depth header on calendar-multiget
                response = self._report(MULTIGET.format(hrefs=hrefs_xml), depth=None)
            except _TooLarge:  # large objects the listing did not size: one GET each, each capped
                fetched.update({href: obj for href in batch if (obj := self._get(href)) is not None})
                continue
            members, _deleted, _token = self._members(response)
            for href, (etag, data) in members.items():
                if data is not None:
                    fetched[href] = RawObject(href=href, etag=etag or _hash(data), ical=data,
                                              calendar_url=self.url)
                elif self._sizes.get(href, 0) > self.max_object_bytes:
                    fetched[href] = self._too_large(href, etag, self._sizes[href], declared=True)
        return fetched

    def _batches(self, hrefs: list[str]) -> Iterable[list[str]]:
        """Up to multiget_batch hrefs each, and (where the listing sized them) half an answer's cap."""
        batch: list[str] = []
        size = 0
        for href in hrefs:
            listed = self._sizes.get(href, 0)
            if batch and (len(batch) >= self.multiget_batch or size + listed > self.max_answer_bytes // 2):
                yield batch
                batch, size = [], 0
            batch.append(href)
            size += listed
        if batch:
            yield batch

    def _get(self, href: str) -> RawObject | None:
        try:
            response = self._client.request(href, "GET")
        except _TooLarge as large:
            return self._too_large(href, large.etag, large.size, declared=large.declared)
        if response.status == 404:
            return None
        if response.status != 200:
            raise http_status_error(self.url, response.status)
        text = _text(response.raw)
        if "BEGIN:VCALENDAR" not in text[:2000]:
            kind = response.headers.get("Content-Type", "no content type").split(";", 1)[0]
            raise CalendarDataError(f"{self.url}: {href} is not iCalendar data ({kind})")
        etag = response.headers.get("ETag")
        return RawObject(href=href, etag=etag or _hash(text), ical=text, calendar_url=self.url)

    def _members(self, response: Any) -> tuple[dict[str, tuple[str | None, str | None]], set[str], str | None]:
        """A multistatus' members, their listed sizes remembered; data past the cap dropped."""
        members, deleted, token = _read_multistatus(response.tree, self._calendar.url, sizes=self._sizes)
        for href, (etag, data) in members.items():
            if data is not None and len(data) > self.max_object_bytes \
                    and len(data.encode()) > self.max_object_bytes:
                self._sizes[href] = len(data.encode())
                members[href] = (etag, None)
        return members, deleted, token

    def _too_large(self, href: str, etag: str | None, size: int, *, declared: bool) -> RawObject:
        limit = self.max_object_bytes
        amount = f"{size / MIB:.1f} MiB" if declared else f"larger than {limit / MIB:g} MiB"
        reason = (f"the calendar object {href} is {amount}; gpubook reads objects of at most {limit / MIB:g} MiB, "
                  "so it was ignored: remove its attachment or long text")
        log.warning("calendar %s: %s", self.url, reason)
        return RawObject(href=href, etag=etag or f'"gpubook-too-large-{size}"', ical="", calendar_url=self.url,
                         refused=reason)

    def _cap_answers(self) -> None:
        """Every answer is streamed and read up to its cap (a GET: one object's; else an answer's),
        so that no server, and no writer of a calendar, makes gpubook download more than that."""
        session = self._client.session
        send = session.request

        def request(method: str, url: str, *args: Any, **kwargs: Any) -> Any:
            kwargs["stream"] = True
            response = send(method, url, *args, **kwargs)
            limit = self.max_object_bytes if str(method).upper() == "GET" else self.max_answer_bytes
            response._content = self._read_capped(response, method=str(method), limit=limit)  # noqa: SLF001
            response._content_consumed = True  # noqa: SLF001 - what reading .content sets
            return response

        session.request = request  # type: ignore[method-assign]

    def _read_capped(self, response: Any, *, method: str, limit: int) -> bytes:
        etag = response.headers.get("ETag")
        declared = response.headers.get("Content-Length", "")
        if declared.isdigit() and int(declared) > limit:
            response.close()
            self._wire.bytes_received -= int(declared)  # the hook counted a body never read
            raise _TooLarge(method, int(declared), declared=True, etag=etag)
        deadline = time.monotonic() + self.timeout * 10
        chunks: list[bytes] = []
        size = 0
        try:
            for chunk in response.iter_content(CHUNK_BYTES):
                size += len(chunk)
                if size > limit:
                    response.close()
                    raise _TooLarge(method, limit, declared=False, etag=etag)
                if time.monotonic() > deadline:
                    response.close()
                    raise CalendarError(f"{self.url}: {method} took longer than {self.timeout * 10:g} s (timeout)")
                chunks.append(chunk)
        finally:
            if not declared.isdigit():
                self._wire.add_streamed(size)  # the hook counted Content-Length where there was one
        return b"".join(chunks)

    def _guarded(self, action: Callable[[], T]) -> T:
        """Run one poll step; turn every library failure into a one-line CalendarError."""
        try:
            return action()
        except CalendarError:
            raise
        except _TooLarge as large:
            raise CalendarDataError(f"{self.url}: {large.method} answered more than "
                                    f"{large.size / MIB:.0f} MiB (download stopped)") from None
        except dav_error.AuthorizationError as failure:
            raise http_status_error(self.url, failure.status or 401) from None
        except dav_error.NotFoundError:
            raise http_status_error(self.url, 404) from None
        except dav_error.DAVError as failure:
            raise _dav_failure(self.url, failure) from None
        except Exception as failure:  # noqa: BLE001  # transport and parser errors of any library
            mapped = transport_error(self.url, failure, timeout=self.timeout)
            self._wire.check_dav_answers(self.url)  # caldav stumbles on HTML in many ways
            if mapped is not None:
                raise mapped from None
            if type(failure).__name__ in ("XMLSyntaxError", "ParseError", "ValueError",
                                          "UnicodeDecodeError", "ResponseError"):
                raise CalendarDataError(
                    f"{self.url}: not a CalDAV calendar: unreadable answer "
                    f"({type(failure).__name__}: {short(failure)})") from None
            raise CalendarError(
                f"{self.url}: {type(failure).__name__}: {short(failure)}") from None


def _read_multistatus(tree: Any, base: Any, *, sizes: dict[str, int] | None = None) -> tuple[
        dict[str, tuple[str | None, str | None]], set[str], str | None]:
    """Members (href -> (etag, calendar data)), deleted hrefs and the sync token of a 207; each
    member's getcontentlength, where listed, into `sizes`."""
    members: dict[str, tuple[str | None, str | None]] = {}
    deleted: set[str] = set()
    token = None
    if tree is None or tree.tag != MULTISTATUS:
        raise CalendarDataError("not a CalDAV calendar: the answer is not a WebDAV multistatus")
    for element in tree:
        if element.tag == SYNC_TOKEN:
            token = (element.text or "").strip() or None
            continue
        if element.tag != RESPONSE:
            continue
        href_text = element.findtext(HREF)
        if not href_text:
            continue
        href = str(base.join(quote(unquote(href_text.strip()), safe="/:@+")).canonical())
        if href.rstrip("/") == str(base.canonical()).rstrip("/"):
            continue  # the collection itself
        if "404" in (element.findtext(STATUS) or ""):
            deleted.add(href)
            continue
        etag = data = None
        for propstat in element.iter(PROPSTAT):
            if "200" not in (propstat.findtext(STATUS) or "200"):
                continue
            etag = propstat.findtext(f"{PROP}/{GETETAG}") or etag
            data = propstat.findtext(f"{PROP}/{CALENDAR_DATA}") or data
            length = (propstat.findtext(f"{PROP}/{GETCONTENTLENGTH}") or "").strip()
            if sizes is not None and length.isdigit():
                sizes[href] = int(length)
        members[href] = (etag, data)
    return members, deleted, token


def _means_no_sync(failure: dav_error.DAVError) -> bool:
    if SUPPORTED_REPORT in failure.preconditions:
        return True
    if isinstance(failure, dav_error.ReportError) and failure.status in (None, 400, 405, 415, 501):
        return True
    return "not supported" in str(failure).lower() and failure.status in (None, 400, 405, 501)


def _dav_failure(url: str, failure: dav_error.DAVError) -> CalendarError:
    status = failure.status
    if isinstance(status, int) and status >= 400:
        return http_status_error(url, status)
    return CalendarError(f"{url}: {_dav_reason(failure)}")


def _dav_reason(failure: dav_error.DAVError) -> str:
    status = f"HTTP {failure.status}" if failure.status else type(failure).__name__
    return f"{status}{' ' + ', '.join(failure.preconditions) if failure.preconditions else ''}"


def _etag(props: Mapping[str, Any] | None) -> str | None:
    value = (props or {}).get(dav.GetEtag.tag)
    return str(value) if value else None


def _text(data: Any) -> str:
    return data.decode("utf-8") if isinstance(data, bytes) else str(data)


def _hash(text: str) -> str:
    return '"sha256-' + hashlib.sha256(text.encode()).hexdigest() + '"'
