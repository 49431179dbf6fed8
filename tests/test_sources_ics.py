"""IcsFeedSource against a real local HTTP server: conditional GETs, splitting, bad feeds."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime

import pytest
from icalendar import Calendar

from gpubook.scheduler.config import CalendarConfig
from gpubook.scheduler.sources import open_source
from gpubook.scheduler.sources.errors import CalendarDataError, CalendarError
from gpubook.scheduler.sources.ics_feed import IcsFeedSource
from tests.kits import servers
from tests.kits.booking_kit import FEED


def feed_source(server: servers.FeedServer, path: str = "/lab.ics", **kwargs) -> IcsFeedSource:
    return IcsFeedSource(server.base_url + path, timeout=kwargs.pop("timeout", 5), **kwargs)


def test_feed_is_split_per_uid_with_its_time_zones(feed_server):
    feed_server.replies["/lab.ics"] = servers.Reply(body=FEED.encode(),
                                                    headers={"Content-Type": "text/calendar"})
    snapshot = feed_source(feed_server).poll()
    url = feed_server.base_url + "/lab.ics"
    assert snapshot.changed and snapshot.stats.method == "ics-full"
    assert set(snapshot.objects) == {url + "#weekly@lab", url + "#floating@lab"}
    weekly = Calendar.from_ical(snapshot.objects[url + "#weekly@lab"].ical)
    assert len(weekly.walk("VEVENT")) == 2  # the series and its moved occurrence stay together
    assert [str(z["TZID"]) for z in weekly.walk("VTIMEZONE")] == ["Europe/Berlin"]
    assert weekly["X-WR-TIMEZONE"] == "Europe/Berlin"
    floating = Calendar.from_ical(snapshot.objects[url + "#floating@lab"].ical)
    assert floating.walk("VTIMEZONE") == []
    assert floating["X-WR-TIMEZONE"] == "Europe/Berlin"
    for href, raw in snapshot.objects.items():
        assert raw.href == href and raw.calendar_url == url and raw.etag


def test_etag_makes_an_unchanged_feed_one_304(feed_server):
    feed_server.replies["/lab.ics"] = servers.Reply(body=FEED.encode(), headers={"ETag": '"v1"'})
    source = feed_source(feed_server)
    first = source.poll()
    second = source.poll()
    assert feed_server.requests[-1][2].get("If-None-Match") == '"v1"'
    assert not second.changed and second.stats.method == "ics-304"
    assert second.stats.requests == 1 and second.objects is first.objects
    assert second.stats.bytes_received < 500

    changed = FEED.replace("bob debian-ssh", "bob debian-ssh gpus=1")
    feed_server.replies["/lab.ics"] = servers.Reply(body=changed.encode(), headers={"ETag": '"v2"'})
    third = source.poll()
    assert third.changed and third.stats.method == "ics-full"
    url = feed_server.base_url + "/lab.ics"
    assert "gpus=1" in third.objects[url + "#floating@lab"].ical
    assert third.objects[url + "#weekly@lab"] == first.objects[url + "#weekly@lab"]


def test_last_modified_makes_an_unchanged_feed_one_304(feed_server):
    stamp = format_datetime(datetime.now(UTC) - timedelta(hours=1), usegmt=True)
    feed_server.replies["/lab.ics"] = servers.Reply(body=FEED.encode(),
                                                    headers={"Last-Modified": stamp})
    source = feed_source(feed_server)
    source.poll()
    second = source.poll()
    assert feed_server.requests[-1][2].get("If-Modified-Since") == stamp
    assert "If-None-Match" not in feed_server.requests[-1][2]
    assert not second.changed and second.stats.method == "ics-304"


def test_a_feed_without_validators_is_parsed_only_when_its_bytes_change(feed_server):
    feed_server.replies["/lab.ics"] = servers.Reply(body=FEED.encode(), honour_validators=False)
    source = feed_source(feed_server)
    first = source.poll()
    second = source.poll()
    assert not second.changed and second.stats.method == "ics-same"
    assert second.objects is first.objects


def test_a_deleted_event_vanishes(feed_server):
    feed_server.replies["/lab.ics"] = servers.Reply(body=FEED.encode(), headers={"ETag": '"a"'})
    source = feed_source(feed_server)
    source.poll()
    start = FEED.index("BEGIN:VEVENT\r\nUID:floating@lab")
    end = FEED.index("END:VEVENT", start) + len("END:VEVENT\r\n")
    feed_server.replies["/lab.ics"] = servers.Reply(body=(FEED[:start] + FEED[end:]).encode(),
                                                    headers={"ETag": '"b"'})
    snapshot = source.poll()
    assert [href.split("#")[1] for href in snapshot.objects] == ["weekly@lab"]


def test_open_source_gives_a_feed_source(feed_server):
    feed_server.replies["/lab.ics"] = servers.Reply(body=FEED.encode())
    config = CalendarConfig(url=feed_server.base_url + "/lab.ics", gpus=None, kind="ics")
    source = open_source(config, timeout=5)
    assert isinstance(source, IcsFeedSource)
    assert len(source.poll().objects) == 2
    assert source.open_writer(timezone="UTC") is None  # a feed is read-only


def test_a_source_named_by_its_class_path_and_its_preflight(feed_server):
    feed_server.replies["/lab.ics"] = servers.Reply(body=FEED.encode())
    config = CalendarConfig(url=feed_server.base_url + "/lab.ics", gpus=None,
                            kind="gpubook.scheduler.sources.ics_feed:IcsFeedSource")
    source = open_source(config, timeout=5)
    assert isinstance(source, IcsFeedSource)
    assert source.preflight() == "2 object(s)"
    absent = CalendarConfig(url=feed_server.base_url + "/absent.ics", gpus=None, kind="ics")
    with pytest.raises(CalendarDataError, match="no such calendar"):
        open_source(absent, timeout=5).preflight()


def test_feed_credentials(feed_server):
    feed_server.auth = ("gpubook", "feed-secret")
    feed_server.replies["/lab.ics"] = servers.Reply(body=FEED.encode())
    assert len(feed_source(feed_server, username="gpubook", password="feed-secret").poll()
               .objects) == 2
    with pytest.raises(CalendarError, match="credentials refused") as caught:
        feed_source(feed_server, username="gpubook", password="not-it-77").poll()
    assert "not-it-77" not in str(caught.value)


# -- bad feeds -----------------------------------------------------------------------------------

def test_50_mb_streamed_feed_is_refused_without_loading_it(feed_server):
    sent = []

    def fifty_megabytes() -> Iterator[bytes]:
        yield b"BEGIN:VCALENDAR\r\nVERSION:2.0\r\n"
        line = b"X-PADDING:" + b"x" * 1000 + b"\r\n"
        for _ in range(50 * 1024):
            sent.append(len(line))
            yield line

    feed_server.replies["/big.ics"] = servers.Reply(body=fifty_megabytes)
    with pytest.raises(CalendarDataError, match="larger than the 20 MiB limit"):
        feed_source(feed_server, "/big.ics").poll()
    # the client hung up near the cap, long before 50 MB were written
    assert sum(sent) < 30 * 1024 * 1024


def test_50_mb_declared_feed_is_refused_before_download(feed_server):
    body = b"BEGIN:VCALENDAR\r\n" + b"X" * (50 * 1024 * 1024)
    feed_server.replies["/big.ics"] = servers.Reply(body=body)
    with pytest.raises(CalendarDataError, match=r"feed of 50\.0 MiB is larger than the 20 MiB"):
        feed_source(feed_server, "/big.ics").poll()


def test_a_smaller_cap_can_be_set(feed_server):
    feed_server.replies["/lab.ics"] = servers.Reply(body=FEED.encode())
    with pytest.raises(CalendarDataError, match="limit"):
        feed_source(feed_server, max_bytes=1000).poll()


@pytest.mark.parametrize(("body", "message"), [
    (FEED.replace("END:VCALENDAR\r\n", ""), "malformed iCalendar"),
    (FEED.replace("END:VEVENT\r\nEND:VCALENDAR", "END:VCALENDAR"), "malformed iCalendar"),
    ("BEGIN:VEVENT\r\nUID:x\r\nEND:VEVENT\r\n", "feed: starts with 'BEGIN:VEVENT'"),
    ("", "not an iCalendar feed: the body is empty"),
    ("\x00\x01garbage", "not an iCalendar feed"),
    ("<!DOCTYPE html><html><body>Sign in</body></html>", "answered with HTML"),
])
def test_malformed_feeds_are_refused_with_the_reason(feed_server, body, message):
    feed_server.replies["/lab.ics"] = servers.Reply(body=body.encode())
    with pytest.raises(CalendarDataError, match=message) as caught:
        feed_source(feed_server).poll()
    assert feed_server.base_url + "/lab.ics" in str(caught.value)


def test_invalid_utf8_is_refused(feed_server):
    feed_server.replies["/lab.ics"] = servers.Reply(body=FEED.encode().replace(b"bob", b"b\xffb"))
    with pytest.raises(CalendarDataError, match="not valid utf-8"):
        feed_source(feed_server).poll()


def test_html_page_with_html_type_is_refused(feed_server):
    feed_server.replies["/lab.ics"] = servers.Reply(
        body=b"BEGIN:VCALENDAR but really a page", headers={"Content-Type": "text/html"})
    with pytest.raises(CalendarDataError, match="answered with HTML"):
        feed_source(feed_server).poll()


@pytest.mark.parametrize(("status", "message"), [
    (404, "no such calendar"), (500, r"server error \(HTTP 500"), (503, "server error"),
    (403, "credentials refused"),
])
def test_http_errors_are_reported(feed_server, status, message):
    feed_server.replies["/lab.ics"] = servers.Reply(status=status, body=b"nope")
    with pytest.raises(CalendarError, match=message):
        feed_source(feed_server).poll()


def test_a_feed_that_never_answers_times_out(feed_server):
    feed_server.replies["/lab.ics"] = servers.Reply(body=FEED.encode(), delay=3)
    with pytest.raises(CalendarError, match="no answer within 0.5 s"):
        feed_source(feed_server, timeout=0.5).poll()


def test_connection_refused_feed():
    source = IcsFeedSource(f"http://127.0.0.1:{servers.free_port()}/lab.ics", timeout=5)
    with pytest.raises(CalendarError, match="connection refused"):
        source.poll()
