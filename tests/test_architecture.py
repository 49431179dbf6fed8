"""The house's registration paths (docs/ARCHITECTURE.md): a fake container engine and a fake
calendar source, each added with one registration line and nothing else, then used through the
real config, `gpubook doctor`'s preflight and a real pass (plan, decide, the Stop handler, the
write-back through the source's own writer).

The fakes are tiny classes meeting the real protocols; nothing of gpubook is patched.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import ClassVar

import pytest

from gpubook.runtime import engines, ssh
from gpubook.runtime.checks import Check
from gpubook.runtime.engines import ContainerInfo, EngineOptions, EngineSettings, container_name
from gpubook.runtime.templates import load_all
from gpubook.scheduler import config as config_module
from gpubook.scheduler import sources
from gpubook.scheduler.apply.passes import Pass
from gpubook.scheduler.core import decide
from gpubook.scheduler.hosts.local import LocalHost
from gpubook.scheduler.service import Calendars
from gpubook.scheduler.sources import BaseSource, EventRef, PollStats, RawObject, Snapshot, WriteResult
from gpubook.scheduler.sources.block import Outcome
from gpubook.scheduler.state import State
from tests.kits.daemon_kit import IdleEngine

NOW = datetime(2026, 11, 23, 12, tzinfo=UTC)
URL = "http://127.0.0.1:9/lab/devbox1/"  # never connected to: the fake source holds the events


class FakeEngine(IdleEngine):
    """An engine that keeps its containers in a dict."""

    name = "fake"
    containers: ClassVar[dict[str, ContainerInfo]] = {}
    stopped: ClassVar[list[str]] = []

    def __init__(self, settings: EngineSettings, options: EngineOptions) -> None:
        self.settings = settings

    def preflight(self) -> list[Check]:  # type: ignore[override]
        return [Check("engine", True, "fake engine, nothing to check")]

    def list(self) -> list[ContainerInfo]:
        return list(self.containers.values())

    def inspect(self, name: str) -> ContainerInfo | None:
        return self.containers.get(name)

    def stop(self, name: str, grace: float) -> None:
        if self.containers.pop(name, None) is not None:
            self.stopped.append(name)


class FakeWriter:
    written: ClassVar[list[tuple[str, Outcome]]] = []

    def write(self, ref: EventRef, outcome: Outcome) -> WriteResult:
        self.written.append((ref.uid, outcome))
        return WriteResult(written=True, reason="written", etag="2")

    def close(self) -> None: ...


class FakeSource(BaseSource):
    """A calendar held in memory (`events`: UID → iCalendar text), with a writer of its own."""

    events: ClassVar[dict[str, str]] = {}

    def __init__(self, url: str, *, username: str | None = None, password: str | None = None,
                 timeout: float = 30.0) -> None:
        self.url = url

    def poll(self) -> Snapshot:
        objects = {f"{self.url}{uid}.ics": RawObject(href=f"{self.url}{uid}.ics", etag="1", ical=text,
                                                     calendar_url=self.url) for uid, text in self.events.items()}
        return Snapshot(calendar_url=self.url, objects=objects, changed=True, stats=PollStats(method="fake"))

    def open_writer(self, *, timezone: str) -> FakeWriter:
        return FakeWriter()


def _event(uid: str, start: datetime, end: datetime) -> str:
    return ("BEGIN:VCALENDAR\r\nVERSION:2.0\r\nPRODID:-//gpubook tests//EN\r\nBEGIN:VEVENT\r\n"
            f"UID:{uid}\r\nDTSTAMP:20261101T120000Z\r\nDTSTART:{start:%Y%m%dT%H%M%SZ}\r\n"
            f"DTEND:{end:%Y%m%dT%H%M%SZ}\r\nSUMMARY:alice debian-ssh\r\nEND:VEVENT\r\nEND:VCALENDAR\r\n")


@pytest.fixture
def registered() -> object:
    engines.register("fake", FakeEngine)  # the one registration line for an engine
    sources.register("fake", f"{__name__}:FakeSource")  # ... and one for a calendar source
    yield
    engines.ENGINES.pop("fake")
    sources.SOURCE_KINDS.pop("fake")
    FakeEngine.containers.clear()
    FakeEngine.stopped.clear()
    FakeWriter.written.clear()
    FakeSource.events.clear()


def _config(tmp_path: Path) -> config_module.Config:
    path = tmp_path / "gpubook.toml"
    path.write_text(f'[host]\nname = "devbox1"\ntimezone = "UTC"\n[[calendar]]\nurl = "{URL}"\nkind = "fake"\n'
                    '[engine]\nname = "fake"\n[gpus]\ncount = 2\n[users.alice]\nuid = 2001\n')
    return config_module.load(path)


def test_an_unregistered_engine_or_source_is_refused_by_the_config(tmp_path: Path) -> None:
    with pytest.raises(config_module.ConfigError) as refused:
        _config(tmp_path)
    assert 'engine.name: must be "podman" or "docker"' in str(refused.value)
    assert "calendar[0].kind" in str(refused.value)


def test_a_registered_engine_and_source_run_a_pass(tmp_path: Path, registered: object) -> None:
    config = _config(tmp_path)
    engine = engines.make_engine(config.engine)
    assert isinstance(engine, FakeEngine)
    assert engines.preflight(config.engine) == [Check("engine", True, "fake engine, nothing to check")]

    # alice's booking ended a minute ago; its container still runs: the pass stops it and the
    # source's own writer gets "ended".
    start, end = NOW - timedelta(hours=2), NOW - timedelta(minutes=1)
    FakeSource.events["b1"] = _event("b1", start, end)
    FakeEngine.containers[container_name("b1")] = ContainerInfo(
        name=container_name("b1"), id="c1", state="running", image="i", booking_id="b1", user="alice",
        gpus=(0,), end=end, spec_hash="h", port=2200, template="debian-ssh")
    reading = Calendars(config).read(now=NOW)
    assert [o.id for o in reading.occurrences] == ["b1"], reading.problems

    host = LocalHost(engine=engine, gpus=(0, 1), driver_version=None,
                     probe_key=ssh.load_probe_key(tmp_path / "probe-key"), cache_dir=tmp_path / "cache")
    with State(tmp_path / "state.sqlite") as state:
        state.container_started("b1", container_name("b1"), user="alice", gpu_count=1, at=start)
        passes = Pass(config, hosts={host.name: host}, state=state, templates=load_all(None))
        result = passes.run(reading.occurrences, now=NOW, etags=reading.etags)
        passes.close()
        assert [type(a).__name__ for a in result.actions] == ["Stop"]
        assert FakeEngine.stopped == [container_name("b1")]
        assert [(uid, outcome.status) for uid, outcome in FakeWriter.written] == [("b1", "ended")]
        assert state.containers(booking_id="b1")[-1].exit_reason == "ended"
        stop = result.actions[0]
        assert isinstance(stop, decide.Stop) and stop.host == host.name
