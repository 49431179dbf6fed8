"""Podman, rootless first (and rootful where the GPU host only allows that).

Every setting that rootless podman would otherwise read from per-user config files is passed as a
global flag, so the daemon behaves the same under a systemd user session, a plain `runuser`, or
root; except the storage driver, which by default follows the user's own podman configuration:
overriding it makes podman refuse a store that was made with another driver.
"""

from __future__ import annotations

import builtins
import contextlib
import fcntl
import hashlib
import json
import logging
import os
import re
import resource
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from gpubook.runtime import cgroups, network
from gpubook.runtime.checks import Check
from gpubook.runtime.data import storage
from gpubook.runtime.engines import conmon
from gpubook.runtime.engines.cli_engine import (
    LOG_MAX_SIZE,
    QUICK_TIMEOUT,
    CliEngine,
    checked_proc_path,
    message_of,
)
from gpubook.runtime.engines.cli_images import LABEL_WARM, WARM_PREFIX
from gpubook.runtime.engines.spec import (
    CONTAINER_PREFIX,
    LABEL_BOOKING,
    ContainerInfo,
    ContainerSpec,
    info_from_labels,
    permanent,
)
from gpubook.runtime.errors import EngineError

if TYPE_CHECKING:
    from gpubook.runtime.engines import EngineOptions, EngineSettings
    from gpubook.runtime.nvidia.model import GpuInjection

log = logging.getLogger(__name__)

# Rootful podman (euid 0) maps container ids 0..N onto host ids starting here: far above any real
# account and any /etc/subuid range that useradd hands out.
ROOTFUL_ID_BASE = 1_000_000_000
CONTAINER_ID_COUNT = 65536
# slirp4netns's port handler: "rootlesskit" (podman's default: rootlessport proxies each connection
# in user space; the source address inside is not the client's) or "slirp4netns" (slirp forwards
# it, keeping the source address). Measured by bench/container_start.py and bench/network_copy.py
# (bench/results/network-2026-11-22): no slower to start, 5-11 % faster to copy through than slirp4netns.
PORT_HANDLER = "rootlesskit"
NPROC = 32768  # rootful default: runc was refused 65536 on the GPU host and on Debian 12

# podman 4: `database storage graph driver "" does not match our storage graph driver "overlay"`;
# older: `database graph driver "vfs" does not match our graph driver "overlay"`.
_DRIVER_MISMATCH = re.compile(
    r'database (?:storage )?graph driver "(?P<store>[^"]*)" does not match our '
    r'(?:storage )?graph driver "(?P<ours>[^"]*)"'
)


def warm_name(image: str) -> str:
    """The container `PodmanEngine.warm` makes for `image` (one name per image: a crash's leftover
    is found again)."""
    return WARM_PREFIX + hashlib.sha256(image.encode()).hexdigest()[:12]


def pause_pid() -> int | None:
    """Rootless podman's pause process, while it runs (its pid file names a live process of this
    account): then podman's namespaces are there, and a refusal saying otherwise is not podman's.
    None for rootful podman, which has none."""
    if os.geteuid() == 0:
        return None
    runtime = os.environ.get("XDG_RUNTIME_DIR") or f"/run/user/{os.getuid()}"
    try:
        pid = int(Path(runtime, "libpod", "tmp", "pause.pid").read_text().strip())
        if pid > 0 and Path(f"/proc/{pid}").stat().st_uid == os.getuid():
            return pid
    except (OSError, ValueError):
        pass
    return None


def _has_ipv6() -> bool:
    """This host can listen on IPv6 (else nobody can squat [::] either, and publishing there fails)."""
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as probe:
            probe.bind(("::", 0))
    except OSError:
        return False
    return True


@dataclass(frozen=True)
class SubordinateIds:
    """The daemon user's subordinate ids: intermediate id 1+N is host id `base+N`."""

    uid_base: int
    uid_count: int
    gid_base: int
    gid_count: int

    def inner_uid(self, host: int) -> int:
        return _inner(host, self.uid_base, self.uid_count, what="uid")

    def inner_gid(self, host: int) -> int:
        return _inner(host, self.gid_base, self.gid_count, what="gid")


def _inner(host: int, base: int, count: int, *, what: str) -> int:
    if not base <= host < base + count:
        raise EngineError(f"host {what} {host} is not one of the daemon's subordinate {what}s")
    return host - base + 1


STORE_DU_TIMEOUT = 120.0  # seconds for measuring the store (doctor)
WARM_TIMEOUT = 3600.0  # seconds for the copy of an image's layers chowned to the bookings' id map
LOCK_POLL = 0.05  # seconds between tries for the command lock (command_lock)
COMMAND_LOCK = "gpubook-podman.lock"


def command_lock_path() -> Path | None:
    """The lock file of this user's podman commands (command_lock): in its runtime folder (private,
    on tmpfs), /run for root; None where there is none (no lock: a host without a runtime folder)."""
    runtime = os.environ.get("XDG_RUNTIME_DIR") or f"/run/user/{os.getuid()}"
    folder = Path("/run") if os.geteuid() == 0 else Path(runtime)
    return folder / COMMAND_LOCK if folder.is_dir() and os.access(folder, os.W_OK) else None


def _store_of(info: str) -> dict[str, str]:
    """The "store" part of `podman info --format json`."""
    try:
        store = json.loads(info).get("store")
    except (ValueError, AttributeError):
        return {}
    return store if isinstance(store, dict) else {}


def _subordinate_range(text: str, name: str) -> tuple[int, int]:
    """The host base and count of the line of `podman unshare cat /proc/self/<name>` that starts
    at intermediate id 1 (id 0 is the daemon's own)."""
    for line in text.splitlines():
        fields = line.split()
        if len(fields) == 3 and fields[0] == "1":
            return int(fields[1]), int(fields[2])
    raise permanent(
        f"rootless podman maps no subordinate ids ({name}: {text.strip()!r}); give the daemon's "
        f"user a range in /etc/subuid and /etc/subgid (usermod --add-subuids/--add-subgids)"
    )


def _is_missing_network(stderr: str) -> bool:
    return "unable to find network" in stderr or "network not found" in stderr


cgroup_version = cgroups.cgroup_version  # where it was before runtime.cgroups


# What podman 4.3 says once the namespaces that every container of this user was made in are gone:
# its pause process, which holds them, ended (a `kill`, a Slurm job's end) while a container was
# recorded running. With none of the containers' conmons left to join instead, every command fails:
# 'invalid internal status, try resetting the pause process with "podman system migrate"'. Once a new
# pause process made new namespaces, every `ps` that reads such a container fails: its network
# namespace was a mount in the old ones ("joining network namespace of container ID: … unknown FS magic").
# podman's own refusal once its pause process is gone ("Error: invalid internal status, try resetting the
# pause process with \"podman system migrate\": …"), at the start of one of its lines: anywhere else it is
# text a booker can make a command print (a file name `du` complains of, a build's RUN), and `podman
# system migrate` stops every container of the account (round 3, M3).
_NO_NAMESPACES = re.compile(r'^(Error: |time="[^"]*" level=(error|fatal) msg=")invalid internal status', re.MULTILINE)
# Commands whose standard error carries what runs inside a container or an image's build: never a reason.
_FOREIGN_STDERR = frozenset({"unshare", "build", "pull", "push", "exec", "logs", "load", "import"})
_LOST_NETNS = re.compile(r"joining network namespace of container (?P<id>[0-9a-f]{64}): "
                         r"retrieving network namespace at \S+: unknown FS magic")
LOST_LIMIT = 64  # containers with a lost network namespace removed in one listing, at most
MIGRATE_TIMEOUT = 600.0  # seconds for `podman system migrate` (it stops each container recorded running)


class PodmanEngine(CliEngine):
    name = "podman"
    package = "podman"

    def __init__(self, settings: EngineSettings, options: EngineOptions) -> None:
        super().__init__(settings, options)
        self.runtime = settings.runtime
        self.storage_driver = settings.storage_driver
        self.cgroup_manager = options.cgroup_manager
        self._subordinate: SubordinateIds | None = None
        self._graph_root: Path | None = None
        self._placement: cgroups.Placement | None = None
        self._prepared = False
        self._used: set[tuple[str, str]] = set()  # (image, id map) of containers made (first_use)
        self._used_lock = threading.Lock()
        self._reset_lock = threading.Lock()
        self._reset_at = float("-inf")  # when `podman system migrate` last ended (monotonic)
        self._starting: set[str] = set()  # names of containers whose start is in progress (guarded by _used_lock)
        self._suspects: set[str] = set()  # ids of conmons running unlisted at the last listing (_sweep)

    def engine_checks(self) -> builtins.list[Check]:
        binary = self.binary_check()
        if not binary.ok:
            return [binary]
        if os.geteuid() != 0 and not shutil.which("newuidmap"):
            return [
                Check(
                    "engine",
                    False,
                    f"{binary.detail}, but newuidmap is missing (rootless podman needs it)",
                    "install the uidmap package",
                )
            ]
        return [binary, self.storage_check(), self.limits_check()]

    def network_checks(self) -> builtins.list[Check]:
        """Rootless: slirp4netns and the tun device it opens; rootful: the network backend and the
        firewall that make each booking's bridge (podman_network.py)."""
        checks = super().network_checks()
        if self.network == "host":
            return checks
        if os.geteuid() != 0:
            return [*checks, network.slirp4netns_check(), network.tun_check()]
        from gpubook.runtime.engines import podman_network  # rootful hosts only

        return [*checks, podman_network.backend_check(self)]

    def storage_check(self) -> Check:
        """`podman info` with gpubook's own flags: the cheapest command that opens the store."""
        try:
            done = self._process(["info", "--format", "json"], timeout=QUICK_TIMEOUT)
        except EngineError as error:  # no answer in time, or the binary gone meanwhile
            return Check("engine storage", False, f"podman info: {error}", "run `podman info` as this user")
        if done.returncode != 0:
            return self._storage_failure(message_of(done))
        store = _store_of(done.stdout)
        if self._graph_root is None and store.get("graphRoot"):
            self._graph_root = Path(store["graphRoot"])  # storage_path's answer, without a second `podman info`
        driver, root = store.get("graphDriverName", "?"), store.get("graphRoot", "?")
        if driver == "vfs":
            return Check(
                "engine storage",
                False,
                f"driver vfs, store {root}: every start copies the whole image (seconds per start, "
                "and the image's size again on disk for each booking)",
                'before the store is first used, put [storage] driver = "overlay" in '
                "~/.config/containers/storage.conf; for a store made already, `podman system reset` "
                "(it removes its images and containers) and then the same",
            )
        return Check("engine storage", True, f"driver {driver}, store {root}")

    def data_root_check(self, root: Path) -> Check | None:
        """Rootless podman sees data_root as the host does: a nosuid,nodev mount (else None: it
        does, or podman runs as root in the host's namespace, or does not run: its own checks say why)."""
        if os.geteuid() == 0:
            return None
        try:
            done = self._process(["unshare", "cat", "/proc/self/mountinfo"], timeout=60)
        except (OSError, EngineError) as error:
            return Check("data_root", False, f"could not look into rootless podman's mount namespace: {error}",
                         "check `podman unshare true` as this user")
        if done.returncode != 0:
            return None  # the engine's own checks say why podman does not run
        problem = storage.mountinfo_problem(done.stdout, root)
        if problem is None:
            return None
        return Check("data_root", False, f"{root} is a nosuid,nodev mount on the host but not in rootless podman's "
                     f"mount namespace ({problem}): it was mounted after podman's pause process started, and / is "
                     "not a shared mount (hosts without systemd)",
                     "as this user, `podman system migrate` between bookings (it ends the pause process); as "
                     "root, keep / shared before mounting data roots (`mount --make-rshared /`, as systemd does at "
                     "boot)")

    def _storage_failure(self, message: str) -> Check:
        mismatch = _DRIVER_MISMATCH.search(message)
        if mismatch is None:
            return Check(
                "engine storage",
                False,
                f"podman info: {message[:300]}",
                "run `podman info` as this user and fix what it reports",
            )
        store, ours = mismatch.group("store"), mismatch.group("ours")
        made_with = f'"{store}"' if store else "podman's default driver"
        return Check(
            "engine storage",
            False,
            f"podman's store was made with {made_with} but gpubook asks for \"{ours}\" "
            f"([engine] storage_driver), so every podman command fails: {message[:200]}",
            "remove [engine] storage_driver so podman uses its store's own driver"
            + (f' (or set it to "{store}")' if store else "")
            + ", or run `podman system reset` if the store's images and containers may be lost",
        )

    # --- podman's own flags --------------------------------------------------------------------

    def global_argv(self) -> builtins.list[str]:
        argv = [self.binary, *self.global_args]
        if self.runtime:
            argv += ["--runtime", self.runtime]
        if self.storage_driver:
            argv += ["--storage-driver", self.storage_driver]
        manager = self.placement().manager if self.cgroup_manager == "auto" else self.cgroup_manager
        if manager:
            argv += ["--cgroup-manager", manager]
        return argv + ["--events-backend", "file"]

    def placement(self) -> cgroups.Placement:
        """Where containers' cgroups go on this host and whether limits hold (read once)."""
        if self._placement is None:
            self._placement = cgroups.placement(euid=os.geteuid(), env=os.environ)
        return self._placement

    def cgroup_args(self) -> builtins.list[str]:
        """In a delegated subtree (cgroup v2, no systemd), rootless podman sets limits only for a
        container given a cgroup parent there (see runtime.cgroups); elsewhere its own choice."""
        if self.cgroup_manager != "auto" or os.geteuid() == 0:
            return []
        parent = self.placement().parent
        if parent is None:
            return []
        if not self._prepared:
            try:
                cgroups.prepare_bookings(parent)
            except cgroups.DelegationError as error:
                raise permanent(f"the delegated cgroup {parent}: {error}") from None
            self._prepared = True
        return ["--cgroup-parent", parent]

    def log_args(self) -> builtins.list[str]:
        """k8s-file, podman's driver that honours max-size (conmon truncates the file there);
        journald's would not, and its size is the journal's."""
        return ["--log-driver", "k8s-file", "--log-opt", f"max-size={LOG_MAX_SIZE}"]

    def auth_args(self, auth_file: Path | None, folder: Path) -> tuple[builtins.list[str], builtins.list[str]]:
        return [], ([] if auth_file is None else ["--authfile", str(auth_file)])

    def storage_path(self) -> Path:
        """The store's graph root, asked once per engine (or read from storage_check's answer): each
        `podman info` asks dpkg for the versions of podman's helpers, about 0.4 s of CPU."""
        if self._graph_root is None:
            self._graph_root = Path(self._call(["info", "--format", "{{.Store.GraphRoot}}"]).strip())
        return self._graph_root

    def store_usage(self) -> tuple[int, int]:
        """The store: how many images (`podman system df`), and the bytes it takes on disk, the
        chowned copies of images included (`du` of the store as podman sees it: `podman system
        df` counts shared layers once per image and no copy)."""
        count = 0
        for line in self._call(["system", "df", "--format", "{{json .}}"]).splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict) and row.get("Type") == "Images":
                count = int(row.get("Total") or 0)
        du = ["du", "-sb", "--", str(self.storage_path())]
        if os.geteuid() != 0:  # the copies belong to subordinate ids: read inside podman's namespace
            done = self._process(["unshare", *du], timeout=STORE_DU_TIMEOUT)
        else:
            try:
                done = subprocess.run(du, capture_output=True, text=True, timeout=STORE_DU_TIMEOUT, check=False)
            except (OSError, subprocess.TimeoutExpired) as error:
                raise EngineError(f"du of the store: {error}") from None
        try:
            return count, int(done.stdout.split()[0])
        except (IndexError, ValueError):
            raise EngineError(f"du of the store: {message_of(done)}") from None

    def pull_scratch(self) -> Path | None:
        """Beside the store, on its file system: a pull's blobs land there before their layers
        are applied (podman's default, /var/tmp, may be a small tmpfs)."""
        return self.storage_path().parent / "gpubook-pulls"

    def present_layers(self) -> set[str]:
        """The digests (compressed and not) of the layers in the store (its overlay-layers/
        layers.json): a pull does not download a layer whose content is there; empty when it
        cannot be read."""
        driver = self.storage_driver or "overlay"
        try:
            layers = json.loads((self.storage_path() / f"{driver}-layers" / "layers.json").read_text())
        except (OSError, ValueError, EngineError):
            return set()
        return {str(layer[name]) for layer in layers if isinstance(layer, dict)
                for name in ("compressed-diff-digest", "diff-digest") if layer.get(name)}

    def warm(self, image: str) -> None:
        """Pay a first start's cost once, now: rootless podman cannot use idmapped mounts, so the
        first container of an image with the bookings' id map (`userns_args`) makes a copy of the
        image's layers chowned to it (seconds per GB; podman keeps it with the image for every
        later container with the same map). A container is created, never started, and removed."""
        name = warm_name(image)
        self._process(["rm", "--force", "--ignore", name], timeout=QUICK_TIMEOUT)  # a crash's leftover
        self._call(["create", "--name", name, "--label", f"{LABEL_WARM}=1", "--network", "none", "--pull", "never",
                    *self._map_args(), image, "true"], timeout=WARM_TIMEOUT, exclusive=True)
        self.used(image, "booking")
        self._call(["rm", "--force", name])

    def first_use(self, image: str, kind: str) -> bool:
        """Until this process has made a container of `image` with that map (its warm-up, or a start
        that made the chowned copy itself: a Slurm step, a start before the warm-up, the service)."""
        with self._used_lock:
            return (image, kind) not in self._used

    def used(self, image: str, kind: str) -> None:
        with self._used_lock:
            self._used.add((image, kind))

    def unused(self, image: str) -> None:
        with self._used_lock:
            self._used = {(name, kind) for name, kind in self._used if name != image}

    @contextlib.contextmanager
    def command_lock(self, *, exclusive: bool = False, timeout: float = QUICK_TIMEOUT) -> Iterator[None]:
        """Every podman command of this user runs under a shared lock, one that may make an image's
        chowned copy (warm, a process's first start: first_use) under an exclusive one. Making the
        copy, podman mounts the new layer under the store's overlay folder and chowns it from a
        helper process; a podman command that starts meanwhile
        while that folder is no mount point (the last command with nothing mounted unmounted it)
        bind-mounts the folder over itself, without the mounts beneath, and the helper chowns an
        empty folder: the copy is recorded complete and empty, and every later booking of the image
        fails with "open …/merged/etc/hosts: permission denied" (seen in CI; made at will by
        tests/test_podman_engine.py). Other commands wait for it, at most their own time."""
        path = command_lock_path()
        if path is None:
            yield
            return
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            deadline = time.monotonic() + timeout
            while True:
                try:
                    fcntl.flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        raise EngineError(f"podman: a command making an image's chowned copy (its warm-up or first "
                                          f"start) still runs after {timeout:.0f} s; this one waits for it") from None
                    time.sleep(LOCK_POLL)
            yield
        finally:
            os.close(fd)

    def _process(self, args: Sequence[str], *, timeout: float, env: Mapping[str, str] | None = None,
                 exclusive: bool = False) -> subprocess.CompletedProcess[str]:
        """The command, and once more after `podman system migrate` where podman refused it because the
        namespaces of this user's containers are gone (_NO_NAMESPACES): without that, no podman
        command of gpubook's would work again, and no booking would start or stop."""
        started = time.monotonic()
        done = super()._process(args, timeout=timeout, env=env, exclusive=exclusive)
        if done.returncode != 0 and args and args[0] not in _FOREIGN_STDERR and _NO_NAMESPACES.search(done.stderr) \
                and pause_pid() is None and self._reset_namespaces(since=started):
            done = super()._process(args, timeout=timeout, env=env, exclusive=exclusive)
        return done

    def _reset_namespaces(self, *, since: float) -> bool:
        """`podman system migrate`, as podman's message says: it stops the containers recorded running
        (their conmons are gone; their processes may run on, unreachable) and ends the pause process;
        the next command makes new namespaces. Once for the commands that failed together: one that
        started before the last reset ended is only run again."""
        with self._reset_lock:
            if self._reset_at >= since:
                return True
            log.warning("podman: the namespaces of this user's containers are gone (podman's pause process and "
                        "every conmon ended while containers were recorded running), so podman refuses every "
                        "command; running `podman system migrate`: it stops those containers, and their bookings "
                        "start again")
            done = super()._process(["system", "migrate"], timeout=MIGRATE_TIMEOUT, exclusive=True)
            self._reset_at = time.monotonic()
        if done.returncode != 0:
            log.error("podman system migrate failed: %s", message_of(done))
            return False
        return True

    def list(self) -> builtins.list[ContainerInfo]:
        """gpubook's containers. One whose network namespace podman lost (_LOST_NETNS) is removed
        first, as no `ps` works while it is there: its booking starts again, as after any death."""
        removed: builtins.list[str] = []
        while True:
            try:
                listed, known = self._ps()
                self._sweep(known)
                return listed
            except EngineError as error:
                lost = _LOST_NETNS.search(str(error))
                if lost is None or lost["id"] in removed or len(removed) >= LOST_LIMIT:
                    raise
                removed.append(lost["id"])
            self._remove_lost(removed[-1])

    def _ps(self) -> tuple[builtins.list[ContainerInfo], set[str]]:
        """gpubook's containers, and the id of every container podman knows, in one command: podman's
        `ps --format json` carries each one's name, id, state, image, labels and pid, all `inspect`
        would add (Docker's needs the inspect after it, CliEngine.list). A listing is the commonest
        engine command of a daemon (each pass) and of the tests' waits: one command instead of two.
        Unfiltered, so that the sweep knows gpubook's other containers (the SFTP service, an image's
        warm-up: named like bookings, labelled otherwise) without an `inspect` each per listing."""
        out = self._call(["ps", "--all", "--no-trunc", "--format", "json"])
        try:
            rows = json.loads(out or "[]") or []
        except ValueError as error:
            raise EngineError(f"{self.name}: its container listing is not JSON: {error}") from None
        listed = [info_from_labels(name=(row.get("Names") or [""])[0], id=row.get("Id") or "",
                                   state=row.get("State") or "unknown", image=row.get("Image") or "",
                                   labels=labels, pid=int(row.get("Pid") or 0))
                  for row in rows if LABEL_BOOKING in (labels := dict(row.get("Labels") or {}))]
        return listed, {row.get("Id") or "" for row in rows}

    def start(self, spec: ContainerSpec) -> ContainerInfo:
        with self._used_lock:
            self._starting.add(spec.name)
        try:
            return super().start(spec)
        finally:
            with self._used_lock:
                self._starting.discard(spec.name)

    def _sweep(self, listed: set[str]) -> None:
        """End the containers of gpubook's names running unlisted (conmon.py) whose booking was never
        started again (deleted meanwhile): one seen at two listings in a row, with no start of its
        name in progress, and unknown to podman by its id."""
        with self._used_lock:
            starting = set(self._starting)
        unlisted = [m for m in conmon.monitors() if m.name.startswith(CONTAINER_PREFIX) and m.id not in listed
                    and m.name not in starting]
        root = self.storage_path() if unlisted else None  # asked only when needed (`podman info`)
        seen = [m for m in unlisted if root is not None and m.in_store(root)]
        suspects, self._suspects = self._suspects, {m.id for m in seen}
        for monitor in seen:
            if monitor.id in suspects:
                self._end_if_unknown(monitor)

    def _end_unlisted(self, name: str) -> bool:
        """conmon.py: a `run` killed midway leaves the container running, unlisted, holding the
        booking's GPUs and port. Only this store's (its bundle under the graph root), only ids
        that podman does not know."""
        found = [m for m in conmon.monitors() if m.name == name]
        if not found:
            return False
        root = self.storage_path()
        return any([self._end_if_unknown(m) for m in found if m.in_store(root)])

    def _remove_half_there(self, name: str) -> bool:
        """A container of exactly `name` that `ps` lists and `inspect` does not know, removed. Podman 4.3
        leaves two such: a `podman run` killed between making the container's storage and recording it
        in its database ("Storage", listed by `ps --external` only), after which every `run` of its
        name fails "the container name … is already in use"; and a `podman rm` killed between removing
        its storage and its record ("Removing": `inspect` says "container not known", `stop` "container
        state improper"), which no stop by name reaches. Only `rm --force` of its id removes either."""
        listed = self._call(["ps", "--all", "--external", "--no-trunc", "--filter", f"name=^{re.escape(name)}$",
                             "--format", "{{.ID}} {{.Names}} {{.State}}"])
        found = [(fields[0], " ".join(fields[2:]).lower()) for fields in map(str.split, listed.splitlines())
                 if fields[1:2] == [name] and not self._inspect_raw([fields[0]], missing_ok=True)]
        for container_id, state in found:
            how = ("its removal was cut short (a `podman rm` killed midway)" if state == "removing" else
                   "it is in podman's storage but not in its database (a `podman run` killed midway), and no "
                   "container of its name can start while it is there")
            log.warning("podman: container %s (%s): %s: removing it", name, container_id[:12], how)
            self._call(["rm", "--force", container_id])
        return bool(found)

    def _end_if_unknown(self, monitor: conmon.Monitor) -> bool:
        if self._inspect_raw([monitor.id], missing_ok=True):
            return False
        log.warning("podman: container %s (%s) runs while podman lists no such container (a `podman run` killed "
                    "midway): ending it", monitor.name, monitor.id[:12])
        conmon.end(monitor)
        return True

    def _remove_lost(self, container_id: str) -> None:
        try:
            raws = self._inspect_raw([container_id], missing_ok=True)  # works: it only logs the error
        except EngineError:
            raws = []
        name = str(raws[0].get("Name", "")).lstrip("/") if raws else ""
        log.warning("podman: container %s lost its network namespace (podman's pause process ended while it ran, "
                    "and a new one made new namespaces), and no `podman ps` works while it is there: removing it; "
                    "its booking starts again", name or container_id[:12])
        done = super()._process(["rm", "--force", "--time", "0", container_id], timeout=QUICK_TIMEOUT)
        if done.returncode != 0:
            raise EngineError(f"podman rm of {name or container_id[:12]} (its network namespace lost): "
                              f"{message_of(done)}")

    def _map_args(self, count: int = CONTAINER_ID_COUNT) -> builtins.list[str]:
        """The id map of bookings' containers (`userns_args`; warm's for any booker); `count`:
        rootful's size, at least CONTAINER_ID_COUNT."""
        if os.geteuid() != 0:
            ids = self._read_subordinate_ids()
            return [f"--uidmap=0:1:{ids.uid_count}", f"--gidmap=0:1:{ids.gid_count}"]
        return [f"--uidmap=0:{ROOTFUL_ID_BASE}:{count}", f"--gidmap=0:{ROOTFUL_ID_BASE}:{count}"]

    def image_exists(self, image: str) -> bool:
        return self._process(["image", "exists", image], timeout=QUICK_TIMEOUT).returncode == 0

    def remove_image(self, image: str) -> None:
        # A warm-up the daemon's death cut short left its container (podman goes on after its
        # caller dies): no use of the image, but `rmi` refuses while it is there.
        self._process(["rm", "--force", "--ignore", warm_name(image)], timeout=QUICK_TIMEOUT)
        super().remove_image(image)

    def userns_args(self, spec: ContainerSpec) -> builtins.list[str]:
        """The container's own user namespace: never the daemon's own uid (nor host root).

        Rootless, container id N is id N+1 of podman's intermediate namespace, which is the
        daemon user's subordinate id `base+N` (/etc/subuid): root inside and the booker are
        subordinate ids, so a file they make on a bound folder, setuid or not, never belongs to
        the daemon user (keep-id mapped the booker onto it). `--passwd=false`: the entrypoint
        writes the booker's account itself. Rootful: one contiguous map far above real accounts.
        A map with an identity hole for the booker would keep host ownership, but podman 4.3's
        overlay driver refuses to mount such a layer ("permission denied"), so folders are
        chown'ed to the mapped ids instead (host_owner).
        """
        if os.geteuid() != 0:
            self._subordinate_ids(spec.uid, spec.gid)  # the booker's ids fit in the range
            return [*self._map_args(), "--passwd=false"]
        return self._map_args(max(CONTAINER_ID_COUNT, spec.uid + 1, spec.gid + 1))

    def service_userns_args(self) -> builtins.list[str]:
        """Root of a service container is the daemon user (rootful: host root), so that the
        daemon's folders are root's inside (sshd's ChrootDirectory wants that); every other id
        maps exactly as in `userns_args`, so a booker's files have one owner in both."""
        if os.geteuid() != 0:
            ids = self._read_subordinate_ids()
            return ["--uidmap=0:0:1", f"--uidmap=1:2:{ids.uid_count - 1}",
                    "--gidmap=0:0:1", f"--gidmap=1:2:{ids.gid_count - 1}", "--passwd=false"]
        count = CONTAINER_ID_COUNT - 1
        return ["--uidmap=0:0:1", f"--uidmap=1:{ROOTFUL_ID_BASE + 1}:{count}",
                "--gidmap=0:0:1", f"--gidmap=1:{ROOTFUL_ID_BASE + 1}:{count}"]

    def publish_args(self, port: int) -> builtins.list[str]:
        """Rootful podman publishes `PORT:PORT` on IPv4 only (conmon holds 0.0.0.0:PORT), which
        left [::]:PORT to any local account, for IPv6 clients to meet: publish on both families,
        so that conmon holds both (issue 22, finding 19)."""
        if os.geteuid() != 0 or not _has_ipv6():
            return super().publish_args(port)
        both = ("0.0.0.0", "[::]")  # noqa: S104 - the host's addresses the port is published on
        return [arg for address in both for arg in ("--publish", f"{address}:{port}:{port}")]

    def private_network_args(self) -> builtins.list[str]:
        """Rootless: slirp4netns, each container its own namespace, the host's loopback out of
        reach (`allow_host_loopback=false`: no host-local service such as the calendar server);
        Debian 12's podman 4.3 has no pasta. The port handler is chosen by the benchmarks'
        figures (see PORT_HANDLER). Rootful: podman's own bridge (netavark/CNI), for services; a
        booking gets a network of its own (network_args)."""
        if os.geteuid() == 0:
            return ["--network", "bridge"]
        return ["--network", f"slirp4netns:port_handler={PORT_HANDLER},allow_host_loopback=false"]

    def network_args(self, spec: ContainerSpec) -> builtins.list[str]:
        """Rootful and private: the booking's own bridge network (prepare_network), so that no other
        booking reaches its services; rootless: slirp4netns, a namespace of its own already."""
        if self.network == "host" or os.geteuid() != 0:
            return super().network_args(spec)
        return ["--network", spec.name, *self.publish_args(spec.port)]

    def prepare_network(self, spec: ContainerSpec) -> None:
        """Rootful podman's "bridge" is one network for every container on it: bookings would reach
        each other's services (issue 22, finding 13). Each booking gets a network of its own, named as
        its container, that netavark isolates from every other network (`isolate=true`)."""
        if self.network == "host" or os.geteuid() != 0:
            return
        if self._process(["network", "exists", spec.name], timeout=QUICK_TIMEOUT).returncode == 0:
            return  # an earlier start's, or one a stop could not remove
        self._call(["network", "create", "--disable-dns", "--opt", "isolate=true",
                    "--label", f"{LABEL_BOOKING}={spec.booking_id}", spec.name])

    def release_network(self, name: str) -> None:
        if self.network == "host" or os.geteuid() != 0:
            return
        done = self._process(["network", "rm", name], timeout=QUICK_TIMEOUT)
        if done.returncode != 0 and not _is_missing_network(done.stderr):
            log.warning("booking network %s: not removed: %s", name, message_of(done))

    def host_owner(self, uid: int, gid: int) -> tuple[int, int]:
        """The host ids that files of booker `uid`/`gid` in bound folders get (and folders need)."""
        if os.geteuid() != 0:
            ids = self._subordinate_ids(uid, gid)
            return ids.uid_base + uid, ids.gid_base + gid
        return ROOTFUL_ID_BASE + uid, ROOTFUL_ID_BASE + gid

    def chown(self, path: Path, uid: int, gid: int) -> None:
        """Give a data folder to host ids `uid`/`gid`; rootless, only podman's namespace can."""
        if os.geteuid() == 0:
            os.chown(path, uid, gid, follow_symlinks=False)
            return
        ids = self._read_subordinate_ids()
        # The daemon's own ids are id 0 of podman's namespace (a folder it keeps, given a group).
        inner = (0 if uid == os.geteuid() else ids.inner_uid(uid), 0 if gid == os.getegid() else ids.inner_gid(gid))
        done = self._process(
            ["unshare", "chown", "--no-dereference", f"{inner[0]}:{inner[1]}", "--", str(path)],
            timeout=QUICK_TIMEOUT,
        )
        if done.returncode != 0:
            raise EngineError(f"podman unshare chown {path}: {message_of(done)}")

    def data_owner_argv(self) -> builtins.list[str] | None:
        """Rootless: root of podman's user namespace owns every booker's id (and has
        CAP_DAC_READ_SEARCH over them there); rootful: root itself."""
        return [] if os.geteuid() == 0 else [*self.global_argv(), "unshare"]

    def _subordinate_ids(self, uid: int, gid: int) -> SubordinateIds:
        ids = self._read_subordinate_ids()
        if uid >= ids.uid_count or gid >= ids.gid_count:
            raise permanent(
                f"booker uid {uid} or gid {gid} is outside the {ids.uid_count} uids and "
                f"{ids.gid_count} gids that /etc/subuid and /etc/subgid give the daemon's user; "
                f"give that user a larger range (usermod --add-subuids/--add-subgids) or the "
                f"booker a smaller uid"
            )
        return ids

    def _read_subordinate_ids(self) -> SubordinateIds:
        """The daemon user's subordinate ranges as podman's namespace maps them (read once)."""
        if self._subordinate is None:
            maps = []
            for name in ("uid_map", "gid_map"):
                done = self._process(["unshare", "cat", f"/proc/self/{name}"], timeout=QUICK_TIMEOUT)
                if done.returncode != 0:
                    raise EngineError(f"podman unshare: {message_of(done)}")
                maps.append(_subordinate_range(done.stdout, name))
            self._subordinate = SubordinateIds(*maps[0], *maps[1])
        return self._subordinate

    def default_ulimits(self) -> builtins.list[str]:
        """nproc from pids_limit (cli_engine). Rootful runc in a user namespace cannot raise
        nofile/nproc: keep them within its own."""
        if os.geteuid() != 0:
            return super().default_ulimits()
        configured = {limit.split("=", 1)[0] for limit in self.ulimits}
        nofile = min(resource.getrlimit(resource.RLIMIT_NOFILE)[1], 1 << 20)
        nproc = min(NPROC, self.pids_limit or NPROC)
        defaults = {"nofile": f"nofile={nofile}:{nofile}", "nproc": f"nproc={nproc}:{nproc}"}
        return [value for key, value in defaults.items() if key not in configured]

    def limits_problem(self) -> str | None:
        """What podman will not enforce here, and why; None where memory and pids limits hold.
        Rootless podman only warns, at each start, when it drops them."""
        placement = self.placement()
        if os.geteuid() == 0:
            return None
        if self.cgroup_manager != "auto" and placement.enforced and (
                placement.parent is not None or self.cgroup_manager != placement.manager):
            # a manager chosen by hand (tools, tests): no cgroup parent in the delegated subtree
            return f"--cgroup-manager {self.cgroup_manager} was given, so gpubook puts no container where limits hold"
        if placement.enforced:
            return None
        return placement.how + ("; only the per-uid nproc ulimit bounds a booking's processes, and root "
                                "inside can get around it by changing uids")

    def limits_check(self) -> Check:
        """Doctor's line on limits: which hold here, through what, and which cannot and why. A WARN
        on cgroups v1, where only a reboot into v2 helps; a FAIL on v2, where `gpubook setup` does."""
        pids = f"pids {self.pids_limit} per container" if self.pids_limit else "no process limit"
        memory = self.memory_line()
        problem = self.limits_problem()
        if problem is None:
            return Check("engine limits", True, f"{pids}, {memory}: enforced ({self.placement().how})")
        v1 = cgroups.cgroup_version() != 2
        if v1:
            fix = ("boot with cgroups v2 (systemd.unified_cgroup_hierarchy=1), then delegate memory and pids "
                   "to the daemon's account (docs/guides/limits.md)")
        else:
            fix = ("run `gpubook setup` as root, or make the delegated subtree by hand and start the daemon in "
                   f"{cgroups.ROOT / cgroups.SUBTREE / cgroups.DAEMON_LEAF} (docs/guides/limits.md)")
        return Check("engine limits", False, f"{pids}, {memory}: NOT enforced: {problem}", fix, optional=v1)

    def gpu_isolation_args(self, injection: GpuInjection, *, booking_id: str) -> builtins.list[str]:
        """libnvidia-container mounts a tmpfs over /proc/driver/nvidia from a hook; runc refuses
        OCI mounts inside /proc, but its maskedPaths are allowed, and podman exposes them as
        `--security-opt mask=` (a ':'-separated list, hence PROC_GPUS as a whole, see
        nvidia.inject). runc masks a folder with an empty read-only tmpfs."""
        if not injection.hidden_proc_paths:
            return []
        paths = [checked_proc_path(p) for p in injection.hidden_proc_paths]
        return ["--security-opt", "mask=" + ":".join(paths)]


