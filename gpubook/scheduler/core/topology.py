"""Where a backend's bookings run, as the pure plan and the booking convention need to know it.

A plain value each backend gives (`gpubook/scheduler/hosts/backend.py`), so that the core never asks
which backend it is: one machine, whose calendars own its GPUs and whose bookers may name GPU
indices; or the nodes of a cluster, which every calendar books whole, where a booking may span
nodes and the cluster picks a node's GPUs itself.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Topology:
    spans_nodes: bool = False  # every host a node that every calendar books; False: the first host alone
    name: str = ""  # how a refusal names the place ("the cluster"); "": the host's own name
    picks_gpus: bool = True  # a booking may name its GPU indices (False: only a count, the backend picks)


ONE_MACHINE = Topology()
CLUSTER = Topology(spans_nodes=True, name="the cluster", picks_gpus=False)
