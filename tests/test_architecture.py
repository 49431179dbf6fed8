"""The house's registration paths (docs/explanation/architecture.md): a fake container engine and a fake
calendar source, each added with one registration line and nothing else, then used through the
real config, `gpubook doctor`'s preflight and real passes (plan, decide, the Start and Stop
handlers, LocalHost's start with its spec, host key and SSH probe, the write-back through the
source's own writer).

The fakes are tiny classes meeting the real protocols; nothing of gpubook is patched. The engine
has only the core `Engine` members (no Builder, ServiceRunner or IdMapper): its "container" is an
SSH server in this process (paramiko) showing the booking's own host key and letting in the keys
the spec hands the container, so the probe LocalHost waits on is the real one.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Iterator, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import ClassVar, cast

import paramiko
import pytest

from gpubook.runtime import engines
from gpubook.runtime.booking import launch, ssh
from gpubook.runtime.checks import Check
from gpubook.runtime.engines import (
    ContainerInfo,
    ContainerSpec,
    EngineOptions,
    EngineSettings,
    ExecResult,
    container_name,
    info_from_labels,
)
from gpubook.runtime.templates.catalog import load_all
from gpubook.scheduler import config as config_module
from gpubook.scheduler import hosts as hosts_module
from gpubook.scheduler import sources
from gpubook.scheduler.apply.passes import Pass
from gpubook.scheduler.calendars import Calendars
from gpubook.scheduler.core import decide
from gpubook.scheduler.core.plan import Accepted
from gpubook.scheduler.core.topology import Topology
from gpubook.scheduler.hosts import Arms, KeepsProvenance, MovesEnd, PreparesAhead, Started, StartRequest
from gpubook.scheduler.hosts import backend as backends
from gpubook.scheduler.hosts.backend import NOTHING_SAMPLED, HostGpus, Reserved, Sampling
from gpubook.scheduler.hosts.local import LocalHost, OneMachine
from gpubook.scheduler.sources import BaseSource, EventRef, PollStats, RawObject, Snapshot, WriteResult
from gpubook.scheduler.sources.block import Outcome
from gpubook.scheduler.state import State

NOW = datetime(2026, 11, 23, 12, tzinfo=UTC)
URL = "http://127.0.0.1:9/lab/devbox1/"  # never connected to: the fake source holds the events


class _Sshd(paramiko.ServerInterface):
    """What the booking's sshd would check: its user, and the keys the spec gave the container."""

    def __init__(self, spec: ContainerSpec) -> None:
        env = dict(spec.env)
        self.user, self.keys = env["GPUBOOK_USER"], env["GPUBOOK_KEYS"]

    def get_allowed_auths(self, username: str) -> str:
        return "publickey"

    def check_auth_publickey(self, username: str, key: paramiko.PKey) -> int:
        wanted = f"{key.get_name()} {key.get_base64()}"
        if username == self.user and any(wanted in line for line in self.keys.splitlines()):
            return paramiko.AUTH_SUCCESSFUL
        return paramiko.AUTH_FAILED


class _Container:
    """A booking's "container": an SSH server on the booking's port, with the host key the spec binds."""

    def __init__(self, spec: ContainerSpec) -> None:
        [folder] = [m.source for m in spec.mounts if m.target == launch.HOST_KEY_TARGET]
        self.host_key = paramiko.Ed25519Key.from_private_key_file(str(folder / ssh.HOST_KEY_FILE))
        self.spec = spec
        self.listener = socket.create_server(("127.0.0.1", spec.port))
        self.thread = threading.Thread(target=self._serve, name=f"fake-sshd-{spec.port}", daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                connection, _ = self.listener.accept()
            except OSError:
                return  # closed: the container stopped
            with paramiko.Transport(connection) as transport:
                transport.add_server_key(self.host_key)
                try:
                    transport.start_server(server=_Sshd(self.spec))
                except (paramiko.SSHException, EOFError):
                    continue
                while transport.is_active():  # the probe logs in and hangs up
                    time.sleep(0.01)

    def stop(self) -> None:
        self.listener.close()
        self.thread.join(timeout=10)


class FakeEngine:
    """An engine with the core members only: its containers are in-process SSH servers."""

    name = "fake"
    containers: ClassVar[dict[str, ContainerInfo]] = {}
    running: ClassVar[dict[str, _Container]] = {}
    started: ClassVar[list[str]] = []
    stopped: ClassVar[list[str]] = []

    def __init__(self, settings: EngineSettings, options: EngineOptions) -> None:
        self.settings = settings

    def ensure_image(self, image: str, *, pull: bool = False) -> None: ...

    def start(self, spec: ContainerSpec) -> ContainerInfo:
        self.running[spec.name] = _Container(spec)
        info = info_from_labels(name=spec.name, id=f"fake-{spec.name}", state="running", image=spec.image,
                                labels=spec.labels())
        self.containers[spec.name] = info
        self.started.append(spec.name)
        return info

    def stop(self, name: str, grace: float) -> None:
        if (container := self.running.pop(name, None)) is not None:
            container.stop()
        if self.containers.pop(name, None) is not None:
            self.stopped.append(name)

    def list(self) -> list[ContainerInfo]:
        return list(self.containers.values())

    def inspect(self, name: str) -> ContainerInfo | None:
        return self.containers.get(name)

    def exec(self, name: str, argv: Sequence[str], *, user: str | None = None,
             timeout: float | None = None) -> ExecResult:
        return ExecResult(0, "", "")

    def logs(self, name: str, *, tail: int | None = None) -> str:
        return ""

    def preflight(self) -> list[Check]:
        return [Check("engine", True, "fake engine, nothing to check")]


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


def _event(uid: str, start: datetime, end: datetime, *, description: str = "") -> str:
    described = f"DESCRIPTION:{description}\r\n" if description else ""
    return ("BEGIN:VCALENDAR\r\nVERSION:2.0\r\nPRODID:-//gpubook tests//EN\r\nBEGIN:VEVENT\r\n"
            f"UID:{uid}\r\nDTSTAMP:20261101T120000Z\r\nDTSTART:{start:%Y%m%dT%H%M%SZ}\r\n"
            f"DTEND:{end:%Y%m%dT%H%M%SZ}\r\nSUMMARY:alice debian-ssh\r\n{described}END:VEVENT\r\nEND:VCALENDAR\r\n")


@pytest.fixture
def registered() -> object:
    engines.register("fake", FakeEngine)  # the one registration line for an engine
    sources.register("fake", f"{__name__}:FakeSource")  # ... and one for a calendar source
    yield
    engines.REGISTRY.unregister("fake")
    sources.REGISTRY.unregister("fake")
    for name in list(FakeEngine.running):
        FakeEngine.running.pop(name).stop()
    FakeEngine.containers.clear()
    FakeEngine.started.clear()
    FakeEngine.stopped.clear()
    FakeWriter.written.clear()
    FakeSource.events.clear()


def _config(tmp_path: Path, *, backend: str = "") -> config_module.Config:
    path = tmp_path / "gpubook.toml"
    path.write_text(f'[host]\nname = "devbox1"\ntimezone = "UTC"\n[[calendar]]\nurl = "{URL}"\nkind = "fake"\n'
                    '[engine]\nname = "fake"\n[gpus]\ncount = 2\n[users.alice]\nuid = 2001\n'
                    + (f'[backend]\nkind = "{backend}"\n' if backend else ""))
    return config_module.load(path)


def test_an_unregistered_engine_or_source_is_refused_by_the_config(tmp_path: Path) -> None:
    with pytest.raises(config_module.ConfigError) as refused:
        _config(tmp_path)
    assert 'engine.name: must be "podman", "docker" or "udocker"' in str(refused.value)
    assert "calendar[0].kind" in str(refused.value)


def test_a_registered_engine_and_source_run_a_pass(tmp_path: Path, registered: object) -> None:
    config = _config(tmp_path)
    engine = engines.make_engine(config.engine)
    assert isinstance(engine, FakeEngine)
    assert engines.preflight(config.engine) == [Check("engine", True, "fake engine, nothing to check")]
    # The core protocol is all a new engine needs (issue 25's udocker: no build, no chown).
    assert isinstance(engine, engines.Engine)
    assert not isinstance(engine, engines.Builder | engines.ServiceRunner | engines.IdMapper)

    # alice's booking started a minute ago: the first pass starts its container through LocalHost
    # (spec, host key, engine start, the SSH probe's login) and the source's writer gets "running";
    # a pass after its end stops the container and the writer gets "ended".
    start, end = NOW - timedelta(minutes=1), NOW + timedelta(hours=2)
    FakeSource.events["b1"] = _event("b1", start, end)
    reading = Calendars(config).read(now=NOW)
    assert [o.id for o in reading.occurrences] == ["b1"], reading.problems

    host = LocalHost(engine=engine, gpus=(0, 1), driver_version=None,
                     probe_key=ssh.load_probe_key(tmp_path / "probe-key"), cache_dir=tmp_path / "cache")
    name = container_name("b1")
    with State(tmp_path / "state.sqlite") as state:
        passes = Pass(config, backend=OneMachine(host, server=config.host.name), state=state,
                      templates=load_all(None))
        # The pass waits for its bookings' actions here: under a heavy load a stop may take longer than
        # the daemon's patience (3 s), after which its write-back would come only with a later pass.
        passes.patience = 120
        try:
            started = passes.run(reading.occurrences, now=NOW, etags=reading.etags)
            assert [type(a).__name__ for a in started.actions] == ["Start"], started
            assert FakeEngine.started == [name] and not started.failures, started.failures
            passes.writeback.settle(30)
            # "running" (the lane's write and the outbox's may both deliver it: the same outcome again)
            assert {(uid, outcome.status) for uid, outcome in FakeWriter.written} == {("b1", "running")}
            spec_port = FakeEngine.containers[name].port
            assert spec_port is not None and FakeEngine.running[name].listener.getsockname()[1] == spec_port

            written_before_stop = len(FakeWriter.written)
            after = end + timedelta(minutes=1)
            result = passes.run(reading.occurrences, now=after, etags=reading.etags)
            passes.writeback.settle(30)
        finally:
            passes.close()
        assert [type(a).__name__ for a in result.actions] == ["Stop"]
        assert FakeEngine.stopped == [name] and name not in FakeEngine.running
        # The stop pass's write-back says "ended" (the fake calendar never changes its events, so the
        # pass may also deliver "running" again from the reading it was given).
        stop_writes = [(uid, outcome.status) for uid, outcome in FakeWriter.written[written_before_stop:]]
        assert ("b1", "ended") in stop_writes, FakeWriter.written
        assert state.containers(booking_id="b1")[-1].exit_reason == "ended"
        stop = result.actions[0]
        assert isinstance(stop, decide.Stop) and stop.host == host.name


class FakeNode:
    """A node of the fake backend: its containers in a dict, SSH at once."""

    driver_version = None

    def __init__(self, name: str) -> None:
        self.name, self.gpus = name, (0, 1)
        self.containers: dict[str, ContainerInfo] = {}
        self.requests: list[StartRequest] = []

    def list(self) -> list[ContainerInfo]:
        return list(self.containers.values())

    def start(self, request: StartRequest) -> Started:
        self.requests.append(request)
        info = ContainerInfo(name=container_name(request.booking_id), id="c", state="running", image="i",
                             booking_id=request.booking_id, user=request.booker.name, gpus=request.gpus,
                             end=request.end, spec_hash="h", port=request.port, template=request.template.name,
                             host=self.name, others=request.placement[1:])
        self.containers[info.name] = info
        return Started(info=info, seconds_to_ssh=0.1)

    def stop(self, name: str, grace: float) -> None:
        self.containers.pop(name, None)

    def exec(self, name: str, argv: Sequence[str], *, timeout: float | None = None) -> ExecResult:
        return ExecResult(0, "", "")

    def inspect(self, name: str) -> ContainerInfo | None:
        return self.containers.get(name)


class FakeBackend:
    """Two nodes that every calendar books whole, reservations that are only remembered, and a
    login address of its own: the Backend protocol, nothing of gpubook patched."""

    topology = Topology(spans_nodes=True, name="the fake cloud", picks_gpus=False)
    made: ClassVar[list[FakeBackend]] = []

    def __init__(self, config: config_module.Config, parts: object) -> None:
        self.hosts = {name: FakeNode(name) for name in ("node-a", "node-b")}
        self.reserved: list[dict[str, tuple[str, ...]]] = []
        self.made.append(self)

    def refresh(self) -> str:
        return ""

    def reserve(self, accepted: Sequence[Accepted], *, now: datetime) -> Reserved:
        self.reserved.append({a.booking.id: tuple(name for name, _ in a.placement) for a in accepted})
        return Reserved({})

    def address(self, host: str) -> str:
        return f"{host}.fake.example"

    @classmethod
    def preflight(cls, config: object) -> list[Check]:
        return []

    def gpus(self) -> dict[str, HostGpus]:
        return {name: HostGpus(source="fake", count=2) for name in self.hosts}

    def sampling(self, world: object) -> Sampling:
        return NOTHING_SAMPLED

    @staticmethod
    def listed_here(engine: object) -> None:
        return None


@pytest.fixture
def fake_backend(registered: object) -> Iterator[None]:
    backends.register("fake", f"{__name__}:FakeBackend")  # the one registration line for a backend
    yield
    backends.backends.unregister("fake")
    FakeBackend.made.clear()


def test_a_registered_backend_runs_a_pass_with_the_real_plan(tmp_path: Path, fake_backend: None,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="gpubook.scheduler.apply.passes")
    config = _config(tmp_path, backend="fake")  # read from the file: the registry says what "fake" is
    backend = backends.make(config, cast(backends.Parts, None))  # what the daemon's wiring calls
    assert isinstance(backend, FakeBackend) and backends.topology_of(config) is FakeBackend.topology
    start, end = NOW - timedelta(minutes=1), NOW + timedelta(hours=2)
    FakeSource.events["wide"] = _event("wide", start, end, description="gpus: 4\\nnodes: 2")
    FakeSource.events["picky"] = _event("picky", start, end, description="gpus: 0,1")
    reading = Calendars(config, topology=backend.topology).read(now=NOW)
    with State(tmp_path / "state.sqlite") as state:
        passes = Pass(config, backend=backend, state=state, templates=load_all(None))
        # Its nodes have the required doors only: the pass says once what each missing one means.
        said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("hosts node-a, node-b")]
        assert said == [f"hosts node-a, node-b (FakeNode): {instead}" for _, instead in hosts_module.OPTIONAL]
        result = passes.run(reading.occurrences, now=NOW, etags=reading.etags)
        passes.close()
        port = state.ports()["wide"]
    # The real plan spread the booking over both nodes (the topology), the backend reserved that
    # placement, the first node started it with the whole placement, the booker is sent to the
    # backend's address; the GPU indices were refused by the convention (the topology again).
    assert [type(a).__name__ for a in result.actions] == ["Start"]
    assert backend.reserved == [{"wide": ("node-a", "node-b")}]
    assert [r.placement for r in backend.hosts["node-a"].requests] == [(("node-a", (0, 1)), ("node-b", (0, 1)))]
    assert backend.hosts["node-b"].requests == []
    written = dict(FakeWriter.written)
    assert written["wide"].status == "running"
    assert f"ssh -p {port} alice@node-a.fake.example" in written["wide"].lines
    assert f"also on node-b: ssh -p {port} alice@node-b.fake.example" in written["wide"].lines
    assert written["picky"].status == "rejected"
    assert "asks for a number of GPUs (gpus: 2), not GPU indices" in written["picky"].lines[0]


def test_a_backend_the_registry_does_not_know_is_refused_by_the_config_in_one_sentence(tmp_path: Path,
                                                                                     registered: object) -> None:
    with pytest.raises(config_module.ConfigError) as refused:
        _config(tmp_path, backend="pbs")
    assert "backend.kind: unknown backend 'pbs' (known: \"local\", \"slurm\", or \"package.module:Class\")" \
        in str(refused.value)
    with pytest.raises(config_module.ConfigError) as refused:
        _config(tmp_path, backend="no_such_module:Backend")
    assert "backend.kind: backend 'no_such_module:Backend': cannot load no_such_module:Backend" in str(refused.value)
    with pytest.raises(config_module.ConfigError) as refused:
        _config(tmp_path, backend=f"{__name__}:FakeSource")
    assert "is not a backend: it has no topology" in str(refused.value)
    assert _config(tmp_path, backend=f"{__name__}:FakeBackend").backend.kind == f"{__name__}:FakeBackend"


def test_the_pure_core_imports_only_what_its_allow_list_names() -> None:
    """The pure-core contract of .importlinter (an allow-list) holds for the code as it is, and
    breaks when the core imports something outside the list: a standard-library module no deny-list
    names (os), or the config reader, which reads files."""
    import configparser

    import grimp

    from tools.import_contracts import AllowListContract

    repo = Path(__file__).resolve().parents[1]
    settings = configparser.ConfigParser()
    settings.read(repo / ".importlinter")
    section = settings["importlinter:contract:pure-core"]
    assert section["type"] == "allowlist"
    options = {key: [line.strip() for line in section[key].splitlines() if line.strip()]
               for key in ("source_modules", "allowed_modules")}
    contract = AllowListContract(name="pure core", session_options={}, contract_options=options)
    graph = grimp.build_graph("gpubook", include_external_packages=True, exclude_type_checking_imports=True,
                              cache_dir=None)  # the tree may be read-only for the test user
    assert contract.check(graph, verbose=False).kept
    for forbidden in ("os", "gpubook.scheduler.config", "gpubook.scheduler.sources.caldav_source"):
        graph.add_import(importer="gpubook.scheduler.core.plan", imported=forbidden, line_number=1,
                         line_contents=f"import {forbidden}")
        check = contract.check(graph, verbose=False)
        graph.remove_import(importer="gpubook.scheduler.core.plan", imported=forbidden)
        assert not check.kept
        assert check.metadata["offences"] == [{"importer": "gpubook.scheduler.core.plan", "imported": forbidden,
                                               "lines": [1]}]


class DoorlessNode(FakeNode):
    """A node whose author forgot `exec`."""

    exec = None  # type: ignore[assignment]


def test_a_host_without_a_required_door_is_refused_in_one_sentence_and_the_optional_doors_are_declared(
        tmp_path: Path, fake_backend: None) -> None:
    config = _config(tmp_path, backend="fake")
    backend = backends.make(config, cast(backends.Parts, None))
    assert isinstance(backend, FakeBackend)
    backend.hosts["node-b"] = DoorlessNode("node-b")  # type: ignore[assignment]
    with State(tmp_path / "state.sqlite") as state, pytest.raises(config_module.ConfigError) as refused:
        Pass(config, backend=backend, state=state, templates=load_all(None))
    assert str(refused.value) == (
        "host 'node-b' (DoorlessNode) is not a gpubook Host: it lacks exec (every host has list, start, stop, "
        "exec and inspect, and a name, gpus and driver_version)")
    # The real hosts: the optional doors are declared by the Protocols, checked structurally.
    from gpubook.scheduler.hosts.slurm.host import SlurmHost
    assert all(issubclass(LocalHost, door) for door in (Arms, MovesEnd, KeepsProvenance, PreparesAhead))
    assert all(callable(getattr(SlurmHost, door, None)) for door in hosts_module.REQUIRED)
    assert not any(issubclass(SlurmHost, door) for door in (Arms, MovesEnd, KeepsProvenance, PreparesAhead))
