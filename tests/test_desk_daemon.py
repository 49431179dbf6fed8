"""`gpubook book` and `gpubook cancel` from the terminal (issue 40): a real `gpubook run` (on the idle
engine: no container starts) reading and written through a real Radicale calendar, the commands run
as a researcher runs them (no config, no secret: the daemon's socket). The booking is an ordinary
event of the booker's calendar, and the answer is the daemon's pass over it.

Hostile: a request naming another user is refused (identity is the socket's peer credentials only);
a booking of someone else's cannot be cancelled, and the refusal names nothing of it."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import paramiko
import pytest

from tests.kits import ask_kit
from tests.kits.daemon_kit import DAEMON_MODULE, DaemonProcess, book, wait_for

pytestmark = DAEMON_MODULE

DAY = (datetime.now(UTC) + timedelta(days=2)).replace(hour=0, minute=0, second=0, microsecond=0)


@pytest.fixture(scope="module")
def desk(radicale_server, tmp_path_factory) -> Iterator[dict]:  # type: ignore[no-untyped-def]
    """One daemon: this account is alice's login; bob (another login) holds both GPUs 12-14 on DAY."""
    folder = tmp_path_factory.mktemp("desk")
    calendar = radicale_server.new_calendar()
    keys = {"alice": paramiko.ECDSAKey.generate(bits=256), "bob": paramiko.ECDSAKey.generate(bits=256)}
    config = ask_kit.idle_config(folder, str(calendar.url), keys=keys,
                                 accounts={"alice": ask_kit.login(), "bob": "nobody"})
    book(calendar, "bob-1@test", user="bob", start=DAY + timedelta(hours=12), end=DAY + timedelta(hours=14),
         gpus="2", summary="bob secret-project-x")
    daemon = DaemonProcess(config).start()
    env = ask_kit.researcher_env(folder / "home", GPUBOOK_DAEMON_ACCOUNT=ask_kit.login())
    try:
        wait_for("the daemon's first pass", lambda: ask_kit.gpubook("mine", "--json", env=env).returncode == 0,
                 timeout=60, daemon=daemon)
        yield {"env": env, "daemon": daemon, "calendar": calendar}
    finally:
        daemon.stop()


def _book(env: dict[str, str], *args: str) -> tuple[int, dict]:
    done = ask_kit.gpubook("book", "--json", *args, env=env, timeout=120)
    assert done.stdout, done.stderr
    return done.returncode, json.loads(done.stdout)


def _events(calendar) -> dict[str, str]:  # type: ignore[no-untyped-def]
    """UID → DESCRIPTION of every event in the calendar, as any client reads it."""
    return {str(e.icalendar_component["UID"]): str(e.icalendar_component.get("DESCRIPTION", ""))
            for e in calendar.events()}


def test_a_booking_from_the_terminal_is_an_event_in_the_bookers_calendar_and_the_daemons_answer(desk: dict) -> None:
    at = (DAY + timedelta(hours=9)).strftime("%Y-%m-%d %H:%M")
    code, answer = _book(desk["env"], "--gpus", "1", "--hours", "2h", "--at", at, "--title", "alice fine-tune")
    assert code == 0, answer
    assert answer["state"] == "booked", answer
    assert datetime.fromisoformat(answer["start"]) == DAY + timedelta(hours=9)
    assert datetime.fromisoformat(answer["end"]) == DAY + timedelta(hours=11)
    # An ordinary event: the booker's client sees it with the convention's lines and where it was made.
    text = _events(desk["calendar"])[answer["id"]]
    assert "gpus: 1" in text and "user: alice" in text
    assert f"Made with `gpubook book` by {ask_kit.login()}" in text
    mine = json.loads(ask_kit.gpubook("mine", "--json", env=desk["env"]).stdout)
    assert answer["id"] in {row["id"] for row in mine["bookings"]}

    # Cancelled from the terminal: the event is gone from the calendar, and from the daemon's plan.
    done = ask_kit.gpubook("cancel", answer["id"], "--json", env=desk["env"], timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["done"] is True
    assert answer["id"] not in _events(desk["calendar"])
    mine = json.loads(ask_kit.gpubook("mine", "--json", env=desk["env"]).stdout)
    assert answer["id"] not in {row["id"] for row in mine["bookings"]}


def test_a_refused_booking_says_why_and_the_next_free_slot_and_exits_1(desk: dict) -> None:
    at = (DAY + timedelta(hours=12, minutes=30)).strftime("%Y-%m-%d %H:%M")
    code, answer = _book(desk["env"], "--gpus", "2", "--hours", "1", "--at", at)
    assert code == 1, answer
    assert answer["state"] == "refused"
    assert "GPU" in answer["reason"] and "free" in answer["reason"], answer["reason"]
    assert "secret-project-x" not in answer["reason"]  # the holder's name (one calendar), never his title
    # The refusal is the calendar's too: the event stays, refused, where the booker moves or deletes it.
    assert answer["id"] in _events(desk["calendar"])
    printed = ask_kit.gpubook("cancel", answer["id"], env=desk["env"], timeout=120)
    assert printed.returncode == 0 and "cancelled" in printed.stdout, printed.stderr


def test_hostile_a_request_naming_another_user_is_refused(desk: dict) -> None:
    before = set(_events(desk["calendar"]))
    line = json.dumps({"kind": "book", "gpus": 1, "hours": "1", "at": "tomorrow 08:00", "user": "bob"}) + "\n"
    answer = json.loads(ask_kit.raw_ask(os.getuid(), line.encode()))
    assert "never for a user named in the request" in answer["error"]
    assert set(_events(desk["calendar"])) == before  # nothing written


def test_hostile_another_users_booking_cannot_be_cancelled_and_is_not_named(desk: dict) -> None:
    done = ask_kit.gpubook("cancel", "bob-1@test", env=desk["env"], timeout=120)
    assert done.returncode == 1
    assert "you have no booking 'bob-1@test'" in done.stderr
    assert "bob-1@test" in _events(desk["calendar"])


def test_a_bad_time_or_length_is_one_sentence_and_writes_nothing(desk: dict) -> None:
    before = set(_events(desk["calendar"]))
    for args, said in ((("--at", "next tuesday-ish"), "the start 'next tuesday-ish' is not understood"),
                       (("--hours", "forever"), "the length 'forever' is not understood"),
                       (("--gpus", "0"), "--gpus must be a whole number from 1 to 64")):
        done = ask_kit.gpubook("book", *args, env=desk["env"], timeout=120)
        assert done.returncode == 1 and said in done.stderr, (args, done.stderr)
    assert set(_events(desk["calendar"])) == before


def test_a_refusal_answered_with_standby_waits_and_its_event_says_so(desk: dict) -> None:
    """The page's "Wait on standby instead" (and `gpubook standby ID`): the daemon puts `standby: yes`
    first in the refused event's description, and the next pass keeps it waiting, tentative."""
    at = (DAY + timedelta(hours=13)).strftime("%Y-%m-%d %H:%M")
    code, answer = _book(desk["env"], "--gpus", "2", "--hours", "30m", "--at", at)
    assert code == 1 and answer["state"] == "refused", answer
    done = ask_kit.gpubook("standby", answer["id"], "--json", env=desk["env"], timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    waiting = json.loads(done.stdout)
    assert waiting["state"] == "standby", waiting
    assert waiting["reason"].startswith("on standby, waiting for its GPUs to free up: "), waiting["reason"]
    assert _events(desk["calendar"])[answer["id"]].startswith("standby: yes\n")
    again = ask_kit.gpubook("standby", answer["id"], env=desk["env"], timeout=120)
    assert again.returncode == 1 and "is standby, not refused: nothing to wait for" in again.stderr, again.stderr
    assert ask_kit.gpubook("cancel", answer["id"], env=desk["env"], timeout=120).returncode == 0


def test_an_html_description_is_not_rewritten_and_the_booker_is_told_where_to_add_the_line(desk: dict) -> None:
    from gpubook.scheduler.sources.caldav_writer import CalendarWriter
    from gpubook.scheduler.sources.errors import CalendarError

    calendar = desk["calendar"]
    html = "<p>user: alice<br>gpus: 1</p>"
    event = book(calendar, "html-1@test", user="alice", start=DAY + timedelta(hours=20),
                 end=DAY + timedelta(hours=21), summary="alice html")
    component = event.icalendar_component
    component.pop("DESCRIPTION")
    component.add("DESCRIPTION", html)
    event.save()
    writer = CalendarWriter(str(calendar.url))
    try:
        with pytest.raises(CalendarError, match="its description is HTML, which gpubook does not rewrite: add the "
                                                "line 'standby: yes' to the event in your calendar"):
            writer.add_line(str(event.url), "standby: yes")
    finally:
        writer.close()
    assert _events(calendar)["html-1@test"] == html
    calendar.event_by_uid("html-1@test").delete()
