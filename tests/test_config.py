"""Config validation: every problem at once, named by file and key; secrets never shown."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gpubook.runtime.errors import ConfigError
from gpubook.scheduler import config

REPO = Path(__file__).resolve().parents[1]

MINIMAL = """
[[calendar]]
url = "http://127.0.0.1:5232/lab/devbox1/"
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "gpubook.toml"
    path.write_text(text)
    return path


def problems(tmp_path: Path, text: str) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        config.load(write(tmp_path, text))
    return str(caught.value).splitlines()


def test_example_config_is_valid() -> None:
    loaded = config.load(REPO / "gpubook" / "config" / "gpubook.example.toml")
    assert loaded.host.name == "devbox1"
    assert loaded.host.timezone == "Europe/Paris"
    assert loaded.calendars[0].gpus is None
    assert loaded.users["alice"].max_gpus == 2
    assert loaded.user_by_email("MAILTO:Alice@Lab.Example") == loaded.users["alice"]


def test_minimal_config_takes_the_defaults(tmp_path: Path) -> None:
    loaded = config.load(write(tmp_path, MINIMAL))
    assert loaded.defaults == config.Defaults()
    assert loaded.calendars[0].kind == "caldav"
    assert loaded.engine.name == "podman"
    assert loaded.users == {}


def test_every_problem_is_reported_at_once_with_file_and_key(tmp_path: Path) -> None:
    lines = problems(tmp_path, """
[host]
nmae = "x"
timezone = "Mars/Olympus"
[[calendar]]
url = "ftp://example.org/cal"
gpus = [0, 0]
[defaults]
gpus = -1
max_hours = true
[users."../etc"]
uid = 5
[users.bob]
uid = 0
email = "bob"
[gpus]
count = "four"
[engnie]
""")
    path = str(tmp_path / "gpubook.toml")
    assert all(line.startswith(path + ": ") for line in lines)
    text = "\n".join(lines)
    assert "host.nmae: unknown key; did you mean 'name'?" in text
    assert "host.timezone: unknown time zone 'Mars/Olympus'" in text
    assert "calendar[0].url: must be an http:// or https:// URL" in text
    assert "calendar[0].gpus: lists a GPU twice" in text
    assert "defaults.gpus: must be greater than 0" in text
    assert "defaults.max_hours: must be an integer or a number, not a boolean" in text
    assert "users.../etc: is not a valid user name" in text
    assert "users.bob.uid: must be a uid between 1" in text
    assert "users.bob.email[0]: is not an e-mail address" in text
    assert "gpus.count: must be an integer, not a string" in text
    assert "engnie: unknown key; did you mean 'engine'?" in text
    assert len(lines) == 11


def test_missing_and_broken_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such file"):
        config.load(tmp_path / "absent.toml")
    with pytest.raises(ConfigError, match="not valid TOML"):
        config.load(write(tmp_path, "[host\nname="))
    assert problems(tmp_path, "[host]\nname = 'x'\n") == [
        f"{tmp_path / 'gpubook.toml'}: calendar: at least one [[calendar]] is required"]


def test_feed_urls_are_recognised(tmp_path: Path) -> None:
    loaded = config.load(write(tmp_path, """
[[calendar]]
url = "webcal://lab.example/bookings/gpu.ics"
[[calendar]]
url = "https://lab.example/export?format=ics"
kind = "ics"
gpus = [1, 0]
"""))
    assert [c.kind for c in loaded.calendars] == ["ics", "ics"]
    assert loaded.calendars[0].url == "https://lab.example/bookings/gpu.ics"
    assert loaded.calendars[1].gpus == (0, 1)


def test_password_file_must_be_private_and_is_never_shown(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("hunter2-very-secret\n")
    secret.chmod(0o644)
    text = MINIMAL + 'username = "gpubook"\npassword_file = "secret"\n'
    [line] = problems(tmp_path, text)
    assert "must be readable by its owner only" in line and "hunter2" not in line
    secret.chmod(0o600)
    loaded = config.load(write(tmp_path, text))
    assert loaded.calendars[0].password == "hunter2-very-secret"
    assert "hunter2" not in repr(loaded)


def test_password_from_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(config.PASSWORD_ENV, "from-env")
    loaded = config.load(write(tmp_path, MINIMAL + 'username = "gpubook"\n'))
    assert loaded.calendars[0].password == "from-env"
    assert "from-env" not in repr(loaded)


def test_same_email_for_two_users_is_refused(tmp_path: Path) -> None:
    [line] = problems(tmp_path, MINIMAL + """
[users.alice]
uid = 1000
email = ["shared@lab.example"]
[users.bob]
uid = 1001
email = ["Shared@lab.example"]
""")
    assert "users.bob.email: Shared@lab.example also belongs to users.alice" in line


def test_cli_config_check(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from gpubook.scheduler.commands import cli

    assert cli.main(["config", "check", "--config", str(REPO / "gpubook" / "config" / "gpubook.example.toml")]) == 0
    assert "ok" in capsys.readouterr().out
    bad = write(tmp_path, "[[calendar]]\nurl = 3\n")
    assert cli.main(["config", "check", "--config", str(bad)]) == 1
    assert "calendar[0].url: must be a string, not an integer 3" in capsys.readouterr().err


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")
def test_unreadable_password_file(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("x")
    secret.chmod(0o000)
    [line] = problems(tmp_path, MINIMAL + 'password_file = "secret"\n')
    assert "cannot read" in line


def test_a_calendar_kind_may_name_a_source_class(tmp_path: Path) -> None:
    loaded = config.load(write(tmp_path, MINIMAL + 'kind = "gpubook.scheduler.sources.ics_feed:IcsFeedSource"\n'))
    assert loaded.calendars[0].kind == "gpubook.scheduler.sources.ics_feed:IcsFeedSource"
    [line] = problems(tmp_path, MINIMAL + 'kind = "no_such_package.sources:Feed"\n')
    assert line.endswith("calendar[0].kind: cannot load the calendar source no_such_package.sources:Feed: "
                         "No module named 'no_such_package'")
    [line] = problems(tmp_path, MINIMAL + 'kind = "gpubook.scheduler.config:Config"\n')
    assert "is not a calendar source" in line


def test_calendar_keys_come_from_the_source_kind(tmp_path: Path) -> None:
    from gpubook.scheduler.sources import source_class

    assert source_class("caldav").calendar_keys == ("username", "password_file")
    [line] = problems(tmp_path, MINIMAL + "zzzzzz = 1\n")
    assert line.endswith("calendar[0].zzzzzz: unknown key; known keys: url, username, password_file, gpus, kind, user")


def test_each_default_is_declared_once_with_help() -> None:
    from gpubook.scheduler.config import reference

    for key in reference.keys():  # every key of every section, plug-ins' and sub-tables included
        assert key.help, f"{key.table}.{key.key} says nothing about itself"
    assert config.DaemonConfig().poll_seconds == 60.0


def test_engine_section_is_read_from_the_engines_own_settings(tmp_path: Path) -> None:
    from gpubook.runtime.engines import EngineSettings

    loaded = config.load(write(tmp_path, MINIMAL + '[engine]\nname = "docker"\nstop_grace_seconds = 3\n'))
    assert loaded.engine == EngineSettings(name="docker", stop_grace_seconds=3.0)
    lines = problems(tmp_path, MINIMAL + '[engine]\nname = "rkt"\nnetwork = "bridge"\nstop_grace_seconds = -1\n'
                     'storage_drive = "vfs"\n')
    assert [line.split(": ", 1)[1] for line in lines] == [
        "engine.storage_drive: unknown key; did you mean 'storage_driver'?",
        'engine.name: must be "podman", "docker" or "udocker"',
        'engine.network: must be "host" or "private"',
        "engine.stop_grace_seconds: must be 0 or more",
    ]


def test_the_gpu_monitor_may_name_a_function(tmp_path: Path) -> None:
    base = '[[calendar]]\nurl = "https://cal.example/c/"\n[gpus]\n'
    assert config.load(write(tmp_path, base + 'monitor = "tests.kits.fake_gpus:read"\n')).gpu_monitor == \
        "tests.kits.fake_gpus:read"
    assert config.load(write(tmp_path, base)).gpu_monitor == "nvml"
    found = problems(tmp_path, base + 'monitor = "tests.kits.fake_gpus:nothing"\n')
    assert any("gpus.monitor" in line and "cannot be loaded" in line for line in found), found
    found = problems(tmp_path, base + 'monitor = "dcgm"\n')
    assert any("must be \"package.module:name\"" in line for line in found), found


def test_mps_with_docker_is_refused(tmp_path: Path) -> None:
    """issue 22, finding 4: root in a Docker container is host root, and the MPS pipe folder a host
    folder every booking writes into; podman (its root a subordinate id) may have it."""
    lines = problems(tmp_path, MINIMAL + '[gpus]\nmps = true\n[engine]\nname = "docker"\n')
    assert len(lines) == 1 and "gpus.mps" in lines[0] and 'name = "docker"' in lines[0], lines
    assert config.load(write(tmp_path, MINIMAL + "[gpus]\nmps = true\n")).gpu_mps


@pytest.mark.parametrize(("section", "key", "extra"), [("images", "auth_file", ""),
                                                       ("web", "htpasswd_file", 'auth = "basic"\n')])
def test_credential_files_others_may_read_are_refused(tmp_path: Path, section: str, key: str, extra: str) -> None:
    """issue 22, finding 12: registry credentials and password hashes are checked as password_file is."""
    secret = tmp_path / "credentials"
    secret.write_text('{"auths": {}}\n')
    text = MINIMAL + f'[{section}]\n{extra}{key} = "credentials"\n'
    secret.chmod(0o644)
    lines = problems(tmp_path, text)
    assert lines == [f"{tmp_path / 'gpubook.toml'}: {section}.{key}: {secret} must be readable by its owner only "
                     f"(chmod 600 {secret})"]
    secret.chmod(0o600)
    assert getattr(getattr(config.load(write(tmp_path, text)), section), key) == secret
    secret.unlink()
    assert "cannot read" in problems(tmp_path, text)[0]
