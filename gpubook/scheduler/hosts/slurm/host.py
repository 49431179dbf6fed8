"""One Slurm node as a `Host` (gpubook/scheduler/hosts): the plan places a booking on a node and its GPUs
(several nodes for a multi-node booking: the first is its host); starting it submits the
booking's job into its reservation (jobs.py) and waits until every node's step says SSH answers
there; stopping it cancels the job (its steps stop the containers).
The plan decides how many GPUs of which node a booking gets and counts them by its own indices;
which of the node's GPUs they are is Slurm's choice (`--gres=gpu:N`), reported by the step. A
booking is listed with the plan's indices (what the plan and decide compare) by its first node,
with its other nodes in `others`.

What the nodes run is read from the job folders (each node's result), by the backend once per pass
(backend.py), not from the nodes' engines: gpubook runs nothing on the nodes itself. `exec` into
a node's container is asked of the booking's step there, through the job folder (the step runs it
in its container and answers): no Slurm step of its own, so it works while slurmctld is away.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from datetime import datetime
from pathlib import Path

from gpubook.runtime.engines import ContainerInfo, EngineSettings, ExecResult, container_name
from gpubook.runtime.errors import EngineError, GpubookError
from gpubook.runtime.slurm.step import StepRequest
from gpubook.scheduler import clock
from gpubook.scheduler.hosts import Started, StartRequest
from gpubook.scheduler.hosts.slurm.cluster import SlurmError
from gpubook.scheduler.hosts.slurm.jobs import STOP_MARGIN, Job, JobRequest, NodeResult, SlurmJobs

ENDED = "the booking's job ended"
EXEC_SECONDS = 30.0


def listed(step: StepRequest, results: dict[str, NodeResult], *, node: str) -> ContainerInfo | None:
    """The booking as its first node lists it: running once every node's step reported SSH."""
    placement = step.placement or ((node, tuple(results[node].gpus) if node in results else ()),)
    if placement[0][0] != node or any(name not in results or results[name].error for name, _ in placement):
        return None
    lead = results[node]
    return ContainerInfo(name=container_name(step.booking_id), id="", state="running", image="",
                         booking_id=step.booking_id, user=step.user, gpus=placement[0][1], end=step.end, spec_hash="",
                         port=step.port, template=step.template, host=node, host_key=lead.host_key,
                         others=tuple(placement[1:]))


class SlurmHost:
    """A GPU node of the cluster, its bookings run as Slurm jobs in their reservations."""

    def __init__(self, *, name: str, gpus: Sequence[int], jobs: SlurmJobs, engine: EngineSettings,
                 templates_dir: Path | None = None, partition: str = "", start_timeout: float = 120.0,
                 data_root: Path | None = None, now: Callable[[], datetime] = clock.now) -> None:
        self.name, self.gpus, self.jobs, self.engine = name, tuple(gpus), jobs, engine
        self.driver_version: str | None = None  # the node's driver is the step's business (it injects it)
        self.templates_dir, self.partition, self.start_timeout, self.now = (templates_dir, partition,
                                                                            start_timeout, now)
        self.data_root = data_root
        self.listing: list[ContainerInfo] | None = None  # set by the backend each pass (None: read it here)

    def start(self, request: StartRequest) -> Started:
        """Submit (or find) the booking's job and wait until every node's step reports SSH answering."""
        booker = request.booker
        placement = request.placement or ((self.name, request.gpus),)
        step = StepRequest(booking_id=request.booking_id, user=booker.name, uid=booker.uid, gid=booker.gid,
                           ssh_keys=booker.ssh_keys, template=request.template.name, templates_dir=self.templates_dir,
                           port=request.port, end=request.end, engine=self.engine, data_root=self.data_root,
                           multi_node=len(placement) > 1, placement=placement)
        began = time.monotonic()
        try:
            job = self.jobs.submit(JobRequest(step=step, nodes=len(placement), gpus_per_node=len(request.gpus),
                                              partition=self.partition), now=self.now())
        except SlurmError as error:
            raise EngineError(f"booking {request.booking_id}: Slurm refused its job: {error}") from None
        deadline = began + self.start_timeout
        while time.monotonic() < deadline:
            results = self.jobs.results(request.booking_id)
            failed = _failed(request.booking_id, results)
            if failed is not None:
                # Nothing half-done: the other nodes' steps are sent SIGTERM and remove their containers.
                self.jobs.cancel(request.booking_id, grace=self.engine.stop_grace_seconds)
                raise failed
            info = listed(step, results, node=self.name)
            if info is not None:
                return Started(info=info, seconds_to_ssh=time.monotonic() - began)
            if job.name not in self.jobs.jobs():
                # A node's error may have been written between the look at the results and the job's end.
                failed = _failed(request.booking_id, self.jobs.results(request.booking_id))
                if failed is not None:
                    raise failed
                raise EngineError(f"booking {request.booking_id}: {ENDED} (job {job.job_id}) before SSH answered "
                                  f"on {self.name}. {self.jobs.why_ended(request.booking_id, job.job_id)}")
            time.sleep(0.5)
        self.jobs.cancel(request.booking_id, grace=self.engine.stop_grace_seconds)  # its steps remove theirs
        raise EngineError(f"booking {request.booking_id}: SSH did not answer on {self.name} within "
                          f"{self.start_timeout:g} s of submitting job {job.job_id}; the job is cancelled")

    def list(self) -> list[ContainerInfo]:
        """The bookings whose job runs with this node first and SSH answering on every node."""
        if self.listing is not None:
            return list(self.listing)
        return read_listing(self.jobs, self.jobs.jobs()).get(self.name, [])

    def inspect(self, name: str) -> ContainerInfo | None:
        return next((info for info in read_listing(self.jobs, self.jobs.jobs()).get(self.name, [])
                     if info.name == name), None)

    def stop(self, name: str, grace: float) -> None:
        """End the job of the booking whose container this is: its steps stop their containers
        within `grace`, then the job ends (scancel only if it does not)."""
        for job in self.jobs.jobs().values():
            step = _request(self.jobs, job)
            if step is not None and name in (container_name(step.booking_id),
                                             *(r.container for r in self.jobs.results(step.booking_id).values())):
                if step.end <= self.now():  # at its end the steps stop their containers themselves
                    self.jobs.wait_ended(step.booking_id, seconds=grace + STOP_MARGIN)
                self.jobs.cancel(step.booking_id, grace=grace)

    def exec(self, name: str, argv: Sequence[str], *, timeout: float | None = None) -> ExecResult:
        """In the booking's container on this node, through its step (the end warning, the idle
        notice); bounded by `timeout`, at least EXEC_SECONDS."""
        # The step answers at its next look (EXEC_POLL) and runs the command with the node's engine:
        # at least EXEC_SECONDS, so a loaded node still delivers a 10-second notice.
        limit = max(timeout or 0.0, EXEC_SECONDS)
        for info in self.list():
            if info.name == name:
                return self.jobs.exec(info.booking_id, self.name, argv, timeout=limit)
        raise EngineError(f"no job of gpubook's runs {name} on Slurm node {self.name}")


def _failed(booking_id: str, results: dict[str, NodeResult]) -> EngineError | None:
    """The error of the nodes whose step said why its container did not start (None: none did)."""
    failed = sorted((node, r.error) for node, r in results.items() if r.error)
    if not failed:
        return None
    return EngineError(f"booking {booking_id}: its container did not start on "
                       + "; ".join(f"{node}: {error}" for node, error in failed))


def _request(jobs: SlurmJobs, job: Job) -> StepRequest | None:
    """The request a job's folder holds (None: none, or one that is not gpubook's to read)."""
    try:
        return StepRequest.read(jobs.shared_dir / job.name / "request.json", owners=jobs.owners)
    except (OSError, ValueError, KeyError, TypeError, GpubookError):
        return None


def read_listing(jobs: SlurmJobs, active: dict[str, Job]) -> dict[str, list[ContainerInfo]]:
    """Every running booking by its first node, from the active jobs' folders (one read each)."""
    found: dict[str, list[ContainerInfo]] = {}
    for job in active.values():
        if job.state != "RUNNING":
            continue
        step = _request(jobs, job)
        if step is None:
            continue
        results = jobs.results(step.booking_id)
        lead = step.placement[0][0] if step.placement else next(iter(sorted(results)), "")
        info = listed(step, results, node=lead) if lead else None
        if info is not None:
            found.setdefault(lead, []).append(info)
    return found
