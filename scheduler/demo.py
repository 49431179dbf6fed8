"""`gpubook demo`: gpubook on embedded defaults, with nothing to set up.

It starts a Radicale on 127.0.0.1 with a temporary calendar, fills it with a few bookings (one for
the current user starting in 10 seconds, a recurring one, and some that must be rejected), writes a
config for a host with a static inventory of two GPUs, and shows the plan gpubook makes of them.
Everything is removed at the end.
"""

from __future__ import annotations

import getpass
import os
import tempfile
import time
from datetime import datetime, timedelta
from pathlib import Path

import caldav
from icalendar import Calendar, Event, vCalAddress

from scheduler import config as config_module
from scheduler import plan as plan_module
from scheduler import service
from scheduler.embedded import RadicaleServer


def _booker_name() -> str:
    name = getpass.getuser()
    return name if config_module.USER_NAME.match(name) and name != "root" else "demo"


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


def demo_config(folder: Path, calendar_url: str, booker: str) -> Path:
    users = {booker: os.getuid() if os.getuid() else 1000, "alice": 2001, "bob": 2002}
    lines = [
        '[host]', 'name = "localhost"', f'timezone = "{config_module._system_timezone()}"', '',
        '[[calendar]]', f'url = "{calendar_url}"', 'gpus = "all"', '',
        '[gpus]', 'count = 2', '',
        '[defaults]', 'template = "debian-ssh"', 'gpus = 1', 'max_hours = 72', '',
    ]
    for name, uid in users.items():
        lines += [f"[users.{name}]", f'email = ["{name}@lab.example"]', f"uid = {uid}", ""]
    path = folder / "gpubook.toml"
    path.write_text("\n".join(lines))
    return path


def run(*, keep_running: bool = False) -> int:
    booker = _booker_name()
    with tempfile.TemporaryDirectory(prefix="gpubook-demo-") as folder, RadicaleServer() as server:
        # Radicale's "none" authentication takes any name; a name is needed to own a calendar.
        client = caldav.DAVClient(url=server.url, username="demo", password="demo")  # type: ignore[operator]  # noqa: S106 - ignored by "none" auth
        principal_calendar = client.principal().make_calendar(name="devbox", cal_id="devbox")
        now = datetime.now().astimezone()
        for text in demo_events(now, booker):
            principal_calendar.save_event(text)
        calendar_url = str(principal_calendar.url)
        config_path = demo_config(Path(folder), calendar_url, booker)
        loaded = config_module.load(config_path)
        print(f"gpubook demo: a Radicale calendar at {calendar_url} with {len(demo_events(now, booker))} bookings")
        print(f"gpubook demo: config {config_path} (a host with 2 GPUs, users {', '.join(sorted(loaded.users))})\n")
        result = service.plan_window(loaded, window_start=now, window_end=now + timedelta(days=7),
                                     now=now)
        print(service.describe_plan(result, timezone=loaded.host.timezone))
        summary = plan_module.to_json(result.plan)
        print(f"\n{len(summary['accepted'])} accepted, {len(summary['rejected'])} rejected.")
        if keep_running:
            print(f"\nThe calendar stays at {calendar_url} (no password); try:\n"
                  f"  gpubook bookings --config {config_path}\nCtrl-C ends the demo.")
            try:
                while True:
                    time.sleep(3600)
            except KeyboardInterrupt:
                pass
    return 0
