"""One Slurm node as a `Host` (scheduler/hosts): the plan places a booking on a node and its GPUs;
starting it submits the booking's job into its reservation (jobs.py) and waits until the node's
step says SSH answers there; stopping it cancels the job (its step stops the container).
The plan decides how many GPUs of which node a booking gets; which of the node's GPUs they are is
Slurm's choice (`--gres=gpu:N`), reported back by the step and listed here.

What the node's engine holds is read from the job folders (each node's result), not from the
node's engine: gpubook runs nothing on the nodes itself. `exec` into a container on another
machine is not offered: the Slurm backend has no way in but the job's own step (not yet).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path

from runtime.engines import ContainerInfo, ExecResult, container_name
from runtime.errors import EngineError
from runtime.slurm_step import StepRequest
from scheduler.hosts import Started, StartRequest
from scheduler.hosts.slurm.cluster import SlurmError
from scheduler.hosts.slurm.jobs import JobRequest, SlurmJobs

ENDED = "the booking's job ended"


class SlurmHost:
    """A GPU node of the cluster, its bookings run as Slurm jobs in their reservations."""

    def __init__(self, *, name: str, gpus: Sequence[int], jobs: SlurmJobs, engine: dict[str, str],
                 templates_dir: Path | None = None, partition: str = "", start_timeout: float = 120.0,
                 now: Callable[[], datetime] = lambda: datetime.now(UTC)) -> None:
        self.name, self.gpus, self.jobs, self.engine = name, tuple(gpus), jobs, dict(engine)
        self.driver_version: str | None = None  # the node's driver is the step's business (it injects it)
        self.templates_dir, self.partition, self.start_timeout, self.now = (templates_dir, partition,
                                                                            start_timeout, now)

    def start(self, request: StartRequest) -> Started:
        """Submit (or find) the booking's job and wait until this node's step reports SSH answering."""
        booker = request.booker
        step = StepRequest(booking_id=request.booking_id, user=booker.name, uid=booker.uid, gid=booker.gid,
                           ssh_keys=booker.ssh_keys, template=request.template.name, templates_dir=self.templates_dir,
                           port=request.port, end=request.end, engine=self.engine, data_root=None, multi_node=False)
        began = time.monotonic()
        try:
            job = self.jobs.submit(JobRequest(step=step, nodes=1, gpus_per_node=len(request.gpus),
                                              partition=self.partition), now=self.now())
        except SlurmError as error:
            raise EngineError(f"booking {request.booking_id}: Slurm refused its job: {error}") from None
        deadline = began + self.start_timeout
        while time.monotonic() < deadline:
            result = self.jobs.results(request.booking_id).get(self.name)
            if result is not None and result.error:
                raise EngineError(f"booking {request.booking_id}: its container did not start on {self.name}: "
                                  f"{result.error}")
            if result is not None:
                info = self._info(step, state="running", host_key=result.host_key, gpus=result.gpus)
                return Started(info=info, seconds_to_ssh=time.monotonic() - began)
            if job.name not in self.jobs.jobs():
                raise EngineError(f"booking {request.booking_id}: {ENDED} (job {job.job_id}) before SSH answered "
                                  f"on {self.name}; its log:\n{self.jobs.log(request.booking_id)}")
            time.sleep(0.5)
        raise EngineError(f"booking {request.booking_id}: SSH did not answer on {self.name} within "
                          f"{self.start_timeout:g} s of submitting job {job.job_id}")

    def list(self) -> list[ContainerInfo]:
        """The bookings whose job is pending or running here, as containers (from their job folders)."""
        found: list[ContainerInfo] = []
        for job in self.jobs.jobs().values():
            path = self.jobs.shared_dir / job.name / "request.json"
            try:
                step = StepRequest.read(path)
            except (OSError, ValueError, KeyError):
                continue
            result = self.jobs.results(step.booking_id).get(self.name)
            if job.state == "PENDING" or (result is None and self.name not in job.nodes):
                continue
            state = "running" if result is not None and not result.error else "created"
            found.append(self._info(step, state=state, host_key=result.host_key if result else "",
                                    gpus=result.gpus if result else ()))
        return found

    def inspect(self, name: str) -> ContainerInfo | None:
        return next((info for info in self.list() if info.name == name), None)

    def stop(self, name: str, grace: float) -> None:
        """Cancel the job of the booking whose container this is (scancel: its step stops it)."""
        info = self.inspect(name)
        if info is not None:
            self.jobs.cancel(info.booking_id)

    def exec(self, name: str, argv: Sequence[str], *, timeout: float | None = None) -> ExecResult:
        raise EngineError(f"running a command in {name} on Slurm node {self.name} is not available: the Slurm "
                          f"backend reaches a booking's container only through its job's step")

    def _info(self, step: StepRequest, *, state: str, host_key: str, gpus: tuple[int, ...]) -> ContainerInfo:
        return ContainerInfo(name=container_name(step.booking_id), id="", state=state, image="",
                             booking_id=step.booking_id, user=step.user, gpus=gpus, end=step.end, spec_hash="",
                             port=step.port, template=step.template, host=self.name, host_key=host_key)
