"""`gpubook free` end to end: a real Radicale calendar, the real CLI in a child process: the free
stretches of each GPU, the next slots that fit a request, the availability feed (--ics) parsed by
icalendar, and a refusal of `gpubook bookings` naming a slot that `gpubook free` shows free."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

import caldav
import icalendar
import pytest

from tests.kits import servers
from tests.kits.cli_kit import gpubook

pytestmark = pytest.mark.caldav

TODAY = datetime.now(UTC).replace(hour=0, minute=0, second=0, microsecond=0)
DAY = TODAY + timedelta(days=2)  # alice's day: far enough that "now" never reaches it during the test
NEXT = DAY + timedelta(days=1)


def event(uid: str, start: datetime, hours: float, *lines: str) -> str:
    end = start + timedelta(hours=hours)
    body = "\r\n".join(lines)
    return ("BEGIN:VCALENDAR\r\nVERSION:2.0\r\nPRODID:-//gpubook tests//EN\r\nBEGIN:VEVENT\r\n"
            f"UID:{uid}\r\nDTSTAMP:20261101T000000Z\r\nCREATED:20261101T000000Z\r\n"
            f"DTSTART:{start:%Y%m%dT%H%M%SZ}\r\nDTEND:{end:%Y%m%dT%H%M%SZ}\r\n{body}\r\n"
            "END:VEVENT\r\nEND:VCALENDAR\r\n")


def day(moment: datetime) -> str:
    days = (moment.date() - datetime.now(UTC).date()).days
    return {0: "today", 1: "tomorrow"}.get(days, f"{moment:%a %d %b}")


def label(moment: datetime) -> str:
    return f"{day(moment)} {moment:%H:%M}"


@pytest.fixture
def config(tmp_path: Path, radicale_server: servers.CalendarServer) -> Path:
    """alice holds GPU 0 on DAY 09:00-17:00 (UTC); bob GPUs 0 and 1 on NEXT 09:00-12:00."""
    calendar: caldav.Calendar = radicale_server.new_calendar()
    calendar.save_event(event("alice-day", DAY + timedelta(hours=9), 8, "DESCRIPTION:user: alice\\ngpus: 0,"))
    calendar.save_event(event("bob-next", NEXT + timedelta(hours=9), 3, "DESCRIPTION:user: bob\\ngpus: 2"))
    path = tmp_path / "gpubook.toml"
    path.write_text(f'[host]\nname = "devbox1"\ntimezone = "UTC"\n[[calendar]]\nurl = "{calendar.url}"\n'
                    '[gpus]\ncount = 2\n[users.alice]\nuid = 2001\n[users.bob]\nuid = 2002\n')
    return path


def test_the_table_shows_each_gpus_free_stretches(config: Path) -> None:
    done = gpubook("free", "--config", str(config))
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("Free GPUs of devbox1, times in UTC (bookings read until ")
    assert lines[1] == (f"  GPU 0  free now → {label(DAY + timedelta(hours=9))}; {label(DAY + timedelta(hours=17))} → "
                        f"{label(NEXT + timedelta(hours=9))}; from {label(NEXT + timedelta(hours=12))}")
    assert lines[2] == (f"  GPU 1  free now → {label(NEXT + timedelta(hours=9))}; "
                        f"from {label(NEXT + timedelta(hours=12))}")
    assert lines[3].startswith("Next slots for 1 GPU for 1 h: GPU 0 is free from today ")


def test_free_from_a_time_as_people_type_it(config: Path) -> None:
    """`--from` takes the words `book --at` takes: the table and the slots from then on; with --ics it is
    a usage error (exit 2), and past what is read ahead one sentence."""
    done = gpubook("free", "--config", str(config), "--from", f"{DAY:%Y-%m-%d} 10:00", "--gpus", "2")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith(f"Free GPUs of devbox1 from {label(DAY + timedelta(hours=10))}, times in UTC"), lines
    assert lines[1] == (f"  GPU 0  busy at {label(DAY + timedelta(hours=10))}; free {label(DAY + timedelta(hours=17))}"
                        f" → {label(NEXT + timedelta(hours=9))}; from {label(NEXT + timedelta(hours=12))}")
    assert lines[2] == (f"  GPU 1  free {label(DAY + timedelta(hours=10))} → {label(NEXT + timedelta(hours=9))}; "
                        f"from {label(NEXT + timedelta(hours=12))}")
    assert lines[3].startswith(f"Next slots for 2 GPUs for 1 h: GPUs 0,1 are free from "
                               f"{label(DAY + timedelta(hours=17))} "), lines
    ics = gpubook("free", "--config", str(config), "--from", "tomorrow", "--ics")
    assert ics.returncode == 2 and "--from does not go with --ics" in ics.stderr, ics.stderr
    far = gpubook("free", "--config", str(config), "--from", f"{TODAY.year + 2}-01-01")
    assert far.returncode == 1 and "is past what gpubook reads ahead" in far.stderr, far.stderr


def test_the_next_slots_fit_the_request_and_are_free(config: Path) -> None:
    done = gpubook("free", "--config", str(config), "--gpus", "2", "--hours", "10", "--json")
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    slots = [(s["start"], s["end"], s["gpus"]) for s in found["slots"]]
    assert slots[1:] == [((DAY + timedelta(hours=17)).isoformat(), (NEXT + timedelta(hours=9)).isoformat(), [0, 1]),
                         ((NEXT + timedelta(hours=12)).isoformat(), None, [0, 1])]
    assert slots[0][1] == (DAY + timedelta(hours=9)).isoformat() and slots[0][2] == [0, 1]
    assert datetime.fromisoformat(slots[0][0]) <= datetime.now(UTC)
    assert [g["free"][1] for g in found["gpus"]] == [
        {"start": (DAY + timedelta(hours=17)).isoformat(), "end": (NEXT + timedelta(hours=9)).isoformat()},
        {"start": (NEXT + timedelta(hours=12)).isoformat(), "end": found["until"]}]


def test_the_feed_is_the_bookings_without_names(config: Path) -> None:
    done = gpubook("free", "--config", str(config), "--ics")
    assert done.returncode == 0, done.stderr
    calendar = icalendar.Calendar.from_ical(done.stdout)
    events = sorted(calendar.walk("VEVENT"), key=lambda e: e.decoded("dtstart"))
    assert [(e.decoded("dtstart"), e.decoded("dtend"), str(e["summary"])) for e in events] == [
        (DAY + timedelta(hours=9), DAY + timedelta(hours=17), "busy: GPU 0"),
        (NEXT + timedelta(hours=9), NEXT + timedelta(hours=12), "busy: GPU 0,1")]
    assert "alice" not in done.stdout and "bob" not in done.stdout


def test_a_refusal_names_a_slot_that_gpubook_free_shows_free(config: Path, radicale_server: servers.CalendarServer,
                                                             ) -> None:
    url = config.read_text().split('url = "')[1].split('"')[0]
    calendar = caldav.Calendar(client=radicale_server.client(), url=url)
    calendar.save_event(event("bob-clash", DAY + timedelta(hours=10), 2, "DESCRIPTION:user: bob\\ngpus: 0,"))
    done = gpubook("bookings", "--config", str(config), "--json")
    assert done.returncode == 0, done.stderr
    reason = {r["id"]: r["reason"] for r in json.loads(done.stdout)["rejected"]}["bob-clash"]
    start, end = label(DAY + timedelta(hours=17)), label(NEXT + timedelta(hours=9))
    assert reason.endswith(f"; GPU 0 is free from {start} to {end}; {day(NEXT)} from 12:00 (UTC)"), reason
    shown = json.loads(gpubook("free", "--config", str(config), "--json").stdout)
    assert {"start": (DAY + timedelta(hours=17)).isoformat(), "end": (NEXT + timedelta(hours=9)).isoformat()} in \
        shown["gpus"][0]["free"]


def test_an_unknown_model_is_one_sentence(config: Path) -> None:
    done = gpubook("free", "--config", str(config), "--model", "a100")
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr == ("gpubook: there is no GPU model 'a100' on devbox1 (models: none (NVML names no GPU "
                           "model here))\n")
