"""[directory] source = "host": the bookers are a host group's members as this host's name service gives
them (here /etc/passwd and /etc/group through NSS, as SSSD's would be), identities from a pattern, keys
from a command run for each member."""

from __future__ import annotations

import grp
import logging
import os
import pwd
import sys
from pathlib import Path

import pytest

from gpubook.runtime.errors import ConfigError
from gpubook.scheduler import config
from gpubook.scheduler.commands.users import directory_check

KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIB6v3b9c0p7s5xXl0bN3cYk2s9mJ0b2cZc8n8kq0tq0Q me@laptop"
ME = pwd.getpwuid(os.getuid()).pw_name
MY_GROUP = grp.getgrgid(os.getgid()).gr_name


def write(tmp_path: Path, *, group: str = MY_GROUP, keys: str = "", extra: str = "") -> Path:
    path = tmp_path / "gpubook.toml"
    path.write_text(f"""
[[calendar]]
url = "http://127.0.0.1:5232/lab/devbox1/"

[daemon]
state_dir = "{tmp_path / 'state'}"

[directory]
source = "host"
group = "{group}"
mail_pattern = "{{user}}@lab.example"
{keys}
{extra}""")
    return path


def key_script(tmp_path: Path, body: str) -> str:
    """keys_command = [python, script, "{user}"]: the script gets the login as its argument."""
    script = tmp_path / "keys.py"
    script.write_text(body)
    return f'keys_command = ["{sys.executable}", "{script}", "{{user}}"]'


AS_ROOT = pytest.mark.skipif(os.geteuid() == 0, reason="uid 0 is never a booker (the next test); the user lanes "
                             "run this as a test account")


@AS_ROOT
def test_the_members_of_the_host_group_with_identities_and_keys(tmp_path: Path) -> None:
    """The group whose primary group it is of this test's account: the account is a member, with its
    uid, an identity by the pattern and the key the command printed for it (and only for it)."""
    keys = key_script(tmp_path, f"import sys\nprint({KEY!r} if sys.argv[1] == {ME!r} else '')\n")
    loaded = config.load(write(tmp_path, keys=keys), directory="read")
    me = loaded.users[ME]
    assert (me.uid, me.gid, me.email, me.ssh_keys) == (os.getuid(), os.getgid(), (f"{ME}@lab.example",), (KEY,))
    assert ME in loaded.directory_users
    assert loaded.user_by_email(f"{ME}@lab.example") is me
    check = directory_check(loaded)
    assert check.ok and check.detail.startswith(f"host group {MY_GROUP}: ") and "1 with keys" in check.detail


@AS_ROOT
def test_a_keys_command_that_fails_leaves_the_member_without_keys_and_says_so(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    keys = key_script(tmp_path, "import sys\nsys.exit('no such user in the key store')\n")
    with caplog.at_level(logging.WARNING):
        loaded = config.load(write(tmp_path, keys=keys), directory="read")
    assert loaded.users[ME].ssh_keys == ()
    assert f"keys of {ME} not read" in caplog.text and "no such user in the key store" in caplog.text


def test_root_is_never_a_booker_whatever_group_it_is_in(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        loaded = config.load(write(tmp_path, group=grp.getgrgid(0).gr_name), directory="read")
    assert "root" not in loaded.users
    assert "directory user root: left out: uidNumber ['0'] is not a uid of 1 or more" in caplog.text


def test_a_group_the_host_does_not_know_is_named(tmp_path: Path) -> None:
    loaded = config.load(write(tmp_path, group="gpubook-no-such-group"), directory="none")
    check = directory_check(loaded)
    assert not check.ok
    assert "the host group 'gpubook-no-such-group' does not exist (getent group gpubook-no-such-group)" in check.detail
    assert "getent group" in (check.fix or "")


@pytest.mark.parametrize(("lines", "said"), [
    ("", 'directory.group: is required with source = "host"'),
    ('mail_pattern = "alice@lab.example"', "directory.mail_pattern: must hold {user}"),
    ('keys_command = ["sss_ssh_authorizedkeys", "{user}"]', "directory.keys_command: must start with an absolute path"),
])
def test_a_host_source_set_wrong_is_refused_by_name(tmp_path: Path, lines: str, said: str) -> None:
    path = tmp_path / "gpubook.toml"
    group = "" if said.startswith("directory.group") else f'group = "{MY_GROUP}"\n'
    path.write_text(f'[[calendar]]\nurl = "http://127.0.0.1:5232/lab/devbox1/"\n[directory]\nsource = "host"\n'
                    f"{group}{lines}\n")
    with pytest.raises(ConfigError, match=said.replace("{", r"\{").replace("}", r"\}")):
        config.load(path, directory="none")


def test_each_member_carries_the_projects_whose_host_group_has_them(caplog: pytest.LogCaptureFixture) -> None:
    """[groups.NAME] read through NSS (grp): a project whose host group holds the account (here as its
    primary group) is the entry's; one whose host group does not exist holds nobody, and says so."""
    from gpubook.scheduler.directory import host
    from gpubook.scheduler.directory.settings import DirectoryConfig

    root_group = grp.getgrgid(0).gr_name
    with caplog.at_level(logging.WARNING):
        entries = host.read(DirectoryConfig(source="host", group=root_group),
                            {"ops": root_group, "ghost": "gpubook-no-such-group"})
    root = next(entry for entry in entries if entry.name == ["root"])
    assert root.groups == ("ops",)
    assert "host group 'gpubook-no-such-group' of [groups.ghost] does not exist: nobody is in ghost" in caplog.text


@AS_ROOT
def test_a_members_projects_default_to_the_host_group_of_the_groups_name(tmp_path: Path) -> None:
    """[groups.NAME] without directory_group is the host group NAME."""
    extra = f'[groups.{MY_GROUP}]\nmax_gpus = 2\n\n[groups.other]\ndirectory_group = "{MY_GROUP}"\n'
    loaded = config.load(write(tmp_path, extra=extra), directory="read")
    assert loaded.groups_of(ME) == (MY_GROUP, "other")
