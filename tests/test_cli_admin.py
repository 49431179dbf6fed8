"""The admin CLI: doctor's levels, the default config path, --config anywhere, --json, and the
state folder's daemon lock as `gpubook status` reads it (no engine, no server: the fast lane)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar

import pytest

from gpubook.runtime import engines
from gpubook.runtime.checks import Check, format_checks
from gpubook.runtime.engines import ContainerInfo, container_name
from gpubook.runtime.errors import ConfigError
from gpubook.runtime.nvidia import gpus
from gpubook.scheduler import config as config_module
from gpubook.scheduler.commands import admin, cli
from gpubook.scheduler.locks import LOCK_FILE
from gpubook.scheduler.state import State
from tests.kits.cli_kit import ROOT, gpubook, write_config
from tests.kits.daemon_kit import IdleEngine

# -- doctor's levels ---------------------------------------------------------------------------


def test_a_warning_is_shown_with_its_fix_and_does_not_fail_doctor() -> None:
    ok = Check("engine", True, "podman version 4.3.1")
    warning = Check("CDI spec", False, "no spec", "gpubook gpus cdi --output F", optional=True)
    failure = Check("data_root", False, "/srv/x does not exist", "mkdir -p /srv/x")
    lines, status = format_checks([ok, warning])
    assert lines == ["ok    engine: podman version 4.3.1", "WARN  CDI spec: no spec",
                     "      fix: gpubook gpus cdi --output F"]
    assert status == 0
    lines, status = format_checks([ok, warning, failure])
    assert status == 1 and "FAIL  data_root: /srv/x does not exist" in lines
    assert [c.level for c in (ok, warning, failure)] == ["ok", "warn", "fail"]
    assert failure.to_json() == {"name": "data_root", "level": "fail", "detail": "/srv/x does not exist",
                                 "fix": "mkdir -p /srv/x"}
    assert Check("x", True, "fine", optional=True).level == "ok"  # optional only matters when not ok


def test_a_host_without_a_cdi_spec_gets_a_warning_not_a_failure(tmp_path: Path) -> None:
    """The GPU host (2026-11-25) had every check ok but this one, and doctor exited 1."""
    [check] = [gpus._cdi_check([tmp_path])]
    assert check.level == "warn" and "gpubook works without it" in (check.fix or "")
    assert format_checks([check])[1] == 0
    (tmp_path / "nvidia.yaml").write_text("cdiVersion: 0.5.0\nkind: nvidia.com/gpu\n")
    assert gpus._cdi_check([tmp_path]).level == "ok"


@pytest.mark.slow  # a second or more: out of the fast lane
def test_doctor_json_is_a_list_of_checks_and_keeps_the_exit_code(tmp_path: Path) -> None:
    broken = tmp_path / "gpubook.toml"
    broken.write_text("[[calendar]]\nurl = 'ftp://x'\n")
    done = gpubook("doctor", "--json", "--config", str(broken))
    assert done.returncode == 1, done.stderr
    checks = json.loads(done.stdout)
    assert all(set(c) == {"name", "level", "detail", "fix"} for c in checks)
    assert all(c["level"] in ("ok", "warn", "fail") for c in checks)
    config = next(c for c in checks if c["name"] == "config")
    assert config["level"] == "fail" and "calendar[0].url: must be an http:// or https:// URL" in config["detail"]


@pytest.mark.slow  # a second or more: out of the fast lane
def test_doctor_without_any_config_says_which_paths_it_tried(tmp_path: Path) -> None:
    if config_module.SYSTEM_CONFIG.exists():
        pytest.skip(f"{config_module.SYSTEM_CONFIG} exists on this machine")
    done = gpubook("doctor", "--json", env={"HOME": str(tmp_path)})
    config = next(c for c in json.loads(done.stdout) if c["name"] == "config")
    assert config["level"] == "fail"
    assert f"none of {tmp_path}/.config/gpubook/gpubook.toml, /etc/gpubook/gpubook.toml exists" in config["detail"]
    assert done.returncode == 1


# -- the default config path -------------------------------------------------------------------


def test_the_config_path_is_the_flag_then_the_variable_then_the_users_then_the_systems(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    home, system = tmp_path / "home", tmp_path / "etc" / "gpubook.toml"
    monkeypatch.setattr(config_module, "SYSTEM_CONFIG", system)

    def resolve(given: str | None = None, **environ: str) -> Path:
        return config_module.config_path(given, environ=environ, home=home)

    with pytest.raises(ConfigError) as raised:
        resolve()
    assert str(raised.value) == (f"no config file: --config not given, $GPUBOOK_CONFIG not set, and none of "
                                 f"{home}/.config/gpubook/gpubook.toml, {system} exists")
    assert config_module.config_path(environ={}, home=home, required=False) is None
    system.parent.mkdir(parents=True)
    system.write_text("")
    assert resolve() == system
    user = home / ".config" / "gpubook" / "gpubook.toml"
    user.parent.mkdir(parents=True)
    user.write_text("")
    assert resolve() == user
    xdg = tmp_path / "xdg" / "gpubook" / "gpubook.toml"
    assert resolve(XDG_CONFIG_HOME=str(xdg.parents[1])) == system  # XDG_CONFIG_HOME replaces ~/.config
    xdg.parent.mkdir(parents=True)
    xdg.write_text("")
    assert resolve(XDG_CONFIG_HOME=str(xdg.parents[1])) == xdg
    assert resolve(XDG_CONFIG_HOME="relative/dir") == user  # not absolute: ignored, as the XDG spec says
    named = tmp_path / "named.toml"
    assert resolve(GPUBOOK_CONFIG=str(named)) == named  # set, it is used even before it exists (load says so)
    assert resolve("flag.toml", GPUBOOK_CONFIG=str(named)) == Path("flag.toml")


@pytest.mark.parametrize("argv", [
    ["--config", "F", "status"], ["status", "--config", "F"], ["templates", "list", "--config", "F"],
    ["templates", "--config", "F", "list"], ["--config", "F", "templates", "show", "x"],
    ["config", "check", "--config", "F"], ["config", "--config", "F", "check"], ["gpus", "cdi", "--config", "F"],
    ["gpus", "--config", "F"], ["doctor", "--config", "F"], ["--config", "F", "log", "-n", "3"],
    ["report", "--from", "2026-11-01", "--to", "2026-12-01", "--config", "F"], ["stop", "b", "--config", "F"],
    ["run", "--config", "F"], ["web", "--config", "F"], ["images", "--config", "F"],
    ["bookings", "--config", "F"],
])
def test_config_is_taken_before_or_after_any_command(argv: list[str]) -> None:
    assert cli.build_parser().parse_args(argv).config == "F"


@pytest.mark.slow  # a second or more: out of the fast lane
def test_every_command_that_needs_a_config_finds_the_default_one(tmp_path: Path) -> None:
    """`templates list --config F` failed before (--config went before the sub-command there)."""
    folder = tmp_path / "templates"
    folder.mkdir()
    (folder / "only-here.toml").write_text('image = "localhost/only-here:1"\ncuda = "none"\nhas_sshd = true\n')
    xdg = tmp_path / "xdg"
    config = write_config(xdg / "gpubook" / "gpubook.toml", state_dir=tmp_path / "state",
                          extra=f'[templates]\ndir = "{folder}"\n')
    listed = gpubook("templates", "list", "--config", str(config))
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.split()[0] == "only-here"
    by_default = gpubook("templates", "list", env={"HOME": str(tmp_path), "XDG_CONFIG_HOME": str(xdg)})
    assert by_default.stdout == listed.stdout
    by_variable = gpubook("config", "check", env={"HOME": str(tmp_path), "GPUBOOK_CONFIG": str(config)})
    assert by_variable.stdout.startswith(f"{config}: ok"), by_variable.stderr
    if config_module.SYSTEM_CONFIG.exists():
        return
    for argv in (["status"], ["log"], ["config", "check"], ["images"]):
        done = gpubook(*argv, env={"HOME": str(tmp_path / "nobody")})
        assert done.returncode == 1, argv
        assert done.stderr == ("gpubook: no config file: --config not given, $GPUBOOK_CONFIG not set, and none of "
                               f"{tmp_path}/nobody/.config/gpubook/gpubook.toml, /etc/gpubook/gpubook.toml exists\n")


# -- --json on config check and log -------------------------------------------------------------


@pytest.mark.slow  # a second or more: out of the fast lane
def test_config_check_json_lists_every_problem(tmp_path: Path) -> None:
    good = write_config(tmp_path / "good.toml", state_dir=tmp_path / "state")
    done = gpubook("config", "check", "--json", "--config", str(good))
    assert done.returncode == 0
    assert json.loads(done.stdout) == {"path": str(good), "ok": True, "calendars": 1, "users": ["alice"],
                                       "problems": []}
    bad = tmp_path / "bad.toml"
    bad.write_text('[[calendar]]\nurl = "ftp://x"\n[gpus]\ncount = 99\n[enigne]\n')
    done = gpubook("config", "check", "--json", "--config", str(bad))
    assert done.returncode == 1 and done.stderr == ""
    report = json.loads(done.stdout)
    assert report["ok"] is False and report["path"] == str(bad)
    assert report["problems"] == [f"{bad}: enigne: unknown key; did you mean 'engine'?",
                                  f"{bad}: calendar[0].url: must be an http:// or https:// URL, not 'ftp://x'",
                                  f"{bad}: gpus.count: must be between 0 and 64"]


@pytest.mark.slow  # a second or more: out of the fast lane
def test_log_json_is_one_object_a_line(tmp_path: Path) -> None:
    state_dir = tmp_path / "state"
    with State(state_dir / "state.sqlite") as state:
        state.log_event("booking started on GPU 0", booking_id="b1@test")
        state.log_event("a \x1b[31mred\x1b[0m line", level="warning")
    config = write_config(tmp_path / "gpubook.toml", state_dir=state_dir)
    done = gpubook("log", "--json", "--config", str(config))
    assert done.returncode == 0, done.stderr
    entries = [json.loads(line) for line in done.stdout.splitlines()]
    assert [(e["level"], e["booking"], e["message"]) for e in entries[-2:]] == [
        ("info", "b1@test", "booking started on GPU 0"), ("warning", None, "a \x1b[31mred\x1b[0m line")]
    assert "\x1b" not in done.stdout  # escaped by JSON, never raw on the terminal
    assert all(set(e) == {"id", "at", "level", "booking", "message"} for e in entries)


# -- the daemon's lock, as status reads it ------------------------------------------------------


HOLD = ("import sys, pathlib\nfrom gpubook.scheduler.locks import hold_lock\n"
        "hold_lock(pathlib.Path(sys.argv[1]))\nprint('held', flush=True)\nsys.stdin.read()\n")


def test_the_lock_holders_pid_is_read_without_taking_the_lock(tmp_path: Path) -> None:
    folder = tmp_path / "state"
    assert admin.daemon_pid(folder) is None  # no folder, no lock file
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(folder)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        assert admin.daemon_pid(folder) == holder.pid
        assert admin.daemon_pid(folder, locks=tmp_path / "no-proc-locks") == holder.pid  # the flock fallback
    finally:
        holder.communicate("", timeout=30)
    assert (folder / LOCK_FILE).exists()  # left behind by the holder, and held by no one
    assert admin.daemon_pid(folder) is None
    assert admin.daemon_pid(folder, locks=tmp_path / "no-proc-locks") is None


@pytest.mark.parametrize("argv", [["setup", "--config", "x.toml", "--user", "a", "--data-root", "/srv/d", "--dry-run"],
                                  ["status", "--conf", "x.toml"]])
def test_options_are_never_abbreviated(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """`setup --config X` must not become `setup --config-from X` (argparse's prefix matching)."""
    with pytest.raises(SystemExit) as ended:
        cli.build_parser().parse_args(argv)
    assert ended.value.code == 2
    assert "unrecognized arguments" in capsys.readouterr().err


# -- gpubook stop, beside a running daemon ------------------------------------------------------


class OneContainerEngine(IdleEngine):
    """An engine running one booking's container (kept in a class attribute: the command makes its own)."""

    name = "one-container"
    running: ClassVar[dict[str, ContainerInfo]] = {}

    def list(self) -> list[ContainerInfo]:
        return list(self.running.values())

    def inspect(self, name: str) -> ContainerInfo | None:
        return self.running.get(name)

    def stop(self, name: str, grace: float) -> None:
        self.running.pop(name, None)


@pytest.fixture
def one_container() -> Iterator[dict[str, ContainerInfo]]:
    engines.register(OneContainerEngine.name, OneContainerEngine)
    name = container_name("b1@test")
    OneContainerEngine.running[name] = ContainerInfo(name=name, id="c1", state="running", image="i",
                                                     booking_id="b1@test", user="alice", gpus=(0,), port=2200,
                                                     end=None, spec_hash="h", template="debian-ssh")
    yield OneContainerEngine.running
    engines.REGISTRY.unregister(OneContainerEngine.name)
    OneContainerEngine.running.clear()


def test_stop_stops_one_container_beside_a_running_daemon_and_builds_nothing_of_a_daemon(
        tmp_path: Path, one_container: dict[str, ContainerInfo], capsys: pytest.CaptureFixture[str]) -> None:
    """While a daemon holds the state folder, `gpubook stop` stops the booking and records it, and
    makes none of a daemon's parts: no GPU probe (a daemon's build logs "no NVIDIA driver here" on
    a host without one), no SFTP service (a daemon's build makes its folder), no thread left."""
    folder = tmp_path / "state"
    data = tmp_path / "data"
    data.mkdir()
    config = write_config(tmp_path / "gpubook.toml", state_dir=folder,
                          extra=f'[engine]\nname = "{OneContainerEngine.name}"\n[storage]\ndata_root = "{data}"\n'
                                '[sftp]\nenabled = true\n')
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(folder)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, text=True)
    before = set(threading.enumerate())
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        assert cli.main(["stop", "b1@test", "--config", str(config)]) == 0
    finally:
        holder.communicate("", timeout=30)
    assert one_container == {}
    assert capsys.readouterr().out == f"stopped {container_name('b1@test')} (booking b1@test)\n"
    with State(folder / "state.sqlite") as state:
        events = [(e.booking_id, e.message) for e in state.events()]
    assert ("b1@test", "stopped (stopped by an admin)") in events, events
    assert not [message for _, message in events if "no NVIDIA driver" in message], events
    assert not (folder / "sftp").exists()
    assert [t.name for t in set(threading.enumerate()) - before if t.is_alive()] == []
