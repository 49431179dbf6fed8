"""Start → SSH for bookings made 1 minute, 5 minutes and 1 hour before their start, whose template
image is only in the registry: `gpubook run` as a process (real Radicale, rootless podman), the
event made before the daemon starts (its first pass sees it, as a poll right after the booking would).

Each case starts from a store without the image (removed, its layers with it) and a fresh daemon
and state folder, so each pays its own pull and warm-up. Measured by this script: the booker's
SSH login (paramiko, the booker's key) after the start; when the image became ready (the status
file's preparation row, set by the daemon) against the start; the container's StartedAt against
that; and the event's lines while it waited ("preparing image …: 4.1 of 9.3 GB, ready about …").

"1 hour ahead" is booked an hour ahead; once its image is ready (and warm) the event is moved to
90 s from then: from that point the daemon's state is what the hour would have left it with (the
image prepared, nothing of the booking made yet; it arms the container LEAD = 60 s before the
start), without waiting out the rest of the hour.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path

import paramiko

from gpubook.runtime.engines import Engine, container_name
from gpubook.runtime.templates.catalog import default_templates_dir
from gpubook.scheduler.state import State
from tests.kits import registry_kit, servers
from tests.kits.daemon_kit import DaemonProcess, book, description, edit, event_text, soon, try_login, write_config

SENTENCE = re.compile(r"preparing image [^\n]*")


@dataclass
class Case:
    lead: str  # "1 min", "5 min", "1 h"
    login: float  # seconds from the start to the booker's SSH login
    ready: float  # seconds from the start to the image being ready (negative: before it)
    started_after_ready: float | None  # seconds from ready to the container's StartedAt (when held)
    sentences: list[str] = field(default_factory=list)  # the event's progress lines seen after the start
    armed: bool = False
    estimate: float | None = None  # seconds the first "ready about" after the start was off (later: +)

    def line(self) -> str:
        held = (f"held {self.ready:.1f} s, started {self.started_after_ready:.2f} s after ready; "
                if self.ready > 0 and self.started_after_ready is not None else
                f"ready {-self.ready:.0f} s before the start{', armed' if self.armed else ''}; ")
        seen = ""
        if self.sentences:
            seen = f"; event said: {self.sentences[0]!r}" + (
                f" … {self.sentences[-1]!r}" if len(self.sentences) > 1 else "")
        if self.estimate is not None:
            seen += f"; its first 'ready about' after the start was {abs(self.estimate):.0f} s " + (
                "early" if self.estimate < 0 else "late")
        return f"booked {self.lead} ahead: login {self.login:.2f} s after the start ({held.rstrip('; ')}){seen}"


def booking_ahead(engine: Engine, image: str, auth_file: Path, *, lead: timedelta, label: str,
                  forget: Callable[[str], None], moved: bool = False) -> Case:
    """One booking of a template naming `image`, made `lead` ahead; `forget` removes the image
    from the store first (under every name it has there)."""
    forget(image)
    key = paramiko.ECDSAKey.generate(bits=256)
    booking = f"bench-{label.replace(' ', '')}@gpubook"
    with tempfile.TemporaryDirectory(prefix="gpubench-") as name, servers.running(servers.radicale) as radicale:
        folder = Path(name)
        templates = folder / "templates"
        templates.mkdir()
        shutil.copy(default_templates_dir() / "debian-ssh.toml", templates)
        (templates / "bench-image.toml").write_text(f'image = "{image}"\ncuda = "none"\nhas_sshd = true\n')
        calendar = radicale.new_calendar()
        config = write_config(folder, str(calendar.url), keys={"alice": key}, poll_seconds=10)
        with config.open("a") as appended:
            appended.write(f'\n[templates]\ndir = "{templates}"\n\n[images]\nauth_file = "{auth_file}"\n')
        start = soon(lead.total_seconds())
        length = timedelta(minutes=10)
        book(calendar, booking, user="alice", start=start, end=start + length, description="template: bench-image\n")
        daemon = DaemonProcess(config).start()
        state_dir = folder / "state"
        try:
            if moved:
                _wait(lambda: "image: ready" in description(calendar, booking), 3600, "the image ready", daemon)
                start = soon(90)
                edit(calendar, booking, event_text(booking, user="alice", start=start, end=start + length,
                                                   description="template: bench-image\n"))
            sentences: list[str] = []
            estimates: list[datetime] = []
            while datetime.now(UTC) < start:
                time.sleep(0.005)
            login, armed = _login(state_dir, booking, key, start, daemon, calendar, sentences, estimates)
            row = _wait(lambda: _ready_row(state_dir), 120, "the status saying ready", daemon)
            ready = datetime.fromisoformat(row["since"])
            started = _started_at(engine, booking)
            return Case(lead=label, login=login, ready=(ready - start).total_seconds(),
                        started_after_ready=(started - ready).total_seconds() if started else None,
                        sentences=sentences, armed=armed,
                        estimate=(ready - estimates[0]).total_seconds() if estimates else None)
        finally:
            daemon.stop()
            engine.stop(container_name(booking), 0)


def _login(state_dir: Path, booking: str, key: paramiko.PKey, start: datetime, daemon: DaemonProcess,
           calendar: object, sentences: list[str], estimates: list[datetime]) -> tuple[float, bool]:
    """Seconds from `start` to the booker's login; whether the container was armed ahead. While it
    waits, the event's progress lines are collected (every 2 s: a calendar read costs)."""
    port, client, looked = None, None, 0.0
    while (state_dir / "state.sqlite").exists() is False:
        time.sleep(0.05)
    with State(state_dir / "state.sqlite") as state:
        while client is None:
            port = port or state.ports().get(booking)
            client = try_login(port, "alice", key, timeout=2) if port else None
            if client is None and time.monotonic() - looked > 2:
                looked = time.monotonic()
                found = SENTENCE.findall(description(calendar, booking))  # type: ignore[arg-type]
                if found and (not sentences or sentences[-1] != found[-1]):
                    sentences.append(found[-1])
                if not estimates and (about := _estimate(state_dir)) is not None:
                    estimates.append(about)
            if client is None:
                time.sleep(0.01)
            if (datetime.now(UTC) - start).total_seconds() > 3600:
                raise SystemExit(f"{booking}: no login within an hour of its start\n{daemon.tail()}")
    seconds = (datetime.now(UTC) - start).total_seconds()
    client.close()
    armed = f"booking {booking}: its container runs ahead of its start" in daemon.log.read_text()
    return seconds, armed


def _ready_row(state_dir: Path) -> dict | None:  # type: ignore[type-arg]
    try:
        status = json.loads((state_dir / "daemon-status.json").read_text())
    except (OSError, ValueError):
        return None
    rows = [r for r in (status.get("images") or {}).get("preparations") or ()
            if r["template"] == "bench-image" and r["state"] == "ready"]
    return rows[0] if rows else None


def _estimate(state_dir: Path) -> datetime | None:
    """The preparation's "ready about" in the status file (to the second), while it is being made."""
    try:
        status = json.loads((state_dir / "daemon-status.json").read_text())
    except (OSError, ValueError):
        return None
    for row in (status.get("images") or {}).get("preparations") or ():
        if row["template"] == "bench-image" and row["state"] != "ready" and row.get("ready_about"):
            return datetime.fromisoformat(row["ready_about"])
    return None


def _started_at(engine: Engine, booking: str) -> datetime | None:
    text = registry_kit.podman(engine, "inspect", "--format", "{{.State.StartedAt}}", container_name(booking)).strip()
    found = re.match(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)(\.\d+)? ([+-]\d{4})", text)
    if found is None:
        return None
    fraction = (found.group(2) or ".0")[:7]
    return datetime.strptime(f"{found.group(1)}{fraction} {found.group(3)}", "%Y-%m-%d %H:%M:%S.%f %z").astimezone(UTC)


def _wait(check, timeout: float, what: str, daemon: DaemonProcess):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.2)
    raise SystemExit(f"timed out after {timeout:.0f} s waiting for {what}\n{daemon.tail()}")


def cases(engine: Engine, image: str, auth_file: Path, *, forget: Callable[[str], None]) -> list[Case]:
    """The three leads for one image, one after the other."""
    return [booking_ahead(engine, image, auth_file, lead=timedelta(minutes=1), label="1 min", forget=forget),
            booking_ahead(engine, image, auth_file, lead=timedelta(minutes=5), label="5 min", forget=forget),
            booking_ahead(engine, image, auth_file, lead=timedelta(hours=1), label="1 h", forget=forget, moved=True)]
