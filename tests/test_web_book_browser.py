"""Booking from the page in a real browser (issue 40): Debian's Chromium, headless, logged in to the
page a real `gpubook run` serves (auth basic), books with the form; the booking is an ordinary event
of the booker's Radicale calendar, the page shows the daemon's answer, and the booker cancels it with
the page's button. A refused slot shows its reason and the next free time. Hostile: a page of another
site that posts the form to this one, even with the booker's own token, is refused, and nothing is
written. The daemon runs on the idle engine (no container starts: tests/test_desk_podman.py and
bench/book_now.py have the SSH logins)."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import bcrypt
import paramiko
import pytest
from selenium.common.exceptions import StaleElementReferenceException
from selenium.webdriver.support.ui import WebDriverWait

from gpubook.scheduler.commands.embedded import free_port
from tests.kits import ask_kit
from tests.kits.daemon_kit import DAEMON_MODULE, DaemonProcess, book, wait_for
from tests.kits.web_kit import CHROMEDRIVER, CHROMIUM, answers, browser

pytestmark = [
    *DAEMON_MODULE, pytest.mark.browser, pytest.mark.slow,
    pytest.mark.skipif(not (Path(CHROMIUM).exists() and Path(CHROMEDRIVER).exists()),
                       reason="Debian's chromium and chromium-driver are not installed"),
]

DAY = (datetime.now(UTC) + timedelta(days=2)).replace(hour=0, minute=0, second=0, microsecond=0)
PASSWORD = "alice-page-pw"


@pytest.fixture(scope="module")
def page(radicale_server, tmp_path_factory) -> Iterator[dict]:  # type: ignore[no-untyped-def]
    """One daemon serving its page (auth basic, alice's login); bob holds both GPUs 12-14 on DAY."""
    folder = tmp_path_factory.mktemp("page-book")
    calendar = radicale_server.new_calendar()
    keys = {"alice": paramiko.ECDSAKey.generate(bits=256), "bob": paramiko.ECDSAKey.generate(bits=256)}
    config = ask_kit.idle_config(folder, str(calendar.url), keys=keys, accounts={"alice": "nobody", "bob": "nobody"})
    htpasswd = folder / "htpasswd"
    htpasswd.write_text(f"alice:{bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(rounds=5)).decode()}\n")
    htpasswd.chmod(0o600)
    port = free_port()
    config.write_text(config.read_text() + f'\n[web]\nenabled = true\nlisten = "127.0.0.1:{port}"\nauth = "basic"\n'
                                           f'htpasswd_file = "{htpasswd}"\n')
    book(calendar, "bob-1@test", user="bob", start=DAY + timedelta(hours=12), end=DAY + timedelta(hours=14),
         gpus="2", summary="bob secret-project-x")
    daemon = DaemonProcess(config).start()
    url = f"http://127.0.0.1:{port}/"
    try:
        wait_for("the daemon's page", lambda: answers(url, status=401), timeout=60, daemon=daemon)
        with browser() as driver:
            # The first pass's status (bob's booking among the next ones) before the browser books.
            driver.get(f"http://alice:{PASSWORD}@127.0.0.1:{port}/")
            wait_for("the first pass on the page", lambda: _reloaded(driver, 'tr[data-booking="bob-1@test"]'),
                     timeout=60, daemon=daemon)
            yield {"driver": driver, "url": url, "calendar": calendar, "daemon": daemon}
    finally:
        daemon.stop()


def _reloaded(driver, selector: str) -> bool:  # type: ignore[no-untyped-def]
    driver.refresh()
    return bool(driver.find_elements("css selector", selector))


def _events(calendar) -> dict[str, str]:  # type: ignore[no-untyped-def]
    return {str(e.icalendar_component["UID"]): str(e.icalendar_component.get("DESCRIPTION", ""))
            for e in calendar.events()}


def _fill_and_book(driver, **fields: str) -> dict[str, str]:  # type: ignore[no-untyped-def]
    """Fill the page's form as a person does, send it, and read the answer shown at the top. (The form
    is outside the part of the page its script refreshes every 15 s, so it is never replaced.)"""
    form = driver.find_element("id", "book-form")
    for name, value in fields.items():
        box = form.find_element("name", name)
        box.clear()
        box.send_keys(value)
    before = driver.current_url
    form.find_element("css selector", "button[type=submit]").click()
    return _answer(driver, since=before)


# The answer as one reading: the page's script replaces its tables (and the answer) every 15 s, so
# an element found first and read after may be gone (a clean-clone run met it once).
_READ_ANSWER = """const shown = document.getElementById("answer");
if (!shown) return null;
const code = shown.querySelector("p code");
return {state: shown.dataset.state, text: shown.innerText, id: code ? code.textContent : ""};"""


def _answer(driver, *, since: str) -> dict[str, str]:  # type: ignore[no-untyped-def]
    """The answer shown once the form's 303 has led away from `since` (each answer has an address of
    its own): read at once, the page still showing the answer before would be read (a loaded run met it)."""
    return WebDriverWait(driver, 120).until(lambda d: d.current_url != since and d.execute_script(_READ_ANSWER))


def _click(driver, selector: str) -> None:  # type: ignore[no-untyped-def]
    """Click the first element `selector` finds, found again if the page's refresh replaced it."""
    def clicked(d) -> bool:  # type: ignore[no-untyped-def]
        found = d.find_elements("css selector", selector)
        if not found:
            return False
        found[0].click()
        return True

    WebDriverWait(driver, 60, ignored_exceptions=(StaleElementReferenceException,)).until(clicked)


def test_a_booking_made_on_the_page_is_an_event_of_the_bookers_calendar_and_is_cancelled_there(page: dict) -> None:
    driver = page["driver"]
    driver.get(page["url"])
    at = (DAY + timedelta(hours=9)).strftime("%Y-%m-%d %H:%M")
    answer = _fill_and_book(driver, gpus="1", hours="2h", at=at, title="alice from the page")
    assert answer["state"] == "booked", answer
    assert answer["id"].endswith("@gpubook-desk")
    text = _events(page["calendar"])[answer["id"]]
    assert "gpus: 1" in text and "user: alice" in text and "Made on gpubook's page of" in text and "by alice" in text
    # The page's own table has it, with a button only its booker sees.
    row = f'tr[data-booking="{answer["id"]}"]'
    assert "alice from the page" in driver.execute_script(f"return document.querySelector('{row}').innerText")
    before = driver.current_url
    _click(driver, f"{row} form.own button")
    cancelled = _answer(driver, since=before)
    assert cancelled["state"] == "cancelled", cancelled
    assert answer["id"] not in _events(page["calendar"])
    assert not driver.find_elements("css selector", f'tr[data-booking="{answer["id"]}"]')


def test_a_refused_slot_shows_why_and_the_next_free_time(page: dict) -> None:
    driver = page["driver"]
    driver.get(page["url"])
    at = (DAY + timedelta(hours=12, minutes=30)).strftime("%Y-%m-%d %H:%M")
    answer = _fill_and_book(driver, gpus="2", hours="1h", at=at)
    assert answer["state"] == "refused", answer
    assert "GPU" in answer["text"] and "free" in answer["text"], answer["text"]
    assert "secret-project-x" not in answer["text"]
    # The refusal is the calendar's: the event stays until the booker cancels it (here, from the answer).
    assert answer["id"] in _events(page["calendar"])
    before = driver.current_url
    _click(driver, '#answer form.own[action="cancel"] button')
    assert _answer(driver, since=before)["state"] == "cancelled"
    assert answer["id"] not in _events(page["calendar"])


class _Evil(http.server.BaseHTTPRequestHandler):
    page = b""

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.end_headers()
        self.wfile.write(self.page)

    def log_message(self, *args: object) -> None:
        pass


def test_hostile_another_sites_page_posting_the_form_is_refused_and_writes_nothing(page: dict) -> None:
    driver = page["driver"]
    driver.get(page["url"])
    token = driver.find_element("css selector", '#book-form input[name="token"]').get_attribute("value")
    before = set(_events(page["calendar"]))
    # Another site (localhost is another site than 127.0.0.1), with alice's own token copied into it:
    # the origin check refuses it on its own.
    _Evil.page = (f'<form id="f" method="post" action="{page["url"]}book"><input name="token" value="{token}">'
                  '<input name="gpus" value="1"><input name="hours" value="1h"></form>'
                  '<script>document.getElementById("f").submit()</script>').encode()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Evil)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        driver.get(f"http://localhost:{server.server_address[1]}/")
        WebDriverWait(driver, 60).until(lambda d: "cannot book here" in d.find_element("tag name", "body").text)
    finally:
        server.shutdown()
    assert "a request from another site (cross-site) cannot book here" in driver.find_element("tag name", "body").text
    assert set(_events(page["calendar"])) == before
