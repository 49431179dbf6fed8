"""The command line as admins' tools have it (issue 41): a closed pipe (`gpubook config example |
head -1`, the reader gone before gpubook writes) ends with exit 1 and no traceback; `-v` and
`--log-level` anywhere on the line."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from gpubook.scheduler.commands.cli import build_parser
from tests.kits.daemon_kit import ROOT


def test_a_reader_that_left_gets_no_traceback() -> None:
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first line
    try:
        done = subprocess.run([sys.executable, "-m", "gpubook.scheduler.commands.cli", "config", "example"],
                              stdout=write, stderr=subprocess.PIPE, text=True, timeout=60, cwd="/",
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
    finally:
        os.close(write)
    assert "Traceback" not in done.stderr and "BrokenPipeError" not in done.stderr, done.stderr
    assert done.returncode == 1


@pytest.mark.parametrize(("argv", "verbose", "level"), [
    (["-v", "config", "example"], True, None),
    (["config", "example", "-v"], True, None),
    (["mine", "--verbose"], True, None),
    (["--log-level", "DEBUG", "config", "example"], False, "debug"),
    (["config", "check", "--log-level", "error"], False, "error"),
    (["free", "--gpus", "2", "--log-level", "info"], False, "info"),
    (["status"], False, None),
])
def test_verbose_and_the_log_level_are_taken_anywhere_on_the_line(argv: list[str], verbose: bool,
                                                                 level: str | None) -> None:
    args = build_parser().parse_args(argv)
    assert (args.verbose, args.log_level) == (verbose, level)


def test_an_unknown_log_level_is_a_usage_error() -> None:
    with pytest.raises(SystemExit) as usage:
        build_parser().parse_args(["mine", "--log-level", "loud"])
    assert usage.value.code == 2


@pytest.mark.parametrize(("argv", "meant"), [(["stauts"], "status"), (["config", "chek"], "check"),
                                             (["templates", "lsit"], "list")])
def test_a_mistyped_command_is_a_usage_error_that_says_what_was_meant(argv: list[str], meant: str,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as usage:
        build_parser().parse_args(argv)
    assert usage.value.code == 2
    assert f"did you mean '{meant}'?" in capsys.readouterr().err


def test_help_opens_with_a_sentence_for_the_user(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--help"])
    shown = capsys.readouterr().out
    assert "book the lab's GPUs in a shared calendar" in shown and "small function" not in shown


def _gpubook(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gpubook.scheduler.commands.cli", *args], capture_output=True,
                          text=True, timeout=60, cwd="/", env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_config_check_takes_the_file_as_its_argument(tmp_path) -> None:  # type: ignore[no-untyped-def]
    example = ROOT / "gpubook" / "config" / "gpubook.example.toml"
    done = _gpubook("config", "check", str(example))
    assert done.returncode == 0 and f"{example}: ok" in done.stdout, done.stderr
    broken = tmp_path / "broken.toml"
    broken.write_text('[host]\nname = "x"\ntimezone = "Mars/Olympus"\n')
    done = _gpubook("config", "check", str(broken))
    assert done.returncode == 1 and "Mars/Olympus" in done.stderr


def test_status_and_log_leave_a_fresh_state_folder_as_it_was(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Read-only commands on a host where the daemon never ran: they say so, and make no database."""
    import paramiko

    from tests.kits import ask_kit

    config = ask_kit.idle_config(tmp_path, "http://127.0.0.1:9/cal/", keys={"alice": paramiko.ECDSAKey.generate(
        bits=256)}, accounts={})
    state = tmp_path / "state"
    before = sorted(p.name for p in state.iterdir()) if state.exists() else []
    status = _gpubook("status", "--config", str(config))
    assert status.returncode == 3, status.stderr  # no daemon runs
    log = _gpubook("log", "--config", str(config))
    assert log.returncode == 0 and "no event log yet" in log.stderr, log.stderr
    assert "WARNING" not in status.stderr + log.stderr
    assert not (state / "state.sqlite").exists()
    assert (sorted(p.name for p in state.iterdir()) if state.exists() else []) == before


@pytest.mark.skipif(os.geteuid() != 0, reason="runs `gpubook status` as root beside another account's state folder")
def test_status_by_another_account_says_whose_engine_and_does_not_list_its_own(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Issue 41: root's `gpubook status` listed root's own podman ("Running (0)") as if it were the
    daemon's, and judged root's limits. The state folder's owner is the daemon's account."""
    import json as json_module
    import pwd

    import paramiko

    from tests.kits import ask_kit

    config = ask_kit.idle_config(tmp_path, "http://127.0.0.1:9/cal/", keys={"alice": paramiko.ECDSAKey.generate(
        bits=256)}, accounts={})
    state = tmp_path / "state"
    state.mkdir(exist_ok=True)
    nobody = pwd.getpwnam("nobody")
    os.chown(state, nobody.pw_uid, nobody.pw_gid)
    done = _gpubook("status", "--config", str(config), "--json")
    assert done.returncode == 3, done.stderr  # no daemon runs
    shown = json_module.loads(done.stdout)
    assert shown["engine"].startswith(f"{ask_kit.IDLE_ENGINE} of nobody, the daemon's account (this command runs as "
                                      "root: the containers are as the daemon's last pass listed them"), shown["engine"]
    assert not any(problem.startswith("resource limits") for problem in shown["problems"])


def test_the_report_window_is_the_last_30_days_by_default() -> None:
    from datetime import UTC, datetime, timedelta
    from zoneinfo import ZoneInfo

    from gpubook.scheduler.commands import report

    paris = ZoneInfo("Europe/Paris")
    now = datetime(2026, 11, 30, 23, 30, tzinfo=UTC)  # 00:30 on Dec 1 in Paris
    start, end = report.window(None, None, paris, now=now)
    assert end == datetime(2026, 12, 2, tzinfo=paris) and end - start == timedelta(days=30)
    start, end = report.window("2026-11-01", None, paris, now=now)
    assert (start, end) == (datetime(2026, 11, 1, tzinfo=paris), datetime(2026, 12, 2, tzinfo=paris))
    start, end = report.window(None, "2026-11-15", paris, now=now)
    assert (start, end) == (datetime(2026, 10, 16, tzinfo=paris), datetime(2026, 11, 15, tzinfo=paris))
    with pytest.raises(report.ReportError, match="the window is empty"):
        report.window("2026-11-15", "2026-11-01", paris, now=now)


LOGS = ("import logging; from gpubook import logsafe; logsafe.configure(logging.INFO, times=True); "
        "logging.getLogger('gpubook.scheduler.daemon').warning('calendar unreachable'); "
        "logging.getLogger('gpubook.scheduler.daemon').info('started'); "
        "logging.getLogger('paramiko.transport').info('Connected (version 2.0, client OpenSSH_9.2p1)'); "
        "logging.getLogger('paramiko.transport').warning('Oops, unhandled type 3')")


def _logged(**env: str) -> str:
    """What a daemon-like process logs to a pipe (its stderr), with `env`'s $JOURNAL_STREAM."""
    read, write = os.pipe()
    stat = os.fstat(write)
    stream = {"JOURNAL_STREAM": f"{stat.st_dev}:{stat.st_ino}"} if env.pop("journal", "") else {}
    try:
        subprocess.run([sys.executable, "-c", LOGS], stderr=write, timeout=60, check=True, cwd="/",
                       env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(ROOT), **stream, **env})
    finally:
        os.close(write)
    with os.fdopen(read) as pipe:
        return pipe.read()


def test_under_journald_each_line_has_its_priority_elsewhere_its_time() -> None:
    journal = _logged(journal="yes").splitlines()
    # paramiko's info (each SSH probe's "Connected", "Authentication successful": two lines a start) is left out,
    # its warnings kept.
    assert journal == ["<4>WARNING calendar unreachable", "<6>INFO started",  # journalctl -p warning: the first
                       "<4>WARNING Oops, unhandled type 3"]
    plain = _logged().splitlines()
    assert [line.split(" ", 2)[2] for line in plain] == ["WARNING calendar unreachable", "INFO started",
                                                          "WARNING Oops, unhandled type 3"]
    assert all(re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d ", line) for line in plain)
    assert "gpubook.scheduler" not in "".join(journal + plain)  # a user reads the message, not a module path
    # Another stream than stderr named in $JOURNAL_STREAM (a parent's, inherited): not journald's.
    assert _logged(JOURNAL_STREAM="1:2").splitlines()[0].endswith("WARNING calendar unreachable")
    assert not _logged(JOURNAL_STREAM="1:2").startswith("<")


def test_config_show_gives_the_effective_config_and_hides_secrets(tmp_path) -> None:  # type: ignore[no-untyped-def]
    secret = tmp_path / "calendar-password"
    secret.write_text("hunter2\n")
    secret.chmod(0o600)
    config = tmp_path / "gpubook.toml"
    config.write_text('[host]\nname = "devbox1"\ntimezone = "Europe/Paris"\n[[calendar]]\n'
                      'url = "http://127.0.0.1:5232/lab/"\nusername = "gpubook"\npassword_file = "calendar-password"\n'
                      "[users.alice]\nuid = 2001\n")
    done = _gpubook("config", "show", "--config", str(config))
    assert done.returncode == 0, done.stderr
    assert "defaults.max_hours = 72.0" in done.stdout  # a default, resolved
    assert 'calendars[0].password = "(set, not shown)"' in done.stdout and "hunter2" not in done.stdout
    assert "calendars[0].gpus = (unset)" in done.stdout
    data = json.loads(_gpubook("config", "show", "--json", "--config", str(config)).stdout)
    assert data["host"]["timezone"] == "Europe/Paris" and data["users"]["alice"]["gid"] == 2001


def test_config_check_lists_every_problem_at_once_with_the_cross_key_ones(tmp_path) -> None:  # type: ignore[no-untyped-def]
    config = tmp_path / "gpubook.toml"
    config.write_text('[host]\nname = "x"\ntimezone = "UTC"\n[[calendar]]\nurl = "http://127.0.0.1:9/c/"\n'
                      'gpus = [0, 5]\n[gpus]\ncount = 2\n[users.alice]\nuid = 2001\n[users.bob]\nuid = 2001\n'
                      "[defaults]\nmax_hours = -1\n")
    done = _gpubook("config", "check", str(config))
    assert done.returncode == 1
    problems = done.stderr.splitlines()
    assert any("defaults.max_hours: must be greater than 0" in line for line in problems)  # a type's problem ...
    assert any("users.bob.uid: 2001 is also alice's" in line for line in problems)  # ... and the cross-key ones
    assert any("calendar[0].gpus: GPU 5 beyond [gpus] count = 2" in line for line in problems)
    nobody = tmp_path / "nobody.toml"
    nobody.write_text('[host]\nname = "x"\ntimezone = "UTC"\n[[calendar]]\nurl = "http://127.0.0.1:9/c/"\n')
    done = _gpubook("config", "check", str(nobody))
    assert done.returncode == 1 and "nobody could book" in done.stderr


def _key_lines() -> dict[str, str]:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec, ed25519

    def line(private) -> str:  # type: ignore[no-untyped-def]
        return private.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                                 serialization.PublicFormat.OpenSSH).decode()

    ed, ecdsa = line(ed25519.Ed25519PrivateKey.generate()), line(ec.generate_private_key(ec.SECP256R1()))
    return {"ed": ed, "ecdsa": ecdsa}


def test_an_ssh_key_is_checked_by_loading_it() -> None:
    """cryptography's load_ssh_public_key decides (issue 41): a truncated key is refused, a valid
    line with OpenSSH's options before its key is taken, and the README's example passes."""
    from gpubook.scheduler.settings import checks

    keys = _key_lines()
    for good in (f"{keys['ed']} alice@laptop", keys["ecdsa"], f'from="10.0.0.0/8",no-agent-forwarding {keys["ed"]} a',
                 f'command="echo hi there",no-pty {keys["ecdsa"]}'):
        assert checks.ssh_key.problem(good) is None, good
    for bad in (f"{keys['ed'][:-6]} alice", keys["ecdsa"][:-10], f'junk here {keys["ed"]}', "ssh-ed25519 AAAA... a",
                f"{keys['ed']}\ncommand=x {keys['ed']}"):
        assert checks.ssh_key.problem(bad) is not None, bad
    readme = (ROOT / "README.md").read_text()
    example = re.search(r'ssh_keys = \["([^"]+)"\]', readme)
    assert example and checks.ssh_key.problem(example.group(1)) is None


def test_the_config_docs_say_unset_not_none() -> None:
    """A setting without a value is "unset" in the reference and the example, never Python's None."""
    for page in (ROOT / "docs" / "reference" / "config.md", ROOT / "gpubook" / "config" / "gpubook.example.toml"):
        assert not re.search(r"\bNone\b", page.read_text()), page
