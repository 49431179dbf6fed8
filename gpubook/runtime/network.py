"""What `gpubook doctor` says about bookings' networks: the host network's risk, and whether the
per-booking network (the default) can be made here. Each engine's preflight checks its own
networks (engines/podman_network.py, engines/docker.py); this module holds what no one engine owns.

A rootless engine gives each container its own network namespace through slirp4netns, which opens
/dev/net/tun as the daemon's user. A stock Linux host has that device at mode 0666; some (the
Debian 12 test machines) have it 0600 root, and then every start fails inside the engine with an
error that does not name the device, so doctor names it and its fix.
"""

from __future__ import annotations

import os
import shutil

from gpubook.runtime.checks import Check
from gpubook.runtime.engines import EngineSettings, make_engine, network_checks
from gpubook.runtime.errors import GpubookError

TUN = "/dev/net/tun"
TUN_FIX = (
    f"as root: chmod 0666 {TUN} (a stock host has it 0666; keep it over reboots with a udev rule "
    'KERNEL=="tun", MODE="0666"), or set [engine] network = "host" and accept its risk'
)


def checks(settings: EngineSettings) -> list[Check]:
    """The network lines of the engine's preflight: the setting's, then the engine's own checks of
    the networks it makes (`network_checks`, where the engine says them apart)."""
    try:
        engine = make_engine(settings)
    except GpubookError:
        return network_checks(settings)
    own = getattr(engine, "network_checks", None)
    return own() if own is not None else network_checks(settings)


def slirp4netns_check() -> Check:
    path = shutil.which("slirp4netns")
    if path is None:
        return Check("slirp4netns", False, "slirp4netns is not installed (rootless podman's private network "
                     "needs it)", "install the slirp4netns package")
    return Check("slirp4netns", True, path)


def tun_check(device: str = TUN) -> Check:
    """Opening the device is the test slirp4netns makes; its mode alone would not say (ACLs, groups)."""
    try:
        fd = os.open(device, os.O_RDWR)
    except OSError as error:
        return Check("tun device", False, f"{device} is not usable by this user ({error.strerror}), so "
                     "slirp4netns cannot give bookings their own network", TUN_FIX)
    os.close(fd)
    return Check("tun device", True, f"{device} is usable by this user")


