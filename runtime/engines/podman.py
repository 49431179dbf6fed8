"""Podman, rootless first (and rootful where the GPU host only allows that).

Every setting that rootless podman would otherwise read from per-user config files is passed as a
global flag, so the daemon behaves the same under a systemd user session, a plain `runuser`, or
root; except the storage driver, which by default follows the user's own podman configuration:
overriding it makes podman refuse a store that was made with another driver.
"""

from __future__ import annotations

import builtins
import json
import os
import re
import resource
import shutil
from typing import TYPE_CHECKING

from runtime.checks import Check
from runtime.engines.cli_engine import QUICK_TIMEOUT, CliEngine, checked_proc_path, message_of
from runtime.engines.spec import ContainerSpec
from runtime.errors import EngineError

if TYPE_CHECKING:
    from runtime.engines import EngineOptions, EngineSettings
    from runtime.nvidia.model import GpuInjection

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


class PodmanEngine(CliEngine):
    name = "podman"
    package = "podman"

    def __init__(self, settings: EngineSettings, options: EngineOptions) -> None:
        super().__init__(settings, options)
        self.runtime = settings.runtime
        self.storage_driver = settings.storage_driver
        self.cgroup_manager = options.cgroup_manager

    def preflight(self) -> builtins.list[Check]:
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
        return [binary, self.storage_check()]

    def storage_check(self) -> Check:
        """`podman info` with gpubook's own flags: the cheapest command that opens the store."""
        try:
            done = self._process(["info", "--format", "json"], timeout=QUICK_TIMEOUT)
        except EngineError as error:  # no answer in time, or the binary gone meanwhile
            return Check("engine storage", False, f"podman info: {error}", "run `podman info` as this user")
        if done.returncode != 0:
            return self._storage_failure(message_of(done))
        try:
            store = json.loads(done.stdout).get("store") or {}
        except ValueError:
            store = {}
        return Check(
            "engine storage",
            True,
            f"driver {store.get('graphDriverName', '?')}, store {store.get('graphRoot', '?')}",
        )

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
        if self.cgroup_manager:
            argv += ["--cgroup-manager", self.cgroup_manager]
        return argv + ["--events-backend", "file"]

    def image_exists(self, image: str) -> bool:
        return self._process(["image", "exists", image], timeout=QUICK_TIMEOUT).returncode == 0

    def userns_args(self, spec: ContainerSpec) -> builtins.list[str]:
        """The container's own user namespace."""
        if os.geteuid() != 0:
            # Rootless: the daemon's uid shows as the booker's inside; the rest of the container's
            # ids come from the daemon user's /etc/subuid range. `--passwd=false`: the entrypoint
            # writes the booker's account itself.
            return [f"--userns=keep-id:uid={spec.uid},gid={spec.gid}", "--passwd=false"]
        # Rootful (keep-id is rootless only): one contiguous map far above real accounts. A map
        # with an identity hole for the booker would keep host ownership, but podman 4.3's overlay
        # driver refuses to mount such a layer ("permission denied"), so folders are chown'ed to
        # the mapped ids instead (host_owner).
        count = max(CONTAINER_ID_COUNT, spec.uid + 1, spec.gid + 1)
        return [f"--uidmap=0:{ROOTFUL_ID_BASE}:{count}", f"--gidmap=0:{ROOTFUL_ID_BASE}:{count}"]

    def private_network_args(self) -> builtins.list[str]:
        """Rootless: slirp4netns, each container its own namespace, the host's loopback out of
        reach (`allow_host_loopback=false`: no host-local service such as the calendar server);
        Debian 12's podman 4.3 has no pasta. The port handler is chosen by the benchmarks'
        figures (see PORT_HANDLER). Rootful: podman's own bridge (netavark/CNI)."""
        if os.geteuid() == 0:
            return ["--network", "bridge"]
        return ["--network", f"slirp4netns:port_handler={PORT_HANDLER},allow_host_loopback=false"]

    def host_owner(self, uid: int, gid: int) -> tuple[int, int]:
        """The host ids that files of booker `uid`/`gid` in bound folders get (and folders need)."""
        if os.geteuid() != 0:
            return os.getuid(), os.getgid()
        return ROOTFUL_ID_BASE + uid, ROOTFUL_ID_BASE + gid

    def default_ulimits(self) -> builtins.list[str]:
        """Rootful runc in a user namespace cannot raise nofile/nproc: keep them within its own."""
        if os.geteuid() != 0:
            return []
        configured = {limit.split("=", 1)[0] for limit in self.ulimits}
        nofile = min(resource.getrlimit(resource.RLIMIT_NOFILE)[1], 1 << 20)
        defaults = {"nofile": f"nofile={nofile}:{nofile}", "nproc": f"nproc={NPROC}:{NPROC}"}
        return [value for key, value in defaults.items() if key not in configured]

    def gpu_isolation_args(self, injection: GpuInjection, *, booking_id: str) -> builtins.list[str]:
        """libnvidia-container mounts a tmpfs over /proc/driver/nvidia from a hook; runc refuses
        OCI mounts inside /proc, but its maskedPaths are allowed, and podman exposes them as
        `--security-opt mask=` (a ':'-separated list, hence PROC_GPUS as a whole, see
        nvidia.inject). runc masks a folder with an empty read-only tmpfs."""
        if not injection.hidden_proc_paths:
            return []
        paths = [checked_proc_path(p) for p in injection.hidden_proc_paths]
        return ["--security-opt", "mask=" + ":".join(paths)]


