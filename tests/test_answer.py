"""The answer in every calendar view (issue 24, part 2): the booked host as a resource attendee whose
PARTSTAT says accepted, refused, held or ended, written by a real pass into events on real
Radicale and Xandikos (read back through the real CalDAV source and booking reader), the booker's
own properties and attendees kept, nothing written when nothing is new; and the answers' notices,
sent by default, once each, across passes and restarts."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import replace
from datetime import datetime, timedelta
from email import message_from_bytes
from email.policy import default as default_policy
from pathlib import Path

import caldav
import icalendar
import pytest
import requests

from gpubook.runtime.engines import container_name
from gpubook.runtime.errors import EngineError
from gpubook.runtime.templates.catalog import load_all
from gpubook.scheduler import config as config_module
from gpubook.scheduler.apply.passes import Pass
from gpubook.scheduler.core.bookings import Booking, Rejection
from gpubook.scheduler.hosts.local import OneMachine
from gpubook.scheduler.outbox import notices
from gpubook.scheduler.sources import EventRef, block, open_source
from gpubook.scheduler.sources.attendee import Resource, address_of
from gpubook.scheduler.sources.caldav_writer import CalendarWriter
from gpubook.scheduler.state import State
from tests.kits import servers
from tests.kits.booking_kit import read, vcalendar
from tests.kits.daemon_kit import port_range
from tests.kits.pass_kit import HOLD, NOW, Machine, event, make_pass

HOST = "devbox1"
ATTENDEE = "urn:x-gpubook:host:devbox1"  # the host's own address, to which no client sends mail
HOUR = timedelta(hours=1)


def _config(tmp_path: Path, url: str, *, notify: str = "") -> config_module.Config:
    """The config of these passes; its SSH ports a free block of the lane's (the ports are probed on
    this host, and the lanes run side by side: a fixed 2200 was once another lane's at that moment)."""
    low, high = port_range()
    path = tmp_path / "gpubook.toml"
    path.write_text(f'[host]\nname = "{HOST}"\ntimezone = "UTC"\n[[calendar]]\nurl = "{url}"\n'
                    '[engine]\nname = "podman"\n[gpus]\ncount = 2\n'
                    '[defaults]\ntemplate = "debian-ssh"\ngpus = 1\nwarn_minutes = 15\n'
                    f'[ssh]\nport_min = {low}\nport_max = {high}\n'
                    '[users.alice]\nuid = 2001\nemail = ["alice@lab.example"]\n[users.bob]\nuid = 2002\n' + notify)
    return config_module.load(path)


def _occurrences(config: config_module.Config) -> tuple[list[Booking | Rejection], dict[str, str | None]]:
    """What the daemon reads: the calendar polled through its real source, expanded by the real reader."""
    source = open_source(config.calendars[0])
    try:
        snapshot = source.poll()
    finally:
        source.close()
    objects = list(snapshot.objects.values())
    expansion = read(*objects, config=config, calendar_url=config.calendars[0].url,
                     start=NOW - timedelta(days=1), end=NOW + timedelta(days=7))
    return list(expansion.occurrences), {o.href: o.etag for o in objects}


def _pass(passes: Pass, config: config_module.Config, *, now: datetime = NOW) -> None:
    occurrences, etags = _occurrences(config)
    passes.run(occurrences, now=now, etags=etags)
    for future in list(passes.busy.values()):
        future.result(HOLD)
    assert passes.writeback.settle(HOLD)


def _stored(calendar: caldav.Calendar) -> dict[str, tuple[str, icalendar.Event]]:
    """Each event on the server as a client reads it: UID → (ETag, its first VEVENT)."""
    found = {}
    for resource in calendar.events():
        answer = requests.get(str(resource.url), auth=("test", "any"), timeout=10)
        answer.raise_for_status()
        component = next(iter(icalendar.Calendar.from_ical(answer.content).walk("VEVENT")))
        found[str(component["UID"])] = (answer.headers["ETag"], component)
    return found


def _attendees(component: icalendar.cal.Component) -> list[icalendar.vCalAddress]:
    found = component.get("ATTENDEE")
    return found if isinstance(found, list) else [] if found is None else [found]


def _host_attendee(component: icalendar.cal.Component) -> dict[str, str]:
    """The host's attendee's parameters; there is exactly one."""
    (ours,) = [a for a in _attendees(component) if str(a).lower() == ATTENDEE]
    return {str(k).upper(): str(v) for k, v in ours.params.items()}


@pytest.fixture
def state(tmp_path: Path) -> Iterator[State]:
    with State(tmp_path / "state.sqlite") as opened:
        yield opened


def _ended_run(state: State, booking_id: str) -> None:
    """A run of `booking_id` from three hours to one hour ago, stopped at its end."""
    name = container_name(booking_id)
    state.container_started(booking_id, name, user="alice", gpu_count=1, at=NOW - 3 * HOUR)
    state.container_stopped(name, reason="the booking ended", at=NOW - HOUR)


@pytest.mark.caldav
def test_the_host_answers_accepted_refused_held_running_and_ended(
        tmp_path: Path, state: State, caldav_server: servers.CalendarServer) -> None:
    calendar = caldav_server.new_calendar()
    config = _config(tmp_path, str(calendar.url))
    for text in (event("ahead", NOW + 24 * HOUR, NOW + 26 * HOUR),
                 event("refused", NOW + 24 * HOUR, NOW + 26 * HOUR, extra=("DESCRIPTION:gpus: 5",)),
                 event("now", NOW - HOUR, NOW + HOUR, extra=("DESCRIPTION:gpus: 0\\,",)),
                 event("held", NOW - HOUR, NOW + HOUR, extra=("DESCRIPTION:gpus: 1\\,",)),
                 event("ended", NOW - 3 * HOUR, NOW - HOUR)):
        calendar.save_event(vcalendar(text))
    _ended_run(state, "ended")
    machine = Machine()
    machine.failing["held"] = EngineError("image localhost/x is not present")
    passes = make_pass(config, machine, state)
    try:
        _pass(passes, config)
        stored = _stored(calendar)
        answers = {uid: _host_attendee(component) for uid, (_, component) in stored.items()}
        assert {uid: a["PARTSTAT"] for uid, a in answers.items()} == {
            "ahead": "ACCEPTED", "refused": "DECLINED", "now": "ACCEPTED", "held": "TENTATIVE", "ended": "ACCEPTED"}
        assert {uid: str(component["X-GPUBOOK-STATUS"]) for uid, (_, component) in stored.items()} == {
            "ahead": "accepted", "refused": "rejected", "now": "running", "held": "accepted", "ended": "ended"}
        for answer in answers.values():  # a room's answer, which no server turns into an invitation
            assert (answer["CUTYPE"], answer["ROLE"], answer["SCHEDULE-AGENT"], answer["RSVP"]) == (
                "RESOURCE", "REQ-PARTICIPANT", "CLIENT", "FALSE")
        assert answers["now"]["CN"] == "devbox1 GPU 0" and answers["held"]["CN"] == "devbox1 GPU 1"
        assert answers["refused"]["CN"] == "devbox1 GPUs"
        assert stored["held"][1]["X-GPUBOOK-STATUS"].params["X-GPUBOOK-HELD"] == "TRUE"
        # What the views draw (Thunderbird fades TENTATIVE): the event's STATUS, gpubook's on these
        # events of the booker's own (no STATUS, nobody invited); never CANCELLED, which gpubook's
        # reader would skip: every booking is still read.
        assert {uid: (str(component["STATUS"]), str(component["X-GPUBOOK-OWNS-STATUS"]))
                for uid, (_, component) in stored.items()} == {
            "ahead": ("CONFIRMED", "CONFIRMED"), "refused": ("TENTATIVE", "TENTATIVE"),
            "now": ("CONFIRMED", "CONFIRMED"), "held": ("TENTATIVE", "TENTATIVE"), "ended": ("CONFIRMED", "CONFIRMED")}
        assert sorted(o.id for o in _occurrences(config)[0]) == ["ahead", "ended", "held", "now", "refused"]

        # A pass with nothing new writes nothing: every ETag stays.
        _pass(passes, config, now=NOW + timedelta(seconds=30))
        assert {uid: etag for uid, (etag, _) in _stored(calendar).items()} == \
            {uid: etag for uid, (etag, _) in stored.items()}

        # The held booking starts: its answer becomes ACCEPTED, in the same attendee.
        del machine.failing["held"]
        passes.recall.failures.clear()  # its retry is due now
        _pass(passes, config, now=NOW + timedelta(minutes=2))
        component = _stored(calendar)["held"][1]
        assert _host_attendee(component)["PARTSTAT"] == "ACCEPTED"
        assert str(component["X-GPUBOOK-STATUS"]) == "running" and "X-GPUBOOK-HELD" not in \
            component["X-GPUBOOK-STATUS"].params
        assert str(component["STATUS"]) == "CONFIRMED"
    finally:
        passes.close()


BOOKERS_OWN = (
    "ORGANIZER;CN=Alice Liddell:mailto:alice@lab.example",
    "ATTENDEE;CN=Bob;ROLE=OPT-PARTICIPANT;PARTSTAT=TENTATIVE;RSVP=TRUE:mailto:bob@lab.example",
    "ATTENDEE;CUTYPE=ROOM;PARTSTAT=ACCEPTED;CN=Seminar room:mailto:room-3@lab.example",
    "ATTENDEE;CN=devbox2 GPU 0;CUTYPE=RESOURCE;PARTSTAT=DECLINED:urn:x-gpubook:host:devbox2",
    "STATUS:TENTATIVE",
    "CLASS:PRIVATE",
    "CATEGORIES:thesis,gpu",
    "X-LAB-PROJECT;X-GRANT=42:vision",
    "DESCRIPTION:gpus: 1\\nmy own notes",
)


@pytest.mark.caldav
def test_a_held_booking_says_why_it_waits_and_its_host_answers_tentative(
        tmp_path: Path, state: State, caldav_server: servers.CalendarServer) -> None:
    """A booking whose start came while gpubook starts nothing (here: its calendar data too old)
    is held: the reason is a line of its block, the attendee and STATUS say TENTATIVE."""
    calendar = caldav_server.new_calendar()
    config = _config(tmp_path, str(calendar.url))
    calendar.save_event(vcalendar(event("wait", NOW - HOUR, NOW + HOUR)))
    reason = "the calendar could not be read for 12 minutes"
    passes = make_pass(config, Machine(), state)
    try:
        occurrences, etags = _occurrences(config)
        passes.run(occurrences, now=NOW, etags=etags, may_start=False, stale_reason=reason)
        assert passes.writeback.settle(HOLD)
        component = _stored(calendar)["wait"][1]
        assert str(component["DESCRIPTION"]).endswith(f"{reason}\n--- end gpubook ---")
        assert (_host_attendee(component)["PARTSTAT"], str(component["STATUS"])) == ("TENTATIVE", "TENTATIVE")
        _pass(passes, config, now=NOW + timedelta(seconds=30))  # it may start again, and does
        component = _stored(calendar)["wait"][1]
        assert reason not in str(component["DESCRIPTION"])
        assert (_host_attendee(component)["PARTSTAT"], str(component["STATUS"])) == ("ACCEPTED", "CONFIRMED")
    finally:
        passes.close()


@pytest.mark.caldav
def test_writing_the_same_answer_again_changes_nothing_on_the_server(caldav_server: servers.CalendarServer) -> None:
    """The server's copy of the attendee (as Radicale and Xandikos keep it) reads back as what was
    written: a second write of the same answer finds nothing to change, and the ETag stays."""
    calendar = caldav_server.new_calendar()
    href = str(calendar.save_event(vcalendar(event("same", NOW, NOW + HOUR, extra=BOOKERS_OWN[:2]))).url)
    writer = CalendarWriter(str(calendar.url), username="test", password="any", timezone="UTC")
    ref = EventRef(str(calendar.url), href, "same")
    try:
        accepted = block.accepted(gpus=[0, 1], template="debian-ssh", start=NOW, end=NOW + HOUR, timezone="UTC")
        for outcome in (replace(block.rejected("GPU 0 is booked by bob"), resource=Resource(HOST)),
                        replace(accepted, resource=Resource(HOST, (0, 1)))):
            assert writer.write(ref, outcome).written
            etag = _stored(calendar)["same"][0]
            again = writer.write(ref, outcome)
            assert (again.written, again.reason) == (False, "unchanged")
            assert _stored(calendar)["same"][0] == etag
        assert writer.write(ref, replace(outcome, held=True)).written  # only the answer is new
        assert _host_attendee(_stored(calendar)["same"][1])["PARTSTAT"] == "TENTATIVE"
        # Thunderbird, saving as the organizer on a scheduling server, drops SCHEDULE-AGENT=CLIENT
        # from attendees (the server would then schedule them): the next write puts it back.
        mine = calendar.event_by_uid("same")
        with mine.edit_icalendar_instance() as ical:
            for attendee in _attendees(next(iter(ical.walk("VEVENT")))):
                attendee.params.pop("SCHEDULE-AGENT", None)
        mine.save(increase_seqno=False)
        assert "SCHEDULE-AGENT" not in _host_attendee(_stored(calendar)["same"][1])
        assert writer.write(ref, replace(outcome, held=True)).written
        assert _host_attendee(_stored(calendar)["same"][1])["SCHEDULE-AGENT"] == "CLIENT"
    finally:
        writer.close()


class _BookerEditsMeanwhile(CalendarWriter):
    """The real writer, with the booker adding a colleague between gpubook's read and its write."""

    def _modify(self, event, ref, outcome):  # type: ignore[no-untyped-def]
        changed = super()._modify(event, ref, outcome)
        if not getattr(self, "raced", False):
            self.raced = True
            mine = caldav.DAVClient(url=self.url, username="test", password="any").calendar(url=self.url)
            edited = mine.event_by_url(ref.href)
            with edited.edit_icalendar_instance() as ical:
                next(iter(ical.walk("VEVENT"))).add("ATTENDEE", "mailto:carol@lab.example", parameters={"CN": "Carol"})
            edited.save(increase_seqno=False)
        return changed


@pytest.mark.caldav
def test_an_attendee_the_booker_adds_while_gpubook_writes_is_kept(caldav_server: servers.CalendarServer) -> None:
    calendar = caldav_server.new_calendar()
    href = str(calendar.save_event(vcalendar(event("race", NOW, NOW + HOUR, extra=BOOKERS_OWN[:2]))).url)
    writer = _BookerEditsMeanwhile(str(calendar.url), username="test", password="any", timezone="UTC",
                                   retry_delay=0)
    try:
        result = writer.write(EventRef(str(calendar.url), href, "race"),
                              replace(block.rejected("GPU 0 is booked by bob"), resource=Resource(HOST)))
    finally:
        writer.close()
    assert (result.written, result.attempts) == (True, 2)  # the first PUT was refused (412), then read again
    component = _stored(calendar)["race"][1]
    assert [str(a).lower() for a in _attendees(component)] == ["mailto:bob@lab.example", "mailto:carol@lab.example",
                                                               ATTENDEE]
    assert _host_attendee(component)["PARTSTAT"] == "DECLINED"


@pytest.mark.caldav
def test_the_bookers_status_is_theirs_and_gpubooks_only_where_nobody_is_invited(
        caldav_server: servers.CalendarServer) -> None:
    """gpubook writes STATUS only where the event has none or still has gpubook's: a STATUS the
    booker sets is theirs from then on; with colleagues invited (whom a scheduling server would
    send an update for a STATUS change) gpubook's STATUS goes once and the attendee alone answers."""
    calendar = caldav_server.new_calendar()
    href = str(calendar.save_event(vcalendar(event("st", NOW, NOW + HOUR))).url)
    writer = CalendarWriter(str(calendar.url), username="test", password="any", timezone="UTC")
    ref = EventRef(str(calendar.url), href, "st")
    refused = replace(block.rejected("GPU 0 is booked by bob"), resource=Resource(HOST))
    accepted = replace(block.accepted(gpus=[0], template="debian-ssh", start=NOW, end=NOW + HOUR, timezone="UTC"),
                       resource=Resource(HOST, (0,)))

    def booker_sets(status: str) -> None:
        mine = calendar.event_by_uid("st")
        with mine.edit_icalendar_instance() as ical:
            next(iter(ical.walk("VEVENT")))["STATUS"] = status
        mine.save(increase_seqno=False)

    def status() -> tuple[str | None, str | None]:
        component = _stored(calendar)["st"][1]
        return (str(component["STATUS"]) if "STATUS" in component else None,
                str(component["X-GPUBOOK-OWNS-STATUS"]) if "X-GPUBOOK-OWNS-STATUS" in component else None)

    try:
        assert writer.write(ref, refused).written and status() == ("TENTATIVE", "TENTATIVE")
        assert writer.write(ref, accepted).written and status() == ("CONFIRMED", "CONFIRMED")
        booker_sets("TENTATIVE")  # the booker's own "maybe"
        assert writer.write(ref, refused).written and status() == ("TENTATIVE", None)  # theirs: the mark goes
        assert writer.write(ref, accepted).written and status() == ("TENTATIVE", None)  # and it stays theirs
        assert _host_attendee(_stored(calendar)["st"][1])["PARTSTAT"] == "ACCEPTED"
    finally:
        writer.close()

    href = str(calendar.save_event(vcalendar(event("inv", NOW, NOW + HOUR))).url)
    writer = CalendarWriter(str(calendar.url), username="test", password="any", timezone="UTC")
    ref = EventRef(str(calendar.url), href, "inv")
    try:
        assert writer.write(ref, refused).written
        assert str(_stored(calendar)["inv"][1]["STATUS"]) == "TENTATIVE"
        mine = calendar.event_by_uid("inv")
        with mine.edit_icalendar_instance() as ical:
            next(iter(ical.walk("VEVENT"))).add("ATTENDEE", "mailto:carol@lab.example", parameters={"CN": "Carol"})
        mine.save(increase_seqno=False)
        assert writer.write(ref, accepted).written
        component = _stored(calendar)["inv"][1]
        assert "STATUS" not in component and "X-GPUBOOK-OWNS-STATUS" not in component
        assert _host_attendee(component)["PARTSTAT"] == "ACCEPTED"
        assert writer.write(ref, refused).written  # the answer changes; STATUS is still not written
        component = _stored(calendar)["inv"][1]
        assert "STATUS" not in component and _host_attendee(component)["PARTSTAT"] == "DECLINED"
    finally:
        writer.close()


def _own(component: icalendar.cal.Component) -> list[tuple[str, str, dict[str, str]]]:
    """The booker's properties as a client reads them: everything but what gpubook writes."""
    owned = ("DESCRIPTION", "X-GPUBOOK-STATUS", "DTSTAMP", "LAST-MODIFIED")
    found = []
    for name, value in component.property_items(recursive=False):
        if name in owned or name in ("BEGIN", "END") or (name == "ATTENDEE" and str(value).lower() == ATTENDEE):
            continue
        found.append((name, value.to_ical().decode() if hasattr(value, "to_ical") else str(value),
                      {str(k).upper(): str(v) for k, v in getattr(value, "params", {}).items()}))
    return sorted(found)


@pytest.mark.caldav
def test_the_bookers_own_attendees_and_properties_are_kept(
        tmp_path: Path, state: State, caldav_server: servers.CalendarServer) -> None:
    calendar = caldav_server.new_calendar()
    config = _config(tmp_path, str(calendar.url))
    calendar.save_event(vcalendar(event("mine", NOW - HOUR, NOW + HOUR, extra=BOOKERS_OWN)))
    before = _own(_stored(calendar)["mine"][1])
    assert len([a for a in before if a[0] == "ATTENDEE"]) == 3
    machine = Machine()
    passes = make_pass(config, machine, state)
    try:
        machine.failing["mine"] = EngineError("image localhost/x is not present")
        _pass(passes, config)  # held: TENTATIVE
        component = _stored(calendar)["mine"][1]
        assert _host_attendee(component)["PARTSTAT"] == "TENTATIVE"
        assert _own(component) == before
        del machine.failing["mine"]
        passes.recall.failures.clear()
        _pass(passes, config, now=NOW + timedelta(minutes=2))  # running: ACCEPTED, the same attendee replaced
        component = _stored(calendar)["mine"][1]
        assert _host_attendee(component)["PARTSTAT"] == "ACCEPTED"
        assert _own(component) == before  # the booker's STATUS too: gpubook's answer is the attendee's
        attendees = [str(a).lower() for a in _attendees(component)]
        assert attendees == ["mailto:bob@lab.example", "mailto:room-3@lab.example", "urn:x-gpubook:host:devbox2",
                             ATTENDEE]  # in place, after the booker's own, never re-ordered
        assert str(component["DESCRIPTION"]).startswith("gpus: 1\nmy own notes\n\n--- gpubook ---\nrunning: ")

        # The booker deletes gpubook's attendee: the next pass (which sees the event changed) puts it back.
        mine = calendar.event_by_uid("mine")
        with mine.edit_icalendar_instance() as ical:
            edited = next(iter(ical.walk("VEVENT")))
            kept = [a for a in _attendees(edited) if str(a).lower() != ATTENDEE]
            edited.pop("ATTENDEE")
            for attendee in kept:
                edited.add("ATTENDEE", attendee, encode=False)
        mine.save(increase_seqno=False)
        assert ATTENDEE not in [str(a).lower() for a in _attendees(_stored(calendar)["mine"][1])]
        _pass(passes, config, now=NOW + timedelta(minutes=3))
        component = _stored(calendar)["mine"][1]
        assert _host_attendee(component)["PARTSTAT"] == "ACCEPTED" and _own(component) == before
    finally:
        passes.close()


@pytest.mark.caldav
def test_a_series_master_answers_for_the_series_and_an_override_for_itself(
        tmp_path: Path, state: State, caldav_server: servers.CalendarServer) -> None:
    """Occurrences without a component of their own are entries of the master's block: the master's
    attendee says ACCEPTED while any of them is accepted, names no GPUs (they may differ from one
    occurrence to the next), and DECLINED only when every one listed is refused. A moved occurrence
    (RECURRENCE-ID) carries its own answer."""
    calendar = caldav_server.new_calendar()
    config = _config(tmp_path, str(calendar.url))
    start = NOW + 24 * HOUR
    master = event("series", start, start + 2 * HOUR, extra=("RRULE:FREQ=DAILY;COUNT=3",))
    moved = event("series", start + 24 * HOUR + HOUR, start + 24 * HOUR + 3 * HOUR,
                  extra=(f"RECURRENCE-ID:{start + 24 * HOUR:%Y%m%dT%H%M%SZ}", "DESCRIPTION:gpus: 5"))
    calendar.save_event(vcalendar(master, moved))
    passes = make_pass(config, Machine(), state)
    try:
        _pass(passes, config)
        text = requests.get(str(calendar.event_by_uid("series").url), auth=("test", "any"), timeout=10).content
        first, override = icalendar.Calendar.from_ical(text).walk("VEVENT")
        assert "RECURRENCE-ID" in override
        assert _host_attendee(override) == {"CUTYPE": "RESOURCE", "ROLE": "REQ-PARTICIPANT", "PARTSTAT": "DECLINED",
                                            "RSVP": "FALSE", "SCHEDULE-AGENT": "CLIENT", "CN": "devbox1 GPUs"}
        answer = _host_attendee(first)
        assert (answer["PARTSTAT"], answer["CN"]) == ("ACCEPTED", "devbox1 GPUs")
        assert [str(s) for s in first["X-GPUBOOK-STATUS"]] == ["accepted", "accepted"]
    finally:
        passes.close()


# -- the answers' notices ----------------------------------------------------------------------

NOTIFY = """
[notify.email]
enabled = true
host = "127.0.0.1"
port = {smtp}
sender = "gpubook@devbox1"
[notify.webhook]
enabled = true
url = "http://127.0.0.1:{hook}/hook"
"""


def _notifying_pass(config: config_module.Config, machine: Machine, state: State) -> Pass:
    passes = Pass(config, backend=OneMachine(machine, server=config.host.name), state=state,
                  templates=load_all(None), notices=notices.Notices.from_config(config))
    passes.patience = HOLD
    return passes


def _told(hook_server) -> list[tuple[str, str, str]]:  # type: ignore[no-untyped-def]
    return [(body["event"], body["booking"], body["user"]) for _, body in hook_server.received]


@pytest.mark.caldav
def test_answers_are_told_by_default_once_each_across_passes_and_restarts(
        tmp_path: Path, caldav_server: servers.CalendarServer, smtp_server, hook_server) -> None:  # type: ignore[no-untyped-def]
    calendar = caldav_server.new_calendar()
    config = _config(tmp_path, str(calendar.url), notify=NOTIFY.format(smtp=smtp_server.server_address[1],
                                                                        hook=hook_server.server_address[1]))
    calendar.save_event(vcalendar(event("later", NOW + 24 * HOUR, NOW + 26 * HOUR)))
    calendar.save_event(vcalendar(event("too-big", NOW + 24 * HOUR, NOW + 26 * HOUR, user="bob",
                                        extra=("DESCRIPTION:gpus: 5",))))
    calendar.save_event(vcalendar(event("soon", NOW + timedelta(minutes=5), NOW + HOUR)))
    machine = Machine()
    with State(tmp_path / "state.sqlite") as state:
        passes = _notifying_pass(config, machine, state)
        try:
            _pass(passes, config)
            passes.delivery.notices_now(NOW)
            _pass(passes, config, now=NOW + timedelta(seconds=30))  # nothing new: nothing told again
            passes.delivery.notices_now(NOW)
        finally:
            passes.close()
    assert sorted(_told(hook_server)) == [("accepted", "later", "alice"), ("accepted", "soon", "alice"),
                                          ("rejected", "too-big", "bob")]
    # By e-mail to alice, who has an address; bob has none, so his refusal goes to the webhook alone.
    assert [envelope["to"] for envelope in smtp_server.received] == [["<alice@lab.example>"]] * 2
    mail = message_from_bytes(smtp_server.received[0]["data"], policy=default_policy)
    assert mail["Subject"] == 'gpubook: "alice debian-ssh" accepted on devbox1'
    assert "accepted: 1 GPU (0), template debian-ssh" in mail.get_content()

    # A restart (a new process on the same State) tells only what is new: the start's ssh line.
    with State(tmp_path / "state.sqlite") as state:
        passes = _notifying_pass(config, machine, state)
        try:
            for seconds in (360, 420):  # the start, then a pass with nothing new
                _pass(passes, config, now=NOW + timedelta(seconds=seconds))
                passes.delivery.notices_now(NOW + timedelta(seconds=seconds))
        finally:
            passes.close()
    assert _told(hook_server)[3:] == [("running", "soon", "alice")]
    running = hook_server.received[3][1]
    port = config.ssh.port_min
    assert running["ssh"] == f"ssh -p {port} alice@devbox1"
    assert running["subject"] == f'gpubook: "alice debian-ssh" is running on devbox1: ssh -p {port} alice@devbox1'
    assert len(smtp_server.received) == 3


# -- the series' answer, without a server --------------------------------------------------------


def _series_answer(*outcomes: tuple[int, block.Outcome]) -> str:
    calendar = icalendar.Calendar.from_ical(vcalendar(event("s", NOW, NOW + HOUR, extra=("RRULE:FREQ=DAILY",))))
    for day, outcome in outcomes:
        block.apply(calendar, uid="s", occurrence=NOW + day * 24 * HOUR, outcome=replace(
            outcome, resource=Resource(HOST, (day,))), timezone="UTC")
        calendar = icalendar.Calendar.from_ical(calendar.to_ical())  # as the server hands it back
    (master,) = calendar.walk("VEVENT")
    answer = _host_attendee(master)
    assert answer["CN"] == "devbox1 GPUs"  # the master names no occurrence's GPUs
    return answer["PARTSTAT"]


def test_a_series_is_declined_only_when_every_occurrence_listed_is_refused() -> None:
    accepted = block.accepted(gpus=[0], template="debian-ssh", start=NOW, end=NOW + HOUR, timezone="UTC")
    refused = block.rejected("GPU 0 is booked by bob")
    assert _series_answer((0, refused), (1, refused)) == "DECLINED"
    assert _series_answer((0, refused), (1, accepted)) == "ACCEPTED"
    assert _series_answer((0, replace(accepted, held=True)), (1, refused)) == "TENTATIVE"
    # Another occurrence's write keeps the held one held (its status says so), and its answer.
    assert _series_answer((0, replace(accepted, held=True)), (1, refused), (2, refused)) == "TENTATIVE"
    assert _series_answer((0, replace(accepted, held=True)), (1, accepted)) == "ACCEPTED"


def test_the_host_address_is_a_urn_made_of_its_name() -> None:
    assert address_of("devbox1") == "urn:x-gpubook:host:devbox1"
    assert address_of("GPU_Box 7.lab.example.") == "urn:x-gpubook:host:gpu-box-7.lab.example"
    assert address_of("...") == "urn:x-gpubook:host:gpubook"


def test_two_deliverers_at_once_send_each_notice_once(tmp_path: Path) -> None:
    """The daemon's notices lane and `gpubook stop` (another process) may deliver at the same time:
    each notice goes out once, from whichever takes it first."""
    with State(tmp_path / "state.sqlite") as state:
        for number in range(40):
            state.queue_notice(kind="accepted", booking_id=f"b{number}", user="alice", subject="s", text="t",
                               fields={}, at=NOW)
    sent: list[str] = []
    together = threading.Barrier(2, timeout=HOLD)

    def deliverer() -> None:
        with State(tmp_path / "state.sqlite") as own:  # its own connection, as another process has
            together.wait()
            notices.deliver_pending(own, lambda message: sent.append(message.booking_id), now=NOW)

    threads = [threading.Thread(target=deliverer) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(HOLD)
    assert sorted(sent) == sorted(f"b{number}" for number in range(40))


def test_a_booker_on_an_ics_feed_learns_the_answers_by_notice(
        tmp_path: Path, feed_server: servers.FeedServer, hook_server) -> None:  # type: ignore[no-untyped-def]
    """A feed cannot be written into: the notices are how its bookers learn a refusal or the ssh line."""
    feed = vcalendar(event("fits", NOW - HOUR, NOW + HOUR),
                     event("no", NOW, NOW + HOUR, extra=("DESCRIPTION:gpus: 5",)))
    feed_server.replies["/lab.ics"] = servers.Reply(body=feed.encode(), headers={"Content-Type": "text/calendar"})
    config = _config(tmp_path, feed_server.base_url + "/lab.ics",
                     notify=f'[notify.webhook]\nenabled = true\nurl = "http://127.0.0.1:{hook_server.server_address[1]}/"\n')
    assert config.calendars[0].kind == "ics"
    with State(tmp_path / "state.sqlite") as state:
        passes = _notifying_pass(config, Machine(), state)
        try:
            _pass(passes, config)
            _pass(passes, config, now=NOW + timedelta(seconds=30))
            passes.delivery.notices_now(NOW)
        finally:
            passes.close()
    assert sorted(_told(hook_server)) == [("rejected", "no", "alice"), ("running", "fits", "alice")]
    refused = next(body for _, body in hook_server.received if body["event"] == "rejected")
    assert refused["text"].endswith("\n\nrejected: this calendar books 2 GPUs of devbox1 (GPUs 0, 1); "
                                    "this booking asks for 5") and refused["answer"] == "DECLINED"
    assert refused["subject"] == 'gpubook: "alice debian-ssh" refused on devbox1'  # its title, not its UID
    assert [method for method, _, _ in feed_server.requests] == ["GET", "GET"]  # read, never written


@pytest.mark.caldav
def test_after_an_upgrade_answered_events_get_the_attendee_and_no_old_news(
        tmp_path: Path, radicale_server: servers.CalendarServer, hook_server) -> None:  # type: ignore[no-untyped-def]
    """An event the previous version answered (its block, no attendee; State has that write) gets
    the attendee at the first pass, and its booker no notice of an answer they had already."""
    calendar = radicale_server.new_calendar()
    config = _config(tmp_path, str(calendar.url),
                     notify=f'[notify.webhook]\nenabled = true\nurl = "http://127.0.0.1:{hook_server.server_address[1]}/"\n')
    old = "--- gpubook ---\\naccepted: 1 GPU (0)\\, template debian-ssh\\n--- end gpubook ---"
    calendar.save_event(vcalendar(event("old", NOW + 24 * HOUR, NOW + 26 * HOUR, extra=(f"DESCRIPTION:{old}",))))
    calendar.save_event(vcalendar(event("new", NOW + 48 * HOUR, NOW + 50 * HOUR)))
    etag = _stored(calendar)["old"][0]
    with State(tmp_path / "state.sqlite") as state:
        state.write_back_done("old", status="accepted 0123456789ab", etag=etag, at=NOW - HOUR)  # the old version's
        passes = _notifying_pass(config, Machine(), state)
        try:
            _pass(passes, config)
            passes.delivery.notices_now(NOW)
        finally:
            passes.close()
    assert _host_attendee(_stored(calendar)["old"][1])["PARTSTAT"] == "ACCEPTED"
    assert _told(hook_server) == [("accepted", "new", "alice")]  # the new booking's answer only
