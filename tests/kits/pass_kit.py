"""A real `Pass` on a tiny host: what the pass tests share (test_pass_bounded, test_reclaim_pass,
test_cluster_pass, test_images_prepare, test_writeback_restart, test_jupyter_templates).

The host is a class meeting the Host protocol whose steps the test holds up with events and
records in the order they happened; events are iCalendar text read by the real BookingReader.
"""

from __future__ import annotations

import threading
from datetime import UTC, datetime, timedelta
from pathlib import Path

from gpubook.runtime.engines import ContainerInfo, ExecResult, container_name
from gpubook.runtime.templates.catalog import load_all
from gpubook.scheduler import config as config_module
from gpubook.scheduler.apply.passes import Pass
from gpubook.scheduler.core.bookings import Booking, Rejection
from gpubook.scheduler.core.plan import LOCAL
from gpubook.scheduler.hosts import Started, StartRequest
from gpubook.scheduler.hosts.local import OneMachine
from gpubook.scheduler.state import State
from tests.kits.booking_kit import raw, read, vcalendar, vevent

NOW = datetime(2026, 11, 23, 12, tzinfo=UTC)


DEAD_URL = "http://127.0.0.1:9/lab/devbox1/"  # never written to: these passes run without write-back


HOLD = 30.0  # a fail-safe only: how long a held step waits before it gives up (the test then fails)


class Machine:
    """A host meeting the Host protocol; `steps` records what happened, in order."""

    def __init__(self, gpus: tuple[int, ...] = (0, 1)) -> None:
        self.name, self.gpus, self.driver_version = LOCAL, gpus, None
        self.containers: dict[str, ContainerInfo] = {}
        self.steps: list[tuple[str, str]] = []
        self.failing: dict[str, Exception] = {}  # booking id → what its start raises
        self.release_exec = threading.Event()  # an exec (the warning notice) waits for this
        self.exec_began = threading.Event()
        self._lock = threading.Lock()

    def step(self, what: str, booking_id: str) -> None:
        with self._lock:
            self.steps.append((what, booking_id))

    def list(self) -> list[ContainerInfo]:
        return list(self.containers.values())

    def inspect(self, name: str) -> ContainerInfo | None:
        return self.containers.get(name)

    def start(self, request: StartRequest) -> Started:
        self.step("start", request.booking_id)
        if request.booking_id in self.failing:
            raise self.failing[request.booking_id]
        info = running(request.booking_id, request.gpus, end=request.end, port=request.port)
        self.containers[info.name] = info
        self.step("running", request.booking_id)
        return Started(info=info, seconds_to_ssh=0.0)

    def stop(self, name: str, grace: float) -> None:
        self.containers.pop(name, None)

    def exec(self, name: str, argv: object, *, timeout: float | None = None) -> ExecResult:
        booking_id = self.containers[name].booking_id
        self.step("exec", booking_id)
        self.exec_began.set()
        self.release_exec.wait(HOLD)  # a booker's terminal holding the notice up
        self.step("exec returned", booking_id)
        return ExecResult(0, "", "")


def running(booking_id: str, gpus: tuple[int, ...], *, end: datetime, port: int | None = 2200) -> ContainerInfo:
    return ContainerInfo(name=container_name(booking_id), id=f"c-{booking_id}", state="running", image="i",
                         booking_id=booking_id, user="alice", gpus=gpus, end=end, spec_hash="h", port=port,
                         template="debian-ssh", host=LOCAL)


def make_config(tmp_path: Path, *, ports: tuple[int, int] = (2200, 2299),
                calendars: tuple[str, ...] = (DEAD_URL,)) -> config_module.Config:
    path = tmp_path / "gpubook.toml"
    listed = "".join(f'[[calendar]]\nurl = "{url}"\n' for url in calendars)
    path.write_text(f'[host]\nname = "devbox1"\ntimezone = "UTC"\n{listed}'
                    '[engine]\nname = "podman"\n[gpus]\ncount = 2\n'
                    '[defaults]\ntemplate = "debian-ssh"\ngpus = 1\nwarn_minutes = 15\n'
                    f'[ssh]\nport_min = {ports[0]}\nport_max = {ports[1]}\n'
                    '[users.alice]\nuid = 2001\n[users.bob]\nuid = 2002\n')
    return config_module.load(path)


def event(uid: str, start: datetime, end: datetime, *, user: str = "alice", extra: tuple[str, ...] = ()) -> str:
    return vevent(uid, f"DTSTART:{start:%Y%m%dT%H%M%SZ}", f"DTEND:{end:%Y%m%dT%H%M%SZ}",
                  f"SUMMARY:{user} debian-ssh", *extra)


def bookings(config: config_module.Config, *events: str, calendar_url: str = DEAD_URL,
             now: datetime = NOW) -> list[Booking | Rejection]:
    objects = [raw(vcalendar(text), name=f"e{number}", calendar_url=calendar_url)
               for number, text in enumerate(events)]
    expansion = read(*objects, config=config, calendar_url=calendar_url, start=now - timedelta(days=1),
                     end=now + timedelta(days=7))
    return list(expansion.occurrences)


def make_pass(config: config_module.Config, machine: Machine, state: State) -> Pass:
    passes = Pass(config, backend=OneMachine(machine, server=config.host.name), state=state,
                  templates=load_all(None))
    passes.patience = HOLD
    return passes
