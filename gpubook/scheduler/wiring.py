"""The composition root: the parts the daemon and the commands run on, built from a config here and
nowhere else.

- `base`: what one process makes once and a reload keeps (the state folder and its database, the
  engine, the probe key, the daemon's locks).
- `build`: the parts a config makes (GPU inventory and monitor, templates, the image preparer, the
  backend (`[backend] kind`) and its hosts, the pass with its notices, the calendars, the sampler,
  the foreign watch, the SFTP service); `gpubook run` builds them at start and at each SIGHUP.
- `for_stop`: what `gpubook stop` needs to stop one booking and write its event, and nothing more
  (no GPU probe, no scheduler, no image preparation, no SFTP service).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import cast
from zoneinfo import ZoneInfo

import paramiko

from gpubook.runtime import crash, engines, private
from gpubook.runtime.booking import ssh
from gpubook.runtime.engines import ContainerInfo, Engine
from gpubook.runtime.errors import ConfigError
from gpubook.runtime.nvidia import gpus as gpu_inventory
from gpubook.runtime.nvidia import nvml
from gpubook.runtime.private import private_folder
from gpubook.runtime.templates.catalog import TemplateSet, load_all
from gpubook.runtime.templates.images import Ledger
from gpubook.scheduler.apply.handlers import StopHandler
from gpubook.scheduler.apply.memory import Journal
from gpubook.scheduler.apply.passes import Pass, PassResult, checked_hosts
from gpubook.scheduler.calendars import Calendars, Freshness
from gpubook.scheduler.core import decide
from gpubook.scheduler.core import plan as plan_module
from gpubook.scheduler.core.bookings import Booking, Rejection
from gpubook.scheduler.core.plan import LOCAL, Plan
from gpubook.scheduler.hosts import Host, usage
from gpubook.scheduler.hosts import backend as backends
from gpubook.scheduler.hosts import sftp as sftp_host
from gpubook.scheduler.hosts.foreign import ForeignWatch
from gpubook.scheduler.hosts.images import ImagePreparer
from gpubook.scheduler.locks import hold_account_lock, hold_lock
from gpubook.scheduler.outbox import notices, status, status_file
from gpubook.scheduler.outbox.metrics import Metrics
from gpubook.scheduler.outbox.writeback import WriteBack
from gpubook.scheduler.settings import Config
from gpubook.scheduler.state import State
from gpubook.scheduler.state.folder import state_dir

log = logging.getLogger(__name__)


def make_engine(config: Config) -> Engine:
    return engines.make_engine(config.engine)


def runnable(config: Config) -> None:
    """What the daemon refuses to start with, in one sentence (the config's own checks came first)."""
    if problem := backends.config_problem(config):
        raise ConfigError(problem)


@dataclass(frozen=True)
class Base:
    """What one process makes once and a reload keeps."""

    state_dir: Path  # 0700: history, probe key, status
    engine: Engine
    state: State
    probe_key: paramiko.PKey
    locks: tuple[int, ...] = ()  # the daemon's flocks (`exclusive`), held until the process ends


def base(config: Config, *, engine: Engine | None = None, exclusive: bool = False) -> Base:
    """`exclusive`: this is the daemon (`gpubook run`), not a command borrowing its parts: take the
    state folder's lock and the account's first, before the state database is opened."""
    folder = private_folder(state_dir(config))
    # 0700 and the daemon's own: the entrypoint every container runs as root, the NVIDIA link
    # folders and the bookings' host keys are made there (issue 22, finding 12).
    private_folder(private.default_cache_dir(), own=True)
    locks = (hold_lock(folder), hold_account_lock(folder)) if exclusive else ()
    made = engine or make_engine(config)
    if exclusive and crash.arm() is not None:  # a test's GPUBOOK_CRASH_AT (runtime/crash.py); else nothing
        made = cast(Engine, crash.CrashingEngine(made))
    return Base(state_dir=folder, engine=made, state=State(folder / "state.sqlite"),
                probe_key=ssh.load_probe_key(folder / "probe-key"), locks=locks)


@dataclass(frozen=True)
class Hooks:
    """What the parts are told by, and tell, the daemon."""

    metrics: Metrics
    gpu_view: nvml.CachedView  # one live view for the sampler, the page and the metrics
    wake: Callable[[], None]  # a pass soon: a preparation or a booking's work ended, a foreign process changed
    running: Callable[[], list[ContainerInfo]]  # the containers as the last pass saw them
    event: Callable[[str], None]  # a warning for the event log


@dataclass(frozen=True)
class Parts:
    """What the daemon runs on, built again from each reloaded config."""

    config: Config
    inventory: gpu_inventory.Inventory
    monitor: Callable[[], nvml.NvmlView]
    templates: TemplateSet
    images: ImagePreparer
    backend: backends.Backend
    passes: Pass
    calendars: Calendars
    sampler: usage.Sampler
    foreign: ForeignWatch
    sftp: sftp_host.SftpService | None

    def gpu_summaries(self) -> dict[str, status.GpuSummary]:
        """Each host's GPUs for the status, as the backend gives them (this machine's, or each cluster node's)."""
        return {name: status.GpuSummary(source=gpus.source, count=gpus.count, driver=gpus.driver, note=gpus.note,
                                        indices=gpus.indices) for name, gpus in self.backend.gpus().items()}

    def gpu_view(self) -> nvml.NvmlView:
        """The GPUs' live view ([gpus] monitor); with NVML, nothing to read (and no NVML call) without a driver."""
        if self.config.gpu_monitor == "nvml" and self.inventory.source != "nvml":
            return nvml.NvmlView(None, problem="no NVIDIA driver")
        return self.monitor()

    def sample(self) -> None:
        """The sampling job: the GPUs' samples and first logins, then the processes outside bookings."""
        try:
            self.sampler()
        finally:  # one half failing never silences the other
            self.foreign()

    def status_of(self, result: PassResult, *, state: State, calendar: Freshness, previous: status.Status | None,
                  now: datetime) -> status.Status:
        """The daemon's status after the pass `result`, as daemon-status.json holds it."""
        return status_file.assemble(
            plan=result.plan, actions=result.actions, failures=result.failures, gpus=self.gpu_summaries(),
            containers=result.world.actual() if result.world is not None else [], state=state, calendar=calendar,
            engine=self.config.engine, now=now, previous=previous, images=self.images.snapshot(),
            sftp=self.sftp.status.to_json() if self.sftp is not None else None)

    def close(self) -> None:
        """Wait for the pass's bookings at work and its write-back; drop the queued preparations."""
        self.passes.close()
        self.images.close()


def build(config: Config, made: Base, hooks: Hooks, *, previous: Parts | None = None) -> Parts:
    """The parts of `config`; `previous`: the parts it replaces (a reload), closed here, whose SFTP
    service is given the new config rather than made again."""
    inventory = gpu_inventory.inventory(static_count=config.gpu_count)
    if inventory.source != "nvml":
        line = (f"no NVIDIA driver here ({inventory.problem or 'NVML lists no GPU'}): bookings run on "
                f"the [gpus] count of {inventory.count} without driver injection")
        log.warning("%s", line)
        hooks.event(line)
    templates = load_all(config.templates_dir)
    for name, problem in templates.errors.items():
        log.warning("template %s is broken and skipped: %s", name, problem.splitlines()[0])
    if previous is not None:
        previous.close()
    monitor = nvml.monitor(config.gpu_monitor)  # loaded once; the config checked that it loads
    images = ImagePreparer(engine=made.engine, ledger=Ledger(made.state_dir / "images.json"),
                           auth_file=config.images.auth_file, min_free_gb=config.images.min_free_gb,
                           workers=config.images.workers, zone=ZoneInfo(config.host.timezone), on_done=hooks.wake)
    images.on_pull = hooks.metrics.image_pulled
    backend = backends.make(config, backends.Parts(engine=made.engine, probe_key=made.probe_key, images=images,
                                                   inventory=inventory))
    # What runs on this machine, as the backend says (a cluster's bookings run on its nodes: nothing here).
    sampling = backend.sampling(hooks.running)
    passes = Pass(config, backend=backend, state=made.state, templates=templates,
                  notices=notices.Notices.from_config(config), metrics=hooks.metrics,
                  logged_in=_logged_in(sampling.logs, made.probe_key.fingerprint))
    # A booking's work that outlasted its pass (an image prepared in the background: on_done above).
    passes.on_settled = hooks.wake
    sampler = usage.Sampler(state=made.state, host=LOCAL, interval=config.daemon.sample_seconds,
                            running=sampling.running, logs=sampling.logs, probe_fingerprint=made.probe_key.fingerprint,
                            read=hooks.gpu_view.view)
    foreign = ForeignWatch(state=made.state, host=LOCAL, read=hooks.gpu_view.view, running=sampling.running,
                           mode=config.policy.foreign_processes, on_change=hooks.wake, inspect=made.engine.inspect,
                           grace=timedelta(minutes=config.policy.foreign_grace_minutes))
    sftp = _sftp(config, made, templates, images, previous.sftp if previous is not None else None)
    passes.writeback.sftp_host_key = sftp.public_key if sftp is not None else lambda: ""
    return Parts(config=config, inventory=inventory, monitor=monitor, templates=templates, images=images,
                 backend=backend, passes=passes, calendars=Calendars(config, topology=backend.topology),
                 sampler=sampler, foreign=foreign, sftp=sftp)


def _logged_in(logs: Callable[[str], str], fingerprint: str) -> Callable[[ContainerInfo], bool]:
    def logged_in(info: ContainerInfo) -> bool:
        """A release's last look for the booker's login in the container's log, read where the
        backend says (as the sampler reads it)."""
        return usage.booker_logged_in(logs(info.name), user=info.user, probe_fingerprint=fingerprint)

    return logged_in


def _sftp_etc(folder: Path) -> Path:
    return folder / "sftp" / "etc"


def _sftp(config: Config, made: Base, templates: TemplateSet, images: ImagePreparer,
          current: sftp_host.SftpService | None) -> sftp_host.SftpService | None:
    """The SFTP data service: made once, given each reloaded config (its users and keys)."""
    settings = sftp_host.settings_of(config)
    image = sftp_host.image_of(config, templates, images.ready)
    if settings is None:
        if current is not None:
            log.info("SFTP service switched off by the config: stopping it")
            current.stop(grace=config.engine.stop_grace_seconds)
        return None
    if current is None:
        private_folder(_sftp_etc(made.state_dir).parent)
        return sftp_host.SftpService(engine=made.engine, settings=settings, etc_dir=_sftp_etc(made.state_dir),
                                     image=image)
    current.configure(settings, image=image)
    return current


@dataclass
class Stopping:
    """What `gpubook stop` runs on: the backend's hosts, State, the stop handler, the write-back (in
    this thread) and the notices. No Pass: no lanes, no handlers but the stop's, no thread pool."""

    config: Config
    state: State
    backend: backends.Backend
    hosts: dict[str, Host]  # the stop handler's: `refresh_hosts` updates it
    stopper: StopHandler
    writeback: WriteBack
    templates: TemplateSet
    calendars: Calendars
    notices: Callable[[notices.Message], None] | None

    def refresh_hosts(self) -> str:
        """The backend's hosts read again, as a pass reads them ("" or why they could not be read)."""
        problem = self.backend.refresh()
        self.hosts.update(checked_hosts(self.backend.hosts, known=self.hosts))
        return problem

    def stop_now(self, booking_id: str, *, now: datetime) -> bool:
        """Stop a booking's container at once; it is not started again (its record says an admin
        stopped it, before the container goes); its notice delivered before this returns."""
        name = engines.container_name(booking_id)
        host = next((h for h in self.hosts.values() if h.inspect(name) is not None), None)
        if host is None:
            return False
        self.stopper(decide.Stop(name, booking_id, decide.ADMIN_STOP, self.config.engine.stop_grace_seconds,
                                 host.name), now=now)
        notices.deliver_pending(self.state, self.notices, now=now)
        return True

    def plan(self, occurrences: Sequence[Booking | Rejection], *, now: datetime) -> Plan:
        """The stopped booking's place in the plan, for its event's ended block (nothing runs for it)."""
        return plan_module.plan(occurrences, inventory={name: host.gpus for name, host in self.hosts.items()},
                                config=self.config, now=now, topology=self.backend.topology,
                                templates=frozenset(self.templates.templates) | frozenset(self.templates.errors))

    def containers(self) -> list[ContainerInfo]:
        return [info for host in self.hosts.values() for info in host.list()]

    def close(self) -> None:
        self.writeback.close()
        self.state.close()


def for_stop(config: Config) -> Stopping:
    """The parts that stop one booking's container and write its event, beside a running daemon:
    the engine, State, the backend's hosts, the stop handler and the write-back; no GPU is probed
    and nothing is scheduled, prepared or served."""
    runnable(config)
    folder = private_folder(state_dir(config))
    engine = make_engine(config)
    state = State(folder / "state.sqlite")
    backend = backends.make(config, backends.Parts(
        engine=engine, probe_key=ssh.load_probe_key(folder / "probe-key"),
        images=ImagePreparer(engine=engine, ledger=Ledger(folder / "images.json")),
        inventory=gpu_inventory.Inventory("none", None, problem="not read: a stop places nothing")))
    hosts = dict(checked_hosts(backend.hosts))
    writeback = WriteBack(config, state, address=backend.address, inline=True)
    writeback.sftp_host_key = lambda: _public_key(_sftp_etc(folder))  # the running service's, if any
    stopper = StopHandler(hosts=hosts, state=state, journal=Journal(state), timezone=config.host.timezone)
    return Stopping(config=config, state=state, backend=backend, hosts=hosts, stopper=stopper, writeback=writeback,
                    templates=load_all(config.templates_dir), calendars=Calendars(config, topology=backend.topology),
                    notices=notices.Notices.from_config(config))


def _public_key(etc_dir: Path) -> str:
    """The SFTP service's public host key line, as the daemon's service gives it (SftpService.public_key)."""
    try:
        return (etc_dir / "host_key.pub").read_text().strip()
    except OSError:
        return ""
