"""Users from the lab's directory, read from a real slapd (tests/kits/ldap_kit.py) over LDAPS and StartTLS."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from gpubook.runtime.errors import ConfigError
from gpubook.scheduler import config, directory
from gpubook.scheduler.commands import cli
from gpubook.scheduler.commands.users import directory_check, rows
from gpubook.scheduler.core.bookings import Booking
from gpubook.scheduler.core.plan import plan
from tests.kits import ldap_kit
from tests.kits.booking_kit import TEMPLATES, raw, read, utc, vcalendar, vevent

pytestmark = pytest.mark.ldap

KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIB6v3b9c0p7s5xXl0bN3cYk2s9mJ0b2cZc8n8kq0tq0Q alice@laptop"


@pytest.fixture(scope="module")
def slapd() -> Iterator[ldap_kit.Slapd]:
    server = ldap_kit.make()
    try:
        server.add("\n".join([
            ldap_kit.person("alice", 2001, mails=("alice@lab.example", "a.smith@lab.example"), keys=(KEY,)),
            ldap_kit.person("bob", 2002, gid=3000, mails=("bob@lab.example",), keys=("not a key", KEY)),
            ldap_kit.person("carol", 2003, mails=("carol@lab.example",)),
            ldap_kit.person("dave", 2004, mails=("bob@lab.example", "dave@lab.example")),
            ldap_kit.person("Bad_Name", 2005, mails=("bad@lab.example",)),
            ldap_kit.posix_group(("alice", "bob", "dave", "Bad_Name")),
            ldap_kit.names_group((f"uid=carol,ou=people,{ldap_kit.BASE}",), dn=f"cn=carols,ou=groups,{ldap_kit.BASE}"),
            # Projects ([groups.NAME]): a posixGroup beside the bookers' group, and a groupOfNames elsewhere named.
            ldap_kit.posix_group(("alice", "bob"), dn=f"cn=vision,ou=groups,{ldap_kit.BASE}", gid=5001),
            ldap_kit.names_group((f"uid=alice,ou=people,{ldap_kit.BASE}",),
                                 dn=f"cn=nlp-people,ou=groups,{ldap_kit.BASE}"),
        ]))
        yield server
    finally:
        ldap_kit.remove(server)


def write(tmp_path: Path, slapd: ldap_kit.Slapd, *, url: str | None = None, extra: str = "",
          mode: int = 0o600, group: str = ldap_kit.GROUP, start_tls: bool = False, calendar_user: str = "") -> Path:
    password = slapd.password_file(tmp_path, mode)
    path = tmp_path / "gpubook.toml"
    path.write_text(f"""
[[calendar]]
url = "http://127.0.0.1:5232/lab/devbox1/"
{f'user = "{calendar_user}"' if calendar_user else ""}

[daemon]
state_dir = "{tmp_path / 'state'}"

[directory]
source = "ldap"
url = "{url or slapd.ldaps_url}"
start_tls = {str(start_tls).lower()}
ca_file = "{slapd.ca_file}"
bind_dn = "{ldap_kit.ADMIN}"
password_file = "{password}"
base = "{ldap_kit.BASE}"
group = "{group}"
{extra}""")
    return path


def test_members_over_ldaps(slapd: ldap_kit.Slapd, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        loaded = config.load(write(tmp_path, slapd), directory="read")
    assert sorted(loaded.users) == ["alice", "bob", "dave"]  # carol is not in the group; Bad_Name is no name
    alice, bob = loaded.users["alice"], loaded.users["bob"]
    assert (alice.uid, alice.gid, alice.email, alice.ssh_keys) == (
        2001, 2001, ("alice@lab.example", "a.smith@lab.example"), (KEY,))
    assert (bob.uid, bob.gid, bob.ssh_keys) == (2002, 3000, (KEY,))
    # dave's copy of bob's address is left out, not dave
    assert set(loaded.users["dave"].email) | set(bob.email) == {"bob@lab.example", "dave@lab.example"}
    assert len({*loaded.users["dave"].email, *bob.email}) == 2
    assert loaded.user_by_email("a.smith@lab.example") is alice
    text = caplog.text
    assert "directory user bob: SSH key 1 left out" in text
    assert "address bob@lab.example left out: it is also" in text
    assert "Bad_Name" in text and "is not a user name" in text


def test_members_over_starttls_and_group_of_names(slapd: ldap_kit.Slapd, tmp_path: Path) -> None:
    loaded = config.load(write(tmp_path, slapd, url=slapd.ldap_url, start_tls=True,
                               group=f"cn=carols,ou=groups,{ldap_kit.BASE}"), directory="read")
    assert list(loaded.users) == ["carol"]
    assert loaded.users["carol"].email == ("carol@lab.example",)


def test_plain_ldap_refused(slapd: ldap_kit.Slapd, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="plain ldap://.*start_tls = true"):
        config.load(write(tmp_path, slapd, url=slapd.ldap_url))


def test_password_file_readable_by_others_refused(slapd: ldap_kit.Slapd, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"directory.password_file: .* must be readable by its owner only"):
        config.load(write(tmp_path, slapd, mode=0o644))


def test_tables_set_limits_of_directory_users(slapd: ldap_kit.Slapd, tmp_path: Path) -> None:
    loaded = config.load(write(tmp_path, slapd, extra="""
[users.alice]
max_gpus = 2
week_gpu_hours = 10

[users.erin]
uid = 4000
email = ["erin@lab.example"]

[users.nobody]
max_gpus = 1
"""), directory="read")
    alice = loaded.users["alice"]
    assert (alice.uid, alice.max_gpus, alice.week_gpu_hours, alice.ssh_keys) == (2001, 2, 10, (KEY,))
    assert loaded.users["erin"].uid == 4000 and "erin" not in loaded.directory_users
    assert "nobody" not in loaded.users  # no uid, and the directory has no nobody


def test_a_calendar_of_a_directory_user_needs_no_table(slapd: ldap_kit.Slapd, tmp_path: Path,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    """`[[calendar]] user = "alice"` names a member the directory gives (no [users.alice]); a name neither
    gives is said once the users are merged (its bookings are refused as any unknown user's)."""
    with caplog.at_level(logging.WARNING):
        loaded = config.load(write(tmp_path, slapd, calendar_user="alice"), directory="read")
    assert loaded.calendars[0].user == "alice" and "alice" in loaded.users
    assert "calendar[0].user" not in caplog.text
    with caplog.at_level(logging.WARNING):
        config.load(write(tmp_path, slapd, calendar_user="zed"), directory="read")
    assert "calendar[0].user 'zed' is neither a member of the directory's group nor a [users] table" in caplog.text


def test_directory_down_keeps_last_good_copy(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    server = ldap_kit.make(tmp_path / "slapd")
    try:
        server.add(ldap_kit.person("alice", 2001, mails=("alice@lab.example",), keys=(KEY,))
                   + "\n" + ldap_kit.posix_group(("alice",)))
        path = write(tmp_path, server, extra="timeout_seconds = 2")
        assert list(config.load(path, directory="read").users) == ["alice"]
        cache = tmp_path / "state" / directory.CACHE_NAME
        assert cache.stat().st_mode & 0o777 == 0o600
        server.stop()
        with caplog.at_level(logging.ERROR):
            assert list(config.load(path).users) == ["alice"]  # any other command: the cache, the directory not asked
            assert not caplog.records, caplog.text
            assert list(config.load(path, directory="read").users) == ["alice"]  # this process's copy
            directory._last_good.clear()  # as after a restart: only the cache is left
            assert list(config.load(path, directory="read").users) == ["alice"]
        said = [r for r in caplog.records if "does not answer" in r.getMessage()]
        assert len(said) == 1, caplog.text
    finally:
        ldap_kit.remove(server)
        directory._down.clear()


def test_users_json(slapd: ldap_kit.Slapd, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path, slapd, extra='[users.erin]\nuid = 4000\n')
    assert cli.main(["users", "--config", str(path), "--json"]) == 0
    listed = {row["name"]: row for row in json.loads(capsys.readouterr().out)["users"]}
    assert listed["alice"] == {"name": "alice", "uid": 2001, "gid": 2001, "keys": 1, "source": "directory",
                               "identities": ["alice@lab.example", "a.smith@lab.example"], "left": None,
                               "groups": []}
    assert listed["erin"]["source"] == "file"


def test_doctor_check(slapd: ldap_kit.Slapd, tmp_path: Path) -> None:
    check = directory_check(config.load(write(tmp_path, slapd)))
    assert check.level == "warn"
    assert "3 user(s), 2 with keys, 2 with identities" in check.detail
    assert "Bad_Name" in check.detail
    down = directory_check(config.load(write(tmp_path, slapd, url="ldaps://127.0.0.1:1", extra="timeout_seconds = 2")))
    assert down.level == "fail"


def test_a_member_who_leaves_the_group_is_kept_as_departed_for_max_hours(tmp_path: Path) -> None:
    """bob leaves the group: the next read keeps him, as departed since that read (his running booking
    runs to its end, core/plan.py refuses the rest), in this process and in the cache after a restart;
    a read max_hours later forgets him; back in the group, he is a member again."""
    server = ldap_kit.make(tmp_path / "slapd")
    directory._last_good.clear()
    try:
        server.add("\n".join([ldap_kit.person("alice", 2001, mails=("alice@lab.example",)),
                              ldap_kit.person("bob", 2002, mails=("bob@lab.example",), keys=(KEY,)),
                              ldap_kit.posix_group(("alice", "bob"))]))
        parsed = config.load(write(tmp_path, server, extra="[defaults]\nmax_hours = 24\n"), directory="none")
        start = datetime(2026, 11, 29, 9, tzinfo=UTC)
        first = directory.with_users(parsed, directory.fetch(parsed, now=start))
        assert sorted(first.users) == ["alice", "bob"] and first.departed_users == {}
        server.modify(f"dn: {ldap_kit.GROUP}\nchangetype: modify\ndelete: memberUid\nmemberUid: bob\n")
        left = start + timedelta(minutes=5)
        after = directory.with_users(parsed, directory.fetch(parsed, now=left))
        assert after.departed_users == {"bob": left} and sorted(after.directory_users) == ["alice"]
        bob = after.users["bob"]
        assert (bob.uid, bob.email, bob.ssh_keys) == (2002, ("bob@lab.example",), (KEY,))  # as before
        assert [(row["name"], row["source"], row["left"]) for row in rows(after)] == [
            ("alice", "directory", None), ("bob", "departed", left.isoformat())]
        directory._last_good.clear()  # a restart: the cache still knows when bob left
        later = directory.with_users(parsed, directory.fetch(parsed, now=left + timedelta(hours=23)))
        assert later.departed_users == {"bob": left}
        gone = directory.with_users(parsed, directory.fetch(parsed, now=left + timedelta(hours=24)))
        assert "bob" not in gone.users and gone.departed_users == {}
        server.modify(f"dn: {ldap_kit.GROUP}\nchangetype: modify\nadd: memberUid\nmemberUid: bob\n")
        back = directory.with_users(parsed, directory.fetch(parsed, now=left + timedelta(hours=25)))
        assert sorted(back.directory_users) == ["alice", "bob"] and back.departed_users == {}
    finally:
        ldap_kit.remove(server)
        directory._last_good.clear()


PROJECTS = f"""
[users.bob]
groups = ["nlp"]

[groups.vision]
week_gpu_hours = 3

[groups.nlp]
directory_group = "cn=nlp-people,ou=groups,{ldap_kit.BASE}"

[groups.speech]
"""


def test_projects_from_the_directorys_groups(slapd: ldap_kit.Slapd, tmp_path: Path,
                                             caplog: pytest.LogCaptureFixture) -> None:
    """vision is cn=vision beside the bookers' group (a posixGroup: memberUid), nlp the groupOfNames its
    directory_group names (member DNs); speech's group does not exist: nobody is in it, said once. A
    table's groups come first (bob's nlp), then the directory's in the config's order; the cache keeps them."""
    path = write(tmp_path, slapd, extra=PROJECTS)
    with caplog.at_level(logging.WARNING):
        loaded = config.load(path, directory="read")
    assert [loaded.groups_of(name) for name in ("alice", "bob", "dave")] == [("vision", "nlp"), ("nlp", "vision"), ()]
    assert f"the group cn=speech,ou=groups,{ldap_kit.BASE} of [groups.speech] was not found" in caplog.text
    assert sorted(loaded.users) == ["alice", "bob", "dave"]  # a missing project group takes nobody away
    assert config.load(path).groups_of("alice") == ("vision", "nlp")  # the daemon's cached copy
    check = directory_check(loaded)
    assert "2 in a [groups] group" in check.detail


def test_a_group_over_its_quota_is_refused_naming_the_group(slapd: ldap_kit.Slapd, tmp_path: Path) -> None:
    """Membership from slapd, events through the booking reader, the plan: alice's 2 GPU-hours count
    against vision (her first group); bob's 2 more for vision would make 4 of its 3."""
    loaded = config.load(write(tmp_path, slapd, extra=PROJECTS), directory="read")
    events = vcalendar(
        vevent("a1", "DTSTART:20261124T090000Z", "DTEND:20261124T110000Z", "SUMMARY:alice gpus=1",
               "CREATED:20261101T000000Z"),
        vevent("b1", "DTSTART:20261124T120000Z", "DTEND:20261124T140000Z", "SUMMARY:bob gpus=1 project=vision",
               "CREATED:20261102T000000Z"))
    found = read(raw(events), config=loaded).occurrences
    assert [(b.id, b.project) for b in found if isinstance(b, Booking)] == [("a1", "vision"), ("b1", "vision")]
    result = plan(found, inventory=(0, 1), config=loaded, templates=TEMPLATES, now=utc(2026, 11, 23, 8))
    assert [a.booking.id for a in result.accepted] == ["a1"]
    assert [r.reason for r in result.rejected] == [
        "group vision has 2 of 3 GPU-hours in the week before this booking ends; this booking needs 2"]
