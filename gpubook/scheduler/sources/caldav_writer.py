"""The CalDAV source's write capability: an outcome written into the booker's event.

Writes are conditional (If-Match with the ETag of the version just read). When someone changed
the event in between, the server answers 412; gpubook reads the new version, applies its block
to it (gpubook/scheduler/sources/block.py) and tries again a bounded number of times, so a concurrent
edit is never lost. When the block and status already say the same, nothing is written.
Obtained from the source (`CaldavSource.open_writer`); read-only sources offer none.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import datetime

import icalendar
from caldav.calendarobjectresource import Event as DavEvent
from caldav.collection import Calendar as DavCalendar
from caldav.davclient import DAVClient
from caldav.elements import cdav
from caldav.lib import error as dav_error

from gpubook.runtime import crash
from gpubook.scheduler.sources import DEFAULT_TIMEOUT, EventRef, WriteResult
from gpubook.scheduler.sources.block import Outcome, apply, label
from gpubook.scheduler.sources.errors import CalendarError, cause, short
from gpubook.scheduler.sources.richtext import description_source, is_html

log = logging.getLogger(__name__)


class CalendarWriter:
    """Writes outcomes into one CalDAV calendar. One DAV client per calendar, reused."""

    def __init__(self, url: str, *, username: str | None = None, password: str | None = None,
                 timezone: str = "UTC", attempts: int = 5, timeout: float = DEFAULT_TIMEOUT,
                 retry_delay: float = 0.2) -> None:
        self.url = url
        self._username, self._password = username, password
        self.timezone = timezone
        self.attempts = attempts
        self.retry_delay = retry_delay
        self._client: DAVClient | None = None
        self._timeout = timeout

    def _calendar(self) -> DavCalendar:
        if self._client is None:
            # caldav's hint says int, but it hands the timeout to requests, which takes float seconds.
            self._client = DAVClient(url=self.url, username=self._username, password=self._password,
                                     timeout=self._timeout)  # type: ignore[arg-type]
        return self._client.calendar(url=self.url)

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    def write(self, ref: EventRef, outcome: Outcome) -> WriteResult:
        """Write `outcome` into the event; re-read and retry when the event changed meanwhile.

        Raises CalendarError when the server cannot be reached or refuses, or when the event kept
        changing for `attempts` tries in a row (the next reconcile pass tries again)."""
        what = f"event {ref.uid}" + (f" ({label(ref.occurrence, self.timezone)})" if ref.occurrence else "")
        try:
            for attempt in range(1, self.attempts + 1):
                result = self._try_once(ref, outcome, attempt)
                if result is not None:
                    if result.written:
                        log.info("%s: wrote %s into the calendar", what, outcome.status)
                    return result
                log.info("%s: changed on the server while gpubook wrote %s; reading it again",
                         what, outcome.status)
                time.sleep(self.retry_delay * attempt)
        except dav_error.DAVError as failure:
            raise CalendarError(f"{what}: writing {outcome.status} back failed: "
                                f"{type(failure).__name__} {_reason(failure)}") from None
        except OSError as failure:  # requests' and niquests' (caldav's HTTP library) errors are OSErrors
            raise CalendarError(f"{what}: writing {outcome.status} back failed: {cause(failure)}") from None
        raise CalendarError(f"{what}: changed on the server {self.attempts} times while gpubook wrote "
                            f"{outcome.status}; will try again on the next pass")

    def _try_once(self, ref: EventRef, outcome: Outcome, attempt: int) -> WriteResult | None:
        """One read-modify-write; None when the server said the event changed in between (412)."""
        calendar = self._calendar()
        event = DavEvent(client=self._client, url=ref.href, parent=calendar)
        try:
            event.load(multiget_fallback=False)
        except dav_error.NotFoundError:
            return WriteResult(written=False, reason="event gone", attempts=attempt - 1)
        changed = self._modify(event, ref, outcome)
        if changed is None:
            return WriteResult(written=False, reason="event gone", etag=event.etag, attempts=attempt - 1)
        if not changed:
            return WriteResult(written=False, reason="unchanged", etag=event.etag, attempts=attempt - 1)
        if event.etag and not event.etag.startswith("W/"):
            # Xandikos sends a Schedule-Tag, which an edit of DESCRIPTION or an X- property does not
            # change: If-Schedule-Tag-Match would let a stale write win. Compare the ETag instead.
            event.props.pop(cdav.ScheduleTag.tag, None)
        elif not event.schedule_tag:
            log.warning("event %s: the server gave no strong ETag; not writing back, since an unconditional "
                        "write could undo a user's edit", ref.uid)
            return WriteResult(written=False, reason="no etag", attempts=attempt - 1)
        try:
            # only_this_recurrence=False: PUT the whole object as read, never merge "into a master".
            crash.point("writeback:before")
            event.save(increase_seqno=False, only_this_recurrence=False, precondition="etag")
        except (dav_error.ETagMismatchError, dav_error.ScheduleTagMismatchError):
            return None
        crash.point("writeback:after")
        return WriteResult(written=True, reason="written", etag=event.etag, attempts=attempt)

    # -- the desk's writes (outbox/desk.py): a new event, a new end, a deletion ------------------------

    def create(self, uid: str, text: bytes) -> str:
        """A new event in this calendar, never over another (If-None-Match); its href."""
        try:
            event = self._calendar().save_event(text.decode(), no_overwrite=True)
            if not isinstance(event, DavEvent):  # caldav's hint includes its async client's coroutine
                raise CalendarError(f"the new event {uid}: caldav answered {type(event).__name__}, not an event")
        except dav_error.DAVError as failure:
            raise CalendarError(f"the new event {uid} could not be written: {type(failure).__name__} "
                                f"{_reason(failure)}") from None
        except OSError as failure:
            raise CalendarError(f"the new event {uid} could not be written: {cause(failure)}") from None
        return str(event.url)

    def change_end(self, href: str, end: datetime) -> None:
        """The event's DTEND moved to `end` (a conditional PUT: a booker's edit meanwhile is read again)."""
        def moved(component: icalendar.cal.Component) -> None:
            start = component.decoded("DTSTART")
            component.pop("DURATION", None)
            component.pop("DTEND", None)
            component.add("DTEND", end.astimezone(start.tzinfo) if isinstance(start, datetime)
                          and start.tzinfo is not None else end)

        self._edit(href, moved, what="the new end")

    def add_line(self, href: str, line: str) -> None:
        """`line` (such as `standby: yes`) put first in the event's plain-text description, where the
        booker's own lines are read first. An HTML description (Google's, Outlook's) is left as it is:
        CalendarError says to add the line in the calendar, where its client writes it as it should."""
        def added(component: icalendar.cal.Component) -> None:
            source, as_html = description_source(component)
            if as_html or is_html(source):
                raise CalendarError(f"{href}: its description is HTML, which gpubook does not rewrite: add the "
                                    f"line '{line}' to the event in your calendar")
            component.pop("DESCRIPTION", None)
            component.add("DESCRIPTION", f"{line}\n{source}" if source else line)

        self._edit(href, added, what=f"the line '{line}'")

    def _edit(self, href: str, change: Callable[[icalendar.cal.Component], None], *, what: str) -> None:
        """The event's VEVENT changed by `change` and saved with a conditional PUT; an edit of the
        booker's meanwhile is read again and `change` applied to it."""
        for attempt in range(1, self.attempts + 1):
            event = DavEvent(client=self._client, url=href, parent=self._calendar())
            try:
                event.load(multiget_fallback=False)
                with event.edit_icalendar_instance() as ical:
                    change(next(c for c in ical.walk("VEVENT")))
                event.save(increase_seqno=False, only_this_recurrence=False, precondition="etag")
                return
            except (dav_error.ETagMismatchError, dav_error.ScheduleTagMismatchError):
                time.sleep(self.retry_delay * attempt)
            except dav_error.DAVError as failure:
                raise CalendarError(f"{href}: {what} could not be written: {type(failure).__name__} "
                                    f"{_reason(failure)}") from None
            except OSError as failure:
                raise CalendarError(f"{href}: {what} could not be written: {cause(failure)}") from None
        raise CalendarError(f"{href}: changed on the server {self.attempts} times while gpubook wrote {what}")

    def delete(self, href: str) -> None:
        """The event gone from the calendar (already gone: nothing to do)."""
        try:
            DavEvent(client=self._client, url=href, parent=self._calendar()).delete()
        except dav_error.NotFoundError:
            return
        except dav_error.DAVError as failure:
            raise CalendarError(f"{href}: the event could not be deleted: {type(failure).__name__} "
                                f"{_reason(failure)}") from None
        except OSError as failure:
            raise CalendarError(f"{href}: the event could not be deleted: {cause(failure)}") from None

    def _modify(self, event: DavEvent, ref: EventRef, outcome: Outcome) -> bool | None:
        """Apply the outcome to the event as read (the step between the GET and the conditional PUT)."""
        with event.edit_icalendar_instance() as ical:
            return apply(ical, uid=ref.uid, occurrence=ref.occurrence, outcome=outcome, timezone=self.timezone)


def _reason(failure: dav_error.DAVError) -> str:
    status = getattr(failure, "status", None)
    return f"(HTTP {status})" if status else short(failure)
