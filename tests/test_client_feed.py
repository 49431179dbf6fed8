"""A real calendar client reads the availability feed: vdirsyncer's http storage syncs /free.ics,
served by the page through waitress, into a vdir, and khal lists its busy blocks at their times,
with no booker's name in them (Debian's khal and vdirsyncer; CI installs both)."""

from __future__ import annotations

import os
import shutil
import subprocess
from datetime import datetime, timedelta
from pathlib import Path

import pytest

from gpubook.scheduler.core.plan import Plan
from gpubook.scheduler.outbox.web import serve
from tests.kits.web_kit import accepted, booking, now_utc, served, status_of, web_config

CLIENTS = ("khal", "vdirsyncer")
MISSING = [name for name in CLIENTS if shutil.which(name) is None]

pytestmark = [
    pytest.mark.clients,
    # Outside CI a developer machine may lack them; CI (CI=true, quickstart's apt list) must run this.
    pytest.mark.skipif(bool(MISSING) and not os.environ.get("CI"),
                       reason=f"Debian's {' and '.join(MISSING)} not installed (a real client reads the feed)"),
]

NOW = now_utc()
ALICE = booking("alice-run@lab", user="alice", start=NOW - timedelta(hours=1), end=NOW + timedelta(hours=2))
BOB = booking("bob-later@lab", user="bob", start=NOW + timedelta(hours=3), end=NOW + timedelta(hours=5), gpus=2)
PLAN = Plan(accepted=(accepted(ALICE, 0), accepted(BOB, 0, 1)), rejected=(), next_wakeup=None)
TIME = "%Y-%m-%d %H:%M"


def sync_feed(folder: Path, feed_url: str, *, login: tuple[str, str] | None = None) -> Path:
    """vdirsyncer's http storage (read-only) into a filesystem vdir, as a booker subscribes; with
    `login`, as user and password of the page's basic auth."""
    vdir = folder / "free"
    vdir.mkdir()
    (folder / "status").mkdir()
    auth = f'auth = "basic"\nusername = "{login[0]}"\npassword = "{login[1]}"\n' if login else ""
    config = folder / "vdirsyncer.conf"
    config.write_text(f'[general]\nstatus_path = "{folder / "status"}"\n\n'
                      '[pair free]\na = "feed"\nb = "local"\ncollections = null\n\n'
                      f'[storage feed]\ntype = "http"\nurl = "{feed_url}"\n{auth}\n'
                      f'[storage local]\ntype = "filesystem"\npath = "{vdir}"\nfileext = ".ics"\n')
    for step in ("discover", "sync"):
        done = subprocess.run(["vdirsyncer", "-c", str(config), step], capture_output=True, text=True, timeout=120,
                              env=client_env(folder))
        assert done.returncode == 0, f"vdirsyncer {step}: {done.stdout}{done.stderr}"
    return vdir


def client_env(folder: Path) -> dict[str, str]:
    # khal keeps its cache under XDG_DATA_HOME; LC_TIME=C: Python maps C.UTF-8 to en_US.UTF-8, absent here.
    return {**os.environ, "XDG_DATA_HOME": str(folder / "data"), "XDG_CONFIG_HOME": str(folder / "config"),
            "LC_TIME": "C"}


def khal_list(folder: Path, vdir: Path, *, start: datetime, end: datetime) -> list[str]:
    config = folder / "khal.conf"
    config.write_text(f"[calendars]\n[[free]]\npath = {vdir}\nreadonly = True\n[locale]\nlocal_timezone = UTC\n"
                      "default_timezone = UTC\ntimeformat = %H:%M\ndateformat = %Y-%m-%d\n"
                      "longdateformat = %Y-%m-%d\ndatetimeformat = %Y-%m-%d %H:%M\n"
                      "longdatetimeformat = %Y-%m-%d %H:%M\n")
    # --once: khal lists an event that spans midnight under each of its days (bookings made hours
    # from now cross midnight in the evening; CI failed so at 19:23 UTC).
    done = subprocess.run(["khal", "-c", str(config), "list", "--once", "--format", "{start}|{end}|{title}",
                           start.strftime("%Y-%m-%d"), end.strftime("%Y-%m-%d")],
                          capture_output=True, text=True, timeout=60, env=client_env(folder))
    assert done.returncode == 0, done.stderr
    return [line for line in done.stdout.splitlines() if "|" in line]  # day headings left out


def test_khal_lists_the_busy_blocks_of_the_feed_synced_by_vdirsyncer(tmp_path: Path) -> None:
    assert not MISSING, f"not installed: {', '.join(MISSING)} (quickstart's apt list installs them in CI)"
    with served(web_config(tmp_path), status_of(PLAN, now=NOW, gpus=2)) as url:
        vdir = sync_feed(tmp_path, url + "/free.ics")
    shown = khal_list(tmp_path, vdir, start=NOW - timedelta(days=1), end=NOW + timedelta(days=2))
    assert shown == [f"{ALICE.start:{TIME}}|{ALICE.end:{TIME}}|busy: GPU 0",
                     f"{BOB.start:{TIME}}|{BOB.end:{TIME}}|busy: GPU 0,1"]
    synced = b"".join(path.read_bytes() for path in vdir.iterdir()).lower()
    assert synced.count(b"begin:vevent") == 2
    for name in (b"alice", b"bob", b"@lab"):
        assert name not in synced


def test_a_booking_gone_from_the_feed_leaves_the_clients_calendar_at_the_next_sync(tmp_path: Path) -> None:
    """The feed's events keep their UIDs from one status to the next, so vdirsyncer removes what the
    page no longer serves (the booking was cancelled) rather than keeping a stale busy block."""
    assert not MISSING, f"not installed: {', '.join(MISSING)} (quickstart's apt list installs them in CI)"
    current = [status_of(PLAN, now=NOW, gpus=2)]
    server = serve.start(web_config(tmp_path), status=lambda: current[0])
    try:
        vdir = sync_feed(tmp_path, f"http://{server.address}/free.ics")
        first = khal_list(tmp_path, vdir, start=NOW - timedelta(days=1), end=NOW + timedelta(days=2))
        current[0] = status_of(Plan(accepted=(accepted(ALICE, 0),), rejected=(), next_wakeup=None),
                               now=NOW + timedelta(seconds=30), gpus=2)
        done = subprocess.run(["vdirsyncer", "-c", str(tmp_path / "vdirsyncer.conf"), "sync"], capture_output=True,
                              text=True, timeout=120, env=client_env(tmp_path))
        assert done.returncode == 0, done.stdout + done.stderr
    finally:
        server.stop()
    assert len(first) == 2
    shown = khal_list(tmp_path, vdir, start=NOW - timedelta(days=1), end=NOW + timedelta(days=2))
    assert shown == [f"{ALICE.start:{TIME}}|{ALICE.end:{TIME}}|busy: GPU 0"]


def test_behind_the_pages_login_khal_shows_the_bookers_own_name_only(tmp_path: Path) -> None:
    """The page's default auth (basic): vdirsyncer logs in as alice, as free's guide says; her busy
    block carries her name, bob's does not."""
    assert not MISSING, f"not installed: {', '.join(MISSING)} (quickstart's apt list installs them in CI)"
    users = tmp_path / "htpasswd"
    subprocess.run(["htpasswd", "-B", "-b", "-C", "5", "-c", str(users), "alice", "alice-pw-1"], check=True,
                   capture_output=True)
    users.chmod(0o600)
    config = web_config(tmp_path, auth="basic", htpasswd_file=str(users))
    with served(config, status_of(PLAN, now=NOW, gpus=2)) as url:
        vdir = sync_feed(tmp_path, url + "/free.ics", login=("alice", "alice-pw-1"))
    shown = khal_list(tmp_path, vdir, start=NOW - timedelta(days=1), end=NOW + timedelta(days=2))
    assert shown == [f"{ALICE.start:{TIME}}|{ALICE.end:{TIME}}|busy: GPU 0 (alice)",
                     f"{BOB.start:{TIME}}|{BOB.end:{TIME}}|busy: GPU 0,1"]
