"""`gpubook free`, `bookings` and `mine` ask the running daemon over its socket, with no config: a
real `gpubook run` (on an engine that starts nothing) reading a real Radicale calendar. Here the
test's account is the daemon's and the asker's; its login is alice's (`[users.alice] account`),
bob's is another. The hostile cases: another user's bookings never by name, a request naming
another user, a squatter on the daemon's socket name, an oversized and a trickled request.
Two host accounts asking one daemon: tests/test_ask_accounts.py."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from gpubook.scheduler.core import free
from tests.kits import ask_kit
from tests.kits.daemon_kit import DAEMON_MODULE, DaemonProcess, book, wait_for

pytestmark = DAEMON_MODULE

DAY = (datetime.now(UTC) + timedelta(days=2)).replace(hour=0, minute=0, second=0, microsecond=0)
BOB_TITLE = "bob secret-project-x"


@pytest.fixture(scope="module")
def asked(radicale_server, tmp_path_factory) -> Iterator[dict]:  # type: ignore[no-untyped-def]
    """One daemon for the module: alice (this account) books both GPUs 10-12, bob both 12-14."""
    import paramiko

    folder = tmp_path_factory.mktemp("ask")
    calendar = radicale_server.new_calendar()
    keys = {"alice": paramiko.ECDSAKey.generate(bits=256), "bob": paramiko.ECDSAKey.generate(bits=256)}
    config = ask_kit.idle_config(folder, str(calendar.url), keys=keys,
                                 accounts={"alice": ask_kit.login(), "bob": "nobody"})
    book(calendar, "alice-1@test", user="alice", start=DAY + timedelta(hours=10), end=DAY + timedelta(hours=12),
         gpus="2", summary="alice training run")
    book(calendar, "bob-1@test", user="bob", start=DAY + timedelta(hours=12), end=DAY + timedelta(hours=14),
         gpus="2", summary=BOB_TITLE)
    daemon = DaemonProcess(config).start()
    env = ask_kit.researcher_env(folder / "home", GPUBOOK_DAEMON_ACCOUNT=ask_kit.login())
    try:
        wait_for("the daemon's answer naming both bookings", lambda: _both_planned(env), timeout=60, daemon=daemon)
        yield {"env": env, "daemon": daemon, "folder": folder, "calendar": calendar}
    finally:
        daemon.stop()


def _both_planned(env: dict[str, str]) -> bool:
    done = ask_kit.gpubook("bookings", "--json", env=env)
    return done.returncode == 0 and len(json.loads(done.stdout)["bookings"]) == 2


def test_bookings_name_my_own_and_show_the_others_as_busy_time(asked: dict) -> None:
    done = ask_kit.gpubook("bookings", "--json", env=asked["env"])
    assert done.returncode == 0, done.stderr
    answer = json.loads(done.stdout)
    mine, theirs = answer["bookings"]
    assert (mine["own"], mine["id"], mine["user"], mine["gpus"]) == (True, "alice-1@test", "alice", [0, 1])
    assert theirs == {"own": False, "state": "busy", "host": "127.0.0.1", "gpus": [0, 1],
                      "start": (DAY + timedelta(hours=12)).isoformat(), "end": (DAY + timedelta(hours=14)).isoformat()}
    text = ask_kit.gpubook("bookings", env=asked["env"])
    for shown in (done.stdout, text.stdout):
        assert "bob" not in shown and "secret-project" not in shown, shown
    assert "alice training run" in text.stdout and " busy" in text.stdout, text.stdout


def test_mine_is_my_own_bookings_only(asked: dict) -> None:
    done = ask_kit.gpubook("mine", env=asked["env"])
    assert done.returncode == 0, done.stderr
    assert "alice training run" in done.stdout and "bob" not in done.stdout, done.stdout


def test_free_answers_from_the_daemons_plan(asked: dict) -> None:
    done = ask_kit.gpubook("free", "--gpus", "2", "--hours", "4", "--json", env=asked["env"])
    assert done.returncode == 0, done.stderr
    answer = json.loads(done.stdout)
    gpu0 = answer["hosts"][0]["gpus"][0]
    assert [DAY + timedelta(hours=10), DAY + timedelta(hours=14)] == [
        datetime.fromisoformat(gpu0["free"][0][1]), datetime.fromisoformat(gpu0["free"][1][0])]
    assert all(datetime.fromisoformat(s["start"]) + timedelta(hours=4) <= DAY + timedelta(hours=10)
               or datetime.fromisoformat(s["start"]) >= DAY + timedelta(hours=14) for s in answer["slots"])
    assert "bob" not in done.stdout and "alice" not in json.dumps(answer["hosts"])


def test_a_refusal_offers_the_free_time_gpubook_free_shows(asked: dict) -> None:
    """One plan: a booking refused for a clash names the next slots that fit it, and `gpubook free`
    for the same request shows that very time, to the minute (both GPUs free from 14:00, when bob's
    booking ends). The refusal is alice's own (`mine`); asked as alice, free names nobody."""
    start, end = DAY + timedelta(hours=11), DAY + timedelta(hours=13)
    book(asked["calendar"], "alice-clash@test", user="alice", start=start, end=end, gpus="2")
    refused = wait_for("alice's clash refused", lambda: next((r for r in json.loads(ask_kit.gpubook(
        "mine", "--json", env=asked["env"]).stdout or "{}").get("rejected", []) if r["id"] == "alice-clash@test"),
        None), timeout=60, daemon=asked["daemon"])
    done = ask_kit.gpubook("free", "--gpus", "2", "--hours", "2", "--json", env=asked["env"])
    assert done.returncode == 0, done.stderr
    answer = json.loads(done.stdout)
    after = [s for s in answer["slots"] if datetime.fromisoformat(s["start"]) >= start]
    assert after and datetime.fromisoformat(after[0]["start"]) == DAY + timedelta(hours=14), answer["slots"]
    assert [gpus for _, gpus in after[0]["placement"]] == [[0, 1]]
    for gpu in answer["hosts"][0]["gpus"]:  # each GPU's free time begins again at 14:00
        assert DAY + timedelta(hours=14) in [datetime.fromisoformat(span[0]) for span in gpu["free"]], gpu
    slot = free.Slot(start=datetime.fromisoformat(after[0]["start"]),
                     end=datetime.fromisoformat(after[0]["end"]) if after[0]["end"] else None,
                     placement=(("127.0.0.1", (0, 1)),))
    offered = free.describe([slot], zone=UTC, now=datetime.now(UTC))
    assert offered.split(";")[0].removesuffix(" (UTC)") in refused["reason"], (offered, refused["reason"])
    assert "14:00" in refused["reason"] and "GPUs 0,1 are free" in refused["reason"], refused["reason"]
    text = ask_kit.gpubook("free", "--gpus", "2", "--hours", "2", env=asked["env"])
    assert text.returncode == 0 and text.stdout.count(f"{free.day(slot.start, zone=UTC, now=datetime.now(UTC))} "
                                                      "14:00") >= 2, text.stdout  # both GPUs' rows
    shown = json.dumps([answer["hosts"], answer["slots"]])  # (the answer names its asker, alice, as "viewer")
    assert "alice" not in shown and "bob" not in shown


def test_a_request_naming_another_user_gets_the_askers_own_view(asked: dict) -> None:
    """Identity is the socket's peer credentials only: a request that says it is bob (or names bob's
    login) is still this account, alice, and never sees bob's booking by name."""
    for claim in ({"user": "bob"}, {"viewer": "bob", "login": "nobody", "users": ["bob"], "everyone": True}):
        answer = json.loads(ask_kit.raw_ask(os.getuid(), json.dumps({"kind": "mine", **claim}).encode() + b"\n"))
        assert [b["id"] for b in answer["bookings"]] == ["alice-1@test"], answer
        assert answer["viewer"]["users"] == ["alice"] and not answer["viewer"]["everyone"]
        every = json.loads(ask_kit.raw_ask(os.getuid(), json.dumps({"kind": "bookings", **claim}).encode() + b"\n"))
        assert BOB_TITLE not in json.dumps(every) and "bob-1@test" not in json.dumps(every)


@contextlib.contextmanager
def _machine_lock(name: str) -> Iterator[None]:
    """A lock every account of this machine takes on one file (flock on /tmp/gpubook-test-NAME.lock)."""
    import fcntl

    path = f"/tmp/gpubook-test-{name}.lock"  # noqa: S108 - one file every lane's account can open
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_CREAT, 0o644)
    except PermissionError:  # made by another account: readable, which is all flock needs
        descriptor = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX)
        yield
    finally:
        os.close(descriptor)


def test_a_squatter_on_the_daemons_socket_name_is_refused(asked: dict) -> None:
    """A process of another uid holding the daemon account's socket name is not believed: the
    client names it and sends nothing. (Here the squatter is this account, and the daemon's
    account is said to be `nobody`.)"""
    import pwd

    nobody = pwd.getpwnam("nobody").pw_uid
    # The name is the machine's (abstract sockets live in the network namespace, which every lane
    # shares): one squatter at a time, or two lanes running this module (the flake hunt's repeats)
    # find it taken (EADDRINUSE; the flake hunt of 5ec7fa0 caught it once in five).
    with _machine_lock("ask-squatter"), socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as squatter:
        squatter.bind(f"\0gpubook-ask-{nobody}")
        squatter.listen(4)
        got: list[bytes] = []

        def serve() -> None:
            connection, _ = squatter.accept()
            with connection:
                connection.settimeout(2)
                try:
                    got.append(connection.recv(4096))
                except TimeoutError:
                    got.append(b"")
                with contextlib.suppress(OSError):  # the client hung up on it
                    connection.sendall(b'{"kind": "bookings", "host": "x", "bookings": [], "rejected": []}\n')

        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        done = ask_kit.gpubook("bookings", "--daemon-account", "nobody", env=asked["env"])
        thread.join(timeout=5)
    assert done.returncode != 0
    assert f"held by uid {os.getuid()}" in done.stderr and "not believed" in done.stderr, done.stderr
    assert got == [b""]  # the client sent nothing to it
    assert len(done.stderr.strip().splitlines()) == 1


def test_an_oversized_or_trickled_request_never_stalls_the_daemon(asked: dict) -> None:
    uid = os.getuid()
    trickler = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    trickler.connect(f"\0gpubook-ask-{uid}")
    stop = threading.Event()

    def trickle() -> None:
        while not stop.is_set():
            try:
                trickler.sendall(b" ")
            except OSError:
                return
            stop.wait(0.2)

    thread = threading.Thread(target=trickle, daemon=True)
    thread.start()
    try:
        began = time.monotonic()
        # Answered with the sentence, or cut off (the kernel resets a connection closed with unread bytes).
        oversized = ask_kit.raw_ask(uid, b'{"kind": "free", "pad": "' + b"x" * 20_000)
        assert oversized == b"" or "longer than" in json.loads(oversized)["error"], oversized
        answered = ask_kit.gpubook("mine", "--json", env=asked["env"])
        assert answered.returncode == 0, answered.stderr
        assert time.monotonic() - began < 10
        trickler.settimeout(10)
        cut = json.loads(trickler.recv(4096))  # the trickler is cut off at the read deadline
        assert "did not arrive within" in cut["error"]
    finally:
        stop.set()
        trickler.close()


def test_with_no_daemon_each_command_says_so(tmp_path: Path) -> None:
    """No daemon runs for the account: one sentence, exit 1 (the module's daemon runs as this account:
    ask as the account `nobody`'s daemon, which runs none)."""
    env = ask_kit.researcher_env(tmp_path / "home", GPUBOOK_DAEMON_ACCOUNT="nobody")
    for argv in (["free", "--gpus", "2", "--hours", "4"], ["bookings"], ["mine"]):
        done = ask_kit.gpubook(*argv, env=env)
        assert done.returncode == 1 and done.stdout == ""
        assert done.stderr == ("gpubook: no gpubook daemon is running for account nobody (nothing answers on its "
                               "socket): ask the admin to start it\n"), done.stderr
