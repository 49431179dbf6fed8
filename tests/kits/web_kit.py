"""What the status page tests and its benchmark share: bookings and plans as plain data, a week of
many generated bookings, the page served by the real waitress server on a free loopback port."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import requests

from gpubook.scheduler.config import Config, parse
from gpubook.scheduler.core.bookings import Booking, Rejection
from gpubook.scheduler.core.plan import LOCAL, Accepted, Plan
from gpubook.scheduler.outbox import status, timeline
from gpubook.scheduler.outbox.web import serve
from gpubook.scheduler.state.records import ContainerRecord

CALENDAR = "http://127.0.0.1:5232/lab/devbox1/"


def booking(booking_id: str, *, user: str, start: datetime, end: datetime, template: str = "debian-ssh",
            gpus: int = 1) -> Booking:
    return Booking(id=booking_id, uid=booking_id, user=user, template=template, gpu_count=gpus, gpu_indices=None,
                   start=start, end=end, created=None, dtstamp=None, calendar_url=CALENDAR,
                   href=f"{CALENDAR}{booking_id}.ics")


def accepted(item: Booking, *gpus: int) -> Accepted:
    return Accepted(booking=item, gpus=tuple(gpus), warn_at=item.end - timedelta(minutes=15))


def rejection(booking_id: str, *, user: str, start: datetime, reason: str) -> Rejection:
    return Rejection(id=booking_id, uid=booking_id, start=start, end=start + timedelta(hours=1), reason=reason,
                     user=user, calendar_url=CALENDAR, href=f"{CALENDAR}{booking_id}.ics")


def generated_plan(now: datetime, *, bookings: int = 1000, gpus: int = 8, rejected: int = 50) -> Plan:
    """`bookings` one-GPU bookings back to back from a week back to a week ahead, round the GPUs,
    with `rejected` refusals: a busy lab's fortnight (`ended_records` gives the past ones' runs)."""
    first = now.replace(minute=0, second=0, microsecond=0) - timedelta(days=7)
    per_gpu = -(-bookings // gpus)
    length = timedelta(days=14) / per_gpu
    users = ("alice", "bob", "carol", "dave", "erin")
    made = [accepted(booking(f"gen{n:04d}@lab", user=users[n % len(users)], start=first + (n // gpus) * length,
                             end=first + (n // gpus + 1) * length), n % gpus) for n in range(bookings)]
    refused = tuple(rejection(f"refused{n:03d}@lab", user=users[n % len(users)], start=now + timedelta(hours=n),
                              reason=f"GPU {n % gpus} is taken by gen{n:04d}@lab at that time")
                    for n in range(rejected))
    return Plan(accepted=tuple(made), rejected=refused, next_wakeup=None)


def ended_records(plan: Plan, *, now: datetime) -> list[ContainerRecord]:
    """State's records of the plan's bookings that ended before `now`: each ran its whole time."""
    return [ContainerRecord(id=n, booking_id=a.booking.id, name=f"gpubook-{n}", user=a.booking.user, gpu_count=1,
                            started_at=a.booking.start, stopped_at=a.booking.end, exit_reason="ended", restarts=0)
            for n, a in enumerate(plan.accepted) if a.booking.end <= now]


def status_of(plan: Plan, *, now: datetime, gpus: int = 8, **kwargs: Any) -> status.Status:
    """The Status the daemon writes after a pass with this plan (`kwargs`: hosts_status's others)."""
    summary = status.GpuSummary(source="config", count=gpus, note="no NVIDIA driver here (test)")
    return status.Status(hosts=status.hosts_status({LOCAL: summary}, plan=plan, now=now, **kwargs),
                         updated=now.isoformat(), last_poll=now.isoformat(), last_poll_ok=now.isoformat(),
                         counts=status.counts(plan, now=now), rejected=timeline.rejected_bookings(plan))


def write_status(folder: Path, report: status.Status) -> Path:
    path = folder / "daemon-status.json"
    path.write_text(json.dumps(report.to_json(), indent=2))
    return path


def web_config(folder: Path, **web: object) -> Config:
    """A config whose [web] is `web` (listen on a free loopback port and auth none unless given)."""
    return parse({"host": {"name": "devbox1", "timezone": "UTC"}, "calendar": [{"url": CALENDAR}],
                  "users": {"alice": {"uid": 2001}, "bob": {"uid": 2002}},
                  "daemon": {"state_dir": str(folder / "state")},
                  "web": {"listen": "127.0.0.1:0", "auth": "none", **web}}, folder / "gpubook.toml")


@contextmanager
def served(config: Config, report: status.Status | None, *,
           mounts: Mapping[str, Any] | None = None) -> Iterator[str]:
    """The page served by waitress as the daemon serves it; yields its base URL."""
    server = serve.start(config, status=lambda: report, mounts=mounts)
    try:
        yield f"http://{server.address}"
    finally:
        server.stop()


def now_utc() -> datetime:
    return datetime.now(UTC).replace(microsecond=0)


CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"


@contextmanager
def browser(*, timezone: str = "Europe/Paris", width: int = 1280, height: int = 1000) -> Iterator[Any]:
    """Debian's Chromium, headless, driven by selenium through Debian's chromium-driver (no
    driver download), in `timezone` (the page must show times in the browser's zone)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    profile = tempfile.mkdtemp(prefix="gpubook-chromium-")
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                     "--no-first-run", f"--window-size={width},{height}", f"--user-data-dir={profile}"):
        options.add_argument(argument)
    service = Service(executable_path=CHROMEDRIVER, env={**os.environ, "TZ": timezone})
    driver = webdriver.Chrome(options=options, service=service)
    driver.set_page_load_timeout(60)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def rendered(driver: Any, url: str) -> Any:
    """Load `url` and wait for the page's script to have drawn it."""
    from selenium.webdriver.support.ui import WebDriverWait

    driver.get(url)
    WebDriverWait(driver, 30).until(lambda d: d.find_element("tag name", "body").get_attribute("data-rendered"))
    return driver


def answers(url: str, *, status: int = 200) -> bool:
    """Whether the page (or any URL of it) answers now, with `status` (401: a page behind a login)."""
    try:
        return requests.get(url, timeout=2).status_code == status
    except requests.RequestException:
        return False
