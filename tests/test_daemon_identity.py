"""Issue 22, finding 7 through the real daemon: an identity the calendar server vouches for.

A lab's Radicale with logins (htpasswd) and rights from a file: each user may write only their own
calendars, the daemon's account reads and writes them all. The daemon (`gpubook run` as a process)
reads each user's calendar with `[[calendar]] user = "NAME"`. Mallory, writing into her own calendar,
cannot book as alice, and cannot write alice's calendar at all (a real HTTP 403 from Radicale).
The bookings are for tomorrow: nothing starts, the outcome is what the daemon writes into the event.
"""

from __future__ import annotations

import dataclasses
import re
import sys
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import caldav
import pytest
from caldav.lib import error as dav_error

from tests.kits import servers
from tests.kits.daemon_kit import (
    DAEMON_MODULE,
    DaemonProcess,
    book,
    description,
    event_text,
    soon,
    wait_for,
    write_config,
)

pytestmark = DAEMON_MODULE

PASSWORDS = {"gpubook": "daemon-pw", "alice": "alice-pw", "mallory": "mallory-pw"}
# First match wins: the daemon's account reads and writes every user's calendars; each user reads
# and writes only the calendars under their own name; anyone logged in may list the root.
RIGHTS = """
[daemon]
user: gpubook
collection: [^/]+(/[^/]+)?
permissions: RrWw

[owner]
user: .+
collection: {user}(/[^/]+)?
permissions: RrWw

[root]
user: .+
collection:
permissions: R
"""


@pytest.fixture
def lab_radicale(tmp_path: Path) -> Iterator[servers.CalendarServer]:
    storage = tmp_path / "radicale"
    storage.mkdir()
    (storage / "htpasswd").write_text("".join(f"{u}:{p}\n" for u, p in PASSWORDS.items()))
    (storage / "rights").write_text(RIGHTS)
    port = servers.free_port()
    argv = [sys.executable, "-m", "radicale", "--config", "--server-hosts", f"127.0.0.1:{port}",
            "--storage-filesystem-folder", str(storage / "collections"), "--logging-level", "warning",
            "--auth-type", "htpasswd", "--auth-htpasswd-filename", str(storage / "htpasswd"),
            "--auth-htpasswd-encryption", "plain", "--rights-type", "from_file",
            "--rights-file", str(storage / "rights")]
    server = servers.CalendarServer(name="radicale", argv=argv, port=port, storage=storage,
                                    calendar_root="/gpubook/").start()
    try:
        yield server
    finally:
        server.stop()


def as_user(server: servers.CalendarServer, user: str) -> servers.CalendarServer:
    return dataclasses.replace(server, username=user, password=PASSWORDS[user], calendar_root=f"/{user}/")


def open_as(server: servers.CalendarServer, user: str, url: str) -> caldav.Calendar:
    return as_user(server, user).client().calendar(url=url)


def test_mallory_cannot_book_as_alice_in_her_own_calendar_nor_write_alices(tmp_path: Path, lab_radicale, keys,
                                                                          daemons) -> None:
    """Hostile: before, a `user: alice` line in any calendar the daemon reads booked alice (her
    quota, her reminder mail carrying mallory's title, her no-show). Now mallory's own calendar books
    for mallory only, and alice's calendar is alice's to write."""
    alices = as_user(lab_radicale, "alice").new_calendar("gpus")
    mallorys = as_user(lab_radicale, "mallory").new_calendar("gpus")
    keys = {**keys, "mallory": keys["bob"]}
    config = write_config(tmp_path, str(alices.url), keys=keys, poll_seconds=1)
    config.write_text(config.read_text().replace(
        f'[[calendar]]\nurl = "{alices.url}"\nusername = "test"\n',
        f'[[calendar]]\nurl = "{alices.url}"\nusername = "gpubook"\nuser = "alice"\n\n'
        f'[[calendar]]\nurl = "{mallorys.url}"\nusername = "gpubook"\nuser = "mallory"\n'))
    assert 'user = "mallory"' in config.read_text()

    # Radicale's own answer to mallory writing into alice's calendar: 403, nothing stored.
    with pytest.raises(dav_error.AuthorizationError) as refused:
        open_as(lab_radicale, "mallory", str(alices.url)).save_event(event_text(
            "planted@test", user="alice", start=soon(86400), end=soon(90000)))
    assert refused.value.status == 403
    assert [e.icalendar_component["UID"] for e in alices.events()] == []

    tomorrow = soon(86400)
    book(mallorys, "as-alice@test", user="alice", start=tomorrow, end=tomorrow + timedelta(hours=2))
    book(mallorys, "own@test", user="mallory", start=tomorrow + timedelta(hours=3),
         end=tomorrow + timedelta(hours=4))
    book(alices, "alice@test", user="alice", start=tomorrow + timedelta(hours=5), end=tomorrow + timedelta(hours=6))
    daemon = DaemonProcess(config, env={"GPUBOOK_CALENDAR_PASSWORD": PASSWORDS["gpubook"]}).start()
    daemons.append(daemon)

    wait_for("mallory's booking as alice refused", lambda: "rejected" in description(mallorys, "as-alice@test"),
             timeout=60, daemon=daemon)
    said = re.sub(r"\s+", " ", description(mallorys, "as-alice@test"))
    assert "this calendar books for mallory only, but the booking names user 'alice'" in said, said
    wait_for("mallory's own booking accepted", lambda: "accepted" in description(mallorys, "own@test"),
             timeout=30, daemon=daemon)
    wait_for("alice's own booking accepted", lambda: "accepted" in description(alices, "alice@test"),
             timeout=30, daemon=daemon)
