#!/usr/bin/env python3
"""What a booker's calendar client shows of gpubook's answers: the pictures and terminal text of
docs/guides/booking.md ("What your calendar shows, client by client"). Run by hand; see
docs/development.md.

It starts Radicale (in this process, on 127.0.0.1), books three events there as a booker's client
would (one now, one that collides with it, one tomorrow), runs the real daemon (`gpubook run`, rootless
podman, two GPUs of a static inventory, its page on 127.0.0.1 serving /free.ics) until it has
answered all three (running, refused, accepted), then shows the calendar and the availability feed:

- in Thunderbird under Xvfb: the week view, and the running and refused bookings' dialogs (PNG, 8-bit);
- in khal, with vdirsyncer syncing the CalDAV calendar and the feed (its http storage) into vdirs:
  `khal list` and `ikhal` in tmux (text).

Needs thunderbird, xvfb, xdotool, imagemagick, khal, vdirsyncer, tmux (Debian packages), podman with
the account's debian-ssh image, and a nosuid,nodev folder for the bookings' data (--data-root). Run
it as the account that runs rootless podman, from a checkout, with a python that has gpubook's test
extras (Radicale):

    python tools/client_screenshots.py --data-root /srv/gpubook-NAME-data --out docs/images
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import icalendar
import paramiko
import requests

ROOT = Path(__file__).resolve().parents[1]
BOOKER = "alice"
OTHER = "bob"
SCREEN = (1600, 1000)
VISIBLE_HOURS = 14
# Where Thunderbird 153 draws the work week in a 1600x1000 window with the event list closed.
WEEK_CROP = (1020, 880, 380, 80)  # width, height, left, top of the week view
GRID_LEFT, COLUMN_WIDTH, GRID_TOP, HOUR_HEIGHT = 452, 189, 200, 56  # Monday's column; the first hour's top
TOOLS = ("thunderbird", "Xvfb", "xdotool", "import", "convert", "khal", "vdirsyncer", "tmux", "podman")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def wait_for(what: str, check: Callable[[], object], *, timeout: float, interval: float = 1.0) -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(interval)
    raise SystemExit(f"client_screenshots: timed out after {timeout:.0f} s waiting for {what}")


# -- the calendar server --------------------------------------------------------------------------


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base class's name
        pass


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


@contextlib.contextmanager
def radicale(folder: Path) -> Iterator[str]:
    """Radicale with auth none in which every request without credentials is the booker's: clients
    (Thunderbird asks for current-user-principal) then never meet a 401 and need no password."""
    import radicale as radicale_module
    import radicale.config

    configuration = radicale.config.load()
    configuration.update({"storage": {"filesystem_folder": str(folder)}, "auth": {"type": "none"},
                          "rights": {"type": "owner_only"}}, "client_screenshots")
    application = radicale_module.Application(configuration)
    credentials = "Basic " + base64.b64encode(f"{BOOKER}:-".encode()).decode()

    def as_booker(environ, start_response):  # type: ignore[no-untyped-def]
        environ.setdefault("HTTP_AUTHORIZATION", credentials)
        return application(environ, start_response)

    server = make_server("127.0.0.1", 0, as_booker, server_class=_Server, handler_class=_QuietHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()


@dataclass(frozen=True)
class Booked:
    uid: str
    title: str
    user: str
    start: datetime
    end: datetime
    gpus: int
    created: datetime  # the first made wins a collision

    @property
    def name(self) -> str:
        return self.uid.split("@")[0]


def bookings(now: datetime) -> list[Booked]:
    """Running now; refused (it wants GPU 0 while that one runs, and was made last); accepted
    tomorrow, 3 hours earlier in the day (today, later, when tomorrow is next week's first day)."""
    hour = now.replace(minute=0, second=0, microsecond=0)
    later = hour + timedelta(hours=21) if now.weekday() < 6 else hour + timedelta(hours=4)
    return [
        Booked("running@screenshots", "alice: fine-tune", BOOKER, hour - timedelta(hours=1),
               hour + timedelta(hours=3), 1, created=hour - timedelta(days=2)),
        Booked("accepted@screenshots", "alice: evaluation", BOOKER, later, later + timedelta(hours=3), 2,
               created=hour - timedelta(days=1)),
        Booked("refused@screenshots", "bob: sweep on both GPUs", OTHER, hour + timedelta(hours=1),
               hour + timedelta(hours=4), 2, created=hour - timedelta(hours=2)),
    ]


def booking_text(booked: Booked) -> str:
    """The event as a booker's client saves it: a title, the times, and gpubook's two lines."""
    calendar = icalendar.Calendar()
    calendar.add("prodid", "-//gpubook client_screenshots//EN")
    calendar.add("version", "2.0")
    event = icalendar.Event()
    for name, value in (("uid", booked.uid), ("summary", booked.title), ("dtstart", booked.start),
                        ("dtend", booked.end), ("dtstamp", booked.created), ("created", booked.created),
                        ("description", f"user: {booked.user}\ngpus: {booked.gpus}\n")):
        event.add(name, value)
    calendar.add_component(event)
    return calendar.to_ical().decode()


# -- the daemon -----------------------------------------------------------------------------------


def write_config(folder: Path, calendar_url: str, *, data: Path, web_port: int) -> Path:
    low = 20000 + (os.getpid() % 2000) * 4
    keys = {user: paramiko.RSAKey.generate(2048) for user in (BOOKER, OTHER)}
    lines = [
        "[host]", 'name = "devbox1"', 'timezone = "UTC"', "",
        "[[calendar]]", f'url = "{calendar_url}"', f'username = "{BOOKER}"', "",
        "[gpus]", "count = 2", "",
        "[defaults]", 'template = "debian-ssh"', "gpus = 1", "",
        "[engine]", 'name = "podman"', 'runtime = "runc"', 'storage_driver = "overlay"', "",
        "[storage]", f'data_root = "{data}"', "",
        "[ssh]", f"port_min = {low}", f"port_max = {low + 19}", "",
        "[daemon]", "poll_seconds = 10", f'state_dir = "{folder / "state"}"', "",
        "[web]", "enabled = true", f'listen = "127.0.0.1:{web_port}"', 'auth = "none"', "",
    ]
    for number, (user, key) in enumerate(keys.items()):
        lines += [f"[users.{user}]", f"uid = {2001 + number}", f'email = ["{user}@lab.example"]',
                  f'ssh_keys = ["{key.get_name()} {key.get_base64()} {user}"]', ""]
    path = folder / "gpubook.toml"
    path.write_text("\n".join(lines))
    return path


def answers(calendar_url: str) -> dict[str, str]:
    """Each booking's X-GPUBOOK-STATUS as the server holds it now."""
    found = {}
    for booked in bookings(datetime.now(UTC)):
        answer = requests.get(f"{calendar_url}{booked.name}.ics", timeout=10)
        if answer.ok:
            event = icalendar.Calendar.from_ical(answer.content).walk("VEVENT")[0]
            found[booked.uid] = str(event.get("X-GPUBOOK-STATUS", ""))
    return found


def remove_bookings(data: Path) -> None:
    """The daemon leaves its containers running when it stops (a restarted daemon adopts them): the
    running booking's container is removed here, by its booking label, and the bookings' data
    folders (owned by the account's sub-UIDs, hence inside podman's user namespace)."""
    for booked in bookings(datetime.now(UTC)):
        found = subprocess.run(["podman", "ps", "-a", "-q", "--filter", f"label=gpubook.booking={booked.uid}"],
                               capture_output=True, text=True).stdout.split()
        if found:
            subprocess.run(["podman", "rm", "-f", "-t", "1", *found], capture_output=True)
    subprocess.run(["podman", "unshare", "rm", "-rf", str(data)], capture_output=True)


# -- Thunderbird ----------------------------------------------------------------------------------


def first_hour(now: datetime) -> int:
    """The first of the VISIBLE_HOURS the week view shows: from 4 hours before now."""
    return max(0, min(now.hour - 4, 24 - VISIBLE_HOURS))


def thunderbird_profile(folder: Path, *, calendar_url: str, feed_url: str, now: datetime) -> Path:
    """A profile with no first-run wizard, the CalDAV calendar and the availability subscription, in
    a 1600x1000 window whose event list (unifinder) is closed; the work week, UTC, Monday first."""
    profile = folder / "thunderbird"
    profile.mkdir()
    prefs = {
        "mail.provider.suppress_dialog_on_startup": True, "mail.shell.checkDefaultClient": False,
        "mailnews.start_page.enabled": False, "app.update.enabled": False,
        "datareporting.policy.dataSubmissionEnabled": False, "toolkit.telemetry.reportingpolicy.firstRun": False,
        "mailnews.start_page_override.mstone": "ignore", "mail.rights.override": True,
        "calendar.timezone.local": "UTC",
        "calendar.timezone.useSystemTimezone": False, "calendar.week.start": 1,
        "calendar.view.daystarthour": first_hour(now), "calendar.view.dayendhour": first_hour(now) + VISIBLE_HOURS,
        "calendar.view.visiblehours": VISIBLE_HOURS,
        "calendar.registry.gpus.type": "caldav", "calendar.registry.gpus.uri": calendar_url,
        "calendar.registry.gpus.name": "GPU bookings", "calendar.registry.gpus.color": "#3a7bd5",
        "calendar.registry.gpus.cache.enabled": False, "calendar.registry.gpus.calendar-main-in-composite": True,
        "calendar.registry.free.type": "ics", "calendar.registry.free.uri": feed_url,
        "calendar.registry.free.name": "devbox1 GPUs: busy", "calendar.registry.free.color": "#8a8a8a",
        "calendar.registry.free.readOnly": True, "calendar.registry.free.calendar-main-in-composite": True,
    }
    (profile / "user.js").write_text("".join(f"user_pref({json.dumps(k)}, {json.dumps(v)});\n"
                                             for k, v in prefs.items()))
    window = {"screenX": "0", "screenY": "0", "width": str(SCREEN[0]), "height": str(SCREEN[1]),
              "sizemode": "normal"}
    # What Thunderbird persists when the event list is closed by hand: its box and splitter hidden.
    unchecked, hidden = {"checked": "-moz-missing\n"}, {"hidden": ""}
    (profile / "xulstore.json").write_text(json.dumps({"chrome://messenger/content/messenger.xhtml": {
        "messengerWindow": window, "bottom-events-box": hidden, "calendar-view-splitter": hidden,
        "calShowUnifinder": unchecked, "calendar_show_unifinder_command": unchecked,
        "calendar_toggle_workdays_only_command": {"checked": "true"}}}))
    return profile


@contextlib.contextmanager
def xvfb() -> Iterator[dict[str, str]]:
    """Xvfb on a display number it picks itself (-displayfd: written once it accepts clients)."""
    read_end, write_end = os.pipe()
    process = subprocess.Popen(["Xvfb", "-displayfd", str(write_end), "-screen", "0", f"{SCREEN[0]}x{SCREEN[1]}x24",
                                "-nolisten", "tcp"], pass_fds=(write_end,), stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    os.close(write_end)
    try:
        with os.fdopen(read_end) as numbers:
            number = numbers.readline().strip()
        if not number:
            raise SystemExit("client_screenshots: Xvfb did not start")
        yield {**os.environ, "DISPLAY": f":{number}"}
    finally:
        process.terminate()
        process.wait(timeout=10)


def xdotool(env: dict[str, str], *args: str) -> str:
    return subprocess.run(["xdotool", *args], env=env, capture_output=True, text=True).stdout.strip()


def save_png(env: dict[str, str], out: Path, *, window: str = "root", crop: tuple[int, int, int, int] | None = None
             ) -> None:
    """The window as an 8-bit PNG (small enough for docs/), cropped to (width, height, left, top)."""
    shot = out.with_suffix(".full.png")
    subprocess.run(["import", "-window", window, str(shot)], env=env, check=True)
    crop_args = ["-crop", "{}x{}+{}+{}".format(*crop), "+repage"] if crop else []
    subprocess.run(["convert", str(shot), *crop_args, "-colors", "96", f"PNG8:{out}"], check=True)
    shot.unlink()
    print(f"client_screenshots: wrote {out} ({out.stat().st_size // 1024} KiB)")


def thunderbird(folder: Path, out: Path, *, calendar_url: str, feed_url: str, now: datetime) -> None:
    profile = thunderbird_profile(folder, calendar_url=calendar_url, feed_url=feed_url, now=now)
    with xvfb() as env:
        env = {k: v for k, v in env.items() if k != "MOZ_HEADLESS"} | {"HOME": str(folder / "home")}
        # MOZ_HEADLESS (set in some shells) would draw nothing on the display.
        with (folder / "thunderbird.log").open("wb") as log:
            process = subprocess.Popen(["thunderbird", "--no-remote", "--profile", str(profile), "-calendar"],
                                       env=env, stdout=log, stderr=log, stdin=subprocess.DEVNULL)
        try:
            wait_for("Thunderbird's calendar window",
                     lambda: xdotool(env, "search", "--name", "Calendar - Mozilla Thunderbird").split(), timeout=120)
            # Both calendars load in the background: the ICS feed once, CalDAV with its first REPORT.
            time.sleep(40)
            subprocess.run(["import", "-window", "root", str(folder / "thunderbird.png")], env=env, check=True)
            save_png(env, out / "clients-thunderbird-week.png", crop=WEEK_CROP)
            for booked in bookings(now):
                if booked.name != "accepted":
                    event_dialog(env, out / f"clients-thunderbird-{booked.name}.png", title=booked.title,
                                 start=booked.start, now=now)
        finally:
            process.terminate()
            process.wait(timeout=30)


def event_dialog(env: dict[str, str], out: Path, *, title: str, start: datetime, now: datetime) -> None:
    """Double-click the event's box, an hour into it, and save the summary dialog Thunderbird opens
    (the description's block, the host's attendee) as clients-thunderbird-<uid>.png. Overlapping
    events share the day's column, so places across it are tried; other dialogs are put away."""
    y = GRID_TOP + int((start.hour - first_hour(now) + 1) * HOUR_HEIGHT)
    for fraction in (0.85, 0.65, 0.45, 0.25, 0.1):
        x = GRID_LEFT + int((start.weekday() + fraction) * COLUMN_WIDTH)
        xdotool(env, "mousemove", str(x), str(y), "click", "--repeat", "2", "--delay", "150", "1")
        time.sleep(5)
        found = xdotool(env, "search", "--name", f"^{title}$").split()
        if found:
            xdotool(env, "windowsize", found[-1], "560", "600")  # room for the description's block
            time.sleep(2)
            save_png(env, out, window=found[-1])
            xdotool(env, "windowunmap", found[-1])
            return
        for other in xdotool(env, "search", "--name", "^(alice|bob|busy):").split():
            xdotool(env, "windowunmap", other)
    print(f"client_screenshots: the dialog of {title!r} did not open (no picture of it)")


# -- khal -----------------------------------------------------------------------------------------


def khal_texts(folder: Path, out: Path, *, calendar_url: str, feed_url: str) -> None:
    """vdirsyncer syncs the calendar (caldav) and the feed (http) into vdirs; khal reads them."""
    base = folder / "khal"
    for name in ("bookings", "free", "status"):
        (base / name).mkdir(parents=True)
    config = base / "vdirsyncer.conf"
    config.write_text(f"""[general]
status_path = "{base / 'status'}"

[pair bookings]
a = "bookings_remote"
b = "bookings_local"
collections = null

[storage bookings_remote]
type = "caldav"
url = "{calendar_url}"
username = "{BOOKER}"
password = "-"

[storage bookings_local]
type = "filesystem"
path = "{base / 'bookings'}"
fileext = ".ics"

[pair free]
a = "free_remote"
b = "free_local"
collections = null

[storage free_remote]
type = "http"
url = "{feed_url}"

[storage free_local]
type = "filesystem"
path = "{base / 'free'}"
fileext = ".ics"
""")
    khal_config = base / "khal.conf"
    khal_config.write_text(f"""[calendars]
[[bookings]]
path = {base / 'bookings'}
color = dark blue
[[free]]
path = {base / 'free'}
color = dark gray
readonly = True

[locale]
timeformat = %H:%M
dateformat = %a %Y-%m-%d
longdateformat = %a %Y-%m-%d
datetimeformat = %Y-%m-%d %H:%M
longdatetimeformat = %Y-%m-%d %H:%M
local_timezone = UTC
default_timezone = UTC
firstweekday = 0
""")
    # LC_TIME=C: Python maps C.UTF-8 to en_US.UTF-8, which hosts without that locale lack (khal calendar).
    env = {**os.environ, "XDG_DATA_HOME": str(base / "data"), "XDG_CONFIG_HOME": str(base / "config"),
           "LC_TIME": "C"}
    for step in (["discover"], ["sync"]):
        subprocess.run(["vdirsyncer", "-c", str(config), *step], env=env, check=True, capture_output=True)
    listed = subprocess.run(["khal", "-c", str(khal_config), "list", "--format",
                             "{start-end-time-style} {status}{title} [{calendar}]", "today", "2d"],
                            env=env, check=True, capture_output=True, text=True).stdout
    write_text(out / "clients-khal-list.txt", listed)
    write_text(out / "clients-ikhal.txt", ikhal(env, khal_config))


def ikhal(env: dict[str, str], khal_config: Path) -> str:
    """ikhal in a detached tmux session of 100x24, captured once it has drawn today."""
    server = f"gpubook-screenshots-{os.getpid()}"
    tmux = ["tmux", "-L", server]
    command = ["env", *(f"{k}={env[k]}" for k in ("XDG_DATA_HOME", "XDG_CONFIG_HOME", "LC_TIME")),
               "TERM=xterm-256color", "ikhal", "-c", str(khal_config)]
    subprocess.run([*tmux, "new-session", "-d", "-s", "ikhal", "-x", "100", "-y", "24", *command], check=True)
    try:
        def drawn() -> str:
            text = subprocess.run([*tmux, "capture-pane", "-p", "-t", "ikhal"], capture_output=True,
                                  text=True).stdout
            return text if "Today" in text else ""
        return str(wait_for("ikhal's first screen", drawn, timeout=30, interval=0.5))
    finally:
        subprocess.run([*tmux, "kill-server"], check=False)


def write_text(path: Path, text: str) -> None:
    path.write_text("\n".join(line.rstrip() for line in text.rstrip().splitlines()) + "\n")
    print(f"client_screenshots: wrote {path}")


# -- all of it ------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-root", type=Path, required=True,
                        help="a nosuid,nodev folder for the bookings' data (gpubook refuses others)")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "images")
    parser.add_argument("--keep", action="store_true", help="keep the working folder (logs, profile)")
    args = parser.parse_args()
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if missing:
        raise SystemExit(f"client_screenshots: not installed: {', '.join(missing)}")
    args.out.mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix="gpubook-screenshots-"))
    data = Path(tempfile.mkdtemp(prefix="screenshots-", dir=args.data_root))
    daemon = None
    try:
        with radicale(folder / "collections") as server:
            calendar_url = f"{server}/{BOOKER}/gpus/"
            requests.request("MKCALENDAR", calendar_url, timeout=10).raise_for_status()
            now = datetime.now(UTC)
            for booked in bookings(now):
                requests.put(f"{calendar_url}{booked.name}.ics", timeout=10, data=booking_text(booked).encode(),
                             headers={"Content-Type": "text/calendar; charset=utf-8"}).raise_for_status()
            web_port = free_port()
            config = write_config(folder, calendar_url, data=data, web_port=web_port)
            with (folder / "daemon.log").open("wb") as log:
                daemon = subprocess.Popen([sys.executable, "-m", "gpubook.scheduler.commands.cli", "run", "--config",
                                           str(config)], cwd=ROOT, stdout=log, stderr=log, stdin=subprocess.DEVNULL,
                                          env={**os.environ, "PYTHONPATH": str(ROOT)})
            wanted = {"running@screenshots": "running", "refused@screenshots": "rejected",
                      "accepted@screenshots": "accepted"}
            wait_for(f"the daemon's answers {wanted} (log: {folder / 'daemon.log'})",
                     lambda: answers(calendar_url) == wanted, timeout=300, interval=2)
            feed_url = f"http://127.0.0.1:{web_port}/free.ics"
            wait_for("busy blocks in /free.ics", lambda: b"BEGIN:VEVENT" in requests.get(feed_url, timeout=10).content,
                     timeout=60)
            thunderbird(folder, args.out, calendar_url=calendar_url, feed_url=feed_url, now=now)
            khal_texts(folder, args.out, calendar_url=calendar_url, feed_url=feed_url)
    finally:
        if daemon is not None:
            daemon.terminate()
            daemon.wait(timeout=120)
        remove_bookings(data)
        if args.keep:
            print(f"client_screenshots: kept {folder}")
        else:
            shutil.rmtree(folder, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
