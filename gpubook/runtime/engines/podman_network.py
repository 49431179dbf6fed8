"""Rootful podman's per-booking network, as its preflight checks it: the network backend that makes
each booking's bridge (netavark, or the older CNI plugins) and the firewall it publishes ports with.

A host without them (the GPU host, 2026-11-25) fails every start inside podman with an error that
names neither, so doctor names them and their fix. Rootless podman's own needs (slirp4netns and
the tun device) are host facts any rootless engine shares: runtime.network checks them.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess

from gpubook.runtime.checks import Check
from gpubook.runtime.engines import EngineSettings, make_engine
from gpubook.runtime.engines.cli_engine import CliEngine
from gpubook.runtime.errors import GpubookError

# Where podman looks for CNI plugins unless containers.conf names others ([network] cni_plugin_dirs).
CNI_PLUGIN_DIRS = ("/usr/local/libexec/cni", "/usr/libexec/cni", "/usr/local/lib/cni", "/usr/lib/cni", "/opt/cni/bin")
FIREWALL_PATH = os.pathsep.join((os.environ.get("PATH", ""), "/usr/local/sbin", "/usr/sbin", "/sbin"))
BACKEND_FIX = (
    "install netavark and iptables (Debian/Ubuntu: apt install netavark iptables; Debian puts netavark in "
    "/usr/lib/podman, a folder podman searches, else name its folder in helper_binaries_dir under [engine] of "
    '/etc/containers/containers.conf) and set network_backend = "netavark" under [network] there'
)
_MISSING_PLUGIN = re.compile(r'failed to find plugin \\?"([\w.-]+)\\?"')


def backend_check(settings: EngineSettings | CliEngine, *, firewall_path: str = FIREWALL_PATH) -> Check:
    """Rootful podman gives bookings its own bridge, made by its network backend (netavark, or the
    older CNI plugins) with iptables or nft. Without them a store and an image look fine and every
    start fails inside podman (a GPU host had neither), so doctor asks podman which backend it uses
    and looks for what that backend runs."""
    try:
        engine = settings if isinstance(settings, CliEngine) else make_engine(settings)
        if not isinstance(engine, CliEngine):  # a site's engine plugin: its own business
            return Check("engine network backend", True, f"engine {engine.name}: not checked")
        done = _run([*engine.global_argv(), "info", "--format", "json"])
    except GpubookError as error:
        return Check("engine network backend", False, f"cannot ask podman: {error}", "see the engine checks above")
    if done.returncode != 0:
        message = " ".join(done.stderr.split())[:300]
        if 'find "netavark"' in message:
            return Check("engine network backend", False, "podman's network backend is netavark, but podman cannot "
                         f"find it, so no booking can start on the private network ({message})", BACKEND_FIX)
        return Check("engine network backend", False, f"podman info: {message}", "see the engine checks above")
    try:
        backend = json.loads(done.stdout)["host"]["networkBackend"]
    except (ValueError, KeyError, TypeError):
        return Check("engine network backend", False, "podman info does not say which network backend it uses",
                     "run `podman info` and check host.networkBackend")
    firewall = shutil.which("iptables", path=firewall_path) or shutil.which("nft", path=firewall_path)
    if backend == "cni":
        problem = _cni_problem(engine.global_argv())
        if problem is not None:
            return Check("engine network backend", False, problem, BACKEND_FIX)
    if firewall is None and backend in ("netavark", "cni"):
        return Check("engine network backend", False, f"podman's network backend {backend} needs iptables (or nft) "
                     "to publish a booking's SSH port, and neither is installed",
                     "install iptables (Debian/Ubuntu: apt install iptables)")
    return Check("engine network backend", True, f"{backend}, with {firewall}" if firewall else backend)


def _cni_problem(argv: list[str]) -> str | None:
    """Podman names the CNI plugins it lacks only when it reads a network's config (a warning)."""
    try:
        listed = _run([*argv, "network", "ls", "--format", "{{.Name}}"])
    except GpubookError as error:
        return f"podman network ls: {error}"
    missing = sorted(set(_MISSING_PLUGIN.findall(listed.stderr)))
    if missing:
        return ("podman's network backend is CNI and its plugins are missing (" + ", ".join(missing) +
                "), so no booking can start on the private network")
    if not any(os.access(os.path.join(folder, "bridge"), os.X_OK) for folder in CNI_PLUGIN_DIRS):
        return ("podman's network backend is CNI and its bridge plugin is in none of " + ", ".join(CNI_PLUGIN_DIRS) +
                ", so no booking can start on the private network")
    return None


def _run(argv: list[str]) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL, check=False)
    except FileNotFoundError:
        raise GpubookError(f"{argv[0]} is not installed") from None
    except subprocess.TimeoutExpired:
        raise GpubookError(f"{argv[0]}: no answer within 60 s") from None
