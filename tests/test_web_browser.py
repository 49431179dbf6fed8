"""The status page in a real browser (Debian's Chromium, headless, driven by selenium): against
the real daemon (`gpubook run`, Radicale, rootless podman) a booking is drawn as running at its
start and as ended after it, a refused booking shows its reason; `gpubook web` holds a week of
1,000 bookings. Times are in the browser's zone (Chromium runs in Europe/Paris, the host in UTC)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from datetime import datetime, timedelta
from pathlib import Path
from zoneinfo import ZoneInfo

import pytest
import requests

from gpubook.scheduler.commands.embedded import free_port
from tests.kits.daemon_kit import DaemonProcess, book, child_env, wait_for, write_config
from tests.kits.told_clock import ToldClock
from tests.kits.web_kit import (
    CHROMEDRIVER,
    CHROMIUM,
    answers,
    browser,
    ended_records,
    generated_plan,
    now_utc,
    rendered,
    status_of,
    write_status,
)

pytestmark = [
    pytest.mark.browser, pytest.mark.slow,
    pytest.mark.skipif(not (Path(CHROMIUM).exists() and Path(CHROMEDRIVER).exists()),
                       reason="Debian's chromium and chromium-driver are not installed"),
]
ROOT = Path(__file__).resolve().parents[1]


def segment(driver, booking: str, kind: str):  # type: ignore[no-untyped-def]
    found = driver.find_elements("css selector", f'.timeline .seg[data-booking="{booking}"][data-kind="{kind}"]')
    return found[0] if found else None


def reloaded_until(driver, what: str, check, *, timeout: float):  # type: ignore[no-untyped-def]
    """Reload the page until `check(driver)` holds (the page itself refreshes every 15 s)."""
    def once():  # type: ignore[no-untyped-def]
        driver.refresh()
        return check(driver)
    return wait_for(what, once, timeout=timeout, interval=0.5)


@pytest.mark.daemon
@pytest.mark.podman
@pytest.mark.caldav
@pytest.mark.skipif(shutil.which("podman") is None, reason="podman is not installed")
def test_the_page_follows_a_booking_from_booked_to_running_to_ended(tmp_path: Path, radicale, engine, keys,
                                                                     cleanup, daemons) -> None:
    calendar = radicale.new_calendar()
    config = write_config(tmp_path, str(calendar.url), keys=keys, poll_seconds=60)
    port = free_port()
    config.write_text(config.read_text() + f'\n[web]\nenabled = true\nlisten = "127.0.0.1:{port}"\nauth = "none"\n')
    # Its start and end are told to the daemon (tests/kits/told_clock.py): on the wall clock a booking
    # 12 s ahead could already run by the time a loaded machine had the browser up, and was never seen
    # as booked (the flake hunt caught it once in five).
    clock = ToldClock(tmp_path)
    start = clock.soon(600)
    end = start + timedelta(minutes=10)
    book(calendar, "life@test", user="alice", start=start, end=end)
    book(calendar, "toomany@test", user="bob", start=start, end=end, gpus="5")
    cleanup.append("life@test")
    daemon = DaemonProcess(config, env=clock.env()).start()
    daemons.append(daemon)
    url = f"http://127.0.0.1:{port}/"
    wait_for("the daemon's status page", lambda: answers(url), timeout=60, daemon=daemon)
    # Mounted beside the page; its booking series appear with the first pass's status (the page may
    # answer before that pass ends).
    wait_for("the bookings in /metrics", lambda: "gpubook_bookings" in requests.get(url + "metrics", timeout=10).text,
             timeout=60, daemon=daemon)

    with browser() as driver:
        rendered(driver, url)
        reloaded_until(driver, "the booking drawn as booked", lambda d: segment(d, "life@test", "booked"), timeout=90)
        refused = driver.find_element("css selector", 'table.rejected tr[data-booking="toomany@test"]')
        assert "this booking asks for 5" in refused.find_element("css selector", "td.reason").text
        assert driver.find_element("id", "zone").text == "Europe/Paris"

        clock.advance_to(start, daemon)
        running = reloaded_until(driver, "the booking drawn as running",
                                 lambda d: segment(d, "life@test", "running"), timeout=60)
        assert running.text == "alice"
        row = driver.find_element("css selector", 'table.running tr[data-booking="life@test"]')
        assert "alice" in row.text and "debian-ssh" in row.text
        shown = row.find_elements("tag name", "time")[0]
        assert shown.get_attribute("datetime").startswith(start.isoformat()[:16])
        # Shown in Paris time (UTC+1 or +2), not as the UTC it is written in.
        local = start.astimezone(ZoneInfo("Europe/Paris"))
        assert f"{local:%H:%M}" in shown.text or f"{local:%-I:%M}" in shown.text, shown.text
        assert "ssh -p" not in driver.page_source  # auth none: no ssh line for anybody

        clock.advance_to(end + timedelta(seconds=1), daemon)
        reloaded_until(driver, "the booking drawn as ended", lambda d: segment(d, "life@test", "ended"), timeout=60)
        assert not driver.find_elements("css selector", 'table.running tr[data-booking="life@test"]')


def overlapping(report, view: str, *, zone: str = "Europe/Paris") -> int:  # type: ignore[no-untyped-def]
    """The segments the page should draw today or this week (Monday to Monday) in `zone`."""
    now = datetime.now(ZoneInfo(zone))
    first = now.replace(hour=0, minute=0, second=0, microsecond=0)
    if view != "day":
        first = _local(first, -first.weekday() + (7 if view == "next" else 0))
    last = _local(first, 1 if view == "day" else 7)
    return sum(1 for lane in report.main.timeline for s in lane.segments
               if datetime.fromisoformat(s.start) < last and datetime.fromisoformat(s.end) > first)


def _local(midnight: datetime, days: int) -> datetime:
    """Midnight `days` later on the wall clock of its zone (a DST change makes a day 23 or 25 h)."""
    moved = midnight.replace(tzinfo=None) + timedelta(days=days)
    return moved.replace(tzinfo=midnight.tzinfo)


def test_the_page_holds_a_week_of_a_thousand_bookings(tmp_path: Path) -> None:
    """`gpubook web` on its own, reading a status file of 1,000 bookings on 8 GPUs."""
    now = now_utc()
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    plan = generated_plan(now)
    report = status_of(plan, now=now, records=ended_records(plan, now=now))
    write_status(state, report)
    config = tmp_path / "gpubook.toml"
    config.write_text(f'[host]\nname = "devbox1"\n[[calendar]]\nurl = "http://127.0.0.1:9/c/"\n[users.alice]\n'
                      f'uid = 2001\n[daemon]\nstate_dir = "{state}"\n[web]\nlisten = "127.0.0.1:0"\nauth = "none"\n')
    web = subprocess.Popen([sys.executable, "-m", "gpubook.scheduler.commands.cli", "web", "--config", str(config)],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=child_env())
    try:
        assert web.stdout is not None
        line = web.stdout.readline()
        found = re.search(r"http://[0-9.]+:[0-9]+/", line)
        assert found, line
        with browser() as driver:
            rendered(driver, found[0])
            lanes = driver.find_elements("css selector", ".timeline .lane[data-gpu]")
            assert len(lanes) == 8
            assert len(driver.find_elements("css selector", ".timeline .seg")) == overlapping(report, "day")
            drawn = 0
            for view in ("week", "next"):
                driver.find_element("css selector", f'.views button[data-view="{view}"]').click()
                assert driver.find_element("css selector", ".timeline").get_attribute("data-view") == view
                drawn += len(driver.find_elements("css selector", ".timeline .seg"))
                assert len(driver.find_elements("css selector", ".timeline .seg")) == overlapping(report, view)
            assert drawn >= 500  # a fortnight of 1,000: this week and the next hold at least half
            assert len(driver.find_elements("css selector", "table.rejected tr[data-booking]")) == 50
    finally:
        web.terminate()
        try:
            web.wait(timeout=60)  # a loaded 2-core CI machine: the page's threads wind down slowly
        except subprocess.TimeoutExpired:
            web.kill()
            raise
