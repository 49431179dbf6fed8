"""Reminders: gpubook's VALARM in accepted events (on Radicale, read back by khal) and reminder notices.

The hostile case: the booker's own alarms must come out of every gpubook write byte for byte.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import icalendar
import pytest
import requests

from gpubook.scheduler.config import Config, parse
from gpubook.scheduler.core import upkeep
from gpubook.scheduler.core.bookings import Booking, Rejection
from gpubook.scheduler.core.plan import Accepted, Plan
from gpubook.scheduler.outbox import reminders
from gpubook.scheduler.outbox.writeback import Remarks, WriteBack
from gpubook.scheduler.sources import block
from gpubook.scheduler.sources.alarm import MARK_PROPERTY, Reminder
from gpubook.scheduler.state import State, notes
from tests.kits import servers

USER, PASSWORD = "test", "any"
START = datetime(2030, 11, 25, 8, 0, tzinfo=UTC)
BOOKER_ALARMS = (
    "BEGIN:VALARM\r\nACTION:DISPLAY\r\nTRIGGER:-P1D\r\nDESCRIPTION:pack the dataset\r\n"
    "X-MOZ-LASTACK:20261101T000000Z\r\nEND:VALARM\r\n",
    "BEGIN:VALARM\r\nACTION:AUDIO\r\nTRIGGER;VALUE=DATE-TIME:20301125T073000Z\r\nEND:VALARM\r\n",
)
NO_REMARKS = Remarks(refused={}, failures={}, notes={})


def _event(uid: str, *, rrule: str | None = None, alarms: tuple[str, ...] = BOOKER_ALARMS) -> str:
    lines = ["BEGIN:VCALENDAR", "VERSION:2.0", "PRODID:-//gpubook tests//EN", "BEGIN:VEVENT", f"UID:{uid}",
             "DTSTAMP:20261101T000000Z", "DTSTART:20301125T080000Z", "DTEND:20301125T100000Z",
             "SUMMARY:alice training", "DESCRIPTION:user: alice", *([f"RRULE:{rrule}"] if rrule else [])]
    return "\r\n".join(lines) + "\r\n" + "".join(alarms) + "END:VEVENT\r\nEND:VCALENDAR\r\n"


def _config(url: str = "http://127.0.0.1:9/cal/", *, remind: float = 15, own: float | None = None,
            notify: bool = False) -> Config:
    alice: dict[str, object] = {"uid": 2001, "email": ["alice@lab.example"]}
    if own is not None:
        alice["remind_minutes"] = own
    data: dict[str, object] = {
        "host": {"name": "devbox1", "timezone": "UTC"},
        "calendar": [{"url": url, "username": USER}],
        "gpus": {"count": 2},
        "users": {"alice": alice},
        "policy": {"remind_minutes": remind},
    }
    if notify:
        data["notify"] = {"webhook": {"enabled": True, "url": "http://127.0.0.1:9/hook"}}
    return parse(data, Path("/etc/gpubook/gpubook.toml"))


def _booking(uid: str, *, url: str = "http://127.0.0.1:9/cal/", href: str = "", occurrence: bool = False,
             start: datetime = START) -> Booking:
    booking_id = f"{uid}@{start.strftime('%Y%m%dT%H%M%SZ')}" if occurrence else uid
    return Booking(id=booking_id, uid=uid, user="alice", template="debian-ssh", gpu_count=1, gpu_indices=None,
                   start=start, end=start + timedelta(hours=2), created=None, dtstamp=None, calendar_url=url,
                   href=href, summary="alice training")


def _plan(*accepted: Booking, rejected: tuple[Rejection, ...] = ()) -> Plan:
    return Plan(accepted=tuple(Accepted(booking=b, gpus=(0,), warn_at=b.end) for b in accepted),
                rejected=rejected, next_wakeup=None)


def _alarms(component: icalendar.cal.Component) -> list[icalendar.cal.Component]:
    return [sub for sub in component.subcomponents if sub.name == "VALARM"]


# -- the event, pure ---------------------------------------------------------------------------


def _outcome(minutes: float | None) -> block.Outcome:
    outcome = block.accepted(gpus=(0,), template="debian-ssh", start=START, end=START + timedelta(hours=2),
                             timezone="UTC")
    reminder = Reminder(minutes=minutes, text='gpubook: "x" starts', detail="d") if minutes is not None else None
    return block.Outcome(outcome.status, outcome.lines, reminder=reminder)


def test_one_alarm_added_updated_and_removed_beside_the_bookers_own() -> None:
    calendar = icalendar.Calendar.from_ical(_event("u1"))
    assert block.apply(calendar, uid="u1", occurrence=None, outcome=_outcome(15)) is True
    (event,) = calendar.walk("VEVENT")
    booker = [a.to_ical() for a in _alarms(event)[:2]]
    ours = [a for a in _alarms(event) if MARK_PROPERTY in a]
    assert len(ours) == 1 and ours[0]["TRIGGER"].to_ical() == b"-PT15M"
    assert str(ours[0]["ACTION"]) == "DISPLAY" and str(ours[0]["UID"]) == "gpubook-u1"
    assert block.apply(calendar, uid="u1", occurrence=None, outcome=_outcome(15)) is False  # no churn
    assert block.apply(calendar, uid="u1", occurrence=None, outcome=_outcome(30)) is True
    assert [a["TRIGGER"].to_ical() for a in _alarms(event) if MARK_PROPERTY in a] == [b"-PT30M"]
    assert block.apply(calendar, uid="u1", occurrence=None, outcome=_outcome(None)) is True
    assert [a.to_ical() for a in _alarms(event)] == booker


def test_a_series_keeps_its_alarm_on_the_master_while_one_occurrence_is_accepted() -> None:
    calendar = icalendar.Calendar.from_ical(_event("s1", rrule="FREQ=WEEKLY;COUNT=4"))
    week = START + timedelta(days=7)
    block.apply(calendar, uid="s1", occurrence=START, outcome=_outcome(15))
    (master,) = calendar.walk("VEVENT")
    (ours,) = [a for a in _alarms(master) if MARK_PROPERTY in a]
    assert str(ours["DESCRIPTION"]) == 'gpubook: "x" starts'  # no occurrence's detail on the master
    # Another occurrence rejected: the accepted one keeps the series' alarm.
    block.apply(calendar, uid="s1", occurrence=week, outcome=block.rejected("GPU 0 is taken"))
    assert len([a for a in _alarms(master) if MARK_PROPERTY in a]) == 1
    # The accepted one rejected too: gone.
    block.apply(calendar, uid="s1", occurrence=START, outcome=block.rejected("GPU 0 is taken"))
    assert not [a for a in _alarms(master) if MARK_PROPERTY in a] and len(_alarms(master)) == 2


def test_remind_minutes_per_user_and_off_by_default(tmp_path: Path) -> None:
    assert parse({"host": {"name": "h"}, "calendar": [{"url": "http://x/c/"}], "gpus": {"count": 1}},
                 Path("/x.toml")).policy.remind_minutes == 0
    state = State(tmp_path / "state.sqlite")
    writeback = WriteBack(_config(remind=15, own=5), state)
    outcome = writeback.outcome(Accepted(_booking("u"), gpus=(0,), warn_at=START), None, None, remarks=NO_REMARKS,
                                now=START - timedelta(days=1))
    assert outcome is not None and outcome.reminder is not None and outcome.reminder.minutes == 5
    off = WriteBack(_config(remind=15, own=0), state)
    outcome = off.outcome(Accepted(_booking("u"), gpus=(0,), warn_at=START), None, None, remarks=NO_REMARKS,
                          now=START - timedelta(days=1))
    assert outcome is not None and outcome.reminder is None
    state.close()


# -- on Radicale, read back by khal -----------------------------------------------------------


@pytest.fixture(scope="module")
def calendar_url() -> Iterator[str]:
    with servers.running(servers.radicale) as server:
        yield str(server.new_calendar().url)


def _put(url: str, text: str, name: str) -> str:
    href = url.rstrip("/") + f"/{name}.ics"
    requests.put(href, data=text.encode(), auth=(USER, PASSWORD), timeout=10,
                 headers={"Content-Type": "text/calendar"}).raise_for_status()
    return href


def _fetch(href: str) -> str:
    answer = requests.get(href, auth=(USER, PASSWORD), timeout=10)
    answer.raise_for_status()
    return answer.text


def _write(config: Config, state: State, plan: Plan, now: datetime) -> None:
    writeback = WriteBack(config, state)
    writeback.write(plan, containers=[], now=now, etags={})
    assert writeback.settle(timeout=30)
    writeback.close()


def _booker_alarm_texts(ics: str) -> list[str]:
    """The booker's VALARM blocks exactly as the server stores them (unfolded lines)."""
    text = ics.replace("\r\n ", "").replace("\r\n", "\n")
    found = []
    for chunk in text.split("BEGIN:VALARM\n")[1:]:
        body = chunk.split("END:VALARM\n")[0]
        if MARK_PROPERTY not in body:
            found.append(body)
    return found


def _khal(tmp_path: Path, ics: str) -> tuple[str, list[list[str]]]:
    """khal, a real calendar client, reading the event: its printics line and its parsed alarms."""
    if shutil.which("khal") is None:
        pytest.fail("khal is not installed (Debian package khal; quickstart installs it)")
    (tmp_path / "cal").mkdir(exist_ok=True)
    conf = tmp_path / "khal.conf"
    conf.write_text(f"[calendars]\n[[lab]]\npath = {tmp_path / 'cal'}\n[locale]\nlocal_timezone = UTC\n"
                    "default_timezone = UTC\ntimeformat = %H:%M\ndateformat = %Y-%m-%d\n"
                    "longdateformat = %Y-%m-%d\ndatetimeformat = %Y-%m-%d %H:%M\n"
                    "longdatetimeformat = %Y-%m-%d %H:%M\n")
    (tmp_path / "event.ics").write_text(ics)
    shown = subprocess.run(["khal", "-c", str(conf), "printics", "-f", "{title}|{alarm-symbol}|{start}",
                            str(tmp_path / "event.ics")], capture_output=True, text=True, check=True).stdout
    # khal's own event model (Debian's python3 runs khal), for the trigger and the text it would show.
    script = ("import json,sys,pytz\nfrom khal.khalendar.event import Event\n"
              "z=pytz.UTC\nl=dict(local_timezone=z,default_timezone=z,timeformat='%H:%M',dateformat='%Y-%m-%d',"
              "longdateformat='%Y-%m-%d',datetimeformat='%Y-%m-%d %H:%M',longdatetimeformat='%Y-%m-%d %H:%M',"
              "unicode_symbols=True)\ne=Event.fromString(open(sys.argv[1]).read(),locale=l)\n"
              "print(json.dumps([[str(t.total_seconds()),str(d)] for t,d in e.alarms]))\n")
    alarms = subprocess.run(["/usr/bin/python3", "-c", script, str(tmp_path / "event.ics")], capture_output=True,
                            text=True, check=True).stdout
    return shown, json.loads(alarms)


@pytest.mark.caldav
def test_the_alarm_is_on_the_server_and_khal_sees_it_beside_the_bookers_own(calendar_url: str,
                                                                            tmp_path: Path) -> None:
    uid = f"{time.time_ns()}@gpubook-test"
    href = _put(calendar_url, _event(uid), uid.split("@")[0])
    before = _booker_alarm_texts(_fetch(href))
    assert len(before) == 2
    booking = _booking(uid, url=calendar_url, href=href)
    now = START - timedelta(days=2)
    with State(tmp_path / "state.sqlite") as state:
        _write(_config(calendar_url, remind=15), state, _plan(booking), now)
        stored = _fetch(href)
        assert stored.count(f"{MARK_PROPERTY}:1") == 1 and "TRIGGER;RELATED=START:-PT15M" in stored
        assert _booker_alarm_texts(stored) == before
        shown, alarms = _khal(tmp_path, stored)
        assert "alice training| ⏰|2030-11-25 08:00" in shown
        assert ["-900.0", 'gpubook: "alice training" starts in 15 min on devbox1 (1 GPU); '
                "the event shows the ssh line at the start"] in alarms
        # khal lists relative alarms: the booker's "-P1D" and gpubook's (it skips the absolute one).
        assert [seconds for seconds, _ in alarms] == ["-86400.0", "-900.0"]

        # The same again: no write (the ETag stays); remind_minutes changed: updated in place.
        etag = requests.get(href, auth=(USER, PASSWORD), timeout=10).headers["ETag"]
        _write(_config(calendar_url, remind=15), state, _plan(booking), now)
        assert requests.get(href, auth=(USER, PASSWORD), timeout=10).headers["ETag"] == etag
        _write(_config(calendar_url, remind=30), state, _plan(booking), now)
        stored = _fetch(href)
        assert stored.count(f"{MARK_PROPERTY}:1") == 1 and "-PT30M" in stored and "-PT15M" not in stored
        assert _booker_alarm_texts(stored) == before

        # Rejected: gpubook's alarm goes, the booker's two stay byte for byte.
        rejection = Rejection(id=uid, uid=uid, start=booking.start, end=booking.end, reason="GPU 0 is taken",
                              user="alice", calendar_url=calendar_url, href=href)
        _write(_config(calendar_url, remind=30), state, _plan(rejected=(rejection,)), now)
        stored = _fetch(href)
        assert MARK_PROPERTY not in stored and _booker_alarm_texts(stored) == before
        assert _khal(tmp_path, stored)[1] == [["-86400.0", "pack the dataset"]]


@pytest.mark.caldav
def test_turning_the_policy_off_removes_only_gpubooks_alarm(calendar_url: str, tmp_path: Path) -> None:
    uid = f"{time.time_ns()}@gpubook-test"
    href = _put(calendar_url, _event(uid, rrule="FREQ=WEEKLY;COUNT=3"), uid.split("@")[0])
    before = _booker_alarm_texts(_fetch(href))
    occurrences = [_booking(uid, url=calendar_url, href=href, occurrence=True, start=START + timedelta(days=7 * n))
                   for n in range(3)]
    now = START - timedelta(days=2)
    with State(tmp_path / "state.sqlite") as state:
        _write(_config(calendar_url, remind=10), state, _plan(*occurrences), now)
        stored = _fetch(href)
        assert stored.count(f"{MARK_PROPERTY}:1") == 1  # one on the master for every occurrence
        assert _booker_alarm_texts(stored) == before
        assert [alarm[0] for alarm in _khal(tmp_path, stored)[1]] == ["-86400.0", "-600.0"]
        _write(_config(calendar_url, remind=0), state, _plan(*occurrences), now)
        stored = _fetch(href)
        assert MARK_PROPERTY not in stored and _booker_alarm_texts(stored) == before


# -- reminder notices --------------------------------------------------------------------------


def queue_due(plan: Plan, *, config: Config, state: State, now: datetime) -> datetime | None:
    """What a pass does with reminders, without a pass: `upkeep.reminders` decides from State's
    notes, each due one is queued (`reminders.queue`, as the pass's RemindHandler does); gives when
    the next one is due (None: none ahead)."""
    if not reminders.wanted(config):
        return None
    due, ahead = upkeep.reminders(plan, reminded=notes.read(state).reminded, minutes=reminders.minutes_of(config),
                                  now=now)
    for action in due:
        reminders.queue(state, action, config=config, now=now)
    return ahead


def test_a_reminder_notice_is_queued_once_when_due(tmp_path: Path) -> None:
    config = _config(remind=15, notify=True)
    booking = _booking("n1")
    with State(tmp_path / "state.sqlite") as state:
        early = START - timedelta(hours=1)
        assert queue_due(_plan(booking), config=config, state=state, now=early) == \
            START - timedelta(minutes=15)  # the daemon's boundary wake-up
        assert state.pending_notices() == []
        due = START - timedelta(minutes=15)
        assert queue_due(_plan(booking), config=config, state=state, now=due) is None
        assert queue_due(_plan(booking), config=config, state=state, now=due + timedelta(minutes=1)) is None
        (notice,) = state.pending_notices()
        assert notice.kind == "reminder" and notice.booking_id == "n1" and "2030-11-25 08:00" in notice.text
        # Moved to a later start: reminded again, of the new start.
        moved = _booking("n1", start=START + timedelta(days=1))
        queue_due(_plan(moved), config=config, state=state, now=moved.start - timedelta(minutes=5))
        assert len(state.pending_notices()) == 2
        # Without a channel that sends reminders, nothing is queued.
        quiet = _booking("n2")
        queue_due(_plan(quiet), config=_config(remind=15), state=state, now=due)
        assert len(state.pending_notices()) == 2
