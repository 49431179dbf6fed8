"""The issue's Done-when: as accounts that are not the daemon's, with no config, `gpubook free --gpus 2
--hours 4`, `gpubook bookings` and `gpubook mine` answer from the running daemon under the page's
rule. Three host accounts made here (as root): the daemon's (`gpubook-askd`, a real `gpubook run`
on an engine that starts nothing), and two researchers' (`gpubook-ask1`: alice, `gpubook-ask2`: bob),
each running the commands through runuser with `env -i`: only its own bookings by name."""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import paramiko
import pytest

from tests.kits import ask_kit, safe_data
from tests.kits.daemon_kit import DAEMON_MODULE, ROOT, DaemonProcess, book, wait_for

pytestmark = [*DAEMON_MODULE, pytest.mark.accounts,
              pytest.mark.skipif(os.geteuid() != 0, reason="makes host accounts and runs commands as them: root")]

DAEMON, ALICE, BOB = "gpubook-askd", "gpubook-ask1", "gpubook-ask2"
DAY = (datetime.now(UTC) + timedelta(days=2)).replace(hour=0, minute=0, second=0, microsecond=0)


def account(name: str) -> pwd.struct_passwd:
    """The account, made (with a home and /run/user/UID) when it is absent."""
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        subprocess.run(["useradd", "--create-home", "--shell", "/usr/sbin/nologin", name], check=True)
        entry = pwd.getpwnam(name)
    runtime = Path(f"/run/user/{entry.pw_uid}")
    runtime.mkdir(parents=True, exist_ok=True)
    os.chown(runtime, entry.pw_uid, entry.pw_gid)
    runtime.chmod(0o700)
    return entry


@pytest.fixture(scope="module")
def daemon(radicale_server) -> Iterator[DaemonProcess]:  # type: ignore[no-untyped-def]
    if not os.access(sys.executable, os.X_OK) or Path(sys.executable).resolve().is_relative_to("/root"):
        pytest.skip(f"{sys.executable} cannot be run by other accounts: use a venv made from /usr/bin/python3")
    owner = account(DAEMON)
    for name in (ALICE, BOB):
        account(name)
    folder = Path(tempfile.mkdtemp(prefix="gpubook-ask-"))
    folder.chmod(0o755)
    os.chown(folder, owner.pw_uid, owner.pw_gid)
    with safe_data.data_root() as data:
        os.chown(data, owner.pw_uid, owner.pw_gid)
        (folder / "data").symlink_to(data)
        calendar = radicale_server.new_calendar()
        keys = {"alice": paramiko.ECDSAKey.generate(bits=256), "bob": paramiko.ECDSAKey.generate(bits=256)}
        config = ask_kit.idle_config(folder, str(calendar.url), keys=keys, accounts={"alice": ALICE, "bob": BOB})
        os.chown(config, owner.pw_uid, owner.pw_gid)
        config.chmod(0o600)
        book(calendar, "alice-1@test", user="alice", start=DAY + timedelta(hours=9), end=DAY + timedelta(hours=11),
             gpus="2", summary="alice sweep")
        book(calendar, "bob-1@test", user="bob", start=DAY + timedelta(hours=11), end=DAY + timedelta(hours=15),
             gpus="1", summary="bob finetune")
        process = DaemonProcess(config, user=DAEMON, tree=ROOT).start()
        try:
            wait_for("both bookings in the daemon's plan", lambda: _planned(ALICE) == 2, timeout=90, daemon=process)
            yield process
        finally:
            process.stop()
            shutil.rmtree(folder, ignore_errors=True)


def researcher(login: str, *args: str) -> subprocess.CompletedProcess[str]:
    """`gpubook ARGS` as `login`, with nothing but a plain environment: no config, no secret; the
    daemon's account named by --daemon-account (alice) or $GPUBOOK_DAEMON_ACCOUNT (bob)."""
    entry = pwd.getpwnam(login)
    env = {"HOME": entry.pw_dir, "USER": login, "LOGNAME": login, "PATH": "/usr/bin:/bin", "LANG": "C.UTF-8",
           "PYTHONPATH": str(ROOT), "PYTHONDONTWRITEBYTECODE": "1"}
    if login == ALICE:
        args = (*args, "--daemon-account", DAEMON)
    else:
        env["GPUBOOK_DAEMON_ACCOUNT"] = DAEMON
    return ask_kit.gpubook(*args, env=env, prefix=ask_kit.as_account(login, env))


def _planned(login: str) -> int:
    done = researcher(login, "bookings", "--json")
    return len(json.loads(done.stdout)["bookings"]) if done.returncode == 0 else -1


def test_each_account_sees_its_own_bookings_by_name_and_the_others_as_busy_time(daemon: DaemonProcess) -> None:
    for login, own, other, other_title in ((ALICE, "alice-1@test", "bob-1@test", "bob finetune"),
                                           (BOB, "bob-1@test", "alice-1@test", "alice sweep")):
        listed = researcher(login, "bookings", "--json")
        assert listed.returncode == 0, listed.stderr
        rows = json.loads(listed.stdout)["bookings"]
        assert [r.get("id") for r in rows if r["own"]] == [own]
        assert len([r for r in rows if not r["own"]]) == 1
        mine = researcher(login, "mine")
        assert mine.returncode == 0, mine.stderr
        for shown in (listed.stdout, mine.stdout, researcher(login, "bookings").stdout):
            assert other not in shown and other_title not in shown, shown
        assert own.split("-")[0] + " " in mine.stdout  # "alice sweep" / "bob finetune" by name


def test_free_for_two_gpus_and_four_hours_names_a_slot_no_booking_holds(daemon: DaemonProcess) -> None:
    for login, other in ((ALICE, "bob"), (BOB, "alice")):
        done = researcher(login, "free", "--gpus", "2", "--hours", "4", "--json")
        assert done.returncode == 0, done.stderr
        answer = json.loads(done.stdout)
        assert answer["slots"], answer
        for slot in answer["slots"]:
            start = datetime.fromisoformat(slot["start"])
            assert start + timedelta(hours=4) <= DAY + timedelta(hours=9) or start >= DAY + timedelta(hours=15)
        assert other not in done.stdout and "@test" not in done.stdout  # no booking named, nobody else's name
        text = researcher(login, "free", "--gpus", "2", "--hours", "4")
        assert text.returncode == 0 and "Next slots for 2 GPUs for 4 h:" in text.stdout, text.stdout + text.stderr


def test_the_daemons_account_is_told_apart_from_a_researchers(daemon: DaemonProcess) -> None:
    """Bob's view is bob's: alice's login is not bob, whatever either one asks."""
    alice = json.loads(researcher(ALICE, "mine", "--json").stdout)["viewer"]
    bob = json.loads(researcher(BOB, "mine", "--json").stdout)["viewer"]
    assert (alice["login"], alice["users"]) == (ALICE, ["alice"])
    assert (bob["login"], bob["users"]) == (BOB, ["bob"])


def test_each_account_books_extends_and_cancels_only_its_own_from_the_terminal(daemon: DaemonProcess) -> None:
    """Issue 40: `gpubook book` as alice's login books for alice (the peer's credentials, nothing
    typed); bob's login can neither cancel nor end it, and his view does not name it; alice cancels it."""
    at = (DAY + timedelta(hours=16)).strftime("%Y-%m-%d %H:%M")
    booked = researcher(ALICE, "book", "--gpus", "1", "--hours", "1h", "--at", at, "--title", "alice eval", "--json")
    assert booked.returncode == 0, booked.stdout + booked.stderr
    answer = json.loads(booked.stdout)
    assert answer["state"] == "booked", answer
    for command in (("cancel", answer["id"]), ("end", answer["id"]), ("extend", "1h", answer["id"])):
        refused = researcher(BOB, *command)
        assert refused.returncode == 1 and f"you have no booking {answer['id']!r}" in refused.stderr, refused.stderr
    assert answer["id"] not in researcher(BOB, "mine").stdout
    assert "alice eval" not in researcher(BOB, "bookings").stdout
    assert answer["id"] in {row["id"] for row in json.loads(researcher(ALICE, "mine", "--json").stdout)["bookings"]}
    cancelled = researcher(ALICE, "cancel", answer["id"], "--json")
    assert cancelled.returncode == 0 and json.loads(cancelled.stdout)["done"] is True, cancelled.stderr
    assert "alice eval" not in researcher(ALICE, "mine").stdout
