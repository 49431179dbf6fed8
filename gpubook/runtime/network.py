"""What `gpubook doctor` says about bookings' networks: the host network's risk, and whether the
per-booking network (the default) can be made here.

Rootless podman gives each container its own network namespace through slirp4netns, which opens
/dev/net/tun as the daemon's user. A stock Linux host has that device at mode 0666; some (the
Debian 12 test machines) have it 0600 root, and then every start fails inside podman with an
error that does not name the device, so doctor names it and its fix.
"""

from __future__ import annotations

import os
import shutil

from gpubook.runtime.checks import Check
from gpubook.runtime.engines import HOST_NETWORK_RISK, EngineSettings

TUN = "/dev/net/tun"
TUN_FIX = (
    f"as root: chmod 0666 {TUN} (a stock host has it 0666; keep it over reboots with a udev rule "
    'KERNEL=="tun", MODE="0666"), or set [engine] network = "host" and accept its risk'
)


DOCKER_ICC = (
    "Docker publishes only each booking's SSH port, but bookings on its bridge reach each other's "
    'services unless dockerd runs with "icc": false (and its iptables rules) in /etc/docker/daemon.json'
)


def checks(settings: EngineSettings) -> list[Check]:
    """One check for the network setting; more for what rootless podman's private network needs."""
    if settings.network == "host":
        return [Check("engine network", False, f'[engine] network = "host": {HOST_NETWORK_RISK}',
                      'set [engine] network = "private" (each booking its own network, only its SSH port '
                      "published)")]
    result = [Check("engine network", True, "private: each booking its own network namespace, only its SSH "
                    "port published on the host")]
    if settings.name == "podman" and os.geteuid() != 0:
        result += [slirp4netns_check(), tun_check()]
    if settings.name == "docker":
        # A limit to know of (shown, not failed): Docker's default bridge lets containers talk.
        result.append(Check("engine network isolation", True, DOCKER_ICC))
    return result


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
