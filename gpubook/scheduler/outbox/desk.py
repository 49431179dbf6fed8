"""Booking without a calendar program (issue 40): `gpubook book`, `extend`, `end` and `cancel` from a
shell on the server, asked of the running daemon over its local socket (outbox/ask_socket.py).

The calendar stays the record. The daemon writes an ordinary event into the calendar that books for
the asker: their own calendar (`[[calendar]] user = NAME`), else the shared one, with a `user:` line.
The booking is then the calendar's like any other, seen in the booker's client and edited or
cancelled there; the event says where it was made ("Made with `gpubook book` by alice on devbox1").
`extend`, `end` and `cancel` change or delete the event the same way, and only an event of the
asker's own. Nothing is booked behind the calendar's back: the answer is the daemon's next pass over
the calendar as written, read from its status (outbox/asking.py's `mine` view).

Who asks is the socket's peer credentials, never the request: a request naming a user is refused.
Every value of the request is checked here and the event is composed with icalendar; nothing of it
reaches a shell or a file name.
"""

from __future__ import annotations

import re
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta, tzinfo
from typing import Any, Protocol

import icalendar

from gpubook.runtime.names import TEMPLATE_NAME
from gpubook.scheduler.core import when
from gpubook.scheduler.outbox.asking import AskError, Viewer
from gpubook.scheduler.settings import CalendarConfig, Config
from gpubook.scheduler.sources.errors import CalendarError

KINDS = ("book", "extend", "end", "cancel", "standby")
MAX_GPUS = 64
MAX_HOURS = when.MAX_HOURS  # the longest request read at all (the config's max_hours decides what is accepted)
MAX_TITLE = 200
WAIT_SECONDS = 60.0  # the longest the daemon waits for a booking's answer before it says so
UID_SUFFIX = "@gpubook-desk"

def duration(text: str, *, what: str = "a duration") -> timedelta:
    """`2h`, `90m`, `1h30m`, `1d`, or a bare number of hours (`2`, `1.5`): core/when.py's reading."""
    try:
        return when.duration(text, what=what)
    except when.TimeWords as error:
        raise AskError(str(error)) from None


def moment(text: str, *, now: datetime, zone: tzinfo) -> datetime:
    """When a booking starts, as people type it, in the host's time zone (core/when.py's words)."""
    try:
        return when.moment(text, now=now, zone=zone)
    except when.TimeWords as error:
        raise AskError(str(error)) from None


@dataclass(frozen=True)
class Booked:
    """A booking asked for from the terminal, every value checked."""

    start: datetime
    end: datetime
    gpus: int
    template: str | None
    title: str
    standby: bool = False


def read_book(request: Mapping[str, Any], *, now: datetime, zone: tzinfo) -> Booked:
    """The `book` request's values, or AskError with the sentence naming the wrong one."""
    if "user" in request or "users" in request:
        raise AskError("a booking is made for the account that asks, never for a user named in the request")
    gpus = request.get("gpus", 1)
    if not isinstance(gpus, int) or isinstance(gpus, bool) or not 1 <= gpus <= MAX_GPUS:
        raise AskError(f"--gpus must be a whole number from 1 to {MAX_GPUS}")
    span = duration(str(request.get("hours", "1")), what="the length")
    start = moment(str(request.get("at") or "now"), now=now, zone=zone)
    if start + span <= now:
        raise AskError(f"that booking would be over already ({start.astimezone(zone):%Y-%m-%d %H:%M})")
    template = request.get("template")
    if template is not None and (not isinstance(template, str) or not re.fullmatch(TEMPLATE_NAME, template)):
        raise AskError(f"--template {str(template)[:40]!r} is no template name")
    title = str(request.get("title") or "")
    if len(title) > MAX_TITLE or any(ord(c) < 32 or ord(c) == 0x7F for c in title):
        raise AskError(f"--title must be one line of at most {MAX_TITLE} characters")
    standby = request.get("standby", False)
    if not isinstance(standby, bool):
        raise AskError("standby is yes or no")
    return Booked(start=start, end=start + span, gpus=gpus, template=template, title=title.strip(), standby=standby)


def calendar_for(config: Config, user: str) -> CalendarConfig:
    """The calendar that books for `user`: their own CalDAV calendar, else a shared one."""
    writable = [c for c in config.calendars if c.kind == "caldav"]
    own = next((c for c in writable if c.user == user), None)
    shared = next((c for c in writable if c.user is None), None)
    found = own or shared
    if found is None:
        raise AskError(f"no CalDAV calendar books for {user} here (an .ics feed cannot be written): "
                       "book in your calendar, or ask the admin for a [[calendar]] with user = "
                       f"\"{user}\"")
    return found


def user_of(viewer: Viewer, request: Mapping[str, Any]) -> str:
    """The one gpubook user the asking account is (`--as NAME` among its own where it is several)."""
    if not viewer.users:
        raise AskError(f"your login {viewer.login or '(none)'} is no gpubook user here: the admin maps it "
                       "with [users.NAME] account")
    wanted = request.get("as")
    if wanted is not None:
        if wanted not in viewer.users:
            raise AskError(f"--as {str(wanted)[:32]!r} is not one of your gpubook users "
                           f"({', '.join(sorted(viewer.users))})")
        return str(wanted)
    if len(viewer.users) > 1:
        raise AskError(f"your login is several gpubook users ({', '.join(sorted(viewer.users))}): say which "
                       "with --as NAME")
    return next(iter(viewer.users))


MADE_WITH = {"terminal": "Made with `gpubook book` by {who} on {host}.",
             "page": "Made on gpubook's page of {host} by {who}."}


def event_text(uid: str, booked: Booked, *, user: str, shared: bool, made_by: str, host: str,
               now: datetime, via: str = "terminal") -> bytes:
    """The event as the booker's client shows it: the title, the time, and the convention's lines."""
    event = icalendar.Event()
    event.add("uid", uid)
    event.add("dtstamp", now)
    event.add("created", now)
    event.add("dtstart", booked.start)
    event.add("dtend", booked.end)
    event.add("summary", booked.title or f"{user} GPU booking")
    lines = [f"user: {user}"] if shared else []
    lines.append(f"gpus: {booked.gpus}")
    if booked.template:
        lines.append(f"template: {booked.template}")
    if booked.standby:
        lines.append("standby: yes")
    lines += ["", MADE_WITH[via].format(who=made_by, host=host)]
    event.add("description", "\n".join(lines))
    calendar = icalendar.Calendar()
    calendar.add("prodid", "-//gpubook//desk//EN")
    calendar.add("version", "2.0")
    calendar.add_component(event)
    return calendar.to_ical()


def new_uid() -> str:
    return f"{uuid.uuid4()}{UID_SUFFIX}"


class CalendarDesk(Protocol):
    """What the desk writes with: one calendar's writer (sources/caldav_writer.py)."""

    def create(self, uid: str, text: bytes) -> str: ...

    def change_end(self, href: str, end: datetime) -> None: ...

    def add_line(self, href: str, line: str) -> None: ...

    def delete(self, href: str) -> None: ...


@dataclass(frozen=True)
class Own:
    """One of the asker's bookings as the daemon's status shows it (asking.mine_view's rows)."""

    id: str
    state: str
    start: str
    end: str
    href: str | None = None


class Desk:
    """The daemon's desk: writes, then waits for the pass that answers (`settled` notified by the
    daemon after each pass). `config()` is the daemon's config now; `writer(calendar)` gives a
    calendar's writer; `mine(viewer)` the asker's view; `nudge()` asks for a change check now;
    `where(booking_id)` the event's href, calendar URL and UID as the last read knew them."""

    def __init__(self, config: Callable[[], Config], *, writer: Callable[[CalendarConfig], CalendarDesk],
                 mine: Callable[[Viewer], dict[str, Any]], nudge: Callable[[], None],
                 where: Callable[[str], tuple[str, str, str] | None], clock: Callable[[], datetime],
                 zone: tzinfo, wait: float = WAIT_SECONDS) -> None:
        self.config, self.writer, self.mine, self.nudge, self.where = config, writer, mine, nudge, where
        self.clock, self.zone, self.wait = clock, zone, wait
        self.settled = threading.Condition()
        self._passes = 0

    def passed(self) -> None:
        """Called by the daemon after each pass: the status the desk waits on is new."""
        with self.settled:
            self._passes += 1
            self.settled.notify_all()

    def answer(self, request: Mapping[str, Any], viewer: Viewer, *, login: str,
               via: str = "terminal") -> dict[str, Any]:
        """The answer to one `book`, `extend`, `end` or `cancel`; AskError with the sentence for a
        bad request or a calendar that would not take the write. `via`: where it was asked ("terminal":
        the ask socket, `login` the host login; "page": the status page, `login` the page's user)."""
        try:
            return self._answer(request, viewer, login=login, via=via)
        except CalendarError as error:
            raise AskError(str(error)) from None

    def _answer(self, request: Mapping[str, Any], viewer: Viewer, *, login: str, via: str) -> dict[str, Any]:
        kind = request.get("kind")
        user = user_of(viewer, request)
        if kind == "book":
            return self.book(request, viewer, user=user, login=login, via=via)
        booking_id = str(request.get("id") or "")
        target = self._own(viewer, booking_id, user=user, running=kind in ("extend", "end"))
        located = self.where(target.id)
        if located is None:
            raise AskError(f"booking {target.id} is not in a calendar gpubook can write (an .ics feed?): change it "
                           "in your calendar")
        href, calendar_url, uid = located
        if uid != target.id:  # one occurrence of a series: a change of its event would change them all
            raise AskError(f"booking {target.id} is one occurrence of a series: change it in your calendar")
        calendar = next((c for c in self.config().calendars if c.url == calendar_url and c.kind == "caldav"), None)
        if calendar is None:
            raise AskError(f"booking {target.id} is in a calendar gpubook cannot write: change it in your calendar")
        writer = self.writer(calendar)
        now = self.clock()
        if kind == "standby":  # a refusal answered with "wait instead" (the page's button)
            if target.state != "refused":
                raise AskError(f"booking {target.id} is {target.state}, not refused: nothing to wait for")
            writer.add_line(href, "standby: yes")
            self._after(lambda: any(row.id == target.id and row.state != "refused" for row in self._rows(viewer)),
                        viewer)
            return {"kind": kind, "id": target.id, **self._outcome(viewer, target.id)}
        if kind == "cancel":
            writer.delete(href)
            done = self._after(lambda: not any(row.id == target.id for row in self._rows(viewer)), viewer)
            return {"kind": kind, "id": target.id, "done": done, "state": "cancelled"}
        end = now.replace(microsecond=0) if kind == "end" else datetime.fromisoformat(target.end) + duration(
            str(request.get("by", "")), what="the extension")
        writer.change_end(href, end)
        self._after(lambda: any(row.id == target.id and _same(row.end, end) for row in self._rows(viewer))
                    or kind == "end" and not any(row.id == target.id and row.state == "running"
                                                  for row in self._rows(viewer)), viewer)
        return {"kind": kind, "id": target.id, **self._outcome(viewer, target.id)}

    def book(self, request: Mapping[str, Any], viewer: Viewer, *, user: str, login: str,
             via: str = "terminal") -> dict[str, Any]:
        now = self.clock()
        booked = read_book(request, now=now, zone=self.zone)
        config = self.config()
        calendar = calendar_for(config, user)
        uid = new_uid()
        text = event_text(uid, booked, user=user, shared=calendar.user is None, made_by=login,
                          host=config.host.name, now=now, via=via)
        self.writer(calendar).create(uid, text)
        # For now: the answer once it runs (or is refused); ahead: once the plan has it.
        starts_now = booked.start <= now + timedelta(seconds=5)
        decided = self._after(lambda: self._decided(viewer, uid, running=starts_now), viewer)
        outcome = self._outcome(viewer, uid)
        if not decided:
            outcome["note"] = (f"the daemon had not answered within {self.wait:g} s; `gpubook mine` shows the "
                               "booking once it has")
        return {"kind": "book", "id": uid, "calendar": calendar.url, **outcome}

    # -- helpers ------------------------------------------------------------------------------------------

    def _rows(self, viewer: Viewer) -> list[Own]:
        view = self.mine(viewer)
        rows = [Own(id=row["id"], state=row["state"], start=row["start"], end=row["end"])
                for row in view.get("bookings", ())]
        rows += [Own(id=row["id"], state=_refusal(row), start=_text(row["start"]), end=_text(row["end"]))
                 for row in view.get("rejected", ())]
        return rows

    def _own(self, viewer: Viewer, booking_id: str, *, user: str, running: bool) -> Own:
        rows = [row for row in self._rows(viewer) if running is False or row.state not in ("refused", "standby")]
        if not booking_id:
            candidates = [row for row in rows if row.state == "running"] if running else []
            if len(candidates) != 1:
                raise AskError("name the booking (its id, as `gpubook mine` shows it)" if not candidates else
                               f"you have {len(candidates)} bookings running: name one "
                               f"({', '.join(row.id for row in candidates)})")
            return candidates[0]
        found = next((row for row in rows if row.id == booking_id), None)
        if found is None:  # another's, or unknown: the same sentence, nothing said of anyone else's
            raise AskError(f"you have no booking {booking_id[:80]!r} (`gpubook mine` lists yours)")
        if running and found.state != "running":
            raise AskError(f"booking {found.id} is not running ({found.state})")
        return found

    def _decided(self, viewer: Viewer, uid: str, *, running: bool) -> bool:
        for row in self._rows(viewer):
            if _of_event(row.id, uid):
                return row.state in ("refused", "standby", "running", "ended") or not running
        return False

    def _after(self, done: Callable[[], bool], viewer: Viewer) -> bool:
        """Nudge the daemon, then wait (bounded) for a pass after which `done()` holds."""
        deadline = time.monotonic() + self.wait
        self.nudge()
        with self.settled:
            while True:
                if done():
                    return True
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.settled.wait(min(left, 2.0))

    def _outcome(self, viewer: Viewer, uid: str) -> dict[str, Any]:
        view = self.mine(viewer)
        for row in view.get("bookings", ()):
            if _of_event(str(row["id"]), uid):
                return {"state": row["state"], "start": row["start"], "end": row["end"],
                        **({"ssh": row["ssh"]} if row.get("ssh") else {})}
        for row in view.get("rejected", ()):
            if _of_event(str(row["id"]), uid):
                return {"state": _refusal(row), "reason": row["reason"], "start": _text(row["start"]),
                        "end": _text(row["end"])}
        return {"state": "waiting"}


def _refusal(row: Mapping[str, Any]) -> str:
    """A refused row's state for the asker: waiting on standby, or refused."""
    return "standby" if row.get("standby") else "refused"


def _of_event(booking_id: str, uid: str) -> bool:
    """Whether a booking is the event's: the event itself, or one of its occurrences (`UID/…`)."""
    return booking_id == uid or booking_id.startswith(f"{uid}/")


def _same(text: str, moment_: datetime) -> bool:
    try:
        return datetime.fromisoformat(text) == moment_
    except ValueError:
        return False


def _text(value: Any) -> str:
    return value.isoformat() if isinstance(value, datetime) else str(value)


def shown(answer: Mapping[str, Any]) -> Sequence[str]:
    """The answer as the terminal prints it."""
    state = answer.get("state")
    head = f"booking {answer.get('id')}: {state}"
    lines = [head]
    if answer.get("ssh"):
        lines.append(str(answer["ssh"]))
    elif state in ("refused", "standby"):
        lines.append(str(answer.get("reason", "")))
    elif answer.get("start"):
        lines.append(f"from {answer.get('start')} to {answer.get('end')}")
    if answer.get("note"):
        lines.append(str(answer["note"]))
    return lines
