"""The plan on a Slurm cluster: every node is a host; a booking goes to the first nodes with its
GPUs free, spread evenly over `nodes: K` or over the fewest nodes its GPUs fit on; quotas count
every node together. Pure: the inventory is what `SlurmCluster.inventory` returns."""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta

import pytest

from gpubook.runtime.engines import ContainerInfo
from gpubook.scheduler.config import Config
from gpubook.scheduler.core import decide
from gpubook.scheduler.core.bookings import Booking
from gpubook.scheduler.core.plan import Plan, plan
from gpubook.scheduler.core.topology import CLUSTER
from tests.kits.booking_kit import CALENDAR, TEMPLATES, make_config, raw, read, single, utc, vcalendar, vevent

NOW = utc(2026, 11, 23, 8)
NODES = {"node1": (0, 1, 2, 3), "node2": (0, 1, 2, 3), "node3": (0, 1)}


def cluster_config(**defaults: object) -> Config:
    config = make_config(**defaults)
    return replace(config, backend=replace(config.backend, kind="slurm"))


CONFIG = cluster_config()


def booking(id: str, *, user: str = "bob", gpus: int = 1, nodes: int | None = None, start: int = 10,
            hours: float = 2) -> Booking:
    begin = utc(2026, 11, 24) + timedelta(hours=start)
    return Booking(id=id, uid=id, user=user, template="debian-ssh", gpu_count=gpus, gpu_indices=None, start=begin,
                   end=begin + timedelta(hours=hours), created=None, dtstamp=None, calendar_url=CALENDAR,
                   href=f"{CALENDAR}{id}.ics", nodes=nodes)


def run(*items: Booking, inventory: dict[str, tuple[int, ...]] = NODES, config: Config = CONFIG,
        running: dict[str, tuple[int, ...]] | None = None,
        placed: dict[str, tuple[tuple[str, tuple[int, ...]], ...]] | None = None) -> Plan:
    return plan(items, inventory=inventory, config=config, templates=TEMPLATES, now=NOW, running=running or {},
                placed=placed or {}, first_seen={}, topology=CLUSTER)


def placement(result: Plan) -> dict[str, tuple[tuple[str, tuple[int, ...]], ...]]:
    return {a.booking.id: a.placement for a in result.accepted}


def reasons(result: Plan) -> dict[str, str]:
    return {r.id: r.reason for r in result.rejected}


def test_a_booking_goes_to_the_first_node_with_its_gpus_free() -> None:
    result = run(booking("a", gpus=3), booking("b", gpus=2), booking("c", gpus=1), booking("d", gpus=2))
    assert placement(result) == {"a": (("node1", (0, 1, 2)),), "b": (("node2", (0, 1)),),
                                 "c": (("node1", (3,)),), "d": (("node2", (2, 3)),)}


def test_a_full_cluster_refuses_naming_a_node() -> None:
    result = run(*(booking(f"x{i}", gpus=4) for i in range(2)), booking("z-late", gpus=4),
                 inventory={"node1": (0, 1, 2, 3), "node2": (0, 1, 2, 3)})  # priority: the UID here
    assert list(reasons(result)) == ["z-late"]
    assert reasons(result)["z-late"].startswith("no node of the cluster has 4 GPUs free at that time (node1: ")
    assert "GPU 0 is booked by bob" in reasons(result)["z-late"]


def test_more_gpus_than_a_node_has_spread_over_the_fewest_nodes() -> None:
    result = run(booking("big", gpus=8))
    assert placement(result) == {"big": (("node1", (0, 1, 2, 3)), ("node2", (0, 1, 2, 3)))}
    accepted = result.accepted[0]
    assert (accepted.host, accepted.gpus, accepted.others) == ("node1", (0, 1, 2, 3), (("node2", (0, 1, 2, 3)),))


def test_nodes_spreads_the_gpus_evenly_over_that_many_nodes() -> None:
    result = run(booking("a-two", gpus=4, nodes=2), booking("b-three", gpus=3, nodes=3))
    assert placement(result) == {"a-two": (("node1", (0, 1)), ("node2", (0, 1))),
                                 "b-three": (("node1", (2,)), ("node2", (2,)), ("node3", (0,)))}


def test_a_multi_node_booking_takes_only_nodes_with_room_and_counts_in_the_quota() -> None:
    config = cluster_config()
    # max_gpus is GPUs at once: a multi-node booking's GPUs on every node count together.
    config = replace(config, users={**config.users, "bob": replace(config.users["bob"], max_gpus=7)})
    result = run(booking("first", gpus=3), booking("wide", gpus=4, nodes=2, start=11),  # judged in UID order
                 booking("x-over", gpus=2, nodes=2), booking("z-huge", gpus=8, nodes=2, start=20), config=config)
    assert placement(result)["wide"] == (("node2", (0, 1)), ("node3", (0, 1)))  # node1 has 1 free then
    # 3 + 4 held from 11 to 12, and 2 more asked for: 9 > 7.
    assert reasons(result)["x-over"] == ("bob may hold at most 7 GPUs at once; their other bookings hold 7 during this "
                                         "booking's time, and it asks for 2")
    assert reasons(result)["z-huge"] == "bob may book at most 7 GPUs; this booking asks for 8"


def test_impossible_shapes_are_refused_in_one_sentence() -> None:
    result = run(booking("many", gpus=4, nodes=4), booking("huge", gpus=11))
    assert reasons(result)["many"] == "the booking asks for 4 nodes with 1 GPU each; the cluster has 3 such nodes"
    assert reasons(result)["huge"].startswith("the booking asks for 11 GPUs; the cluster's nodes have at most 4")


def test_a_running_multi_node_booking_keeps_its_nodes() -> None:
    wide = booking("wide", gpus=4, nodes=2, start=-30)  # began before NOW
    first = run(wide, booking("early", gpus=2, start=-31, hours=0.5))
    assert placement(first)["wide"] == (("node1", (0, 1)), ("node2", (0, 1)))
    moved = (("node2", (2, 3)), ("node3", (0, 1)))
    result = run(booking("other", gpus=4, start=-30), wide, running={"wide": (2, 3)}, placed={"wide": moved})
    assert placement(result)["wide"] == moved
    assert placement(result)["other"] == (("node1", (0, 1, 2, 3)),)


def test_pinning_keeps_a_multi_node_bookings_count() -> None:
    wide = booking("wide", gpus=4, nodes=2, start=-30)
    info = ContainerInfo(name="gpubook-wide", id="", state="running", image="", booking_id="wide", user="bob",
                         gpus=(2, 3), end=wide.end, spec_hash="", port=None, template="debian-ssh", host="node2",
                         others=(("node3", (0, 1)),))
    pinned = decide.pin_running([wide], [info], now=NOW)
    assert pinned.occurrences == (replace(wide, gpu_indices=None, gpu_count=4, nodes=2),)
    assert pinned.notes == {}


def test_the_local_backend_refuses_nodes() -> None:
    result = plan([booking("two", gpus=2, nodes=2)], inventory=(0, 1, 2, 3), config=make_config(),
                  templates=TEMPLATES, now=NOW)
    assert reasons(result)["two"] == ("nodes: 2 asks for 2 machines; devbox1 is one machine "
                                      "(a booking spans nodes on a Slurm cluster)")


def test_the_convention_reads_nodes() -> None:
    start, end = "DTSTART:20261124T100000Z", "DTEND:20261124T120000Z"
    two = single(start, end, "SUMMARY:training", "DESCRIPTION:user: bob\\ngpus: 16\\nnodes: 2", config=CONFIG,
                 topology=CLUSTER)
    assert (two.gpu_count, two.nodes) == (16, 2)
    titled = single(start, end, "SUMMARY:bob nodes=3", config=CONFIG, topology=CLUSTER)
    assert (titled.gpu_count, titled.nodes) == (3, 3)  # the default GPU count on each node
    plain = single(start, end, "SUMMARY:bob gpus=8", config=CONFIG, topology=CLUSTER)
    assert (plain.gpu_count, plain.nodes) == (8, None)


@pytest.mark.parametrize(("description", "reason"), [
    ("user: bob\\ngpus: 5\\nnodes: 2", "5 GPUs cannot be spread evenly over 2 nodes; ask for a multiple of 2 GPUs"),
    ("user: bob\\nnodes: 0", "nodes: '0' is not a number of nodes from 1 to 64"),
    ("user: bob\\nnodes: all", "nodes: 'all' is not a number of nodes from 1 to 64"),
    ("user: bob\\ngpus: 0,1", "on a Slurm cluster a booking asks for a number of GPUs (gpus: 2), not GPU indices: "
                              "Slurm picks which GPUs of a node"),
])
def test_wrong_nodes_are_refused(description: str, reason: str) -> None:
    result = read(raw(vcalendar(vevent("u1", "DTSTART:20261124T100000Z", "DTEND:20261124T120000Z",
                                       "SUMMARY:x", f"DESCRIPTION:{description}"))), config=CONFIG,
                  topology=CLUSTER)
    assert [r.reason for r in result.occurrences] == [reason]


def test_a_running_booking_stays_when_its_nodes_offer_nothing_for_now() -> None:
    wide = booking("wide", gpus=4, nodes=2, start=-30)
    placed = (("node1", (0, 1)), ("node2", (0, 1)))
    result = run(wide, booking("new", gpus=1), inventory={"node1": (), "node2": ()}, running={"wide": (0, 1)},
                 placed={"wide": placed})
    assert placement(result) == {"wide": placed}
    assert reasons(result)["new"].startswith("the booking asks for 1 GPU; the cluster's nodes have at most 0")


def test_a_multi_node_booking_is_busy_time_on_each_of_its_nodes() -> None:
    """The status's GPU timelines (which the page, the free feed and `gpubook free` read) show a
    booking spread over two nodes on both: the second node's GPUs were shown free (a clean run of
    test_daemon_slurm: `gpubook free` offered node2 at once while the refusal, from the plan, said
    it was held)."""
    from gpubook.scheduler.outbox.timeline import gpu_timelines

    result = run(booking("wide", gpus=6, nodes=2), booking("one"))
    assert placement(result)["wide"] == (("node1", (1, 2, 3)), ("node2", (0, 1, 2)))
    busy = {node: {lane.gpu: [s.booking for s in lane.segments]
                   for lane in gpu_timelines(result, host=node, gpus=gpus, now=NOW)}
            for node, gpus in NODES.items()}
    assert busy["node1"] == {0: ["one"], 1: ["wide"], 2: ["wide"], 3: ["wide"]}
    assert busy["node2"] == {0: ["wide"], 1: ["wide"], 2: ["wide"], 3: []}
    assert busy["node3"] == {0: [], 1: []}
