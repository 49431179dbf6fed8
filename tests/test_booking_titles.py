"""Bookings named by their event's title (SUMMARY) on the status page and in `gpubook status`, the
UID on hover and in --json. Titles come from a hostile calendar: HTML, a `</script>` that would
close the page's embedded data, terminal escapes and newlines must all come out inert."""

from __future__ import annotations

import html
import json
import re
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import pytest
import requests

from gpubook.runtime.engines import ContainerInfo, container_name
from gpubook.scheduler.core.plan import Plan
from gpubook.scheduler.outbox import status
from gpubook.scheduler.outbox.timeline import TITLE_WIDTH, short_title
from gpubook.scheduler.state.records import ContainerRecord
from tests.kits.web_kit import (
    CHROMEDRIVER,
    CHROMIUM,
    accepted,
    booking,
    browser,
    now_utc,
    rendered,
    served,
    status_of,
    web_config,
)

NOW = now_utc()
HOSTILE = ('</script><script>alert("pwned")</script><img src=x onerror=alert(1)> \x1b[2J\x1b[31mred\x1b[0m\n'
           'Ignore: fine-tune a very long model name for the whole afternoon')
UID = "040000008200E00074C5B7101A82E00800000000D0C3B5B3E0A3D901000000000000000010000000@outlook.example"


def hostile_status() -> status.Status:
    """alice runs the hostile title on GPU 0 (its UID an Outlook-like hash); bob's next booking on
    GPU 1 is called "Thesis run"."""
    run = replace(booking(UID, user="alice", start=NOW - timedelta(hours=1), end=NOW + timedelta(hours=1)),
                  summary=HOSTILE)
    later = replace(booking("thesis@lab", user="bob", start=NOW + timedelta(hours=2), end=NOW + timedelta(hours=3)),
                    summary="Thesis run")
    info = ContainerInfo(name=container_name(run.id), id="c", state="running", image="i", booking_id=run.id,
                         user="alice", gpus=(0,), end=run.end, spec_hash="h", port=2201, template=run.template,
                         start=run.start)
    plan = Plan(accepted=(accepted(run, 0), accepted(later, 1)), rejected=(), next_wakeup=None)
    return status_of(plan, now=NOW, gpus=2, containers=[info], ports={})


def test_a_title_is_shortened_with_its_controls_escaped_and_its_lines_joined() -> None:
    short = short_title(HOSTILE)
    assert len(short) == TITLE_WIDTH and short.endswith("…")
    assert not re.search(r"[\x00-\x1f\x7f-\x9f]", short)
    assert short_title("a\x1b[31mb") == "a\\x1b[31mb"
    assert short_title("  Thesis\n\trun ") == "Thesis run"


def test_gpubook_status_names_bookings_by_their_titles_escaped_and_json_keeps_title_and_uid() -> None:
    report = hostile_status()
    text = "\n".join(report.render("UTC"))
    (row,) = [line for line in text.splitlines() if "alice" in line]
    # The title first, shortened and escaped; the UID (what `gpubook stop` takes) last.
    assert row.startswith(f"  {short_title(HOSTILE)} alice ") and row.endswith(f"[running]  {UID}")
    assert re.search(r"^  Thesis run +bob .* thesis@lab$", text, re.M)
    assert "\x1b" not in text
    assert not re.search(r"[\x00-\x09\x0b-\x1f\x7f-\x9f]", text)
    data = json.loads(json.dumps(report.to_json()))
    (running,) = data["running"]
    assert (running["booking"], running["title"]) == (UID, HOSTILE)
    assert [(n["id"], n["title"]) for n in data["next"]] == [("thesis@lab", "Thesis run")]
    # `gpubook status` lists what runs from the engine, which knows no titles: the last pass's are kept.
    again = status.Status.from_json(data).with_containers(
        [ContainerInfo(name=container_name(UID), id="c", state="running", image="i", booking_id=UID, user="alice",
                       gpus=(0,), end=NOW + timedelta(hours=1), spec_hash="h", port=2201, template="debian-ssh")],
        ports={})
    assert again.main.running[0].title == HOSTILE


def test_the_page_names_bookings_by_their_titles_escaped_with_the_uid_on_hover(tmp_path) -> None:
    with served(web_config(tmp_path), hostile_status()) as url:
        page = requests.get(url + "/", timeout=10)
        api = requests.get(url + "/api/status", timeout=10)
    assert page.status_code == 200, page.text
    body = page.text
    assert "<script>alert" not in body and "<img src=x" not in body and "\x1b" not in body
    # The embedded data for app.js: one script element, closed once, its JSON intact.
    embedded = re.search(r'<script type="application/json" id="page-data">(.*?)</script>', body, re.S)
    assert embedded is not None and "</script" not in embedded[1] and "<" not in embedded[1]
    data = json.loads(embedded[1])
    (running,) = data["hosts"][0]["running"]
    assert (running["booking"], running["title"]) == (UID, short_title(HOSTILE))
    row = re.search(r'<tr data-booking="[^"]*"><td class="booking" title="([^"]*)">([^<]*)</td><td>alice</td>', body)
    assert row is not None, "alice's running row names the booking by its title"
    assert (html.unescape(row[1]), html.unescape(row[2])) == (UID, short_title(HOSTILE))
    assert re.search(r'<td class="booking" title="thesis@lab">Thesis run</td><td>bob</td>', body)
    segments = [s for lane in data["hosts"][0]["timeline"] for s in lane["segments"]]
    assert {s["booking"]: s["title"] for s in segments} == {UID: short_title(HOSTILE), "thesis@lab": "Thesis run"}
    assert api.status_code == 200
    assert api.json()["hosts"][0]["running"][0]["title"] == short_title(HOSTILE)


def test_a_booking_gone_from_the_plan_keeps_its_title_on_the_timeline_once_ended() -> None:
    before = hostile_status()
    record = ContainerRecord(id=1, booking_id=UID, name=container_name(UID), user="alice", gpu_count=1,
                             started_at=NOW - timedelta(hours=1), stopped_at=NOW, exit_reason="ended", restarts=0)
    after = status_of(Plan(accepted=(), rejected=(), next_wakeup=None), now=NOW + timedelta(minutes=1), gpus=2,
                      records=[record], previous=before)
    (ended,) = [s for lane in after.main.timeline for s in lane.segments]
    assert (ended.kind, ended.booking, ended.title) == ("ended", UID, HOSTILE)


@pytest.mark.browser
@pytest.mark.slow
@pytest.mark.skipif(not (Path(CHROMIUM).exists() and Path(CHROMEDRIVER).exists()),
                    reason="Debian's chromium and chromium-driver are not installed")
def test_in_a_real_browser_a_hostile_title_runs_nothing_and_shows_as_text(tmp_path) -> None:
    from selenium.common.exceptions import NoAlertPresentException

    with served(web_config(tmp_path), hostile_status()) as url, browser() as driver:
        rendered(driver, url + "/")  # app.js parsed the embedded data and drew the timeline
        cell = driver.find_element("css selector", f'table.running tr[data-booking="{UID}"] td.booking')
        assert (cell.text, cell.get_attribute("title")) == (short_title(HOSTILE), UID)
        block = driver.find_element("css selector", f'.timeline .seg[data-booking="{UID}"]')
        assert block.text == "alice"
        assert block.get_attribute("title").startswith(short_title(HOSTILE) + "\nrunning: " + UID)
        assert driver.find_elements("css selector", "img") == []  # the <img onerror> stayed text
        assert len(driver.find_elements("tag name", "script")) == 2  # app.js and the page's data
        with pytest.raises(NoAlertPresentException):
            driver.switch_to.alert.text  # noqa: B018 - reading it is the check that none opened
