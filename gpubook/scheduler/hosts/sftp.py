"""The SFTP data service of the local host: one always-on container beside the bookings.

OpenSSH's sshd with internal-sftp (gpubook/runtime/data/sftp.py writes its files): every configured user, with
the same keys as their bookings, gets `input/`, `output/` (and `home/`) of `<data_root>/<user>`
at any time, chrooted there, with no shell and nothing forwarded. The daemon calls `check()` every
`[sftp] check_seconds`: it makes the users' folders (so they can upload before a first booking),
measures each user's space against `[storage] quota_gb`, rewrites sshd's files, starts the
container when it is not running (killed, crashed, first start) and sends sshd a SIGHUP when its
config changed. Like booking containers, the service outlives the daemon: a new daemon finds it
running with the same spec and keeps it.

Users and keys are files sshd reads at each login, so a change never drops another user's
transfer; a removed user's or an over-quota user's open sessions are ended (`pkill -u UID` as the
container's root: the uid is theirs alone, the config checks that).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from gpubook.runtime import engines
from gpubook.runtime.data import sftp, storage
from gpubook.runtime.engines import ContainerInfo, Engine, ServiceSpec
from gpubook.runtime.errors import GpubookError, TemplateError
from gpubook.runtime.mounts import Mount
from gpubook.runtime.templates.catalog import Template, TemplateSet
from gpubook.scheduler.settings import Config

log = logging.getLogger(__name__)

SERVICE = "sftp"
PIDS_LIMIT = 4096  # sshd forks a process or two per session
BIND_SECONDS = 10.0  # how long a start waits for sshd to say it listens on every address
MEMORY_LIMIT = "1g"  # sshd and an sftp-server per session take a few MB each (issue 22, finding 6)
USAGE_SECONDS = 300.0  # without a quota, how often each user's space is measured (for `status`)


@dataclass(frozen=True)
class SftpSettings:
    """What the service needs from the config (read again at each SIGHUP)."""

    port: int
    listen: str
    data_root: Path
    users: tuple[sftp.SftpUser, ...]  # quota notes not set yet
    quota_bytes: int | None = None
    quota_files: int | None = None
    measure_seconds: float = 20.0
    persistent_home: bool = False
    host_network: bool = True  # [sftp] network = "host": sshd itself binds `listen`; else the engine publishes it


@dataclass(frozen=True)
class Usage:
    """A user's space as last measured; `complete` False: a lower bound (the walk stopped at its
    time bound, at a quota, or met something unreadable)."""

    bytes: int
    quota: int | None
    files: int = 0
    quota_files: int | None = None
    complete: bool = True
    timed_out: bool = False

    @property
    def over(self) -> bool:
        """Past a quota, or not measurable within its bound while a quota holds: a walk made slow on
        purpose (a million empty files) must not buy unmeasured space, so it fails closed."""
        if self.quota is None and self.quota_files is None:
            return False
        return ((self.quota is not None and self.bytes > self.quota)
                or (self.quota_files is not None and self.files > self.quota_files) or self.timed_out
                or not self.complete)


@dataclass(frozen=True)
class SftpStatus:
    """The service as `gpubook status` and daemon-status.json show it."""

    port: int
    listen: str
    running: bool
    container: str
    restarts: int = 0
    host_key: str = ""  # "ssh-ed25519 AAAA...": what the users' known_hosts gets
    problem: str | None = None
    usage: dict[str, Usage] = field(default_factory=dict)
    left_out: tuple[str, ...] = ()

    def to_json(self) -> dict[str, object]:
        return {"port": self.port, "listen": self.listen, "running": self.running,
                "container": self.container, "restarts": self.restarts, "problem": self.problem,
                "host_key": self.host_key,
                "left_out": list(self.left_out),
                "usage": {name: {"bytes": u.bytes, "quota": u.quota, "files": u.files, "quota_files": u.quota_files,
                                 "complete": u.complete, "over": u.over}
                          for name, u in sorted(self.usage.items())}}


def users_of(config: Config) -> tuple[sftp.SftpUser, ...]:
    """The config's users as the service's accounts (their container ids and keys)."""
    return tuple(sftp.SftpUser(name=user.name, uid=user.uid, gid=user.gid, keys=user.ssh_keys)
                 for user in config.users.values())


def settings_of(config: Config) -> SftpSettings | None:
    """The service's settings, or None when it is off ([sftp] enabled false, or no data_root)."""
    if not config.sftp.enabled or config.storage.data_root is None:
        return None
    quota = config.storage.quota_gb
    return SftpSettings(port=config.sftp.port, listen=config.sftp.listen, data_root=config.storage.data_root,
                        users=users_of(config), quota_bytes=round(quota * 1e9) if quota is not None else None,
                        quota_files=config.storage.quota_files, measure_seconds=config.sftp.measure_seconds,
                        persistent_home=config.storage.persistent_home,
                        host_network=config.sftp.network == "host")


def image_of(config: Config, templates: TemplateSet, overlay: Callable[[Template], str]) -> Callable[[], str]:
    """The image the service runs, through `overlay`: its template's image (which needs sshd) or
    that image's sshd overlay (raises Preparing while either is prepared in the background)."""
    name = config.sftp.template

    def image() -> str:
        template = templates.templates.get(name)
        if template is None:
            why = templates.errors.get(name, "there is no such template")
            raise TemplateError(f"[sftp] template {name}: {why.splitlines()[0]}")
        return overlay(template)

    return image


def quota_note(user: str, usage: Usage, *, seconds: float = 0.0) -> str:
    end = "uploads are refused until you delete files (rm in input/, output/ or home/)."
    if usage.quota_files is not None and usage.files > usage.quota_files:
        return f"gpubook: {user} has {usage.files} files and folders, over a quota of {usage.quota_files}: {end}"
    if usage.quota is not None and usage.bytes > usage.quota:
        return f"gpubook: {user} uses {usage.bytes / 1e9:.3g} GB of a {usage.quota / 1e9:g} GB quota: {end}"
    if usage.timed_out:
        return (f"gpubook: {user}'s folder could not be measured within {seconds:g} s (at least {usage.files} "
                f"files, {usage.bytes / 1e9:.3g} GB): {end}")
    return (f"gpubook: part of {user}'s folder could not be read to measure it (at least {usage.files} files, "
            f"{usage.bytes / 1e9:.3g} GB): {end}")


class SftpService:
    def __init__(self, *, engine: Engine, settings: SftpSettings, etc_dir: Path,
                 image: Callable[[], str], name: str = sftp.SERVICE_NAME) -> None:
        """`etc_dir`: a folder of the daemon's for sshd's files; `image`: the image to run (it may
        raise Preparing while it is being built); `name`: the container's."""
        self.engine = engine
        self.services = engines.service_runner(engine, why="the SFTP service ([sftp] enabled)")
        self.settings = settings
        self.etc_dir = etc_dir
        self.image = image
        self.name = name
        self._lock = threading.Lock()
        self._served: tuple[sftp.SftpUser, ...] = ()
        self._usage: dict[str, Usage] = {}  # each user's space at the last measure
        self._measured_at = -USAGE_SECONDS
        self._restarts = 0
        self._seccomp: Path | None = None  # written at the first start: it depends on nothing that changes
        self._alive: tuple[str, int, str] | None = None  # (spec hash, host pid, its start time) last seen running
        self.status = SftpStatus(port=settings.port, listen=settings.listen, running=False, container=self.name)

    def configure(self, settings: SftpSettings, *, image: Callable[[], str] | None = None) -> None:
        """A reloaded config: the next check applies it."""
        with self._lock:
            self.settings = settings
            self.image = image or self.image

    def public_key(self) -> str:
        """The service's public host key line ("" before its first check made it): what the
        events' known_hosts line for the SFTP port carries."""
        try:
            return (self.etc_dir / "host_key.pub").read_text().strip()
        except OSError:
            return ""

    def stop(self, *, grace: float) -> None:
        with self._lock:
            self.engine.stop(self.name, grace)
            self._alive = None

    def check(self) -> SftpStatus:
        """Folders, quotas, files, container: one round of the watch (never raises)."""
        with self._lock:
            try:
                self.status = self._check()
            except GpubookError as error:
                log.warning("SFTP service: %s", error)
                self.status = SftpStatus(port=self.settings.port, listen=self.settings.listen, running=False,
                                         container=self.name, restarts=self._restarts, problem=str(error))
            return self.status

    def _check(self) -> SftpStatus:
        settings = self.settings
        problem = storage.mount_problem(settings.data_root)
        if problem is not None:
            raise sftp.SftpError(problem)
        users, left_out = sftp.usable(settings.users)
        usage: dict[str, Usage] = {}
        served = []
        # With a quota, every check measures (it enforces); without, `status` gets a figure this often.
        quota = settings.quota_bytes is not None or settings.quota_files is not None
        measure = quota or time.monotonic() - self._measured_at >= USAGE_SECONDS
        if measure:
            self._measured_at = time.monotonic()
        for user in users:
            folders = self._folders(user)
            used = None if measure else self._usage.get(user.name)
            if used is None:
                used = self._usage[user.name] = self._measure(settings, folders.input.parent)
            usage[user.name] = used
            note = quota_note(user.name, used, seconds=settings.measure_seconds) if used.over else None
            _note_file(folders.input.parent, note)
            served.append(sftp.SftpUser(name=user.name, uid=user.uid, gid=user.gid, keys=user.keys,
                                        quota_note=note))
        inside = settings.listen if settings.host_network else "0.0.0.0"  # noqa: S104 - the container's own network
        written = sftp.write_files(self.etc_dir, port=settings.port, listen=inside, users=served,
                                   previous=self._served)
        running, started = self._ensure(settings)
        if written.config_changed and not started:
            self.services.signal(self.name, "HUP")  # sshd re-executes its listener; sessions go on
        newly_over = _over_quota(served) - _over_quota(self._served)
        for user in (*written.removed, *(u for u in served if u.name in newly_over)):
            self._end_sessions(user, why="removed" if user in written.removed else "over quota")
        for name in sorted(newly_over):
            log.warning("SFTP: %s is over quota (%s); uploads refused until they delete", name, usage[name].bytes)
        self._served = tuple(served)
        return SftpStatus(port=settings.port, listen=settings.listen, running=running, container=self.name,
                          restarts=self._restarts, usage=usage, left_out=tuple(left_out), host_key=written.host_key)

    def _measure(self, settings: SftpSettings, folder: Path) -> Usage:
        """The user's whole folder (home/ and folders they closed with chmod 700 included),
        measured as the owner of their files, in `measure_seconds` at most; it stops early once
        past a quota (walking on would only cost time)."""
        found = sftp.measure(folder, owner_argv=engines.data_owner_argv(self.engine), seconds=settings.measure_seconds,
                             stop_bytes=settings.quota_bytes, stop_files=settings.quota_files)
        if found.timed_out or found.unreadable:
            why = f"not measured within {settings.measure_seconds:g} s" if found.timed_out else \
                f"{found.unreadable} entries could not be read"
            log.warning("SFTP: %s: %s; at least %s bytes in %s files", folder, why, found.bytes, found.files)
        return Usage(bytes=found.bytes, quota=settings.quota_bytes, files=found.files, quota_files=settings.quota_files,
                     complete=found.complete or not (found.timed_out or found.unreadable), timed_out=found.timed_out)

    def _folders(self, user: sftp.SftpUser) -> storage.DataFolders:
        uid, gid = engines.host_owner(self.engine, user.uid, user.gid)
        return storage.prepare(self.settings.data_root, user.name, uid=uid, gid=gid,
                               home=self.settings.persistent_home, chown=engines.chown_for(self.engine))

    def _ensure(self, settings: SftpSettings) -> tuple[bool, bool]:
        """Whether the container runs, and whether this call started it. While the process seen
        running with this spec is still there (/proc), the engine is not asked at all: a check
        costs no engine command when nothing happened."""
        spec = self.spec(settings)
        alive = self._alive
        if alive is not None and alive[0] == spec.spec_hash and _started_at(alive[1]) == alive[2]:
            return True, False
        current = self.services.inspect_service(self.name)
        if current is not None and current.running and current.spec_hash == spec.spec_hash:
            self._remember(spec, current)
            return True, False
        if current is not None:
            self._restarts += 1
            why = "was not running" if not current.running else "had another spec"
            log.warning("SFTP service %s %s (%s): starting it again", self.name, why, current.state)
        if current is None or not current.running:  # else its own sshd holds the port
            self._refuse_squatter(settings, sftp.taken_address(settings.port, sftp.listen_addresses(settings.listen)))
        info = self.services.start_service(spec)
        log.info("SFTP service started on %s:%s", settings.listen, settings.port)
        if settings.host_network:
            self._check_bound(settings)
        self._remember(spec, info)
        return info.running, True

    def _refuse_squatter(self, settings: SftpSettings, address: str | None) -> None:
        if address is not None:
            raise sftp.SftpError(
                f"port {settings.port} on {address} is held by another process: the SFTP service does not "
                f"start, since clients reaching that address would meet it instead of the service; find "
                f"it with `ss -ltnp 'sport = :{settings.port}'`")

    def _check_bound(self, settings: SftpSettings) -> None:
        """sshd bound every address, or the service is stopped: a squatter that took one between
        the probe and sshd's bind would otherwise answer that address family's clients."""
        wanted = len(sftp.listen_addresses(settings.listen))
        deadline = time.monotonic() + BIND_SECONDS
        while time.monotonic() < deadline:
            text = self.engine.logs(self.name, tail=200)
            failed = sftp.bind_failures(text, settings.port)
            if failed:
                self.engine.stop(self.name, 1)
                self._alive = None
                self._refuse_squatter(settings, failed[0])
            # Each address ends in one of the two lines (an address family the host lacks fails otherwise).
            if text.count("Server listening on ") + text.count(f"Bind to port {settings.port} on ") >= wanted:
                return
            time.sleep(0.2)

    def _remember(self, spec: ServiceSpec, info: ContainerInfo) -> None:
        started = _started_at(info.pid) if info.pid else None
        self._alive = (spec.spec_hash, info.pid, started) if started else None

    def spec(self, settings: SftpSettings) -> ServiceSpec:
        if self._seccomp is None:
            self._seccomp = sftp.write_seccomp(self.etc_dir.parent / f"{self.name}-seccomp.json")
        profile = self._seccomp
        return ServiceSpec(
            name=self.name, service=SERVICE, image=self.image(), port=settings.port, listen=settings.listen,
            command=sftp.COMMAND, capabilities=sftp.CAPABILITIES, seccomp=profile, pids_limit=PIDS_LIMIT,
            memory=MEMORY_LIMIT,
            host_network=settings.host_network,
            mounts=(Mount(self.etc_dir, sftp.ETC_TARGET, read_only=True),
                    Mount(settings.data_root.resolve(), sftp.DATA_TARGET, read_only=False)),
        )

    def _end_sessions(self, user: sftp.SftpUser, *, why: str) -> None:
        try:
            done = self.engine.exec(self.name, ["pkill", "-KILL", "-u", str(user.uid)], user="0", timeout=30)
        except GpubookError as error:
            log.warning("SFTP: could not end %s's sessions (%s): %s", user.name, why, error)
            return
        if done.returncode == 0:
            log.warning("SFTP: %s's open sessions ended (%s)", user.name, why)


def _over_quota(users: tuple[sftp.SftpUser, ...] | list[sftp.SftpUser]) -> set[str]:
    return {user.name for user in users if user.quota_note is not None}


def _note_file(user_dir: Path, note: str | None) -> None:
    """OVER-QUOTA.txt at the top of the user's folder (the daemon's, read-only to them) while they
    are over their quota: what `ls` shows them, with the figures the login banner points to."""
    path = user_dir / sftp.OVER_QUOTA_FILE
    if note is None:
        path.unlink(missing_ok=True)
    else:
        sftp.write_public(path, note + "\n")


def _started_at(pid: int) -> str | None:
    """The start time of process `pid` (field 22 of /proc/PID/stat), None when it is gone: with
    the pid it names one process, never a later one that got the same number."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text.rsplit(")", 1)[-1].split()[19]
