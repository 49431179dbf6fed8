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
from collections.abc import Callable, Iterable, Sequence
from datetime import datetime

from gpubook.runtime.checks import Check
from gpubook.runtime.engines import ContainerInfo, Engine
from gpubook.scheduler.core.plan import Accepted
from gpubook.scheduler.core.topology import CLUSTER
from gpubook.scheduler.hosts import Host
from gpubook.scheduler.hosts.backend import NOTHING_SAMPLED, HostGpus, Parts, Reserved, Sampling
from gpubook.scheduler.hosts.slurm.cluster import SlurmCluster, SlurmError, SlurmUnreachable
from gpubook.scheduler.hosts.slurm.host import SlurmHost, read_listing
from gpubook.scheduler.hosts.slurm.jobs import SlurmJobs
from gpubook.scheduler.settings import Config

log = logging.getLogger(__name__)


class SlurmBackend:
    """The cluster's nodes as hosts, and gpubook's reservations kept in step with the plan. The
    nodes run the bookings: nothing is sampled on the daemon's machine (the login node)."""

    topology = CLUSTER

    @classmethod
    def config_problem(cls, config: Config) -> str | None:
        if config.backend.shared_dir is None:
            return (f"{config.path}: backend.shared_dir: not set; the Slurm backend needs a folder that "
                    "every node and the daemon see at the same path (the bookings' job folders)")
        return None

    def __init__(self, config: Config, parts: Parts) -> None:
        """`parts`: the daemon's, of which the nodes need none (each node runs its own engine,
        with the whole `[engine]` section sent in the booking's job request)."""
        backend = config.backend
        if backend.shared_dir is None:
            raise SlurmError("backend.shared_dir is not set: the Slurm backend needs a folder every node sees")
        self.cluster = SlurmCluster.from_config(backend)
        account = pwd.getpwuid(os.geteuid()).pw_name
        self.jobs = SlurmJobs(scontrol=self.cluster.scontrol, prefix=backend.reservation_prefix,
                              shared_dir=backend.shared_dir, user=account)
        self.engine, self.templates_dir, self.partition = config.engine, config.templates_dir, backend.partition
        self.data_root = config.storage.data_root
        self.server = config.host.name
        self.hosts: dict[str, Host] = {}
        self.nodes: dict[str, SlurmHost] = {}  # the same hosts, as the Slurm nodes they are
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
            host = self.nodes.get(node.name)
            if host is None:
                host = self.nodes[node.name] = self.hosts[node.name] = SlurmHost(
                    name=node.name, gpus=(), jobs=self.jobs, engine=self.engine, templates_dir=self.templates_dir,
                    partition=self.partition, data_root=self.data_root)
            if node.usable or not node.silent or not host.gpus:  # a silent node keeps what it offered
                host.gpus = tuple(range(node.gpus)) if node.usable else ()
        for name, host in self.nodes.items():
            host.listing = listing.get(name, [])
        return ""

    def reserve(self, accepted: Sequence[Accepted], *, now: datetime) -> Reserved:
        return self.sync(accepted, now=now)

    def address(self, host: str) -> str:
        """The node the booking runs on (the daemon's server while it is not known)."""
        return host or self.server

    @classmethod
    def preflight(cls, config: Config) -> list[Check]:
        """The shared folder is set and can be made here, and the controller answers with GPU nodes."""
        backend = config.backend
        if problem := cls.config_problem(config):
            return [Check("slurm shared_dir", False, problem, "set [backend] shared_dir to a folder every node sees")]
        shared = backend.shared_dir
        assert shared is not None  # config_problem said so
        result = [Check("slurm shared_dir", True, f"{shared} (made by the daemon if absent)")
                  if shared.is_dir() or shared.parent.is_dir() else  # gpubook makes the folder, not its parent
                  Check("slurm shared_dir", False, f"{shared}: its parent folder {shared.parent} is not here",
                        "mount the shared storage here at the path every node uses")]
        try:
            nodes = SlurmCluster.from_config(backend).gpu_nodes()
        except SlurmError as error:
            return [*result, Check("slurm controller", False, str(error),
                                   "check [backend] slurm_conf and that slurmctld runs")]
        usable = sum(1 for node in nodes if node.usable)
        where = f" in partition {backend.partition}" if backend.partition else ""
        return [*result, Check("slurm controller", bool(usable), f"{usable} of {len(nodes)} GPU node(s){where} "
                               "usable", None if usable else "resume or undrain a GPU node (scontrol update)")]

    def gpus(self) -> dict[str, HostGpus]:
        """Each node's GPUs as Slurm counts them."""
        return {name: HostGpus(source="slurm", count=len(host.gpus), indices=host.gpus,
                               note=None if host.gpus else "down, drained or without GPUs in Slurm")
                for name, host in sorted(self.nodes.items())}

    def sampling(self, world: Callable[[], Sequence[ContainerInfo]]) -> Sampling:
        return NOTHING_SAMPLED  # the bookings run on the nodes; the daemon's machine runs none

    @staticmethod
    def listed_here(engine: Engine) -> list[ContainerInfo] | None:
        return None  # on the nodes: as the daemon's last pass listed them

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
