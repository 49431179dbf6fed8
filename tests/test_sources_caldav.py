"""CaldavSource against real Radicale and Xandikos: sync tokens, fallbacks and failures."""

from __future__ import annotations

import re
import shutil
import socket
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import caldav
import pytest
import requests
from icalendar import Calendar, Event

from gpubook.scheduler.config import CalendarConfig
from gpubook.scheduler.sources import open_source
from gpubook.scheduler.sources.caldav_source import CaldavSource
from gpubook.scheduler.sources.errors import CalendarDataError, CalendarError
from tests.kits import servers

pytestmark = pytest.mark.caldav


def ical_event(uid: str, summary: str, *, days: int = 1) -> str:
    calendar = Calendar()
    calendar.add("prodid", "-//gpubook tests//")
    calendar.add("version", "2.0")
    event = Event()
    start = datetime.now(UTC).replace(microsecond=0) + timedelta(days=days)
    event.add("uid", uid)
    event.add("summary", summary)
    event.add("dtstart", start)
    event.add("dtend", start + timedelta(hours=2))
    event.add("dtstamp", datetime.now(UTC))
    calendar.add_component(event)
    return calendar.to_ical().decode()


def add_events(calendar: caldav.Calendar, count: int) -> list[caldav.CalendarObjectResource]:
    return [calendar.add_event(ical_event(f"ev-{n}-{uuid.uuid4().hex[:6]}", f"booking {n}"))
            for n in range(count)]


def source_for(server: servers.CalendarServer, calendar: caldav.Calendar, **kwargs) -> CaldavSource:
    return CaldavSource(str(calendar.url), username=server.username, password=server.password,
                        timeout=10, **kwargs)


def summaries(snapshot) -> set[str]:
    found = set()
    for raw in snapshot.objects.values():
        for event in Calendar.from_ical(raw.ical).walk("VEVENT"):
            found.add(str(event["SUMMARY"]))
    return found


def test_first_load_sees_every_event(caldav_server, new_calendar):
    add_events(new_calendar, 7)
    snapshot = source_for(caldav_server, new_calendar).poll()
    assert snapshot.changed
    assert snapshot.stats.method == "sync-token"
    assert summaries(snapshot) == {f"booking {n}" for n in range(7)}
    for href, raw in snapshot.objects.items():
        assert raw.href == href and href.startswith(str(new_calendar.url))
        assert raw.etag and raw.ical.startswith("BEGIN:VCALENDAR")
        assert raw.calendar_url == snapshot.calendar_url


def test_edits_additions_and_deletions_arrive_through_the_sync_token(caldav_server, new_calendar):
    events = add_events(new_calendar, 5)
    source = source_for(caldav_server, new_calendar)
    first = source.poll()
    token = source.sync_token

    edited, deleted = events[0], events[1]
    edited.icalendar_component["SUMMARY"] = "booking 0 moved"
    edited.save(increase_seqno=False)
    deleted.delete()
    new_calendar.add_event(ical_event("late-arrival", "booking late"))

    second = source.poll()
    assert second.changed and second.stats.method == "sync-token"
    assert source.sync_token != token
    assert str(deleted.url.canonical()) in first.objects
    assert str(deleted.url.canonical()) not in second.objects
    assert summaries(second) == {"booking 0 moved", "booking 2", "booking 3", "booking 4",
                                 "booking late"}
    # the earlier snapshot is left as it was
    assert summaries(first) == {f"booking {n}" for n in range(5)}


def test_a_poll_without_change_is_one_small_request(caldav_server, new_calendar):
    add_events(new_calendar, 5)
    source = source_for(caldav_server, new_calendar)
    first = source.poll()
    second = source.poll()
    assert not second.changed
    assert second.stats.requests == 1
    assert second.stats.method == "sync-token"
    assert second.stats.bytes_received < 1000
    assert second.objects is first.objects


def test_an_unknown_sync_token_leads_to_a_full_resync_that_sees_deletions(caldav_server,
                                                                       new_calendar):
    events = add_events(new_calendar, 4)
    source = source_for(caldav_server, new_calendar)
    source.poll()
    events[2].delete()
    # A token the server never issued, as after the server forgot ours.
    source._sync_token = "http://radicale.org/ns/sync/" + "0" * 64 if caldav_server.name == \
        "radicale" else "0" * 40
    snapshot = source.poll()
    assert snapshot.stats.method == "sync-resync"
    assert str(events[2].url.canonical()) not in snapshot.objects
    assert summaries(snapshot) == {"booking 0", "booking 1", "booking 3"}
    # the resync fetched nothing that was unchanged: listing, then nothing else
    assert snapshot.stats.requests == 2, source._wire.answers
    assert source.poll().stats.method == "sync-token"


def test_radicale_forgetting_its_tokens_is_survived(radicale_server):
    calendar = radicale_server.new_calendar()
    events = add_events(calendar, 3)
    source = source_for(radicale_server, calendar)
    source.poll()
    events[0].delete()
    cal_dir = next(Path(radicale_server.storage).rglob(Path(calendar.url.path).name))
    shutil.rmtree(cal_dir / ".Radicale.cache" / "sync-token")  # what max_sync_token_age does
    snapshot = source.poll()
    assert snapshot.stats.method == "sync-resync"
    assert summaries(snapshot) == {"booking 1", "booking 2"}


@pytest.mark.parametrize("method", ["etag", "time-range"])
def test_fallback_methods_see_changes_and_deletions(caldav_server, new_calendar, method):
    events = add_events(new_calendar, 5)
    source = source_for(caldav_server, new_calendar, method=method)
    first = source.poll()
    assert first.changed and len(first.objects) == 5
    unchanged = source.poll()
    assert not unchanged.changed and unchanged.objects is first.objects
    if method == "etag":
        assert unchanged.stats.method == "ctag" and unchanged.stats.requests == 1
    events[3].delete()
    events[4].icalendar_component["SUMMARY"] = "booking 4 edited"
    events[4].save(increase_seqno=False)
    changed = source.poll()
    assert changed.changed
    assert summaries(changed) == {"booking 0", "booking 1", "booking 2", "booking 4 edited"}


def test_open_source_picks_the_kind(radicale_server):
    calendar = radicale_server.new_calendar()
    config = CalendarConfig(url=str(calendar.url), gpus=None, username=radicale_server.username,
                            password=radicale_server.password)
    source = open_source(config, timeout=5)
    assert isinstance(source, CaldavSource)
    first = source.poll()
    assert first.objects == {} and first.changed
    assert not source.poll().changed


# -- failures ------------------------------------------------------------------------------------

def test_wrong_password_is_refused_without_showing_it(radicale_auth_server):
    calendar = radicale_auth_server.new_calendar()
    user, _ = servers.RADICALE_USER
    source = CaldavSource(str(calendar.url), username=user, password="wrong-secret-42", timeout=5)
    with pytest.raises(CalendarError, match="credentials refused") as caught:
        source.poll()
    assert str(calendar.url) in str(caught.value)
    assert "wrong-secret-42" not in str(caught.value)
    assert "\n" not in str(caught.value)


def test_password_in_the_url_is_used_and_never_shown(radicale_auth_server):
    calendar = radicale_auth_server.new_calendar()
    add_events(calendar, 1)
    user, password = servers.RADICALE_USER
    with_secret = str(calendar.url).replace("://", f"://{user}:{password.replace(' ', '%20')}@")
    source = CaldavSource(with_secret, timeout=5)
    snapshot = source.poll()
    assert len(snapshot.objects) == 1
    assert password not in source.url and all(password not in h for h in snapshot.objects)


def test_missing_calendar_is_reported(caldav_server):
    url = f"{caldav_server.base_url}{caldav_server.calendar_root}no-such-calendar/"
    source = CaldavSource(url, username=caldav_server.username, password=caldav_server.password,
                          timeout=5)
    with pytest.raises(CalendarError, match="no such calendar|HTTP 40") as caught:
        source.poll()
    assert url in str(caught.value)


def test_server_error_is_reported(feed_server):
    feed_server.replies["/cal/"] = servers.Reply(status=500, body=b"boom")
    source = CaldavSource(feed_server.base_url + "/cal/", timeout=5)
    with pytest.raises(CalendarError, match=r"server error \(HTTP 500"):
        source.poll()


def test_a_server_that_never_answers_times_out(feed_server):
    feed_server.replies["/cal/"] = servers.Reply(status=207, delay=3)
    source = CaldavSource(feed_server.base_url + "/cal/", timeout=0.5)
    with pytest.raises(CalendarError, match="no answer within 0.5 s") as caught:
        source.poll()
    assert caught.value.temporary


def test_connection_refused_is_reported():
    port = servers.free_port()  # nothing listens there
    source = CaldavSource(f"http://127.0.0.1:{port}/cal/", timeout=5)
    with pytest.raises(CalendarError, match="connection refused"):
        source.poll()


def test_html_instead_of_a_calendar_is_refused(feed_server):
    page = b"<!DOCTYPE html><html><body><h1>Welcome to the lab wiki</h1></body></html>"
    feed_server.replies["/cal/"] = servers.Reply(headers={"Content-Type": "text/html"}, body=page)
    source = CaldavSource(feed_server.base_url + "/cal/", timeout=5)
    with pytest.raises(CalendarDataError, match="not a CalDAV calendar.*text/html"):
        source.poll()


def test_garbage_xml_is_refused(feed_server):
    feed_server.replies["/cal/"] = servers.Reply(
        status=207, headers={"Content-Type": "application/xml"}, body=b"<multistatus><oops")
    source = CaldavSource(feed_server.base_url + "/cal/", timeout=5)
    with pytest.raises(CalendarError, match="/cal/"):
        source.poll()


def test_port_is_free_helper_gives_a_closed_port():
    port = servers.free_port()
    with socket.socket() as probe, pytest.raises(OSError):
        probe.settimeout(1)
        probe.connect(("127.0.0.1", port))


@pytest.mark.parametrize(("refuse_listing", "method"), [(False, "etag"), (True, "time-range")])
def test_a_server_without_sync_is_polled_by_etag_then_time_range(caldav_server, new_calendar,
                                                                 refuse_listing, method):
    events = add_events(new_calendar, 5)
    proxy = servers.NoSyncProxy(caldav_server.base_url, refuse_listing=refuse_listing).start()
    try:
        url = str(new_calendar.url).replace(caldav_server.base_url, proxy.base_url)
        source = CaldavSource(url, username=caldav_server.username,
                              password=caldav_server.password, timeout=10)
        first = source.poll()
        assert source.method == method and first.stats.method == method
        assert summaries(first) == {f"booking {n}" for n in range(5)}
        assert "REPORT" in proxy.refused
        unchanged = source.poll()
        assert not unchanged.changed and unchanged.objects is first.objects
        if method == "etag":
            assert unchanged.stats.method == "ctag" and unchanged.stats.requests == 1
        events[0].delete()
        assert summaries(source.poll()) == {f"booking {n}" for n in range(1, 5)}
    finally:
        proxy.stop()


def test_forcing_sync_tokens_on_a_server_without_them_is_an_error(radicale_server):
    calendar = radicale_server.new_calendar()
    proxy = servers.NoSyncProxy(radicale_server.base_url).start()
    try:
        url = str(calendar.url).replace(radicale_server.base_url, proxy.base_url)
        source = CaldavSource(url, username=radicale_server.username,
                              password=radicale_server.password, timeout=10, method="sync-token")
        with pytest.raises(CalendarError, match="sync tokens do not work here"):
            source.poll()
    finally:
        proxy.stop()


def test_many_changes_are_fetched_in_bulk(caldav_server, new_calendar):
    events = add_events(new_calendar, 7)
    source = source_for(caldav_server, new_calendar)
    source.multiget_batch = 2  # what 500 is to a 10,000-event calendar
    first = source.poll()
    assert summaries(first) == {f"booking {n}" for n in range(7)}
    # Radicale answers the first sync with the data in it; Xandikos needs one calendar-query.
    assert first.stats.requests == (1 if caldav_server.name == "radicale" else 2)

    for event in events[:6]:  # more than a few GETs' worth: calendar-multiget in batches
        event.icalendar_component["SUMMARY"] = event.icalendar_component["SUMMARY"] + " v2"
        event.save(increase_seqno=False)
    second = source.poll()
    assert second.stats.method == "sync-token" and second.stats.requests == 1 + 3
    assert summaries(second) == {f"booking {n} v2" for n in range(6)} | {"booking 6"}

    for event in events[:3]:
        event.icalendar_component["SUMMARY"] = event.icalendar_component["SUMMARY"] + " v3"
        event.save(increase_seqno=False)
    events[6].delete()
    source._sync_token = "http://radicale.org/ns/sync/" + "0" * 64 if caldav_server.name == \
        "radicale" else "0" * 40
    third = source.poll()  # refused token, ETag listing, one calendar-query for the three
    assert third.stats.method == "sync-resync" and third.stats.requests == 3
    assert summaries(third) == ({f"booking {n} v2 v3" for n in range(3)}
                                | {f"booking {n} v2" for n in range(3, 6)})


def put_big(server: servers.CalendarServer, calendar: caldav.Calendar, summary: str) -> None:
    """A 5 MiB event, PUT with a patient timeout (Radicale takes seconds to store it on a busy host)."""
    text = ical_event("big-1", summary).replace(f"SUMMARY:{summary}",
                                                f"SUMMARY:{summary}\r\nDESCRIPTION:" + "x" * (5 * 1024 * 1024))
    answer = requests.put(f"{calendar.url}big-1.ics", data=text.encode(), auth=(server.username, server.password),
                          headers={"Content-Type": "text/calendar; charset=utf-8"}, timeout=300)
    assert answer.status_code in (201, 204), answer.status_code


def test_an_object_past_the_cap_is_refused_with_a_sentence_and_not_downloaded_again(radicale_server):
    """Finding 15 of issue 22: CalDAV objects had no size cap (the ICS feed has 20 MiB): a 5 MiB
    event was downloaded, parsed and held at every change. Now an object past 1 MiB is refused with a
    sentence, the others are read, and a changed big object is not downloaded past the cap."""
    from gpubook.scheduler.core.parsing import parse

    calendar = radicale_server.new_calendar()
    add_events(calendar, 2)
    put_big(radicale_server, calendar, "big v1")
    source = source_for(radicale_server, calendar)
    first = source.poll()
    [refused] = [raw for raw in first.objects.values() if raw.refused]
    assert refused.ical == "" and refused.href == f"{calendar.url}big-1.ics"
    assert re.search(r"big-1\.ics is 5\.\d MiB; gpubook reads objects of at most 1 MiB, so it was ignored: "
                     "remove its attachment or long text", refused.refused), refused.refused
    assert summaries(type(first)(first.calendar_url, {h: r for h, r in first.objects.items() if not r.refused},
                                 True)) == {"booking 0", "booking 1"}
    assert [p.reason for p in parse(refused).problems] == [refused.refused]

    assert source.poll().changed is False  # unchanged: nothing fetched again
    put_big(radicale_server, calendar, "big v2")
    second = source.poll()  # one changed object: one GET, stopped at the cap
    [again] = [raw for raw in second.objects.values() if raw.refused]
    assert again.etag != refused.etag and "gpubook reads objects of at most 1 MiB" in again.refused
    assert second.stats.bytes_received < 1024 * 1024


def test_a_multiget_past_the_answer_cap_falls_back_to_one_capped_get_each(radicale_server):
    """A batch that would answer past its cap (sizes not listed) is fetched one capped GET each."""
    calendar = radicale_server.new_calendar()
    events = add_events(calendar, 6)
    source = source_for(radicale_server, calendar)
    source.poll()
    source.max_answer_bytes = 4096  # what 64 MiB is to a batch of large events
    for event in events:
        event.icalendar_component["SUMMARY"] = event.icalendar_component["SUMMARY"] + " v2"
        event.save(increase_seqno=False)
    changed = source.poll()
    assert summaries(changed) == {f"booking {n} v2" for n in range(6)}
