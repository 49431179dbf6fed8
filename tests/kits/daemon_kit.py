"""What the daemon tests and the daemon benchmark share: a config on real Radicale and rootless
podman, events made through CalDAV, the daemon as a real process, SSH as the booker."""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TypeVar

import caldav
import icalendar
import paramiko
import pytest
from caldav.lib import error as dav_error

from gpubook.runtime.engines import (
    ContainerInfo,
    ContainerSpec,
    Engine,
    ExecResult,
    ServiceSpec,
    conmon,
    container_name,
)
from gpubook.scheduler.commands.embedded import end_process
from gpubook.scheduler.config import load as load_config
from gpubook.scheduler.daemon import Daemon
from gpubook.scheduler.sdnotify import Notifier
from gpubook.scheduler.state import State
from tests.kits import safe_data

ROOT = Path(__file__).resolve().parents[2]
T = TypeVar("T")

# The marks of a module whose tests run the daemon on rootless podman against a real calendar server
# (`pytestmark = DAEMON_MODULE`): out of the fast lane, skipped where podman is absent, in the flake hunt.
DAEMON_MODULE = [
    pytest.mark.podman, pytest.mark.caldav, pytest.mark.slow, pytest.mark.daemon,
    pytest.mark.skipif(shutil.which("podman") is None, reason="podman is not installed"),
]


def daemon_test(test: T) -> T:
    """DAEMON_MODULE's marks on one test, in a module whose other tests need no daemon."""
    for mark in DAEMON_MODULE:
        test = mark(test)
    return test


# `[engine]` of write_config's `engine`: rootless podman, or udocker (which has only the host's network).
ENGINE_LINES = {
    "podman": ('name = "podman"', 'runtime = "runc"', 'storage_driver = "overlay"'),
    "udocker": ('name = "udocker"', 'network = "host"'),
    # containers that are SSH servers in the daemon's process (bench/department.py's twenty servers)
    "answering": ('name = "tests.kits.department_kit:AnsweringEngine"',),
}


def lane_ports() -> tuple[int, int]:
    """The block of booking ports this test lane may use (`GPUBOOK_TEST_PORTS`, "low-high", given by
    tools/lanes.py: the lanes running side by side never draw the same port), else 20000-31999."""
    told = os.environ.get("GPUBOOK_TEST_PORTS", "")
    if told:
        low, _, high = told.partition("-")
        return int(low), int(high)
    return 20000, 31999


def port_range(size: int = 20) -> tuple[int, int]:
    """A block of ports that nothing uses now, away from other tests' free_port() picks."""
    import socket

    low, high = lane_ports()
    for _ in range(200):
        # Below the kernel's ephemeral range (32768-60999): no outgoing connection's local port, nor
        # another test's free_port() pick, can take a booking's port between its arming and its start.
        base = low + secrets.randbelow((high - low + 1 - size) // 4) * 4
        free = True
        for port in range(base, base + size):
            with socket.socket() as probe:
                try:
                    probe.bind(("0.0.0.0", port))  # noqa: S104 - the container's sshd binds all addresses
                except OSError:
                    free = False
                    break
        if free:
            return base, base + size - 1
    raise RuntimeError("no free block of ports")


def key_line(key: paramiko.PKey) -> str:
    return f"{key.get_name()} {key.get_base64()} test"


def write_config(folder: Path, calendar_url: str, *, keys: dict[str, paramiko.PKey], gpus: int = 2,
                 poll_seconds: float = 60, warn_minutes: float = 0.1, stale_after_minutes: float = 30,
                 notice_seconds: float = 3, restart_backoff_seconds: float = 1, template: str = "debian-ssh",
                 templates_dir: Path | None = None, engine_lines: Sequence[str] = (),
                 gpu_lines: Sequence[str] = (), engine: str = "podman", state_dir: Path | None = None,
                 ports: tuple[int, int] | None = None) -> Path:
    low, high = ports or port_range()
    if not (folder / "data").exists():
        # gpubook refuses a data_root without nosuid,nodev: the test mount's, seen as folder/data.
        (folder / "data").symlink_to(tempfile.mkdtemp(prefix="daemon-", dir=safe_data.MOUNT))
    lines = [
        '[host]', 'name = "127.0.0.1"', 'timezone = "UTC"', '',
        '[[calendar]]', f'url = "{calendar_url}"', 'username = "test"', '',
        '[gpus]', f'count = {gpus}', *gpu_lines, '',
        '[defaults]', f'template = "{template}"', 'gpus = 1', f'warn_minutes = {warn_minutes}', '',
        '[engine]', *ENGINE_LINES[engine], 'stop_grace_seconds = 1', *engine_lines, '',
        '[storage]', f'data_root = "{folder / "data"}"', '',
        '[ssh]', f'port_min = {low}', f'port_max = {high}', '',
        '[daemon]', f'poll_seconds = {poll_seconds}', f'state_dir = "{state_dir or folder / "state"}"',
        f'stale_after_minutes = {stale_after_minutes}', f'notice_seconds = {notice_seconds}',
        f'restart_backoff_seconds = {restart_backoff_seconds}', '',
    ]
    if templates_dir is not None:
        lines += ['[templates]', f'dir = "{templates_dir}"', '']
    for number, (user, key) in enumerate(keys.items()):
        lines += [f'[users.{user}]', f'uid = {2001 + number}', f'email = ["{user}@lab.example"]',
                  f'ssh_keys = ["{key_line(key)}"]', '']
    path = folder / "gpubook.toml"
    path.write_text("\n".join(lines))
    return path


def event_text(uid: str, *, user: str, start: datetime, end: datetime, gpus: str = "1",
               description: str = "", summary: str | None = None, rrule: str | None = None) -> str:
    calendar = icalendar.Calendar()
    calendar.add("prodid", "-//gpubook tests//EN")
    calendar.add("version", "2.0")
    event = icalendar.Event()
    event.add("uid", uid)
    event.add("summary", f"{user} debian-ssh" if summary is None else summary)
    event.add("dtstart", start)
    event.add("dtend", end)
    event.add("dtstamp", datetime.now(UTC))
    event.add("created", datetime.now(UTC))
    event.add("description", f"{description}user: {user}\ngpus: {gpus}\n")
    if rrule:
        event.add("rrule", icalendar.vRecur.from_ical(rrule))
    calendar.add_component(event)
    return calendar.to_ical().decode()


def sampled_config(folder: Path, calendar_url: str, *, keys: dict[str, paramiko.PKey], poll_seconds: float,
                   policy: str, gpus: int = 8) -> Path:
    """write_config's daemon on `gpus` fake GPUs (tests/kits/fake_gpus.py: their utilisation from the
    file the test names in its environment), sampled every second, with these `[policy]` lines."""
    config = write_config(folder, calendar_url, keys=keys, poll_seconds=poll_seconds, gpus=gpus,
                          gpu_lines=['monitor = "tests.kits.fake_gpus:read"'])
    config.write_text(config.read_text().replace("[daemon]\n", "[daemon]\nsample_seconds = 1\n")
                      + f"\n[policy]\n{policy}")
    return config


def book(calendar: caldav.Calendar, uid: str, *, user: str, start: datetime, end: datetime,
         gpus: str = "1", description: str = "", summary: str | None = None, rrule: str | None = None
         ) -> caldav.Event:
    return calendar.save_event(event_text(uid, user=user, start=start, end=end, gpus=gpus,
                                          description=description, summary=summary, rrule=rrule))


def description(calendar: caldav.Calendar, uid: str) -> str:
    event = calendar.event_by_uid(uid)
    component = event.icalendar_component
    return str(component.get("DESCRIPTION", ""))


def child_env() -> dict[str, str]:
    """This environment with the source tree first on PYTHONPATH; folders already there are kept
    (on the GPU test host the dependencies' wheels are unpacked into one)."""
    kept = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *([kept] if kept else [])])}


def as_account(user: str, tree: Path) -> tuple[dict[str, object], dict[str, str]]:
    """Popen's arguments and the environment that run a process as `user` itself (no wrapper
    process), importing gpubook from `tree`."""
    import pwd

    entry = pwd.getpwnam(user)
    return ({"user": entry.pw_uid, "group": entry.pw_gid, "extra_groups": []},
            {"HOME": entry.pw_dir, "USER": user, "LOGNAME": user, "PYTHONDONTWRITEBYTECODE": "1",
             "XDG_RUNTIME_DIR": f"/run/user/{entry.pw_uid}", "PYTHONPATH": str(tree)})


STARTED: list[DaemonProcess] = []  # every daemon a test started; an autouse fixture stops what outlives it


class DaemonProcess:
    """`gpubook run` as a real process; stderr kept in a file for the failure message."""

    def __init__(self, config: Path, *, env: dict[str, str] | None = None, user: str | None = None,
                 tree: Path = ROOT) -> None:
        """`env`: added to the daemon's environment (e.g. tests/kits/fake_gpus.py's file); `user`: the
        account it runs as (a test run as root: the Slurm tests), from the source `tree` it can read."""
        self.config = config
        self.env = env or {}
        self.user, self.tree = user, tree
        self.log = config.with_name("daemon.log")
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> DaemonProcess:
        argv = [sys.executable, "-m", "gpubook.scheduler.commands.cli", "run", "--config", str(self.config)]
        env = child_env() | self.env
        account: dict[str, object] = {}
        if self.user is not None:  # exec'd as the account itself: a kill -9 reaches the daemon, not a wrapper
            account, extra = as_account(self.user, self.tree)
            env |= extra
        with self.log.open("ab") as log:
            self.process = subprocess.Popen(argv, stdout=log, stderr=log, env=env, stdin=subprocess.DEVNULL,
                                            cwd=self.tree, **account)  # type: ignore[call-overload]
        STARTED.append(self)
        return self

    def signal(self, number: int) -> None:
        assert self.process is not None
        self.process.send_signal(number)

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait()

    def stop(self, timeout: float = 30) -> int | None:
        if self.process is None:
            return None
        return end_process(self.process, timeout=timeout)

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:] if self.log.exists() else ""


# Seconds between two looks, at the most: within a wait's first LONG_WAIT seconds, then after (a wait
# that long is for a booking's end or a warning, which a second's lateness does not change).
SLOWEST_LOOK = 0.5
SLOWEST_LONG_LOOK = 1.0
LONG_WAIT = 10.0


def wait_for(what: str, check: Callable[[], T | None], *, timeout: float, interval: float = 0.1,
             daemon: DaemonProcess | None = None) -> T:
    """`check()` until it gives something true, first every `interval` seconds, then less often (each
    look a little later, up to SLOWEST_LOOK, and SLOWEST_LONG_LOOK once the wait is long): a look is
    often a podman command (75 ms of CPU here), and the lanes running side by side share two cores."""
    began = time.monotonic()
    deadline = began + timeout
    pause = interval
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(pause)
        slowest = SLOWEST_LONG_LOOK if time.monotonic() - began > LONG_WAIT else SLOWEST_LOOK
        pause = min(max(interval, slowest), pause * 1.25)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}\n"
                         + (f"daemon log:\n{daemon.tail()}\n" if daemon else "") + _bookings_logs())


def _bookings_logs() -> str:
    """The end of each booking container's log (an armed container's sshd, say), for a failure message."""
    import subprocess

    parts = []
    try:
        listed = subprocess.run(["podman", "ps", "-a", "--filter", "label=gpubook.booking", "--format",
                                 "{{.Names}} {{.Status}}"], capture_output=True, text=True, timeout=30, check=False)
        for line in listed.stdout.splitlines():
            logs = subprocess.run(["podman", "logs", "--tail", "15", line.split()[0]], capture_output=True,
                                  text=True, timeout=30, check=False)
            parts.append(f"container {line}:\n{logs.stdout}{logs.stderr}")
    except (OSError, subprocess.SubprocessError) as error:
        parts.append(f"(no container logs: {error})")
    return "\n".join(parts)


def alive(pid: int) -> bool:
    """Whether process `pid` runs: there, and no zombie (killed and not reaped yet)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def try_login(port: int, user: str, key: paramiko.PKey, *, timeout: float = 3) -> paramiko.SSHClient | None:
    client = paramiko.SSHClient()
    client.set_missing_host_key_policy(paramiko.AutoAddPolicy())  # noqa: S507 - a fresh container's host key
    try:
        client.connect("127.0.0.1", port=port, username=user, pkey=key, look_for_keys=False, allow_agent=False,
                       timeout=timeout, banner_timeout=timeout, auth_timeout=timeout)
    except (OSError, paramiko.SSHException, EOFError):
        client.close()
        return None
    return client


def running_container(engine: Engine, booking_id: str):  # type: ignore[no-untyped-def]
    """The booking's container if it runs, else None. With podman, a container runs only under its
    conmon: while no conmon of this account has its name, None without a podman command (a wait
    for a start looks many times before it; each look was a `podman container inspect`, ~75 ms of
    CPU, and the lanes share two cores)."""
    name = container_name(booking_id)
    if engine.name == "podman" and not any(monitor.name == name for monitor in conmon.monitors()):
        return None
    info = engine.inspect(name)
    return info if info is not None and info.running else None


def run(client: paramiko.SSHClient, command: str) -> tuple[int, str]:
    _, stdout, _ = client.exec_command(command, timeout=30)
    status = stdout.channel.recv_exit_status()
    return status, stdout.read().decode()


def assert_warned(client: paramiko.SSHClient, *, warn_at: datetime, daemon: DaemonProcess | None = None,
                  timeout: float = 20) -> None:
    """The booker is told that the booking ends soon (the WarnHandler's notice, due at `warn_at`): on a
    shell opened before then, the notice comes to its terminal; a shell opened later (a loaded machine
    that logged in late: a clean-clone run, 16.6 s after the start) finds it in /run/gpubook/notice,
    which the notice leaves for sessions that log in after it."""
    shell = client.invoke_shell(term="xterm")
    if datetime.now(UTC) < warn_at:
        shell.settimeout(1.0)
        seen = b""
        deadline = time.monotonic() + timeout
        while b"this booking ends at" not in seen and time.monotonic() < deadline:
            try:
                seen += shell.recv(4096)
            except TimeoutError:
                pass
        assert b"this booking ends at" in seen, seen[-500:]
        return

    def notice() -> str | None:
        text = run(client, "cat /run/gpubook/notice 2>/dev/null")[1]
        return text if "this booking ends at" in text else None

    said = wait_for("the warning in /run/gpubook/notice", notice, timeout=timeout, daemon=daemon)
    assert said.startswith("gpubook: this booking ends at"), said


def soon(seconds: float) -> datetime:
    """A whole second `seconds` from now (calendar times have no fractions)."""
    return (datetime.now(UTC) + timedelta(seconds=seconds + 1)).replace(microsecond=0)


class IdleEngine:
    """An engine with no containers, meeting the Engine protocol: for a daemon built in-process
    whose passes have nothing to run (its scheduling, files and notifications are under test)."""

    name = "idle"

    def __init__(self, *args: object) -> None: ...

    def preflight(self) -> list[object]:
        return []

    def list(self) -> list[ContainerInfo]:
        return []

    def inspect(self, name: str) -> ContainerInfo | None:
        return None

    def stop(self, name: str, grace: float) -> None: ...

    def exec(self, name: str, argv: Sequence[str], *, user: str | None = None,
             timeout: float | None = None) -> ExecResult:
        return ExecResult(0, "", "")

    def start(self, spec: ContainerSpec) -> ContainerInfo:
        raise NotImplementedError("an idle engine starts nothing")

    def ensure_image(self, image: str, *, pull: bool = False) -> None: ...

    def logs(self, name: str, *, tail: int | None = None) -> str:
        return ""

    def host_owner(self, uid: int, gid: int) -> tuple[int, int]:
        return uid, gid

    def chown(self, path: Path, uid: int, gid: int) -> None: ...

    def data_owner_argv(self) -> list[str] | None:
        return []

    def build(self, tag: str, context: Path, *, containerfile: str = "Containerfile") -> None: ...

    def import_rootfs(self, tarball: Path, tag: str) -> None: ...

    def start_service(self, spec: ServiceSpec) -> ContainerInfo:
        raise NotImplementedError("an idle engine starts nothing")

    def inspect_service(self, name: str) -> ContainerInfo | None:
        return None

    def signal(self, name: str, signal_name: str) -> None: ...


def in_process_daemon(folder: Path, *, notifier: Notifier | None = None, poll_seconds: float = 60,
                      kind: type[Daemon] = Daemon) -> Daemon:
    """`Daemon` built in this process on an idle engine and a calendar never connected to (its
    first poll finds the calendar unreachable); its state in folder/state."""
    path = folder / "gpubook.toml"
    path.write_text('[host]\nname = "devbox1"\ntimezone = "UTC"\n[[calendar]]\nurl = "http://127.0.0.1:9/cal/"\n'
                    '[gpus]\ncount = 1\n[users.alice]\nuid = 2001\n'
                    f'[daemon]\nstate_dir = "{folder / "state"}"\npoll_seconds = {poll_seconds}\n')
    return kind(load_config(path), engine=IdleEngine(), notifier=notifier or Notifier(None))


def cli(config: Path, *args: str, user: str | None = None, tree: Path = ROOT) -> subprocess.CompletedProcess[str]:
    """A `gpubook` command (status, stop, log, ...) on the test's config, as an admin runs it
    (`user`: as the daemon's account, from a source `tree` it can read; see DaemonProcess)."""
    env, account = child_env(), {}
    if user is not None:
        account, extra = as_account(user, tree)
        env |= extra
    return subprocess.run([sys.executable, "-m", "gpubook.scheduler.commands.cli", *args, "--config", str(config)],
                          capture_output=True, text=True, timeout=120, cwd=tree, env=env,
                          **account)  # type: ignore[call-overload]


def events(folder: Path, booking_id: str | None = None) -> list[str]:
    """The daemon's event log in folder/state (one booking's, or all)."""
    with State(folder / "state" / "state.sqlite") as state:
        return [e.message for e in state.events(booking_id=booking_id)]


def edit(calendar: caldav.Calendar, uid: str, text: str) -> bool:
    """Replace an event's content, as a calendar program does (If-Match its current ETag)."""
    event = calendar.event_by_uid(uid)
    event.data = text
    try:
        event.save()
    except dav_error.ETagMismatchError:
        return False  # gpubook wrote back in between: read it again
    return True
