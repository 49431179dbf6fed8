"""A pass on a cluster backend (`Pass(backend=...)`), with real State and the plan, the cluster a
tiny class meeting the Backend protocol and its nodes test_pass_bounded's Machine: bookings
go to the nodes the plan chose, a reservation Slurm refused holds its booking with Slurm's
sentence, and a controller that does not answer starts nothing and ends nothing."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from pathlib import Path

from gpubook.runtime.checks import Check
from gpubook.runtime.engines import container_name
from gpubook.scheduler import config as config_module
from gpubook.scheduler.apply.passes import Pass
from gpubook.scheduler.core.plan import Accepted
from gpubook.scheduler.core.topology import CLUSTER
from gpubook.scheduler.hosts import Started, StartRequest
from gpubook.scheduler.hosts.backend import NOTHING_SAMPLED, HostGpus, Sampling
from gpubook.scheduler.state import State, notes
from tests.kits.pass_kit import DEAD_URL, HOLD, NOW, Machine, bookings, event


class Node(Machine):
    def __init__(self, name: str, gpus: tuple[int, ...]) -> None:
        super().__init__(gpus)
        self.name = name

    def start(self, request: StartRequest) -> Started:
        started = super().start(request)
        info = replace(started.info, host=self.name, others=request.placement[1:])
        self.containers[info.name] = info
        return replace(started, info=info)


@dataclass(frozen=True)
class Reserved:
    refused: dict[str, str] = field(default_factory=dict)
    problem: str = ""


class Cluster:
    topology = CLUSTER

    def __init__(self, *nodes: Node) -> None:
        self.hosts = {node.name: node for node in nodes}
        self.problem = ""
        self.refuse: dict[str, str] = {}
        self.synced: list[dict[str, tuple[str, ...]]] = []

    def refresh(self) -> str:
        return self.problem

    def reserve(self, accepted: Sequence[Accepted], *, now: datetime) -> Reserved:
        if self.problem:
            return Reserved(problem=self.problem)
        self.synced.append({a.booking.id: tuple(name for name, _ in a.placement) for a in accepted})
        return Reserved(refused={k: v for k, v in self.refuse.items() if k in self.synced[-1]})

    def address(self, host: str) -> str:
        return host or "login"

    @classmethod
    def preflight(cls, config: object) -> list[Check]:
        return []

    def gpus(self) -> dict[str, HostGpus]:
        return {name: HostGpus(source="test", count=len(node.gpus)) for name, node in self.hosts.items()}

    def sampling(self, world: object) -> Sampling:
        return NOTHING_SAMPLED

    @staticmethod
    def listed_here(engine: object) -> None:
        return None


def make(tmp_path: Path, cluster: Cluster, state: State) -> Pass:
    path = tmp_path / "gpubook.toml"
    path.write_text(f'[host]\nname = "login"\ntimezone = "UTC"\n[[calendar]]\nurl = "{DEAD_URL}"\n'
                    '[backend]\nkind = "slurm"\nshared_dir = "/shared"\n[engine]\nname = "podman"\n'
                    '[defaults]\ntemplate = "debian-ssh"\ngpus = 1\n[users.alice]\nuid = 2001\n')
    passes = Pass(config_module.load(path), backend=cluster, state=state, templates=_templates())
    passes.patience = HOLD
    return passes


def _templates():  # type: ignore[no-untyped-def]
    from gpubook.runtime.templates.catalog import load_all

    return load_all(None)


def test_bookings_start_on_the_nodes_the_plan_chose(tmp_path: Path) -> None:
    node1, node2 = Node("node1", (0, 1, 2, 3)), Node("node2", (0, 1, 2, 3))
    cluster = Cluster(node1, node2)
    with State(tmp_path / "state.sqlite") as state:
        passes = make(tmp_path, cluster, state)
        items = [event("a-small", NOW, NOW + timedelta(hours=2), extra=("DESCRIPTION:gpus: 2",)),
                 event("b-wide", NOW, NOW + timedelta(hours=2), extra=("DESCRIPTION:gpus: 4\\nnodes: 2",)),
                 event("c-full", NOW, NOW + timedelta(hours=2), extra=("DESCRIPTION:gpus: 3",)),
                 event("d-later", NOW + timedelta(hours=3), NOW + timedelta(hours=4), extra=("DESCRIPTION:gpus: 3",))]
        try:
            result = passes.run(bookings(passes.config, *items), now=NOW, write_back=False)
        finally:
            passes.close()
    assert {a.booking.id: a.placement for a in result.plan.accepted} == {
        "a-small": (("node1", (0, 1)),), "b-wide": (("node1", (2, 3)), ("node2", (0, 1))),
        "d-later": (("node1", (0, 1, 2)),)}
    assert [r.id for r in result.plan.rejected] == ["c-full"]
    assert cluster.synced == [{"a-small": ("node1",), "b-wide": ("node1", "node2"), "d-later": ("node1",)}]
    assert sorted(s for s in node1.steps if s[0] == "start") == [("start", "a-small"), ("start", "b-wide")]
    assert node2.steps == []  # a multi-node booking starts once, through its first node
    assert node1.containers[container_name("b-wide")].others == (("node2", (0, 1)),)


def test_a_refused_reservation_holds_its_booking_with_slurms_sentence(tmp_path: Path) -> None:
    node1 = Node("node1", (0, 1))
    cluster = Cluster(node1)
    cluster.refuse = {"a": "Slurm refused to create reservation gpubook-a-1: Requested nodes are busy"}
    with State(tmp_path / "state.sqlite") as state:
        passes = make(tmp_path, cluster, state)
        items = [event("a", NOW, NOW + timedelta(hours=2)), event("b", NOW, NOW + timedelta(hours=2))]
        try:
            passes.run(bookings(passes.config, *items), now=NOW, write_back=False)
        finally:
            passes.close()
        said = [e.message for e in state.events(booking_id="a")]
        held = notes.read(state).held
    assert [s for s in node1.steps if s[0] == "start"] == [("start", "b")]
    assert held["a"] == cluster.refuse["a"]  # the event's note
    assert any(cluster.refuse["a"] in line for line in said), said


def test_a_silent_controller_starts_nothing_and_ends_nothing(tmp_path: Path) -> None:
    node1 = Node("node1", (0, 1))
    cluster = Cluster(node1)
    with State(tmp_path / "state.sqlite") as state:
        passes = make(tmp_path, cluster, state)
        first = event("first", NOW, NOW + timedelta(hours=2))
        second = event("second", NOW + timedelta(minutes=5), NOW + timedelta(hours=2))
        try:
            passes.run(bookings(passes.config, first, second), now=NOW, write_back=False)
            cluster.problem = "the Slurm controller does not answer (timed out); nothing starts until it does"
            later = NOW + timedelta(minutes=6)
            passes.run(bookings(passes.config, first, second, now=later), now=later, write_back=False)
        finally:
            passes.close()
        held = notes.read(state).held
    assert [s for s in node1.steps if s[0] == "start"] == [("start", "first")]
    assert list(node1.containers) == [container_name("first")]  # the running one is not stopped
    assert held["second"] == cluster.problem
