"""The event block (sources.block), the CalDAV writer and the notices: the block in DESCRIPTION
(pure), write-back against real Radicale and Xandikos, e-mail against a small real SMTP
server, webhook against a real HTTP server."""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import UTC, date, datetime, timedelta
from email import message_from_bytes
from email.policy import default as default_policy

import icalendar
import pytest
import requests

from gpubook.scheduler.config import CalendarConfig
from gpubook.scheduler.outbox import notices
from gpubook.scheduler.outbox.notices import (
    MailSettings,
    Message,
    NotifyError,
    WebhookSettings,
    post_webhook,
    send_mail,
)
from gpubook.scheduler.sources import EventRef, open_writer
from gpubook.scheduler.sources import block as notify
from gpubook.scheduler.sources.block import BEGIN, END, MAX_OCCURRENCES, apply, replace_block, strip_block
from gpubook.scheduler.sources.caldav_writer import CalendarWriter
from gpubook.scheduler.sources.errors import CalendarError
from tests.kits.servers import free_port
from tests.kits.writeback_kit import PASSWORD, USER, USER_TEXT, booker_calendar, booker_event, calendar_on, put_event

TZ = "Europe/Paris"
START = datetime(2026, 11, 23, 8, 0, tzinfo=UTC)  # 09:00 in Paris
END_TIME = START + timedelta(hours=8)


def _running(end: datetime = END_TIME, port: int = 2201) -> notify.Outcome:
    return notify.running(port=port, user="alice", host="devbox1", end=end, timezone=TZ)


def _vevents(calendar: icalendar.Calendar) -> list[icalendar.Event]:
    return list(calendar.walk("VEVENT"))


# -- the block, without a server ---------------------------------------------------------------


def test_block_is_appended_after_the_users_text_and_replaced_in_place() -> None:
    first = replace_block(USER_TEXT, f"{BEGIN}\nrunning: x\n{END}")
    assert first == USER_TEXT + f"\n\n{BEGIN}\nrunning: x\n{END}"
    # The user adds text below the block; the next update keeps it, and the text above, exactly.
    edited = first + "\n\nPS: added later by the user\n"
    second = replace_block(edited, f"{BEGIN}\nended: y\n{END}")
    assert second == USER_TEXT + f"\n\n{BEGIN}\nended: y\n{END}" + "\n\nPS: added later by the user\n"
    assert replace_block("", f"{BEGIN}\n{END}") == f"{BEGIN}\n{END}"
    assert strip_block(second) == USER_TEXT + "\n\n" + "\n\nPS: added later by the user\n"
    assert strip_block(USER_TEXT) == USER_TEXT


def test_a_block_missing_its_end_marker_is_left_alone() -> None:
    broken = f"my text\n{BEGIN}\nrunning: x\nmore of my text, do not eat"
    updated = replace_block(broken, f"{BEGIN}\nended: y\n{END}")
    assert updated.startswith(broken) and updated.endswith(f"{BEGIN}\nended: y\n{END}")


def test_block_with_crlf_lines_is_found() -> None:
    text = f"mine\r\n\r\n{BEGIN}\r\nrunning: x\r\n{END}\r\nbelow"
    assert replace_block(text, "NEW") == "mine\r\n\r\nNEW\r\nbelow"


def test_single_event_gets_block_and_status_and_a_repeat_changes_nothing() -> None:
    calendar = icalendar.Calendar.from_ical(booker_event())
    assert apply(calendar, uid="b1@lab", occurrence=None, outcome=_running(), timezone=TZ) is True
    (event,) = _vevents(calendar)
    assert str(event["DESCRIPTION"]) == (USER_TEXT + f"\n\n{BEGIN}\nrunning: ssh -p 2201 alice@devbox1\n"
                                         f"until 2026-11-23 17:00 +0100\n{END}")
    assert str(event["X-GPUBOOK-STATUS"]) == "running"
    assert event["SEQUENCE"] == 3
    again = icalendar.Calendar.from_ical(calendar.to_ical())  # as a server would hand it back
    assert apply(again, uid="b1@lab", occurrence=None, outcome=_running(), timezone=TZ) is False
    assert apply(again, uid="b1@lab", occurrence=START, outcome=_running(), timezone=TZ) is False  # not a series
    assert apply(again, uid="other@lab", occurrence=None, outcome=_running(), timezone=TZ) is None


def test_outcome_texts() -> None:
    accepted = notify.accepted(gpus=[0, 2], template="tensorflow-cuda9", start=START, end=END_TIME, timezone=TZ)
    assert accepted.lines == ("2 GPUs (0, 2), template tensorflow-cuda9",
                              "from 2026-11-23 09:00 +0100 to 2026-11-23 17:00 +0100")
    rejected = notify.rejected("GPU 1 is already booked\nby bob")
    assert rejected.lines == ("GPU 1 is already booked by bob",)
    ended = notify.ended(gpu_hours=16, outputs="/srv/gpubook/alice/output", at=END_TIME, timezone=TZ)
    assert ended.lines == ("16.00 GPU-hours, stopped 2026-11-23 17:00 +0100", "outputs: /srv/gpubook/alice/output")
    noted = _running().with_note("the end was not moved to 19:00: GPU 0 is booked then by bob")
    assert noted.lines[-1] == "the end was not moved to 19:00: GPU 0 is booked then by bob"


def test_series_occurrences_are_entries_on_the_master() -> None:
    calendar = icalendar.Calendar.from_ical(booker_event(rrule="FREQ=WEEKLY;COUNT=10"))
    week = timedelta(days=7)
    apply(calendar, uid="b1@lab", occurrence=START, outcome=notify.ended(
        gpu_hours=8, outputs=None, at=END_TIME, timezone=TZ), timezone=TZ)
    apply(calendar, uid="b1@lab", occurrence=START + week, outcome=_running(END_TIME + week), timezone=TZ)
    (master,) = _vevents(calendar)
    assert str(master["DESCRIPTION"]).endswith(
        f"{BEGIN}\n2026-11-23 09:00 +0100: ended: 8.00 GPU-hours, stopped 2026-11-23 17:00 +0100\n"
        f"2026-11-30 09:00 +0100: running: ssh -p 2201 alice@devbox1\n  until 2026-11-30 17:00 +0100\n{END}")
    statuses = [(str(p), p.params["X-GPUBOOK-OCCURRENCE"]) for p in master["X-GPUBOOK-STATUS"]]
    assert statuses == [("ended", "20261123T080000Z"), ("running", "20261130T080000Z")]
    reread = icalendar.Calendar.from_ical(calendar.to_ical())
    assert apply(reread, uid="b1@lab", occurrence=START + week, outcome=_running(END_TIME + week),
                 timezone=TZ) is False
    # Only the latest entries are kept; an update for one already dropped changes nothing.
    for n in range(2, 2 + MAX_OCCURRENCES):
        apply(reread, uid="b1@lab", occurrence=START + n * week, outcome=_running(), timezone=TZ)
    (master,) = _vevents(reread)
    assert len(master["X-GPUBOOK-STATUS"]) == MAX_OCCURRENCES
    assert "2026-11-23 09:00" not in str(master["DESCRIPTION"])
    assert apply(reread, uid="b1@lab", occurrence=START, outcome=_running(), timezone=TZ) is False
    assert str(master["DESCRIPTION"]).startswith(USER_TEXT)


def test_an_overridden_occurrence_carries_its_own_block() -> None:
    override = "\r\n".join(["BEGIN:VEVENT", "UID:b1@lab", "DTSTAMP:20261120T100000Z",
                            "RECURRENCE-ID:20261130T080000Z", "DTSTART:20261130T100000Z",
                            "DTEND:20261130T180000Z", "SUMMARY:moved", "DESCRIPTION:moved one", "END:VEVENT"])
    calendar = icalendar.Calendar.from_ical(booker_event(rrule="FREQ=WEEKLY;COUNT=10", extra=override))
    occurrence = START + timedelta(days=7)
    assert apply(calendar, uid="b1@lab", occurrence=occurrence, outcome=_running(), timezone=TZ) is True
    master, moved = _vevents(calendar)
    assert "X-GPUBOOK-STATUS" not in master and str(master["DESCRIPTION"]) == USER_TEXT
    assert str(moved["DESCRIPTION"]).startswith(f"moved one\n\n{BEGIN}\nrunning: ")
    assert str(moved["X-GPUBOOK-STATUS"]) == "running"


def test_all_day_series_occurrence() -> None:
    text = booker_event(rrule="FREQ=DAILY;COUNT=3").replace("DTSTART:20261123T080000Z", "DTSTART;VALUE=DATE:20261123") \
        .replace("DTEND:20261123T160000Z", "DTEND;VALUE=DATE:20261124")
    calendar = icalendar.Calendar.from_ical(text)
    assert apply(calendar, uid="b1@lab", occurrence=date(2026, 11, 24), outcome=_running(), timezone=TZ)
    (master,) = _vevents(calendar)
    assert "2026-11-24: running: ssh -p 2201" in str(master["DESCRIPTION"])
    assert master["X-GPUBOOK-STATUS"].params["X-GPUBOOK-OCCURRENCE"] == "20261124"
    assert apply(icalendar.Calendar.from_ical(calendar.to_ical()), uid="b1@lab", occurrence=date(2026, 11, 24),
                 outcome=_running(), timezone=TZ) is False


def test_read_only_feed_offers_no_writer_without_a_request() -> None:
    # Nothing listens on these ports: asking for the capability sends nothing.
    feed = CalendarConfig(url=f"http://127.0.0.1:{free_port()}/lab.ics", gpus=None, kind="ics")
    assert open_writer(feed, timezone=TZ) is None
    calendar = CalendarConfig(url=f"http://127.0.0.1:{free_port()}/lab/devbox1/", gpus=None, kind="caldav")
    writer = open_writer(calendar, timezone=TZ)
    assert isinstance(writer, CalendarWriter) and writer.timezone == TZ


# -- real CalDAV servers -----------------------------------------------------------------------


@pytest.fixture(scope="module", params=["radicale", "xandikos"])
def calendar_url(request) -> Iterator[str]:
    yield from calendar_on(request.param)


def _config(url: str) -> CalendarConfig:
    return CalendarConfig(url=url, gpus=None, username=USER, password=PASSWORD, kind="caldav")


def _writer(url: str, **settings) -> CalendarWriter:  # type: ignore[no-untyped-def]
    return CalendarWriter(url, username=USER, password=PASSWORD, **settings)


def _server_copy(href: str) -> tuple[str, icalendar.Calendar]:
    answer = requests.get(href, auth=(USER, PASSWORD), timeout=10)
    answer.raise_for_status()
    return answer.headers["ETag"], icalendar.Calendar.from_ical(answer.content)


def _uid() -> str:
    return f"{time.time_ns()}@gpubook-test"


@pytest.mark.caldav
def test_write_back_keeps_user_text_sets_status_and_is_idempotent(calendar_url: str) -> None:
    uid = _uid()
    href = put_event(calendar_url, booker_event(uid))
    writer = open_writer(_config(calendar_url), timezone=TZ)  # the source's capability
    assert isinstance(writer, CalendarWriter)
    ref = EventRef(calendar_url, href, uid, occurrence=START)
    sequence = _vevents(_server_copy(href)[1])[0]["SEQUENCE"]
    first = writer.write(ref, _running())
    assert (first.written, first.reason, first.attempts) == (True, "written", 1)
    etag, stored = _server_copy(href)
    (event,) = _vevents(stored)
    description = str(event["DESCRIPTION"])
    assert description.startswith(USER_TEXT + "\n\n")
    assert f"{BEGIN}\nrunning: ssh -p 2201 alice@devbox1\n" in description
    assert str(event["X-GPUBOOK-STATUS"]) == "running"
    assert event["SEQUENCE"] == sequence  # no re-invitation
    assert first.etag in (None, etag)

    # The same outcome again: no write, the ETag stays.
    second = writer.write(ref, _running())
    assert (second.written, second.reason, second.attempts) == (False, "unchanged", 0)
    assert _server_copy(href)[0] == etag

    # A new status replaces the block in place; text the user put below it stays.
    user = booker_calendar(calendar_url).event_by_url(href)
    with user.edit_icalendar_instance() as ical:
        target = _vevents(ical)[0]
        target["DESCRIPTION"] = str(target["DESCRIPTION"]) + "\n\nPS from alice"
    user.save(increase_seqno=False)
    writer.write(ref, notify.ended(gpu_hours=8, outputs="/srv/out", at=END_TIME, timezone=TZ))
    (event,) = _vevents(_server_copy(href)[1])
    assert str(event["DESCRIPTION"]) == (USER_TEXT + f"\n\n{BEGIN}\nended: 8.00 GPU-hours, stopped 2026-11-23 17:00 "
                                         f"+0100\noutputs: /srv/out\n{END}\n\nPS from alice")
    assert str(event["X-GPUBOOK-STATUS"]) == "ended"
    writer.close()


class _RacingWriter(CalendarWriter):
    """The real writer, with a user saving the event between gpubook's read and gpubook's write."""

    races = 1

    def _modify(self, event, ref, outcome):
        changed = super()._modify(event, ref, outcome)
        if self.races > 0:
            self.races -= 1
            user = booker_calendar(self.url).event_by_url(ref.href)
            with user.edit_icalendar_instance() as ical:
                target = _vevents(ical)[0]
                target["SUMMARY"] = "alice training (moved to the big GPU)"
                target["DESCRIPTION"] = "USER EDIT\n" + str(target["DESCRIPTION"])
            user.save(increase_seqno=False)
        return changed


@pytest.mark.caldav
def test_a_concurrent_user_edit_survives(calendar_url: str) -> None:
    uid = _uid()
    href = put_event(calendar_url, booker_event(uid))
    writer = _RacingWriter(calendar_url, username=USER, password=PASSWORD, timezone=TZ, retry_delay=0)
    result = writer.write(EventRef(calendar_url, href, uid), _running())
    assert (result.written, result.attempts) == (True, 2)  # the first PUT was refused (412), then re-read
    (event,) = _vevents(_server_copy(href)[1])
    assert str(event["SUMMARY"]) == "alice training (moved to the big GPU)"
    description = str(event["DESCRIPTION"])
    assert description.startswith("USER EDIT\n" + USER_TEXT)
    assert description.count(BEGIN) == 1 and "running: ssh -p 2201 alice@devbox1" in description
    assert str(event["X-GPUBOOK-STATUS"]) == "running"


@pytest.mark.caldav
def test_an_event_edited_on_every_try_is_an_error_not_a_lost_edit(calendar_url: str) -> None:
    uid = _uid()
    href = put_event(calendar_url, booker_event(uid))
    writer = _RacingWriter(calendar_url, username=USER, password=PASSWORD, timezone=TZ, attempts=3, retry_delay=0)
    writer.races = 3
    with pytest.raises(CalendarError, match="changed on the server 3 times"):
        writer.write(EventRef(calendar_url, href, uid), _running())
    (event,) = _vevents(_server_copy(href)[1])
    assert str(event["DESCRIPTION"]).startswith("USER EDIT\nUSER EDIT\nUSER EDIT\n")
    assert BEGIN not in str(event["DESCRIPTION"])


@pytest.mark.caldav
def test_series_occurrence_on_the_server(calendar_url: str) -> None:
    uid = _uid()
    href = put_event(calendar_url, booker_event(uid, rrule="FREQ=WEEKLY;COUNT=4"))
    writer = _writer(calendar_url, timezone=TZ)
    second = START + timedelta(days=7)
    assert writer.write(EventRef(calendar_url, href, uid, occurrence=second), _running()).written
    (master,) = _vevents(_server_copy(href)[1])
    assert "2026-11-30 09:00 +0100: running: ssh -p 2201" in str(master["DESCRIPTION"])
    assert master["X-GPUBOOK-STATUS"].params["X-GPUBOOK-OCCURRENCE"] == "20261130T080000Z"
    assert "RRULE" in master


@pytest.mark.caldav
def test_deleted_event_is_reported_as_gone(calendar_url: str) -> None:
    uid = _uid()
    href = put_event(calendar_url, booker_event(uid))
    booker_calendar(calendar_url).event_by_url(href).delete()
    result = _writer(calendar_url).write(EventRef(calendar_url, href, uid), _running())
    assert (result.written, result.reason) == (False, "event gone")


@pytest.mark.caldav
def test_unreachable_server_is_a_calendar_error() -> None:
    url = f"http://127.0.0.1:{free_port()}/lab/devbox1/"
    with pytest.raises(CalendarError, match="writing running back failed"):
        _writer(url, timeout=5).write(EventRef(url, url + "x.ics", "x"), _running())


# -- e-mail and webhook ------------------------------------------------------------------------


MESSAGE = Message(kind="warning", booking_id="b1@lab/20261123T080000Z", user="alice",
                  subject="gpubook: your booking ends at 17:00\nBcc: everyone@lab.example",
                  text="Your container on devbox1 stops in 15 minutes. Outputs stay in /srv/gpubook/alice/output.",
                  fields={"port": 2201, "end": "2026-11-23T17:00:00+01:00", "gpus": [0]})


def test_mail_is_delivered_without_forged_headers(smtp_server) -> None:
    settings = MailSettings(host="127.0.0.1", port=smtp_server.server_address[1], sender="gpubook@devbox1")
    send_mail(settings, MESSAGE, to=["alice@lab.example"])
    (envelope,) = smtp_server.received
    assert envelope["from"] == "<gpubook@devbox1>" and envelope["to"] == ["<alice@lab.example>"]
    mail = message_from_bytes(envelope["data"], policy=default_policy)
    assert mail["Subject"] == "gpubook: your booking ends at 17:00 Bcc: everyone@lab.example"
    assert mail["Bcc"] is None
    assert mail["X-Gpubook-Booking"] == "b1@lab/20261123T080000Z"
    assert "stops in 15 minutes" in mail.get_content()


def test_mail_server_unreachable_is_a_notify_error() -> None:
    settings = MailSettings(host="127.0.0.1", port=free_port(), timeout=5)
    with pytest.raises(NotifyError, match="e-mail to alice@lab.example via 127.0.0.1"):
        send_mail(settings, MESSAGE, to=["alice@lab.example"])


def test_webhook_posts_one_json_object(hook_server) -> None:
    url = f"http://127.0.0.1:{hook_server.server_address[1]}/hooks/gpubook"
    post_webhook(WebhookSettings(url=url, token="s3cret"), MESSAGE)
    ((headers, body),) = hook_server.received
    assert headers["Authorization"] == "Bearer s3cret" and headers["Content-Type"] == "application/json"
    assert body == {"event": "warning", "booking": "b1@lab/20261123T080000Z", "user": "alice",
                    "subject": MESSAGE.subject, "text": MESSAGE.text, "port": 2201,
                    "end": "2026-11-23T17:00:00+01:00", "gpus": [0]}
    assert "s3cret" not in repr(WebhookSettings(url=url, token="s3cret"))


def test_webhook_refusal_and_absence_are_notify_errors(hook_server) -> None:
    hook_server.answer = 500
    url = f"http://127.0.0.1:{hook_server.server_address[1]}/"
    with pytest.raises(NotifyError, match="answered 500"):
        post_webhook(WebhookSettings(url=url), MESSAGE)
    with pytest.raises(NotifyError, match="webhook .* failed"):
        post_webhook(WebhookSettings(url=f"http://127.0.0.1:{free_port()}/", timeout=5), MESSAGE)


def _notify_config(tmp_path, body: str):  # type: ignore[no-untyped-def]
    from gpubook.scheduler import config as config_module

    path = tmp_path / "gpubook.toml"
    path.write_text('[[calendar]]\nurl = "http://127.0.0.1:5232/lab/devbox1/"\n'
                    '[users.alice]\nuid = 2001\nemail = ["alice@lab.example"]\n' + body)
    return config_module.load(path)


def test_notices_are_off_by_default(tmp_path) -> None:
    assert notices.Notices.from_config(_notify_config(tmp_path, "")) is None


def test_notices_go_by_mail_and_webhook_as_configured(tmp_path, smtp_server, hook_server, caplog) -> None:
    token = tmp_path / "token"
    token.write_text("t0ken\n")
    token.chmod(0o600)
    config = _notify_config(tmp_path, f"""
[notify.email]
enabled = true
host = "127.0.0.1"
port = {smtp_server.server_address[1]}
sender = "gpubook@devbox1"
events = ["warning"]
[notify.webhook]
enabled = true
url = "http://127.0.0.1:{hook_server.server_address[1]}/hook"
token_file = "token"
events = ["warning", "ended"]
""")
    assert "t0ken" not in repr(config)
    sender = notices.Notices.from_config(config)
    assert sender is not None
    sender(MESSAGE)
    ended = Message(kind="ended", booking_id="b1", user="alice", subject="ended", text="ended")
    sender(ended)
    assert [envelope["to"] for envelope in smtp_server.received] == [["<alice@lab.example>"]]  # ended: no mail
    assert [body["event"] for _, body in hook_server.received] == ["warning", "ended"]
    assert hook_server.received[0][0]["Authorization"] == "Bearer t0ken"
    hook_server.answer = 500
    sender(ended)  # a failed delivery is logged, never raised
    assert "the webhook notice (ended) was not delivered" in caplog.text


def test_notify_config_errors_are_named(tmp_path) -> None:
    from gpubook.runtime.errors import ConfigError

    with pytest.raises(ConfigError) as caught:
        _notify_config(tmp_path, """
[notify.email]
enabled = true
securty = "tls"
events = ["warnings"]
[notify.webhook]
enabled = true
url = "ftp://x"
""")
    text = str(caught.value)
    assert "notify.email.securty: unknown key; did you mean 'security'?" in text
    assert "notify.email.events[0]: is not a notice" in text
    assert "notify.webhook.url: must be an http(s):// URL" in text


def test_smtp_login_without_tls_is_refused_at_config_load(tmp_path) -> None:
    """A user name with security "none" would send the SMTP password in clear (even to a loopback
    host, where any local user may hold the port while the relay is down): refused at load."""
    from gpubook.runtime.errors import ConfigError

    password = tmp_path / "smtp-password"
    password.write_text("s3cret\n")
    password.chmod(0o600)
    mail = ('[notify.email]\nenabled = true\nhost = "127.0.0.1"\nusername = "gpubook"\n'
            'password_file = "smtp-password"\n')
    with pytest.raises(ConfigError) as caught:
        _notify_config(tmp_path, mail)
    assert ('notify.email.security: is "none", but a username is set: logging in to 127.0.0.1:25 would send '
            'the password in clear; set security = "starttls" or "tls"') in str(caught.value)
    assert "s3cret" not in str(caught.value)
    for security in ("starttls", "tls"):
        config = _notify_config(tmp_path, mail + f'security = "{security}"\n')
        assert config.notify.email is not None and config.notify.email.password == "s3cret"
    assert _notify_config(tmp_path, '[notify.email]\nenabled = true\n').notify.email is not None  # no login
