"""Book for right now: the daemon's change check between polls ([daemon] check_seconds).

On real Radicale and Xandikos, with poll_seconds far longer than any test: whatever the daemon
learns here, it learns from the check. A daemon built in this process on an idle engine (its
checks and passes are counted) shows that a check finding nothing runs no pass and that a change
runs one; the check's pace on a slow server and on a dead one. The login of a booking saved for
now, on rootless podman, is in test_book_now_login.py.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import caldav
import paramiko
import pytest

from gpubook.scheduler.calendars import CHECK_COST_FACTOR, check_interval
from gpubook.scheduler.config import load as load_config
from gpubook.scheduler.daemon import Daemon
from gpubook.scheduler.sdnotify import Notifier
from gpubook.scheduler.sources.caldav_source import CaldavSource
from gpubook.scheduler.sources.ics_feed import IcsFeedSource
from tests.kits import servers
from tests.kits.daemon_kit import IdleEngine, book, description, event_text, events, wait_for
from tests.kits.front import CountingFront

pytestmark = [pytest.mark.caldav]

FAR = 3600  # poll_seconds: no test lasts this long, so only the check can have read anything


class CountingDaemon(Daemon):
    """The daemon with its checks and passes counted (their monotonic times)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.checks: list[float] = []
        self.passes_run: list[float] = []
        self.counted = threading.Condition()
        self.pass_seconds = 0.0  # how long a pass takes at least (one starting bookings takes seconds)

    def check(self) -> None:
        with self.counted:
            self.checks.append(time.monotonic())
        super().check()

    def reconcile(self) -> None:
        with self.counted:
            self.passes_run.append(time.monotonic())
        super().reconcile()
        time.sleep(self.pass_seconds)


def config_file(folder: Path, url: str, *, check_seconds: float, poll_seconds: float = FAR) -> Path:
    path = folder / "gpubook.toml"
    path.write_text(
        '[host]\nname = "devbox1"\ntimezone = "UTC"\n'
        f'[[calendar]]\nurl = "{url}"\nusername = "test"\n'
        '[gpus]\ncount = 1\n'
        f'[users.alice]\nuid = 2001\nssh_keys = ["{key_line()}"]\n'
        f'[daemon]\nstate_dir = "{folder / "state"}"\npoll_seconds = {poll_seconds}\n'
        f'check_seconds = {check_seconds}\n')
    return path


def key_line() -> str:
    key = paramiko.ECDSAKey.generate(bits=256)
    return f"{key.get_name()} {key.get_base64()} alice"


@pytest.fixture
def started() -> Iterator[list[CountingDaemon]]:
    """In-process daemons whose scheduler runs; shut down after the test."""
    made: list[CountingDaemon] = []
    yield made
    for daemon in made:
        daemon.scheduler.shutdown(wait=True)
        daemon.parts.close()
        daemon.state.close()


def start(folder: Path, url: str, made: list[CountingDaemon], *, check_seconds: float) -> CountingDaemon:
    """The daemon's jobs as `run` sets them: the scheduler, then the poll (at once; it sets the check)."""
    daemon = CountingDaemon(load_config(config_file(folder, url, check_seconds=check_seconds)),
                            engine=IdleEngine(), notifier=Notifier(None))
    made.append(daemon)
    daemon.scheduler.start()
    daemon._schedule_polls(first=datetime.now(UTC))
    wait_for("the first poll's pass", lambda: daemon.last_status, timeout=60)
    return daemon


def checks_after(daemon: CountingDaemon, moment: float, count: int, *, timeout: float = 60) -> list[float]:
    def enough() -> list[float] | None:
        with daemon.counted:
            after = [t for t in daemon.checks if t > moment]
        return after if len(after) >= count else None

    return wait_for(f"{count} change checks", enough, timeout=timeout)


def passes_after(daemon: CountingDaemon, moment: float) -> list[float]:
    with daemon.counted:
        return [t for t in daemon.passes_run if t > moment]


def test_a_check_that_finds_nothing_runs_no_pass_and_a_change_runs_one(
        tmp_path: Path, new_calendar: caldav.Calendar, started: list[CountingDaemon]) -> None:
    daemon = start(tmp_path, str(new_calendar.url), started, check_seconds=0.2)
    settled = time.monotonic()
    polled_at = daemon.calendar.last_ok
    checks_after(daemon, settled, 5)
    assert passes_after(daemon, settled) == [], "a change check that found nothing ran a pass"
    # A check that answered counts as fresh calendar data, though nothing was read.
    assert daemon.calendar.last_ok is not None and polled_at is not None and daemon.calendar.last_ok > polled_at

    later = (datetime.now(UTC) + timedelta(days=2)).replace(microsecond=0)
    daemon.pass_seconds = 1.5  # longer than check_seconds: the checks go on after it
    saved = time.monotonic()
    book(new_calendar, "later@gpubook", user="alice", start=later, end=later + timedelta(hours=1))
    wait_for("a pass after the change", lambda: passes_after(daemon, saved), timeout=60)
    assert any(getattr(o, "uid", None) == "later@gpubook" for o in daemon.calendar.occurrences)
    assert daemon.scheduler.get_job("poll").next_run_time > datetime.now(UTC) + timedelta(seconds=FAR - 120)

    # gpubook's own write-back ("accepted") is a change too: one more pass, then quiet.
    wait_for("the write-back", lambda: "accepted" in description(new_calendar, "later@gpubook"), timeout=60)
    written = time.monotonic()
    wait_for("the pass after gpubook's own write", lambda: passes_after(daemon, written), timeout=60)
    daemon.pass_seconds = 0.0
    quiet = time.monotonic() + 2.0  # that pass over
    checks_after(daemon, quiet, 4)
    assert passes_after(daemon, quiet) == [], "a check after the changes were read ran a pass"


def test_the_check_keeps_its_distance_on_a_slow_server(
        tmp_path: Path, radicale_server: servers.CalendarServer, started: list[CountingDaemon]) -> None:
    """A server that takes 0.3 s a request (a large calendar): checks asked every 0.1 s come no
    sooner than CHECK_COST_FACTOR times that apart, so its load stays bounded."""
    calendar = radicale_server.new_calendar()
    front = CountingFront(radicale_server.base_url, delay=0.3).start()
    try:
        path = calendar.url.path
        daemon = start(tmp_path, f"{front.base_url}{path}", started, check_seconds=0.1)
        settled = time.monotonic()
        checks_after(daemon, settled, 1, timeout=120)

        def asked() -> list[float] | None:  # a check kept from the server asks nothing: count what it got
            reports = [t for t, method, _ in front.requests(since=settled) if method == "REPORT"]
            return reports if len(reports) >= 3 else None

        reports = wait_for("three checks at the slow server", asked, timeout=120, interval=0.2)
        gaps = [b - a for a, b in zip(reports, reports[1:], strict=False)]
        assert min(gaps) >= CHECK_COST_FACTOR * 0.3, f"checks came {gaps} s apart on a 0.3 s server"
    finally:
        front.stop()


def test_the_checks_of_daemons_that_lost_their_server_together_come_back_apart() -> None:
    """Issue 42, part 3: 20 daemons on one Radicale, taken away for 2 minutes, heard it again 31.6-31.7 s after
    it was back, all in the same tenth of a second. A failing check's pace is now doubled per failure, at most
    a poll interval, then spread over its second half at random."""
    def pace(failed: int, draw: float) -> float:
        return check_interval(check_seconds=1, poll_seconds=60, took=0.01, failed=failed, spread=lambda: draw)

    assert [pace(failed, 0.0) for failed in (1, 2, 3)] == [1.0, 2.0, 4.0]
    assert [pace(failed, 1.0) for failed in (1, 2, 3)] == [2.0, 4.0, 8.0]
    assert pace(9, 0.0) == 30.0 and pace(9, 1.0) == 60.0  # never more than the poll interval
    assert pace(0, 0.0) == pace(0, 1.0) == 1.0  # a server that answers is checked at the set pace
    assert check_interval(check_seconds=1, poll_seconds=60, took=0.5) == 5.0  # ten times its answer
    after_outage = {round(check_interval(check_seconds=1, poll_seconds=60, took=0.01, failed=7), 3)
                    for _ in range(20)}  # twenty daemons' next check, with the real random draw
    assert len(after_outage) >= 15 and min(after_outage) >= 30 and max(after_outage) <= 60, after_outage


def test_a_dead_server_is_said_once_and_checked_ever_less_often(
        tmp_path: Path, radicale: servers.CalendarServer, started: list[CountingDaemon]) -> None:
    calendar = radicale.new_calendar()
    daemon = start(tmp_path, str(calendar.url), started, check_seconds=0.2)
    radicale.stop()
    stopped = time.monotonic()
    failing = checks_after(daemon, stopped, 5, timeout=120)
    gaps = [b - a for a, b in zip(failing, failing[1:], strict=False)]
    # Each failure in a row doubles the pace: 0.4, 0.8, 1.6, 3.2 s, each between half of it and all of it at
    # random (the scheduler may run late, never early).
    assert all(gap >= 0.2 * 2 ** (n + 1) * 0.5 * 0.95 for n, gap in enumerate(gaps)), gaps
    assert gaps[-1] > gaps[0], gaps
    assert passes_after(daemon, stopped) == []
    said = [e for e in events(tmp_path) if "unreachable" in e]
    assert len(said) == 1, said

    radicale.start()
    back = time.monotonic()
    wait_for("the check to hear the calendar again",
             lambda: any("reachable again" in e for e in events(tmp_path)), timeout=120)
    assert [e for e in events(tmp_path) if "unreachable" in e] == said
    assert passes_after(daemon, back) == [], "the calendar did not change, yet a pass ran"


@pytest.mark.parametrize(("refuse_listing", "method"), [(False, "etag"), (True, "time-range")])
def test_the_check_polls_a_server_without_sync_only_where_its_ctag_answers(
        caldav_server: servers.CalendarServer, new_calendar: caldav.Calendar, refuse_listing: bool,
        method: str) -> None:
    """Sync tokens and a ctag check cheaply (one small request when nothing changed); a server
    that can only be queried by time range downloads everything each time: polls only."""
    book(new_calendar, "one@gpubook", user="alice", start=datetime(2030, 1, 1, tzinfo=UTC),
         end=datetime(2030, 1, 1, 1, tzinfo=UTC))
    direct = CaldavSource(str(new_calendar.url), username=caldav_server.username,
                          password=caldav_server.password, timeout=10)
    assert not direct.checks_cheaply  # not loaded yet: the poll loads it first
    direct.poll()
    assert direct.method == "sync-token" and direct.checks_cheaply
    proxy = servers.NoSyncProxy(caldav_server.base_url, refuse_listing=refuse_listing).start()
    try:
        source = CaldavSource(str(new_calendar.url).replace(caldav_server.base_url, proxy.base_url),
                              username=caldav_server.username, password=caldav_server.password, timeout=10)
        source.poll()
        assert source.method == method
        assert source.checks_cheaply == (method == "etag")
        if method == "etag":
            assert source.poll().stats.requests == 1
    finally:
        proxy.stop()


def test_an_ics_feed_is_never_checked(feed_server: servers.FeedServer) -> None:
    feed_server.replies["/lab.ics"] = servers.Reply(body=event_text(
        "feed@gpubook", user="alice", start=datetime(2030, 1, 1, tzinfo=UTC),
        end=datetime(2030, 1, 1, 1, tzinfo=UTC)).encode(), headers={"Content-Type": "text/calendar"})
    source = IcsFeedSource(f"{feed_server.base_url}/lab.ics")
    assert len(source.poll().objects) == 1
    assert not source.checks_cheaply


def test_an_event_listed_before_its_get_finds_it_is_asked_for_again(
        caldav_server: servers.CalendarServer, new_calendar: caldav.Calendar) -> None:
    """A sync listing that names a new event whose GET answers 404 for a moment (a server under
    concurrent writes): the next poll asks from the same token and gets it, instead of never
    hearing of it again."""
    front = CountingFront(caldav_server.base_url).start()
    try:
        source = CaldavSource(str(new_calendar.url).replace(caldav_server.base_url, front.base_url),
                              username=caldav_server.username, password=caldav_server.password, timeout=10)
        source.poll()
        saved = book(new_calendar, "late@gpubook", user="alice", start=datetime(2030, 1, 1, tzinfo=UTC),
                     end=datetime(2030, 1, 1, 1, tzinfo=UTC))
        front.lose_once.add(saved.url.path)
        missed = source.poll()
        assert missed.stats.method == "sync-token" and not missed.objects
        assert saved.url.path not in front.lose_once  # its GET was tried, and answered 404
        again = source.poll()
        assert again.changed and [o.href.endswith(saved.url.path) for o in again.objects.values()] == [True]
    finally:
        front.stop()
