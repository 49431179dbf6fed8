"""`gpubook demo`: gpubook on embedded defaults, with nothing to set up.

It starts a Radicale on 127.0.0.1 with a temporary calendar, fills it with a few bookings (one for
the current user starting in 10 seconds, a recurring one, and some that must be rejected), writes a
config for this host (NVML's GPUs, else a static inventory of two), shows the plan gpubook makes of
them, builds the local `debian-ssh` image if it is missing, runs the daemon, and prints the ssh line
the moment SSH answers: with a key made for the demo and a known_hosts file holding the booking's own
host key (gpubook pins it; nothing is trusted on first use). Ctrl-C ends it: the daemon, the demo's
containers, the calendar server and every file are removed.

Its data folders need a nosuid,nodev mount (as every gpubook data_root does): GPUBOOK_DEMO_DATA_ROOT,
else the first writable one of $XDG_RUNTIME_DIR and /dev/shm (tmpfs, nosuid,nodev on most hosts);
without one the plan is shown and the demo says what to mount.
"""

from __future__ import annotations

import base64
import contextlib
import getpass
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timedelta
from pathlib import Path

import caldav
import paramiko
from icalendar import Calendar, Event, vCalAddress

from gpubook.runtime import engines, private
from gpubook.runtime.booking import ssh
from gpubook.runtime.data import sftp, storage
from gpubook.runtime.engines import ContainerInfo, Engine, container_name
from gpubook.runtime.errors import GpubookError
from gpubook.runtime.names import USER_NAME
from gpubook.runtime.templates import overlay_image
from gpubook.runtime.templates.catalog import get_template
from gpubook.scheduler import calendars as calendars_module
from gpubook.scheduler import config as config_module
from gpubook.scheduler import wiring
from gpubook.scheduler.commands.embedded import RadicaleServer, end_process, free_port
from gpubook.scheduler.core import plan as plan_module

NOW_BOOKING = "demo-now@gpubook"
DATA_ROOT_ENV = "GPUBOOK_DEMO_DATA_ROOT"
READY_TIMEOUT = 120.0  # seconds from the booking's start to a successful login, at most
SFTP_TIMEOUT = 30.0  # seconds after the booking's login for the SFTP service to serve, at most


def _booker_name() -> str:
    name = getpass.getuser()
    return name if USER_NAME.match(name) and name != "root" else "demo"


def _event(uid: str, summary: str, start: datetime, end: datetime, *, description: str = "",
           organizer: str | None = None, rrule: dict[str, object] | None = None,
           created: datetime | None = None) -> str:
    calendar = Calendar()
    calendar.add("prodid", "-//gpubook//demo//EN")
    calendar.add("version", "2.0")
    event = Event()
    event.add("uid", uid)
    event.add("summary", summary)
    event.add("dtstart", start)
    event.add("dtend", end)
    event.add("dtstamp", created or start)
    event.add("created", created or start)
    if description:
        event.add("description", description)
    if organizer:
        event.add("organizer", vCalAddress(f"mailto:{organizer}"))
    if rrule:
        event.add("rrule", rrule)
    calendar.add_component(event)
    return calendar.to_ical().decode()


def demo_events(now: datetime, booker: str) -> list[str]:
    """The demo calendar's content, relative to `now` (an aware local time)."""
    soon = now.replace(microsecond=0) + timedelta(seconds=10)
    tomorrow_9 = (now + timedelta(days=1)).replace(hour=9, minute=0, second=0, microsecond=0)
    early = now - timedelta(days=30)
    return [
        _event("demo-now@gpubook", f"{booker} debian-ssh gpus=1", soon, soon + timedelta(hours=2),
               created=early),
        _event("demo-weekly@gpubook", "Alice's weekly training run", tomorrow_9, tomorrow_9 + timedelta(hours=8),
               description="user: alice\ntemplate: debian-ssh\ngpus: 2", rrule={"freq": "weekly", "count": 4},
               created=early),
        _event("demo-clash@gpubook", "bob wants both GPUs too", tomorrow_9 + timedelta(hours=2),
               tomorrow_9 + timedelta(hours=4), description="user: bob\ngpus: 0,1", created=now),
        _event("demo-stranger@gpubook", "someone from outside", tomorrow_9 + timedelta(days=1),
               tomorrow_9 + timedelta(days=1, hours=1), organizer="mallory@elsewhere.example", created=now),
        _event("demo-long@gpubook", "bob trains for 100 hours", tomorrow_9 + timedelta(days=2),
               tomorrow_9 + timedelta(days=2, hours=100), description="user: bob", created=now),
    ]


def _free_ports(size: int = 10) -> tuple[int, int]:
    """The first block of `size` ports from 2200 up that nothing listens on now."""
    for base in range(2200, 2900, size):
        try:
            for port in range(base, base + size):
                with socket.socket() as probe:
                    probe.bind(("0.0.0.0", port))  # noqa: S104 - sshd in the container binds all addresses
        except OSError:
            continue
        return base, base + size - 1
    raise GpubookError("no free block of 10 ports between 2200 and 2900 for the demo's SSH")


def data_root_candidates() -> list[str]:
    """Where the demo may put its data folders, in order: the one named, then tmpfs folders that are
    nosuid,nodev on most hosts (`./quickstart demo` names the tmpfs it mounts)."""
    named = os.environ.get(DATA_ROOT_ENV)
    if named:
        return [named]
    return [path for path in (os.environ.get("XDG_RUNTIME_DIR"), "/dev/shm") if path]  # noqa: S108 - a tmpfs


def find_data_root() -> Path | None:
    """The first candidate this user may write on a nosuid,nodev mount, or None."""
    for candidate in data_root_candidates():
        if os.access(candidate, os.W_OK | os.X_OK) and storage.mount_problem(Path(candidate)) is None:
            return Path(candidate)
    return None


def no_data_root_sentence() -> str:
    tried = ", ".join(data_root_candidates()) or "none"
    return (f"no nosuid,nodev folder this user may write for the demo's data (tried: {tried}); "
            f"gpubook refuses data folders elsewhere, so mount one, e.g. `sudo mount -t tmpfs -o "
            f"nosuid,nodev,size=1g,uid={os.getuid()} gpubook-demo /mnt`, and run "
            f"`{DATA_ROOT_ENV}=/mnt gpubook demo`")


def demo_config(folder: Path, calendar_url: str, booker: str, key_line: str, *, data_root: Path) -> Path:
    users = {booker: os.getuid() if os.getuid() else 1000, "alice": 2001, "bob": 2002}
    low, high = _free_ports()
    lines = [
        '[host]', 'name = "localhost"', f'timezone = "{config_module.system_timezone()}"', '',
        '[[calendar]]', f'url = "{calendar_url}"', 'gpus = "all"', '',
        '[gpus]', 'count = 2', '',
        '[defaults]', 'template = "debian-ssh"', 'gpus = 1', 'max_hours = 72', '',
        '[storage]', f'data_root = "{data_root}"', '',
        '[ssh]', f'port_min = {low}', f'port_max = {high}', '',
        '[daemon]', 'poll_seconds = 30', f'state_dir = "{folder / "state"}"', '',
        '[sftp]', 'enabled = true', f'port = {free_port()}', 'listen = "127.0.0.1"', '',
    ]
    if shutil.which("runc"):
        lines[lines.index('[storage]'):lines.index('[storage]')] = ['[engine]', 'runtime = "runc"', '']
    for name, uid in users.items():
        lines += [f"[users.{name}]", f'email = ["{name}@lab.example"]', f"uid = {uid}"]
        if name == booker:
            lines.append(f'ssh_keys = ["{key_line}"]')
        lines.append("")
    path = folder / "gpubook.toml"
    path.write_text("\n".join(lines))
    return path


def _login(port: int, user: str, key: paramiko.PKey, *, host_key: str) -> bool:
    """The booker logs in to the server showing the booking's host key, and sudo works there.

    The quiet probe first (gpubook's own): while sshd starts, the published port accepts and hangs
    up, which paramiko's transport thread would log as an error with its traceback."""
    try:  # a server showing another host key raises ForeignHostKey: the demo stops with it
        ssh.probe_login("127.0.0.1", port, user, key, host_key=host_key, timeout=3)
    except (OSError, paramiko.SSHException, EOFError):
        return False
    client = paramiko.SSHClient()
    kind, blob = host_key.split()[:2]
    pinned = paramiko.PKey.from_type_string(kind, base64.b64decode(blob))
    client.get_host_keys().add(f"[127.0.0.1]:{port}", kind, pinned)
    client.set_missing_host_key_policy(paramiko.RejectPolicy())
    try:
        client.connect("127.0.0.1", port=port, username=user, pkey=key, look_for_keys=False,
                       allow_agent=False, timeout=3, banner_timeout=3, auth_timeout=3)
        _, stdout, _ = client.exec_command("sudo -n true && echo ok", timeout=10)
        return stdout.read().decode().strip() == "ok"
    except (OSError, paramiko.SSHException, EOFError):
        return False
    finally:
        client.close()


def _wait_until_ready(engine: Engine, daemon: subprocess.Popen[bytes], booker: str,
                      key: paramiko.PKey, *, deadline: float) -> ContainerInfo:
    """The booking's container once the booker can log in (and sudo); raises if it never comes."""
    name = container_name(NOW_BOOKING)
    while time.monotonic() < deadline:
        if daemon.poll() is not None:
            raise GpubookError(f"the daemon exited with status {daemon.returncode}")
        info = engine.inspect(name)
        if (info is not None and info.running and info.port and info.host_key
                and _login(info.port, booker, key, host_key=info.host_key)):
            return info
        time.sleep(0.2)
    raise GpubookError(f"the demo booking did not answer on SSH within {READY_TIMEOUT:.0f} s of its start")


def write_known_hosts(path: Path, info: ContainerInfo) -> None:
    """The booking's pinned host key as OpenSSH reads it for `localhost` and the booking's port."""
    assert info.port is not None
    path.write_text(ssh.known_hosts_line(host="localhost", port=info.port, host_key=info.host_key) + "\n")


def _sftp_known_hosts(engine: Engine, known_hosts: Path, config: config_module.Config) -> bool:
    """Add the SFTP service's host key to the demo's known_hosts once it serves (bounded wait)."""
    if not config.sftp.enabled:
        return False
    public = wiring.state_dir(config) / "sftp" / "etc" / "host_key.pub"
    services = engines.service_runner(engine, why="the demo's SFTP service")
    deadline = time.monotonic() + SFTP_TIMEOUT
    while time.monotonic() < deadline:
        service = services.inspect_service(sftp.SERVICE_NAME)
        if service is not None and service.running and public.is_file():
            line = ssh.known_hosts_line(host="localhost", port=config.sftp.port, host_key=public.read_text().strip())
            with known_hosts.open("a") as out:
                out.write(line + "\n")
            return True
        time.sleep(0.2)
    print(f"gpubook demo: the SFTP service did not start within {SFTP_TIMEOUT:.0f} s; see the daemon's log",
          flush=True)
    return False


def _clean_up(engine: Engine, daemon: subprocess.Popen[bytes] | None, booking_ids: set[str],
              sftp_port: int | None) -> None:
    if daemon is not None:
        end_process(daemon, timeout=30)
    # The daemon leaves containers running on purpose (they outlive it); the demo's must go.
    for info in engine.list():
        if info.booking_id in booking_ids or info.booking_id.split("@20", 1)[0] in booking_ids:
            engine.stop(info.name, 0)
    service = engine.inspect_service(sftp.SERVICE_NAME) if isinstance(engine, engines.ServiceRunner) else None
    if service is not None and sftp_port is not None and service.port == sftp_port:  # the demo's, not a site's
        engine.stop(service.name, 0)


def _ensure_image(config: config_module.Config, engine: Engine) -> None:
    template = get_template(config.defaults.template, config.templates_dir)
    image = overlay_image.run_image(template)
    if engine.image_exists(image):  # type: ignore[attr-defined]
        return
    print(f"gpubook demo: building the {template.name} image (mmdebstrap, about a minute, once)", flush=True)
    if template.build is not None:
        overlay_image.build_rootfs_image(engine, template, cache_dir=private.default_cache_dir())
    if not template.has_sshd:
        overlay_image.build_overlay(engine, template)


def _run_daemon(config: config_module.Config, config_path: Path, booker: str, key: paramiko.PKey,
                key_path: Path, *, start: datetime, booking_ids: set[str], until_ready: bool) -> int:
    engine = wiring.make_engine(config)
    _ensure_image(config, engine)
    log_path = config_path.with_name("daemon.log")
    daemon = None
    try:
        with log_path.open("wb") as log:
            daemon = subprocess.Popen([sys.executable, "-m", "gpubook.scheduler.commands.cli", "run", "--config",
                                       str(config_path)], stdout=log, stderr=log, stdin=subprocess.DEVNULL)
        wait = (start - datetime.now(start.tzinfo)).total_seconds()
        print(f"gpubook demo: the daemon runs; your booking starts in {max(wait, 0):.0f} s …", flush=True)
        info = _wait_until_ready(engine, daemon, booker, key, deadline=time.monotonic() + max(wait, 0) + READY_TIMEOUT)
        late = (datetime.now(start.tzinfo) - start).total_seconds()
        known_hosts = key_path.with_name("known_hosts")
        write_known_hosts(known_hosts, info)
        print(f"\nYour booking is up ({late:.1f} s after its start). Log in with:\n\n"
              f"  ssh -o UserKnownHostsFile={known_hosts} -i {key_path} -p {info.port} {booker}@localhost\n",
              flush=True)
        if _sftp_known_hosts(engine, known_hosts, config):
            print("Your data folders (input/, output/), at any time, before and after bookings:\n\n"
                  f"  sftp -o UserKnownHostsFile={known_hosts} -i {key_path} -P {config.sftp.port} "
                  f"{booker}@localhost\n", flush=True)
        if until_ready:
            return 0
        print("Ctrl-C ends the demo (the container is stopped and everything removed).", flush=True)
        while daemon.poll() is None:
            time.sleep(1)
        print(f"gpubook demo: the daemon exited with status {daemon.returncode}; its log:\n"
              + log_path.read_text(errors="replace")[-3000:])
        return 1
    except KeyboardInterrupt:
        return 0
    except GpubookError:
        print(log_path.read_text(errors="replace")[-3000:] if log_path.exists() else "", file=sys.stderr)
        raise
    finally:
        _clean_up(engine, daemon, booking_ids, config.sftp.port if config.sftp.enabled else None)
        print("gpubook demo: stopped the daemon and the demo's containers.", flush=True)


def _data_folder(stack: contextlib.ExitStack, folder: Path) -> tuple[Path, bool]:
    """The demo's data_root (removed at the end) and whether it is on a nosuid,nodev mount; said."""
    root = find_data_root()
    if root is None:
        tried = ", ".join(data_root_candidates()) or "none"
        print(f"gpubook demo: no nosuid,nodev folder for the booking's data (tried: {tried}): the plan is "
              "shown, the booking cannot start", flush=True)
        (folder / "data").mkdir()
        return folder / "data", False
    data = stack.enter_context(tempfile.TemporaryDirectory(prefix="gpubook-demo-data-", dir=root,
                                                           ignore_cleanup_errors=True))
    print(f"gpubook demo: the booking's data folders go to {data} (a nosuid,nodev mount), removed at the end")
    return Path(data), True


def run(*, plan_only: bool = False, until_ready: bool = False) -> int:
    booker = _booker_name()
    # Ctrl-C or a plain `kill` both end the demo through the same clean-up.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    # While sshd starts, logins fail by design; paramiko would log each with a traceback.
    logging.getLogger("paramiko.transport").setLevel(logging.CRITICAL)
    with contextlib.ExitStack() as stack:
        folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="gpubook-demo-")))
        server = stack.enter_context(RadicaleServer())
        data_root, data_safe = _data_folder(stack, folder)
        # Radicale's "none" authentication takes any name; a name is needed to own a calendar.
        client = caldav.DAVClient(url=server.url, username="demo", password="demo")  # type: ignore[operator]  # noqa: S106 - ignored by "none" auth
        principal_calendar = client.principal().make_calendar(name="devbox", cal_id="devbox")
        now = datetime.now().astimezone()
        events = demo_events(now, booker)
        for text in events:
            principal_calendar.save_event(text)
        calendar_url = str(principal_calendar.url)
        key = paramiko.ECDSAKey.generate(bits=256)
        key_path = folder / "demo-key"
        key.write_private_key_file(str(key_path))
        key_path.chmod(0o600)
        config_path = demo_config(folder, calendar_url, booker, f"{key.get_name()} {key.get_base64()} demo",
                                  data_root=data_root)
        loaded = config_module.load(config_path)
        print(f"gpubook demo: a Radicale calendar at {calendar_url} with {len(events)} bookings")
        print(f"gpubook demo: config {config_path} (users {', '.join(sorted(loaded.users))})\n")
        result = calendars_module.plan_window(loaded, window_start=now, window_end=now + timedelta(days=7),
                                     now=now)
        print(calendars_module.describe_plan(result, timezone=loaded.host.timezone))
        summary = plan_module.to_json(result.plan)
        print(f"\n{len(summary['accepted'])} accepted, {len(summary['rejected'])} rejected.\n", flush=True)
        if plan_only:
            return 0
        if not data_safe:
            raise GpubookError(f"the demo cannot start its booking: {no_data_root_sentence()}")
        start = next(a.booking.start for a in result.plan.accepted if a.booking.id == NOW_BOOKING)
        booking_ids = {"demo-now@gpubook", "demo-weekly@gpubook", "demo-clash@gpubook",
                       "demo-stranger@gpubook", "demo-long@gpubook"}
        return _run_daemon(loaded, config_path, booker, key, key_path, start=start, booking_ids=booking_ids,
                           until_ready=until_ready)
