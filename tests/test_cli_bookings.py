"""`gpubook bookings` end to end: a real Radicale calendar, the real CLI in a child process."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import caldav
import pytest

from tests.kits import safe_data, servers

pytestmark = pytest.mark.caldav

REPO = Path(__file__).resolve().parents[1]
START = datetime(2026, 12, 7, 9, 0, tzinfo=UTC)  # a Monday


def event(uid: str, start: datetime, hours: float, *lines: str, created: str = "20261101T000000Z") -> str:
    end = start + timedelta(hours=hours)
    body = "\r\n".join(lines)
    return ("BEGIN:VCALENDAR\r\nVERSION:2.0\r\nPRODID:-//gpubook tests//EN\r\nBEGIN:VEVENT\r\n"
            f"UID:{uid}\r\nDTSTAMP:20261101T000000Z\r\nCREATED:{created}\r\n"
            f"DTSTART:{start:%Y%m%dT%H%M%SZ}\r\nDTEND:{end:%Y%m%dT%H%M%SZ}\r\n{body}\r\n"
            "END:VEVENT\r\nEND:VCALENDAR\r\n")


def gpubook(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gpubook.scheduler.commands.cli", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=120, check=False)


@pytest.fixture
def calendar(radicale_server: servers.CalendarServer) -> caldav.Calendar:
    return radicale_server.new_calendar()


def write_config(tmp_path: Path, url: str) -> Path:
    path = tmp_path / "gpubook.toml"
    path.write_text(f"""
[host]
name = "devbox1"
timezone = "Europe/Paris"
[[calendar]]
url = "{url}"
[gpus]
count = 2
[defaults]
max_hours = 24
[users.alice]
uid = 2001
email = ["alice@lab.example"]
max_gpus = 2
[users.bob]
uid = 2002
templates = ["debian-*"]
""")
    return path


def test_every_occurrence_is_accepted_or_rejected_with_a_reason(tmp_path: Path, calendar: caldav.Calendar) -> None:
    calendar.save_event(event("weekly", START, 2, "SUMMARY:alice debian-ssh gpus=2", "RRULE:FREQ=DAILY;COUNT=3"))
    calendar.save_event(event("clash", START + timedelta(days=1), 1, "DESCRIPTION:user: bob\\ngpus: 1,",
                              created="20261115T000000Z"))
    calendar.save_event(event("cuda", START + timedelta(hours=5), 1,
                              "DESCRIPTION:user: bob\\ntemplate: tensorflow-cuda9"))
    calendar.save_event(event("mail", START + timedelta(hours=6), 1, "ORGANIZER:mailto:Alice@lab.example"))
    calendar.save_event(event("stranger", START + timedelta(hours=7), 1, "ORGANIZER:mailto:eve@evil.example"))
    calendar.save_event(event("long", START + timedelta(hours=8), 30, "DESCRIPTION:user: alice"))
    calendar.save_event(event("evil", START + timedelta(hours=9), 1, "DESCRIPTION:user: ../../etc"))
    calendar.save_event(event("gone", START + timedelta(hours=10), 1, "DESCRIPTION:user: alice",
                              "STATUS:CANCELLED"))
    config = write_config(tmp_path, str(calendar.url))

    done = gpubook("bookings", "--config", str(config), "--from", "2026-12-07T00:00+00:00",
                   "--to", "2026-12-14T00:00+00:00", "--json")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert set(result) == {"accepted", "rejected"}
    accepted = {item["id"]: item for item in result["accepted"]}
    rejected = {item["id"]: item for item in result["rejected"]}
    assert not set(accepted) & set(rejected)
    weekly_ids = [f"weekly@{(START + timedelta(days=d)):%Y%m%dT%H%M%SZ}" for d in range(3)]
    assert set(accepted) == {*weekly_ids, "mail"}
    assert set(rejected) == {"clash", "cuda", "stranger", "long", "evil"}
    for item in result["accepted"]:
        assert set(item) == {"id", "uid", "user", "gpus", "template", "start", "end"}
        assert datetime.fromisoformat(item["start"]).utcoffset() is not None
    assert accepted[weekly_ids[0]]["gpus"] == [0, 1] and accepted[weekly_ids[0]]["user"] == "alice"
    assert accepted["mail"] == {"id": "mail", "uid": "mail", "user": "alice", "gpus": [0],
                                "template": "debian-ssh", "start": "2026-12-07T15:00:00+00:00",
                                "end": "2026-12-07T16:00:00+00:00"}
    for item in result["rejected"]:
        assert set(item) == {"id", "uid", "start", "end", "reason"} and item["reason"]
    assert "alice" in rejected["clash"]["reason"]
    assert "not allowed" in rejected["cuda"]["reason"] or "tensorflow-cuda9" in rejected["cuda"]["reason"]
    assert "eve@evil.example" in rejected["stranger"]["reason"]
    assert "24 hours" in rejected["long"]["reason"]
    assert "../../etc" in rejected["evil"]["reason"]


def test_edits_and_deletions_are_seen_by_the_next_run(tmp_path: Path, calendar: caldav.Calendar) -> None:
    saved = calendar.save_event(event("one", START, 1, "DESCRIPTION:user: alice"))
    config = write_config(tmp_path, str(calendar.url))
    window = ("--from", "2026-12-07T00:00+00:00", "--to", "2026-12-08T00:00+00:00", "--json")
    first = json.loads(gpubook("bookings", "--config", str(config), *window).stdout)
    assert [item["gpus"] for item in first["accepted"]] == [[0]]
    saved.data = event("one", START, 1, "DESCRIPTION:user: alice\\ngpus: 2")
    saved.save()
    second = json.loads(gpubook("bookings", "--config", str(config), *window).stdout)
    assert [item["gpus"] for item in second["accepted"]] == [[0, 1]]
    saved.delete()
    third = json.loads(gpubook("bookings", "--config", str(config), *window).stdout)
    assert third == {"accepted": [], "rejected": []}


def test_human_readable_plan_and_errors(tmp_path: Path, calendar: caldav.Calendar) -> None:
    calendar.save_event(event("one", START, 1, "DESCRIPTION:user: alice"))
    config = write_config(tmp_path, str(calendar.url))
    done = gpubook("bookings", "--config", str(config), "--from", "2026-12-07T00:00+01:00")
    assert done.returncode == 0, done.stderr
    assert "Accepted (1), times in Europe/Paris:" in done.stdout
    assert "Mon 2026-12-07 10:00 → Mon 2026-12-07 11:00  alice" in done.stdout
    unreachable = write_config(tmp_path, f"http://127.0.0.1:{servers.free_port()}/nobody/cal/")
    done = gpubook("bookings", "--config", str(unreachable))
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.startswith("gpubook: ") and "127.0.0.1" in done.stderr
    assert "Traceback" not in done.stderr
    bad_window = gpubook("bookings", "--config", str(config), "--from", "next tuesday")
    assert bad_window.returncode == 2, bad_window.stderr
    assert "the time 'next tuesday' is not understood: say now, now+2h, 14:00, today, tomorrow 09:00" \
        in bad_window.stderr


def test_a_booking_over_the_week_quota_shows_the_sentence(tmp_path: Path, calendar: caldav.Calendar) -> None:
    # Friday 4 December, before the window shown: 8 GPU-hours that still count for Tuesday's week.
    calendar.save_event(event("friday", START - timedelta(days=3), 4, "SUMMARY:alice gpus=2"))
    calendar.save_event(event("tuesday", START + timedelta(days=1), 4, "SUMMARY:alice"))
    config = write_config(tmp_path, str(calendar.url))
    config.write_text(config.read_text() + "[policy]\nweek_gpu_hours = 10\n")
    done = gpubook("bookings", "--config", str(config), "--from", "2026-12-07T00:00+00:00")
    assert done.returncode == 0, done.stderr
    assert "alice has 8 of 10 GPU-hours in the week before this booking ends; this booking needs 4" in done.stdout
    assert "2026-12-04" not in done.stdout  # read to count, not shown: it is before the window


def test_the_daemon_reads_two_weeks_back_only_where_a_week_quota_is_set(
        tmp_path: Path, calendar: caldav.Calendar) -> None:
    from gpubook.scheduler import config as config_module
    from gpubook.scheduler.calendars import Calendars

    calendar.save_event(event("ten-days-ago", START - timedelta(days=10), 4, "SUMMARY:alice"))
    path = write_config(tmp_path, str(calendar.url))
    plain = config_module.load(path)  # max_hours = 24: the daemon reads 24 hours back
    assert [o.id for o in Calendars(plain).read(now=START).occurrences] == []
    path.write_text(path.read_text() + "[policy]\nweek_gpu_hours = 10\n")
    quota = config_module.load(path)  # 14 days + 24 hours back: the week of next week's bookings
    assert [o.id for o in Calendars(quota).read(now=START).occurrences] == ["ten-days-ago"]


def test_demo_runs_on_embedded_defaults() -> None:
    done = gpubook("demo", "--plan-only")
    assert done.returncode == 0, done.stderr
    assert "2 accepted, 3 rejected." in done.stdout
    assert "is not a known user" in done.stdout and "at most 72 hours" in done.stdout


def _reader(process: subprocess.Popen[str]) -> tuple[queue.Queue[str], threading.Thread]:
    """The process's output lines, as they come, and the thread that reads them (it ends at EOF)."""
    lines: queue.Queue[str] = queue.Queue()

    def read() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            lines.put(line)

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return lines, thread


def _line_starting(lines: queue.Queue[str], prefix: str, *, seen: list[str], timeout: float) -> str:
    """The next output line starting with `prefix` (every line read is kept in `seen`); bounded."""
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        try:
            line = lines.get(timeout=left)
        except queue.Empty:
            break
        seen.append(line)
        if line.strip().startswith(prefix):
            return line.strip()
    raise AssertionError(f"no {prefix!r} line within {timeout:.0f} s:\n" + "".join(seen)[-3000:])


@pytest.mark.podman
@pytest.mark.slow
def test_demo_starts_a_booking_the_user_can_log_in_to(tmp_path: Path) -> None:
    """The README's first command, from another directory: the daemon starts the demo booking; the
    printed ssh and sftp lines work as printed with OpenSSH, against the booking's pinned host key
    (no StrictHostKeyChecking=no); no traceback reaches the terminal; Ctrl-C (here SIGTERM) stops and
    removes everything."""
    # The demo's data go where ./quickstart mounted the test path's nosuid,nodev tmpfs.
    env = {**os.environ, "GPUBOOK_DEMO_DATA_ROOT": str(safe_data.MOUNT)}
    stderr = tmp_path / "stderr"
    with stderr.open("w") as errors:
        demo = subprocess.Popen([sys.executable, "-m", "gpubook", "demo"], cwd="/", env=env, text=True,
                                stdout=subprocess.PIPE, stderr=errors, stdin=subprocess.DEVNULL)
    seen: list[str] = []
    try:
        lines, reader = _reader(demo)
        ssh_line = _line_starting(lines, "ssh ", seen=seen, timeout=600)
        sftp_line = _line_starting(lines, "sftp ", seen=seen, timeout=120)
        login = subprocess.run([*ssh_line.split(), "true"], capture_output=True, text=True, timeout=60,
                               check=False, stdin=subprocess.DEVNULL)
        assert login.returncode == 0, login.stderr
        listing = subprocess.run([sftp_line.split()[0], "-b", "-", *sftp_line.split()[1:]], input="ls\n",
                                 capture_output=True, text=True, timeout=60, check=False)
        assert listing.returncode == 0 and "input" in listing.stdout, listing.stdout + listing.stderr
    finally:
        demo.terminate()
        demo.wait(timeout=120)
    reader.join(timeout=30)  # the demo has exited: its output ends
    while not lines.empty():
        seen.append(lines.get())
    output = "".join(seen) + stderr.read_text()
    assert "Traceback" not in output and "StrictHostKeyChecking" not in output, output[-3000:]
    assert "UserKnownHostsFile=" in ssh_line and "UserKnownHostsFile=" in sftp_line
    key_path = Path(ssh_line.split()[ssh_line.split().index("-i") + 1])
    assert not key_path.exists(), "the demo's files must be removed"
    assert "stopped the daemon and the demo's containers" in output
    from gpubook.runtime.engines import container_name
    from gpubook.scheduler.commands import demo as demo_module

    containers = subprocess.run(["podman", "ps", "-a", "--format", "{{.Names}}"], capture_output=True, text=True,
                                timeout=60, check=False)
    assert container_name(demo_module.NOW_BOOKING) not in containers.stdout
    assert "gpubook-sftp" not in containers.stdout.split(), "the demo's SFTP service must be removed"


def test_demo_without_a_nosuid_nodev_folder_shows_the_plan_and_says_what_to_mount() -> None:
    env = {**os.environ, "GPUBOOK_DEMO_DATA_ROOT": "/"}  # a mount with suid and devices
    done = subprocess.run([sys.executable, "-m", "gpubook", "demo", "--until-ready"], cwd="/", env=env,
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 1
    assert "2 accepted, 3 rejected." in done.stdout
    assert done.stderr.startswith("gpubook: the demo cannot start its booking: no nosuid,nodev folder")
    assert "GPUBOOK_DEMO_DATA_ROOT=" in done.stderr and "Traceback" not in done.stderr


def test_the_daemon_reads_past_the_longest_max_days_ahead(tmp_path: Path, calendar: caldav.Calendar) -> None:
    """A week ahead by default; with max_days_ahead = 10 the daemon reads 11 days ahead, so a booking
    10.5 days ahead is read and refused (unread, it would pass once it came within the week: first
    seen 7 days before its start). One made further ahead is refused when it comes within 11 days."""
    from gpubook.scheduler import config as config_module
    from gpubook.scheduler.calendars import Calendars

    calendar.save_event(event("in-ten-days", START + timedelta(days=10.5), 4, "SUMMARY:alice"))
    path = write_config(tmp_path, str(calendar.url))
    assert [o.id for o in Calendars(config_module.load(path)).read(now=START).occurrences] == []
    path.write_text(path.read_text() + "[policy]\nmax_days_ahead = 10\n")
    assert [o.id for o in Calendars(config_module.load(path)).read(now=START).occurrences] == ["in-ten-days"]
    done = gpubook("bookings", "--config", str(path), "--from", START.isoformat(), "--to",
                   (START + timedelta(days=14)).isoformat())
    assert done.returncode == 0, done.stderr
    assert "alice may book at most 10 days ahead" in done.stdout, done.stdout
