"""The Slurm cluster as the daemon's hosts (`[backend] kind = "slurm"`): one `SlurmHost` per GPU
node, read again at the start of every pass (one `scontrol show node`, one `squeue`), and the
plan's accepted bookings made into advance reservations after it (`SlurmCluster.sync`).

A node that goes down or is drained keeps its host (its running bookings are still listed and can
be stopped) but offers no GPU to the plan, which places new bookings elsewhere; one that is only
silent for now (`IDLE*`, as every node is for a moment after slurmctld restarts) keeps what it
offered, so that no reservation moves and no event flaps to "rejected" meanwhile. A controller that
does not answer is said once per pass as the reason nothing starts (`problem`): the hosts keep
their last listing, so nothing is mistaken for dead and nothing starts twice.
"""

from __future__ import annotations

import logging
import os
import pwd
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from gpubook.runtime.engines import EngineSettings
from gpubook.scheduler.core.plan import Accepted
from gpubook.scheduler.hosts.slurm.cluster import SlurmCluster, SlurmError, SlurmUnreachable
from gpubook.scheduler.hosts.slurm.host import SlurmHost, read_listing
from gpubook.scheduler.hosts.slurm.jobs import SlurmJobs
from gpubook.scheduler.settings import Config

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Reserved:
    """One sync's outcome: the bookings whose reservation Slurm refused, or why none was synced."""

    refused: dict[str, str]  # booking id → Slurm's sentence
    problem: str = ""  # slurmctld unreachable: nothing synced this pass


class SlurmBackend:
    """The cluster's nodes as hosts, and gpubook's reservations kept in step with the plan."""

    def __init__(self, config: Config, *, engine: EngineSettings, templates_dir: Path | None) -> None:
        backend = config.backend
        if backend.shared_dir is None:
            raise SlurmError("backend.shared_dir is not set: the Slurm backend needs a folder every node sees")
        self.cluster = SlurmCluster.from_config(backend)
        account = pwd.getpwuid(os.geteuid()).pw_name
        self.jobs = SlurmJobs(scontrol=self.cluster.scontrol, prefix=backend.reservation_prefix,
                              shared_dir=backend.shared_dir, user=account)
        self.engine, self.templates_dir, self.partition = engine, templates_dir, backend.partition
        self.data_root = config.storage.data_root
        self.hosts: dict[str, SlurmHost] = {}
        self.problem = ""
        self.active: frozenset[str] = frozenset()

    def refresh(self) -> str:
        """Read the nodes and gpubook's jobs once; "" or why Slurm could not be read (then the
        hosts keep what they listed last)."""
        try:
            nodes = self.cluster.gpu_nodes()
            active = self.jobs.jobs()
        except SlurmUnreachable as error:
            return self._unreachable(error)
        if self.problem:
            log.warning("the Slurm controller answers again (was: %s)", self.problem)
        self.problem = ""
        self.active = frozenset(active)  # the jobs' names: their reservations stay while they run
        listing = read_listing(self.jobs, active)
        for node in nodes:
            host = self.hosts.get(node.name)
            if host is None:
                host = self.hosts[node.name] = SlurmHost(
                    name=node.name, gpus=(), jobs=self.jobs, engine=self.engine, templates_dir=self.templates_dir,
                    partition=self.partition, data_root=self.data_root)
            if node.usable or not node.silent or not host.gpus:  # a silent node keeps what it offered
                host.gpus = tuple(range(node.gpus)) if node.usable else ()
        for name, host in self.hosts.items():
            host.listing = listing.get(name, [])
        return ""

    def sync(self, accepted: Iterable[Accepted], *, now: datetime) -> Reserved:
        """The reservations of the plan's accepted bookings, on the nodes the plan chose."""
        if self.problem:
            return Reserved({}, self.problem)
        chosen = list(accepted)
        nodes_of = {a.booking.id: tuple(name for name, _ in a.placement) for a in chosen}
        try:
            synced = self.cluster.sync(chosen, now=now, nodes_of=nodes_of, keep=self.active)
        except SlurmUnreachable as error:
            return Reserved({}, self._unreachable(error))
        for change in synced.changes:
            if change.booking_id not in synced.refused:
                log.warning("reservation %s: %s for booking %s", change.name, change.kind, change.booking_id or
                            "(none: an orphan)")
        return Reserved(dict(synced.refused))

    def _unreachable(self, error: SlurmUnreachable) -> str:
        """Said once when it begins; the hosts keep their last listing meanwhile."""
        problem = f"the Slurm controller does not answer ({error}); nothing starts until it does"
        if not self.problem:
            log.warning("%s", problem)
        self.problem = problem
        return problem
