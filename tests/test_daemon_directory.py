"""Users from the lab's directory, end to end: a real slapd (tests/kits/ldap_kit.py) with the bookers, no
[users] table at all, the daemon on rootless podman and Radicale. The booker logs in with the key the
directory holds and is their uidNumber inside; one who leaves the group keeps the booking that runs and
has the next one refused (issue 38)."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest

from tests.kits import ldap_kit
from tests.kits.daemon_kit import (
    DAEMON_MODULE,
    DaemonProcess,
    book,
    description,
    key_line,
    run,
    running_container,
    soon,
    try_login,
    wait_for,
    write_config,
)

pytestmark = [*DAEMON_MODULE, pytest.mark.ldap]


@pytest.fixture
def slapd(tmp_path: Path, keys) -> Iterator[ldap_kit.Slapd]:  # type: ignore[no-untyped-def]
    server = ldap_kit.make(tmp_path / "slapd")
    try:
        server.add("\n".join([
            ldap_kit.person("alice", 2101, mails=("alice@lab.example",), keys=(key_line(keys["alice"]),)),
            ldap_kit.person("bob", 2102, mails=("bob@lab.example",), keys=(key_line(keys["bob"]),)),
            ldap_kit.posix_group(("alice", "bob")),
        ]))
        yield server
    finally:
        ldap_kit.remove(server)


def test_directory_users_book_log_in_with_its_keys_and_one_who_leaves_keeps_the_running_booking(
        tmp_path: Path, radicale, engine, keys, cleanup, daemons, slapd: ldap_kit.Slapd) -> None:
    calendar = radicale.new_calendar()
    config = write_config(tmp_path, str(calendar.url), keys={}, gpus=2, poll_seconds=1)
    password = slapd.password_file(tmp_path)
    with config.open("a") as file:
        file.write(f'\n[directory]\nsource = "ldap"\nurl = "{slapd.ldaps_url}"\nca_file = "{slapd.ca_file}"\n'
                   f'bind_dn = "{ldap_kit.ADMIN}"\npassword_file = "{password}"\nbase = "{ldap_kit.BASE}"\n'
                   f'group = "{ldap_kit.GROUP}"\n')
    start = soon(8)
    for user in ("alice", "bob"):
        book(calendar, f"{user}-now@test", user=user, start=start, end=start + timedelta(minutes=10))
        cleanup.append(f"{user}-now@test")
    book(calendar, "bob-later@test", user="bob", start=start + timedelta(minutes=30),
         end=start + timedelta(minutes=40))
    daemon = DaemonProcess(config).start()
    daemons.append(daemon)

    clients = {}
    for user, uid in (("alice", 2101), ("bob", 2102)):
        info = wait_for(f"{user}'s container", lambda user=user: running_container(engine, f"{user}-now@test"),
                        timeout=90, daemon=daemon)
        client = wait_for(f"{user}'s login with the directory's key",
                          lambda info=info, user=user: try_login(info.port, user, keys[user]), timeout=60,
                          daemon=daemon)
        assert run(client, "id -u")[1].strip() == str(uid)  # the directory's uidNumber inside
        clients[user] = (client, info)
    assert "accepted:" in description(calendar, "bob-later@test")

    slapd.modify(f"dn: {ldap_kit.GROUP}\nchangetype: modify\ndelete: memberUid\nmemberUid: bob\n")
    daemon.signal(signal.SIGHUP)  # read again now (else at the next refresh_minutes)
    refused = wait_for("bob's later booking refused", lambda: "no longer among the bookers" in (
        text := description(calendar, "bob-later@test")) and text, timeout=60, daemon=daemon)
    assert "not in the directory's group since" in refused, refused
    # bob's running booking runs on, as alice's does: the same container, and he still logs in.
    for user in ("alice", "bob"):
        client, info = clients[user]
        client.close()
        assert running_container(engine, f"{user}-now@test").id == info.id
        again = wait_for(f"{user} logs in again", lambda info=info, user=user: try_login(info.port, user, keys[user]),
                         timeout=30, daemon=daemon)
        again.close()
    assert "no longer among the bookers" not in description(calendar, "bob-now@test")
