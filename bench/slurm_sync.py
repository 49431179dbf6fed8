"""Plan + Slurm reservation sync for many bookings on a simulated cluster: prints figures, asserts nothing.

    PYTHONPATH=. python bench/slurm_sync.py [BOOKINGS] [NODES] [GPUS_PER_NODE]

BOOKINGS bookings (default 1,000) over a week on NODES x GPUS_PER_NODE GPUs (default 64 x 8).
Times, in this process: the plan; the first sync (every reservation's create argv built); the
sync where nothing changed (scontrol's listing of every reservation parsed, compared: it must
issue no command beyond that one listing); a sync where 10 bookings moved. scontrol itself is
replaced by a subclass of the backend's `Scontrol` that answers the listing from memory and
counts commands, so the figures are gpubook's own cost, not slurmctld's.

The plan places bookings on the cluster's nodes as the daemon's does (`[backend] kind = "slurm"`:
every node a host, a booking on the first nodes with its GPUs free); one in twenty asks for 16
GPUs, which go on two nodes of 8.
"""

from __future__ import annotations

import os
import platform
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TypeVar

from gpubook.scheduler.config import parse
from gpubook.scheduler.core.bookings import Booking
from gpubook.scheduler.core.plan import Accepted, plan
from gpubook.scheduler.hosts.slurm import Scontrol, SlurmCluster, sync

CALENDAR = "http://127.0.0.1:5232/cluster/"
NOW = datetime(2026, 11, 23, tzinfo=UTC)
T = TypeVar("T")


class InMemoryScontrol(Scontrol):
    """Answers `show reservation` with what the syncs so far created; counts every other command."""

    def __init__(self) -> None:
        super().__init__()
        self.listing = ""
        self.commands: list[tuple[str, ...]] = []

    def __call__(self, *args: str) -> str:
        self.calls += 1
        if args[:2] == ("show", "reservation"):
            return self.listing
        self.commands.append(args)
        return ""


def listing(wanted: Sequence[sync.Wanted]) -> str:
    """What scontrol 22.05 prints for these reservations (--oneliner, TZ=UTC)."""
    return "".join(
        f"ReservationName={w.name} StartTime={sync.stamp(w.start)} EndTime={sync.stamp(w.end)} Duration=01:00:00 "
        f"Nodes={','.join(w.nodes)} NodeCnt={len(w.nodes)} CoreCnt=64 Features=(null) PartitionName=(null) "
        f"Flags=OVERLAP,SPEC_NODES TRES=cpu=64 Users={','.join(w.users)} Groups=(null) Accounts=(null) "
        "Licenses=(null) State=INACTIVE BurstBuffer=(null) Watts=n/a MaxStartDelay=(null)\n" for w in wanted)


def bookings(count: int, rng: random.Random) -> list[Booking]:
    out = []
    for n in range(count):
        start = NOW + timedelta(minutes=30 * rng.randrange(7 * 48))
        out.append(Booking(id=f"bench-{n}@gpubook", uid=f"bench-{n}@gpubook", user=f"user{rng.randrange(20)}",
                           template="base", gpu_count=rng.choice([1, 1, 2, 2, 4, 4, 8, 8, 1, 1, 2, 2, 4, 4, 8, 8,
                                                                   1, 2, 4, 16]), gpu_indices=None, start=start,
                           end=start + timedelta(hours=rng.choice([1, 2, 4, 8, 24])), created=None, dtstamp=None,
                           calendar_url=CALENDAR, href=f"{CALENDAR}{n}.ics"))
    return out


def timed(action: Callable[[], T]) -> tuple[T, float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    result = action()
    return result, (time.perf_counter() - wall) * 1000, (time.process_time() - cpu) * 1000


def main() -> None:
    count = int(sys.argv[1]) if len(sys.argv) > 1 else 1000
    nodes = int(sys.argv[2]) if len(sys.argv) > 2 else 64
    per_node = int(sys.argv[3]) if len(sys.argv) > 3 else 8
    config = parse({"host": {"name": "bench", "timezone": "UTC"}, "backend": {"kind": "slurm"},
                    "calendar": [{"url": CALENDAR, "gpus": "all"}],
                    "users": {f"user{n}": {"uid": 2000 + n} for n in range(20)}}, Path("bench.toml"))
    items = bookings(count, random.Random(42))
    inventory = {f"node{n + 1:03d}": tuple(range(per_node)) for n in range(nodes)}
    planned, plan_ms, plan_cpu = timed(lambda: plan(items, inventory=inventory, config=config,
                                                    templates={"base"}, now=NOW))
    placed: list[Accepted] = list(planned.accepted)
    spanning = sum(1 for a in placed if a.others)
    scontrol = InMemoryScontrol()
    cluster = SlurmCluster(scontrol=scontrol, prefix="gpubook-", users=["gpubook"])

    nodes_of = {a.booking.id: tuple(name for name, _ in a.placement) for a in placed}
    first, first_ms, first_cpu = timed(lambda: cluster.sync(placed, now=NOW, nodes_of=nodes_of))
    scontrol.listing = listing(sync.wanted(placed, prefix="gpubook-", users=["gpubook"], nodes_of=nodes_of))
    before = len(scontrol.commands), scontrol.calls
    same, same_ms, same_cpu = timed(lambda: cluster.sync(placed, now=NOW, nodes_of=nodes_of))
    issued, listings = len(scontrol.commands) - before[0], scontrol.calls - before[1] - (len(scontrol.commands)
                                                                                      - before[0])
    moved = [replace(a, booking=replace(a.booking, end=a.booking.end + timedelta(hours=1))) if i < 10 else a
             for i, a in enumerate(placed)]
    edit, edit_ms, edit_cpu = timed(lambda: cluster.sync(moved, now=NOW, nodes_of=nodes_of))

    print(f"machine: {platform.platform()}, {os.cpu_count()} CPUs, Python {platform.python_version()}")
    print(f"{count} bookings over 7 days on {nodes} nodes x {per_node} GPUs: "
          f"{len(planned.accepted)} accepted ({spanning} on two nodes), {len(planned.rejected)} rejected")
    print(f"plan:                                   {plan_ms:8.1f} ms wall {plan_cpu:8.1f} ms CPU")
    print(f"first sync ({len(first.changes)} creates built):         {first_ms:8.1f} ms wall {first_cpu:8.1f} ms CPU")
    print(f"no-change sync (listing parsed, diffed): {same_ms:8.1f} ms wall {same_cpu:8.1f} ms CPU; "
          f"{issued} commands issued besides {listings} listing; {len(same.changes)} changes")
    print(f"sync after 10 edits ({len(edit.changes)} updates):      {edit_ms:8.1f} ms wall {edit_cpu:8.1f} ms CPU")


if __name__ == "__main__":
    main()
