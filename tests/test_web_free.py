"""The availability calendar served by the page (/free.ics, /free/<model>.ics) through the real
waitress server, parsed by icalendar: its busy events are the accepted bookings, with no names for
a viewer the page does not know or for another booker; a booker sees their own name only."""

from __future__ import annotations

import subprocess
from datetime import timedelta
from pathlib import Path

import icalendar
import requests

from gpubook.scheduler.core.plan import Plan
from gpubook.scheduler.outbox import status
from gpubook.scheduler.outbox.web.app import create_app
from gpubook.scheduler.outbox.web.live import LiveGpu, LiveGpus
from tests.kits.web_kit import accepted, booking, now_utc, served, status_of, web_config

NOW = now_utc()
PASSWORDS = {"alice": "alice-pw-1", "bob": "bob-pw-2"}
ALICE = booking("alice-run@lab", user="alice", start=NOW - timedelta(hours=1), end=NOW + timedelta(hours=2))
BOB = booking("bob-later@lab", user="bob", start=NOW + timedelta(hours=3), end=NOW + timedelta(hours=5), gpus=2)
PLAN = Plan(accepted=(accepted(ALICE, 0), accepted(BOB, 0, 1)), rejected=(), next_wakeup=None)


def lab_status() -> status.Status:
    return status_of(PLAN, now=NOW, gpus=2)


def htpasswd(folder: Path) -> Path:
    """An htpasswd file made by Apache's own tool, bcrypt (-B)."""
    path = folder / "htpasswd"
    for number, (user, password) in enumerate(PASSWORDS.items()):
        subprocess.run(["htpasswd", "-B", "-b", "-C", "5", *(["-c"] if number == 0 else []), str(path), user,
                        password], check=True, capture_output=True)
    path.chmod(0o600)
    return path


def events(body: bytes) -> list[icalendar.Event]:
    calendar = icalendar.Calendar.from_ical(body)
    return sorted(calendar.walk("VEVENT"), key=lambda e: e.decoded("dtstart"))


def test_the_feed_is_the_accepted_bookings_without_names(tmp_path: Path) -> None:
    with served(web_config(tmp_path), lab_status()) as url:
        answer = requests.get(url + "/free.ics", timeout=10)
    assert answer.status_code == 200
    assert answer.headers["Content-Type"] == "text/calendar; charset=utf-8"
    calendar = icalendar.Calendar.from_ical(answer.content)
    assert str(calendar["x-wr-calname"]) == "devbox1 GPUs: busy"
    assert b"\r\nREFRESH-INTERVAL;VALUE=DURATION:PT5M\r\n" in answer.content
    assert b"\r\nX-PUBLISHED-TTL:PT5M\r\n" in answer.content
    found = [(e.decoded("dtstart"), e.decoded("dtend"), str(e["summary"]), str(e["transp"]))
             for e in events(answer.content)]
    assert found == [(ALICE.start, ALICE.end, "busy: GPU 0", "OPAQUE"), (BOB.start, BOB.end, "busy: GPU 0,1", "OPAQUE")]
    # Nobody is known with auth none: no user name, no booking id, anywhere in the feed.
    for secret in (b"alice", b"bob", b"@lab"):
        assert secret not in answer.content.lower()


def test_the_feed_stands_behind_the_login_and_names_only_the_viewers_own(tmp_path: Path) -> None:
    config = web_config(tmp_path, auth="basic", htpasswd_file=str(htpasswd(tmp_path)))
    with served(config, lab_status()) as url:
        assert requests.get(url + "/free.ics", timeout=10).status_code == 401
        assert requests.get(url + "/free.ics", auth=("alice", "wrong"), timeout=10).status_code == 401
        as_alice = requests.get(url + "/free.ics", auth=("alice", PASSWORDS["alice"]), timeout=10)
        as_bob = requests.get(url + "/free.ics", auth=("bob", PASSWORDS["bob"]), timeout=10)
        refused_model = requests.get(url + "/free/a100.ics", auth=("bob", PASSWORDS["bob"]), timeout=10)
    assert [str(e["summary"]) for e in events(as_alice.content)] == ["busy: GPU 0 (alice)", "busy: GPU 0,1"]
    assert [str(e["summary"]) for e in events(as_bob.content)] == ["busy: GPU 0", "busy: GPU 0,1 (bob)"]
    assert b"bob" not in as_alice.content and b"alice" not in as_bob.content
    assert "no-store" not in as_alice.headers["Cache-Control"] and "private" in as_alice.headers["Cache-Control"]
    # The same events (UIDs) for each viewer, so one subscription stays one set of events.
    assert {str(e["uid"]) for e in events(as_alice.content)} == {str(e["uid"]) for e in events(as_bob.content)}
    assert refused_model.status_code == 404
    assert refused_model.text == ("there is no GPU model 'a100' on devbox1 (feeds per model: none: NVML names "
                                  "no GPU model here)\n")


def test_a_host_with_two_models_has_a_feed_for_each(tmp_path: Path) -> None:
    """NVML names the models (a fake reading: no GPU here); each model's feed has its GPUs' blocks."""
    live = LiveGpus(gpus=(LiveGpu(0, "NVIDIA A100-SXM4-80GB", None, None, None),
                          LiveGpu(1, "Tesla T4", None, None, None)))
    app = create_app(status=lab_status, web=web_config(tmp_path).web, host_name="devbox1", live=lambda: live)
    client = app.test_client()
    a100 = client.get("/free/a100-sxm4-80gb.ics")
    t4 = client.get("/free/tesla-t4.ics")
    unknown = client.get("/free/h100.ics")
    assert [(e.decoded("dtstart"), str(e["summary"])) for e in events(a100.data)] == [
        (ALICE.start, "busy: GPU 0"), (BOB.start, "busy: GPU 0")]
    assert [(e.decoded("dtstart"), str(e["summary"])) for e in events(t4.data)] == [(BOB.start, "busy: GPU 1")]
    assert str(icalendar.Calendar.from_ical(t4.data)["x-wr-calname"]) == "devbox1 Tesla T4 GPUs: busy"
    assert unknown.status_code == 404
    assert unknown.text == ("there is no GPU model 'h100' on devbox1 (feeds per model: /free/a100-sxm4-80gb.ics, "
                            "/free/tesla-t4.ics)\n")


def test_before_the_first_pass_the_feed_is_an_empty_calendar(tmp_path: Path) -> None:
    with served(web_config(tmp_path), None) as url:
        answer = requests.get(url + "/free.ics", timeout=10)
    assert answer.status_code == 200 and events(answer.content) == []


def test_a_new_status_gives_a_new_feed(tmp_path: Path) -> None:
    """The feed is built once per status: the next pass's status (a booking more) is served at once."""
    current = [lab_status()]
    app = create_app(status=lambda: current[0], web=web_config(tmp_path).web, host_name="devbox1")
    client = app.test_client()
    assert len(events(client.get("/free.ics").data)) == 2
    assert len(events(client.get("/free.ics").data)) == 2
    later = booking("carol@lab", user="carol", start=NOW + timedelta(hours=6), end=NOW + timedelta(hours=7))
    current[0] = status_of(Plan(accepted=(*PLAN.accepted, accepted(later, 1)), rejected=(), next_wakeup=None),
                           now=NOW + timedelta(seconds=30), gpus=2)
    assert [str(e["summary"]) for e in events(client.get("/free.ics").data)] == [
        "busy: GPU 0", "busy: GPU 0,1", "busy: GPU 1"]
