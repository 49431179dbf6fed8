"""The page logs in with an LDAP password: [web] auth = "ldap" against a real slapd (tests/kits/ldap_kit.py,
LDAPS with its own CA), the page served by waitress and asked with requests. The hostile cases: a wrong
password, an unknown name, an empty password (the kit's slapd accepts an unauthenticated bind), LDAP
filter injection in the name, a directory user outside the booking group, gpubook's own bind password,
guessing (the throttle), and the directory down (a 503; the page goes on)."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from gpubook.runtime.errors import ConfigError
from gpubook.scheduler import config, directory
from gpubook.scheduler.commands import web as web_command
from gpubook.scheduler.directory import ldap
from gpubook.scheduler.directory.errors import DirectoryError
from gpubook.scheduler.directory.settings import DirectoryConfig
from gpubook.scheduler.outbox.web import directory_login
from gpubook.scheduler.outbox.web.directory_login import DirectoryLogin, Down, login_names
from tests.kits import ldap_kit
from tests.kits.web_kit import served

pytestmark = pytest.mark.ldap

PASSWORDS = {"alice": "alice-pw-1", "bob": "bob-pw-2", "carol": "carol-pw-3"}


def people() -> str:
    """alice and bob in the booking group with passwords, dave in it without one, carol outside it."""
    return "\n".join([
        ldap_kit.person("alice", 2001, mails=("alice@lab.example",), password=PASSWORDS["alice"]),
        ldap_kit.person("bob", 2002, mails=("bob@lab.example",), password=PASSWORDS["bob"]),
        ldap_kit.person("carol", 2003, mails=("carol@lab.example",), password=PASSWORDS["carol"]),
        ldap_kit.person("dave", 2004, mails=("dave@lab.example",)),
        ldap_kit.posix_group(("alice", "bob", "dave")),
    ])


@pytest.fixture(scope="module")
def slapd() -> Iterator[ldap_kit.Slapd]:
    server = ldap_kit.make()
    try:
        server.add(people())
        yield server
    finally:
        ldap_kit.remove(server)


def write(folder: Path, slapd: ldap_kit.Slapd, *, source: str = "ldap") -> Path:
    password = slapd.password_file(folder)
    path = folder / "gpubook.toml"
    path.write_text(f"""
[[calendar]]
url = "http://127.0.0.1:5232/lab/devbox1/"

[daemon]
state_dir = "{folder / 'state'}"

[directory]
source = "{source}"
url = "{slapd.ldaps_url}"
ca_file = "{slapd.ca_file}"
bind_dn = "{ldap_kit.ADMIN}"
password_file = "{password}"
base = "{ldap_kit.BASE}"
group = "{ldap_kit.GROUP}"

[web]
listen = "127.0.0.1:{ldap_kit.free_port()}"
auth = "ldap"
""")
    return path


@pytest.fixture
def page(slapd: ldap_kit.Slapd, tmp_path: Path) -> Iterator[str]:
    loaded = config.load(write(tmp_path, slapd), directory="read")
    assert sorted(loaded.users) == ["alice", "bob", "dave"]
    with served(loaded, None) as url:
        yield url


def viewer(url: str, name: str, password: str) -> tuple[int, str | None, str]:
    answer = requests.get(url + "/api/status", auth=(name, password), timeout=30)
    return answer.status_code, answer.json()["viewer"] if answer.status_code == 200 else None, answer.text


def test_a_member_logs_in_with_their_directory_password_and_is_the_bookings_user(page: str) -> None:
    assert viewer(page, "alice", PASSWORDS["alice"])[:2] == (200, "alice")
    assert viewer(page, "bob", PASSWORDS["bob"])[:2] == (200, "bob")
    refused = requests.get(page + "/api/status", timeout=30)
    assert refused.status_code == 401 and refused.headers["WWW-Authenticate"].startswith("Basic")


def test_a_wrong_password_an_unknown_name_and_a_non_member_get_the_same_refusal(page: str) -> None:
    answers = {viewer(page, name, password)[::2] for name, password in (
        ("alice", "wrong"), ("alice", PASSWORDS["bob"]), ("mallory", "alice-pw-1"), ("Alice", PASSWORDS["alice"]),
        ("carol", PASSWORDS["carol"]),  # a directory user with a right password, outside the booking group
    )}
    assert answers == {(401, "log in with your lab account's user name and password\n")}


def test_an_empty_password_is_refused_before_any_bind(page: str, slapd: ldap_kit.Slapd) -> None:
    """The kit's slapd, like many servers, lets a DN bind without a password ("unauthenticated"):"""
    whoami = subprocess.run(["ldapwhoami", "-x", "-H", slapd.ldap_url, "-D", f"uid=alice,ou=people,{ldap_kit.BASE}",
                             "-w", ""], capture_output=True, text=True, timeout=30)
    assert whoami.returncode == 0, whoami.stderr
    assert viewer(page, "alice", "")[:2] == (401, None)
    assert viewer(page, "dave", "")[:2] == (401, None)


@pytest.mark.parametrize("name", ["*", "alice)(uid=*", "*)(|(uid=*", "al*", "alice\\", "alice\0", "\\2a"])
def test_a_filter_in_the_name_finds_nobody(page: str, name: str) -> None:
    """With alice's password: a name that matched her entry as a filter would log in as that name."""
    assert viewer(page, name, PASSWORDS["alice"])[:2] == (401, None)


def test_names_are_escaped_in_the_filter_rfc_4515() -> None:
    assert ldap.escaped("a*b(c)d\\e\0f") == "a\\2ab\\28c\\29d\\5ce\\00f"
    settings = DirectoryConfig(source="ldap", url="ldaps://x", base="dc=x")
    assert ldap.login_filter(settings, "*)(uid=*") == "(&(objectClass=posixAccount)(uid=\\2a\\29\\28uid=\\2a))"


def test_gpubooks_own_bind_never_vouches_for_a_user(page: str) -> None:
    """gpubook binds as the directory's admin to find the entry; its password is nobody's, and a member
    with no password of their own (dave) has none that works."""
    for name in ("alice", "dave"):
        assert viewer(page, name, ldap_kit.ADMIN_PASSWORD)[:2] == (401, None)
    assert viewer(page, "dave", PASSWORDS["alice"])[:2] == (401, None)


def test_guessing_one_name_is_throttled(page: str) -> None:
    for attempt in range(directory_login.TRIES):
        assert viewer(page, "bob", f"guess-{attempt}")[0] == 401
    assert viewer(page, "bob", PASSWORDS["bob"])[:2] == (401, None)  # refused unasked for a minute
    assert viewer(page, "alice", PASSWORDS["alice"])[:2] == (200, "alice")  # another name is not


def test_a_directory_down_is_a_503_and_the_page_goes_on(tmp_path: Path) -> None:
    server = ldap_kit.make(tmp_path / "slapd")
    try:
        server.add(people())
        loaded = config.load(write(tmp_path, server), directory="read")
        with served(loaded, None) as url:
            assert viewer(url, "alice", PASSWORDS["alice"])[:2] == (200, "alice")
            server.stop()
            status, _, text = viewer(url, "bob", PASSWORDS["bob"])
            assert (status, text) == (503, "the lab's directory, which checks this page's passwords, does not "
                                           "answer; try again in a few minutes\n")
            assert viewer(url, "alice", PASSWORDS["alice"])[:2] == (200, "alice")  # accepted before: still
            assert viewer(url, "alice", "wrong")[0] == 503  # the directory cannot say it is wrong
    finally:
        ldap_kit.remove(server)


def test_a_member_who_left_the_group_no_longer_logs_in(slapd: ldap_kit.Slapd, tmp_path: Path) -> None:
    """bob is kept as departed for his running booking, but the page lets him in no more; `gpubook web`
    on its own sees it when the daemon's copy of the directory changes."""
    base = config.load(write(tmp_path, slapd), directory="none")
    directory.fetch(base)  # the daemon's read, which writes its copy in the state folder
    members = web_command._members(base)
    assert {"alice", "bob"} <= members()
    change = f"dn: {ldap_kit.GROUP}\nchangetype: modify\n%s: memberUid\nmemberUid: bob\n"
    slapd.modify(change % "delete")
    try:
        now = directory.with_users(base, directory.fetch(base))
        assert "bob" in now.users and "bob" in now.departed_users
        assert "bob" not in login_names(now) and "bob" not in members() and "alice" in members()
    finally:
        slapd.modify(change % "add")


def test_ldap_login_without_an_ldap_directory_is_refused_at_load(tmp_path: Path, slapd: ldap_kit.Slapd) -> None:
    path = write(tmp_path, slapd, source="host")
    with pytest.raises(ConfigError, match='web.auth: "ldap" checks the page\'s passwords by a bind to the lab\'s '
                                          'directory: it needs \\[directory\\] source = "ldap" .*source = "host"'):
        config.load(path, directory="none")
    path.write_text(path.read_text().split("[directory]")[0] + '[users.alice]\nuid = 2001\n[web]\nauth = "ldap"\n')
    with pytest.raises(ConfigError, match='this config has source = "file"'):
        config.load(path, directory="none")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_the_throttle_counts_per_name_and_forgets_after_its_window() -> None:
    asked: list[str] = []

    def verify(settings: DirectoryConfig, name: str, password: str) -> bool:
        asked.append(name)
        return password == "right"

    clock = Clock()
    login = DirectoryLogin(DirectoryConfig(source="ldap", url="ldaps://x", base="dc=x"), members=lambda: {"alice"},
                           verify=verify, clock=clock)
    assert login.check("mallory", "right") is False and login.check("alice", "") is False and asked == []
    for _ in range(directory_login.TRIES - 1):
        assert login.check("alice", "wrong") is False
    assert login.check("alice", "right") is False and len(asked) == directory_login.TRIES - 1  # "" counted too
    clock.now += directory_login.TRIES_WINDOW
    assert login.check("alice", "right") is True


def test_a_directory_error_is_down_not_a_refusal() -> None:
    def down(settings: DirectoryConfig, name: str, password: str) -> bool:
        raise DirectoryError("ldaps://x: LDAPSocketOpenError: connection refused")

    login = DirectoryLogin(DirectoryConfig(source="ldap", url="ldaps://x", base="dc=x"), members=lambda: {"alice"},
                           verify=down)
    assert login.check("alice", "pw") == Down("ldaps://x: LDAPSocketOpenError: connection refused")
