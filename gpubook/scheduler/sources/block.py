"""The event block: what gpubook writes into an event's DESCRIPTION, and how reading strips it.

One module for both directions, pure (no I/O): the booking parser calls `strip_block` so that a
line gpubook wrote is never taken for the user's `key: value` line; the CalDAV source's writer
calls `apply` between its GET and its conditional PUT.

gpubook owns one marked block at the end of the event's DESCRIPTION::

    (the user's own text, never touched)

    --- gpubook ---
    running: ssh -p 2201 alice@devbox1
    until 2026-11-23 17:00 +0100
    --- end gpubook ---

an ``X-GPUBOOK-STATUS`` property (accepted, rejected, standby, running, ended) for programs, and the booked
host as a resource attendee whose PARTSTAT is the answer (ACCEPTED, DECLINED, or TENTATIVE while an
accepted booking's start came but it is held: gpubook/scheduler/sources/attendee.py), which the
event's STATUS, what views draw, repeats where gpubook may write it (sources/event_status.py).
The block is replaced in place on each update; text above and below it stays byte for byte. The
block is an end marker and the begin marker nearest above it: a begin marker whose end marker the
user deleted is not recognised and is left alone (a new block is added below), and the booker's
lines after such a stray marker are neither hidden from the parser nor replaced on the next write.

Descriptions in HTML (Google Calendar, Outlook: gpubook/scheduler/sources/richtext.py) get the block in
HTML, one ``<br>`` per line, so that it shows as lines there; markers are found in both forms.
Outlook's ``X-ALT-DESC;FMTTYPE=text/html`` gets the same block as DESCRIPTION.

`apply` says whether anything changed, so that a writer skips the write when the block and status
already say the same: a write-back is idempotent and a level-triggered reconciler may call it on
every pass. How the write itself stays safe against concurrent edits is the writer's story
(gpubook/scheduler/sources/caldav_writer.py); read-only sources (ICS feeds) have no writer.

Recurring events — the choice made here
---------------------------------------
A booker who opens one occurrence of a series expects to see *that* occurrence's outcome.

- An occurrence that already has its own component (a RECURRENCE-ID override: the user moved or
  edited that instance) gets the block and status on that component, like a single event.
- Any other occurrence gets an entry in the block of the series' master, named by the
  occurrence's start, with one ``X-GPUBOOK-STATUS;X-GPUBOOK-OCCURRENCE=<start>`` per entry::

      --- gpubook ---
      2026-11-23 09:00 +0100: running: ssh -p 2201 alice@devbox1
        until 2026-11-23 17:00 +0100
      2026-11-30 09:00 +0100: accepted: 1 GPU (0), template debian-ssh
      --- end gpubook ---

  A held entry's status carries ``X-GPUBOOK-HELD=TRUE``. The master's attendee answers for the
  whole series and names no GPUs, so that each occurrence's write finds it unchanged: ACCEPTED
  while any entry is accepted (running, ended), TENTATIVE when the only accepted ones are held,
  DECLINED when every entry is refused. At most ``MAX_OCCURRENCES`` entries are kept, chosen by
  what the booker needs: the running occurrence's (its ssh line) always, then the next ones to
  start, then the latest ended.
  gpubook does not create an override per occurrence: an override freezes a copy of the
  series' properties, so a later edit of the whole series (say, a new ``template:`` line)
  would silently not reach those occurrences — in the user's calendar and in gpubook's own
  reading of it. Every client shows the master's description on each occurrence, so the entry
  with the matching date is where the user looks.
"""

from __future__ import annotations

import bisect
import html
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, date, datetime
from enum import StrEnum
from typing import Any
from zoneinfo import ZoneInfo

import icalendar

from gpubook.scheduler.sources import attendee, event_status
from gpubook.scheduler.sources.alarm import Reminder
from gpubook.scheduler.sources.alarm import put as put_alarm
from gpubook.scheduler.sources.attendee import Answer, Resource
from gpubook.scheduler.sources.richtext import html_lines, is_html

BEGIN = "--- gpubook ---"
END = "--- end gpubook ---"
STATUS_PROPERTY = "X-GPUBOOK-STATUS"
OCCURRENCE_PARAMETER = "X-GPUBOOK-OCCURRENCE"
HELD_PARAMETER = "X-GPUBOOK-HELD"  # on an accepted status: its start came, it is not running (yet)
ALT_PROPERTY = "X-ALT-DESC"  # Outlook's HTML description
MAX_OCCURRENCES = 4  # entries kept in a series' block
_ENTRY = re.compile(r"^(?P<when>\d{4}-\d\d-\d\d(?: \d\d:\d\d [+-]\d{4})?): (?P<status>[a-z]+): (?P<head>.*)$")


class Status(StrEnum):
    ACCEPTED = "accepted"
    REJECTED = "rejected"
    STANDBY = "standby"  # refused for now, waiting for its GPUs (`standby: yes`): TENTATIVE, not DECLINED
    RUNNING = "running"
    ENDED = "ended"


# -- what is written ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Outcome:
    """A status and the lines a booker reads; the first line is the headline. `reminder`: gpubook's
    alarm in the event (gpubook/scheduler/sources/alarm.py); None: the event carries none of gpubook's.
    `resource`: the host (and GPUs) whose attendee answers (gpubook/scheduler/sources/attendee.py);
    None: the attendees are left as they are. `held`: accepted, its start came, and it does not run."""

    status: Status
    lines: tuple[str, ...]
    reminder: Reminder | None = None
    resource: Resource | None = None
    held: bool = False

    @property
    def answer(self) -> Answer:
        """What the host's attendee says of this outcome (PARTSTAT)."""
        return _answer(self.status, held=self.held)

    def with_note(self, note: str) -> Outcome:
        """Add a sentence, e.g. why a moved end was not followed."""
        return replace(self, lines=(*self.lines, one_line(note)))


def ssh_line(*, port: int, user: str, host: str) -> str:
    return f"ssh -p {port} {user}@{host}"


def sftp_line(*, port: int, user: str, host: str) -> str:
    return f"sftp -P {port} {user}@{host}"


def _when(moment: datetime, timezone: str) -> str:
    return moment.astimezone(ZoneInfo(timezone)).strftime("%Y-%m-%d %H:%M %z")


def one_line(text: str) -> str:
    return " ".join(str(text).split())


def accepted(*, gpus: Sequence[int], template: str, start: datetime, end: datetime, timezone: str,
             upload: str | None = None) -> Outcome:
    """`upload`: the SFTP line where the booker puts their input before the start."""
    count = f"{len(gpus)} GPU{'s' if len(gpus) != 1 else ''} ({', '.join(map(str, gpus))})"
    lines = (f"{count}, template {template}", f"from {_when(start, timezone)} to {_when(end, timezone)}")
    return Outcome(Status.ACCEPTED, lines + ((f"input: {upload} (put files in input/)",) if upload else ()))


def rejected(reason: str, *, standby: bool = False) -> Outcome:
    """`standby`: it waits on standby for its GPUs (core/plan.py's Rejection.standby)."""
    return Outcome(Status.STANDBY if standby else Status.REJECTED, (one_line(reason),))


def running(*, port: int, user: str, host: str, end: datetime, timezone: str, known_hosts: str = "",
            extra: Sequence[str] = ()) -> Outcome:
    """`known_hosts`: the booking's `[host]:port ssh-ed25519 AAAA...` line, for a first login
    without trust on first use; `extra`: lines said at its start (JupyterLab, CUDA limits)."""
    lines: tuple[str, ...] = (ssh_line(port=port, user=user, host=host), f"until {_when(end, timezone)}")
    lines += (f"known_hosts: {known_hosts}",) if known_hosts else ()
    return Outcome(Status.RUNNING, lines + tuple(one_line(line) for line in extra))


def ended(*, gpu_hours: float, outputs: str | None, at: datetime, timezone: str,
          download: str | None = None) -> Outcome:
    """`download`: the SFTP line where the booker fetches their output/ at any time."""
    lines = [f"{gpu_hours:.2f} GPU-hours, stopped {_when(at, timezone)}"]
    if download:
        lines.append(f"outputs: {download} (in output/)")
    elif outputs:
        lines.append(f"outputs: {outputs}")
    return Outcome(Status.ENDED, tuple(lines))


# -- the block in DESCRIPTION (pure) -----------------------------------------------------------


def _markers(description: str, marker: str) -> list[tuple[int, int]]:
    """(start, end) of each `marker` that stands on a line of its own: between the text's start, a
    line break or a tag's '>' and a line break, a '<' or the end, blanks allowed. Linear: each
    occurrence is found with str.find and its blanks are looked at once."""
    found, position = [], description.find(marker)
    while position >= 0:
        before = position
        while before > 0 and description[before - 1] in " \t":
            before -= 1
        after = position + len(marker)
        while after < len(description) and description[after] in " \t":
            after += 1
        if (before == 0 or description[before - 1] in "\n>") \
                and (after == len(description) or description[after] in "\r\n<"):
            found.append((position, position + len(marker)))
        position = description.find(marker, position + len(marker))
    return found


def find_block(description: str) -> tuple[int, int] | None:
    """(start, end) of gpubook's complete block in `description`, or None: the first end marker and
    the begin marker nearest above it (a begin marker without its end is not a block)."""
    begins = [start for start, _ in _markers(description, BEGIN)]
    for end_start, end_end in _markers(description, END):
        if (above := bisect.bisect_left(begins, end_start)) > 0:
            return begins[above - 1], end_end
    return None


def _body(description: str, span: tuple[int, int]) -> str:
    """The lines between a block's markers, in plain text."""
    inner = description[span[0] + len(BEGIN): span[1] - len(END)]
    return "\n".join(html_lines(inner)) if is_html(description) else inner


def strip_block(description: str) -> str:
    """`description` without gpubook's block: what the booking parser should read, so that a line
    gpubook wrote can never be taken for the user's `key: value` line."""
    span = find_block(description)
    return description if span is None else description[: span[0]] + description[span[1]:]


def replace_block(description: str, block: str) -> str:
    """`description` with gpubook's block replaced in place, or appended after a blank line
    (`<br><br>` in an HTML description)."""
    span = find_block(description)
    if span is not None:
        return description[: span[0]] + block + description[span[1]:]
    if not description.strip():
        return block
    if is_html(description):
        return description + "<br><br>" + block
    return description.rstrip("\r\n") + "\n\n" + block


def _render(body: Iterable[str], *, as_html: bool = False) -> str:
    lines = [BEGIN, *body, END]
    if not as_html:
        return "\n".join(lines)
    # Leading blanks (an entry's continuation lines) would collapse in HTML: keep them visible.
    return "<br>".join("&nbsp;" * (len(line) - len(line.lstrip(" "))) + html.escape(line.lstrip(" "), quote=False)
                       for line in lines)


def _single_body(outcome: Outcome) -> list[str]:
    head, *rest = outcome.lines or ("",)
    return [f"{outcome.status}: {head}", *rest]


@dataclass(frozen=True)
class _Entry:
    when: datetime | date
    label: str
    status: str
    lines: tuple[str, ...]


def _sort_key(when: datetime | date) -> datetime:
    if isinstance(when, datetime):
        return when.astimezone(UTC)
    return datetime(when.year, when.month, when.day, tzinfo=UTC)


def _parse_entries(body: str) -> list[_Entry]:
    """Entries of a series' block as gpubook wrote them; foreign lines inside the block are dropped."""
    entries: list[_Entry] = []
    for line in body.splitlines():
        if match := _ENTRY.match(line):
            label = match["when"]
            when = (datetime.strptime(label, "%Y-%m-%d %H:%M %z") if " " in label  # noqa: DTZ007 - %z is in it
                    else date.fromisoformat(label))
            entries.append(_Entry(when, label, match["status"], (match["head"],)))
        elif line.startswith("  ") and entries:
            last = entries[-1]
            entries[-1] = replace(last, lines=(*last.lines, line[2:]))
    return entries


def _series_entries(description: str, occurrence: datetime | date, label: str,
                    outcome: Outcome) -> list[_Entry]:
    span = find_block(description)
    old = _parse_entries(_body(description, span)) if span else []
    mine = _Entry(occurrence, label, str(outcome.status), outcome.lines or ("",))
    entries = [e for e in old if _sort_key(e.when) != _sort_key(occurrence)] + [mine]
    kept = sorted(entries, key=_keep_first)[:MAX_OCCURRENCES]
    return sorted(kept, key=lambda e: _sort_key(e.when))


def _keep_first(entry: _Entry) -> tuple[int, float]:
    """Which entries a full block keeps: the running occurrence's (the booker's ssh line) first,
    then the next ones to start (earliest first), then what ended (latest first). The entries
    furthest ahead are dropped, so writing one of them again changes nothing (no write churn)."""
    moment = _sort_key(entry.when).timestamp()
    if entry.status == Status.RUNNING:
        return 0, -moment
    if entry.status == Status.ENDED:
        return 2, -moment
    return 1, moment


def _series_body(entries: Sequence[_Entry]) -> list[str]:
    body = []
    for entry in entries:
        head, *rest = entry.lines
        body.append(f"{entry.label}: {entry.status}: {head}")
        body.extend(f"  {line}" for line in rest)
    return body


def _occurrence_value(when: datetime | date) -> str:
    if isinstance(when, datetime):
        return when.astimezone(UTC).strftime("%Y%m%dT%H%M%SZ")
    return when.strftime("%Y%m%d")


def label(when: datetime | date, timezone: str) -> str:
    if isinstance(when, datetime):
        return _when(when if when.tzinfo else when.replace(tzinfo=ZoneInfo(timezone)), timezone)
    return when.isoformat()


def _status_properties(component: icalendar.cal.Component) -> list[tuple[str, dict[str, str]]]:
    found = component.get(STATUS_PROPERTY)
    values = found if isinstance(found, list) else [] if found is None else [found]
    return [(str(v), {k.upper(): str(p) for k, p in getattr(v, "params", {}).items()}) for v in values]


def _same_occurrence(a: datetime | date, b: datetime | date, timezone: str) -> bool:
    if isinstance(a, datetime) != isinstance(b, datetime):
        return False
    if isinstance(a, datetime) and isinstance(b, datetime):
        zone = ZoneInfo(timezone)  # floating times are read in the host's zone, as bookings do
        return (a if a.tzinfo else a.replace(tzinfo=zone)) == (b if b.tzinfo else b.replace(tzinfo=zone))
    return a == b


def _target(calendar: icalendar.Calendar, uid: str, occurrence: datetime | date | None,
            timezone: str) -> tuple[icalendar.cal.Component, datetime | date | None] | None:
    """The component to write on, and the occurrence to name in it (None: the component is the occurrence)."""
    events = [c for c in calendar.walk("VEVENT") if str(c.get("UID", "")) == uid]
    master = next((e for e in events if "RECURRENCE-ID" not in e), None)
    if occurrence is not None:
        for override in events:
            recurrence_id: Any = override.get("RECURRENCE-ID")
            if recurrence_id is not None and _same_occurrence(recurrence_id.dt, occurrence, timezone):
                return override, None
    if master is None:
        return None
    recurring = "RRULE" in master or "RDATE" in master
    return master, occurrence if recurring and occurrence is not None else None


def apply(calendar: icalendar.Calendar, *, uid: str, occurrence: datetime | date | None, outcome: Outcome,
          timezone: str = "UTC") -> bool | None:
    """Put `outcome` into the event `uid` of `calendar` (in place). True: changed; False: it already
    said this; None: no such event or occurrence in the object."""
    found = _target(calendar, uid, occurrence, timezone)
    if found is None:
        return None
    component, named = found
    old_description = component.get("DESCRIPTION")
    description = str(old_description) if old_description is not None else ""
    if named is None:
        body = _single_body(outcome)
        held = outcome.held and outcome.status == Status.ACCEPTED
        statuses: list[tuple[str, dict[str, str]]] = [(str(outcome.status), _held({}, held=held))]
        answer, resource = outcome.answer, outcome.resource
    else:
        entries = _series_entries(description, named, label(named, timezone), outcome)
        body = _series_body(entries)
        statuses = _series_statuses(component, entries, named=named, outcome=outcome)
        # The master serves every occurrence: its attendee names no GPUs, which may differ from one
        # occurrence to the next, so that each occurrence's write finds the same attendee there.
        answer = _series_answer(statuses)
        resource = replace(outcome.resource, gpus=()) if outcome.resource is not None else None
    changed = _put_block(component, "DESCRIPTION", body)
    if _is_html_alternative(component.get(ALT_PROPERTY)):
        changed = _put_block(component, ALT_PROPERTY, body, as_html=True) or changed
    changed = _put_reminder(component, outcome, named=named, statuses=statuses) or changed
    if resource is not None:
        changed = attendee.put(component, resource, answer) or changed
        changed = event_status.put(component, answer, own_attendee=resource.address) or changed
    if not changed and statuses == _status_properties(component):
        return False
    component.pop(STATUS_PROPERTY, None)
    for value, parameters in statuses:
        component.add(STATUS_PROPERTY, value, parameters=parameters)
    return True


def _answer(status: str, *, held: bool) -> Answer:
    if status == Status.REJECTED:
        return Answer.DECLINED
    if status == Status.STANDBY:
        return Answer.TENTATIVE
    return Answer.TENTATIVE if held and status == Status.ACCEPTED else Answer.ACCEPTED


def _held(parameters: dict[str, str], *, held: bool) -> dict[str, str]:
    return {**parameters, HELD_PARAMETER: "TRUE"} if held else parameters


def _series_statuses(component: icalendar.cal.Component, entries: Sequence[_Entry], *, named: datetime | date,
                     outcome: Outcome) -> list[tuple[str, dict[str, str]]]:
    """One X-GPUBOOK-STATUS per entry; whether another occurrence is held is read from its status
    as written before (the block's text does not say it)."""
    before = {parameters.get(OCCURRENCE_PARAMETER): HELD_PARAMETER in parameters
              for _, parameters in _status_properties(component)}
    statuses = []
    for entry in entries:
        value = _occurrence_value(entry.when)
        held = outcome.held if _sort_key(entry.when) == _sort_key(named) else before.get(value, False)
        statuses.append((entry.status, _held({OCCURRENCE_PARAMETER: value},
                                              held=held and entry.status == Status.ACCEPTED)))
    return statuses


def _series_answer(statuses: Sequence[tuple[str, dict[str, str]]]) -> Answer:
    """What the master's attendee says for the whole series: ACCEPTED while any occurrence listed
    is accepted (running, ended), TENTATIVE when the only accepted ones are held, DECLINED when
    gpubook refused every occurrence listed. Each occurrence's own answer is its entry in the block."""
    answers = {_answer(status, held=HELD_PARAMETER in parameters) for status, parameters in statuses
               if status in {str(known) for known in Status}}
    return next((a for a in (Answer.ACCEPTED, Answer.TENTATIVE) if a in answers), Answer.DECLINED)


def _put_reminder(component: icalendar.cal.Component, outcome: Outcome, *, named: datetime | date | None,
                  statuses: Sequence[tuple[str, dict[str, str]]]) -> bool:
    """gpubook's alarm on the component written. On a series' master one rejected occurrence does
    not take the alarm away from the series' accepted or running ones."""
    if named is not None and outcome.status in (Status.REJECTED, Status.STANDBY) \
            and any(status in (Status.ACCEPTED, Status.RUNNING) for status, _ in statuses):
        return False
    return put_alarm(component, outcome.reminder, series=named is not None)


def _put_block(component: icalendar.cal.Component, name: str, body: Sequence[str], *,
               as_html: bool = False) -> bool:
    """Write the block into one text property, in the form its text is in; True if it changed."""
    old = component.get(name)
    description = str(old) if old is not None else ""
    as_html = as_html or is_html(strip_block(description))
    new_description = replace_block(description, _render(body, as_html=as_html))
    if new_description == description:
        return False
    text = icalendar.vText(new_description)
    if old is not None:
        text.params.update(getattr(old, "params", {}))
    component[name] = text
    return True


def _is_html_alternative(prop: object) -> bool:
    """Outlook's HTML copy of the description, which it shows instead of DESCRIPTION."""
    return prop is not None and str(getattr(prop, "params", {}).get("FMTTYPE", "")).lower() == "text/html"
