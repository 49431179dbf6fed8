"""What the GPU daemon suites share (tests/gpu: daemon, accounting, foreign, reclaim, Slurm): the sshd
test image's template from the bundle, and the daemon's [engine] lines on the GPU host."""

from __future__ import annotations

import json
import re

from tests.kits import hostroot

BUNDLE, TEMPLATE, IMAGE, TEMPLATE_TOML, ULIMITS = (hostroot.BUNDLE, hostroot.SSHD_TEMPLATE, hostroot.SSHD_IMAGE,
                                                  hostroot.SSHD_TEMPLATE_TOML, hostroot.ULIMITS)


# The host's network: podman runs as root there, and the bundle brings no netavark or CNI plugins
# for a bridge (rootless podman's slirp4netns is tested on the build machine).
ENGINE_LINES = (f"ulimits = {json.dumps(list(ULIMITS))}", 'network = "host"')


RUNNING_LINE = re.compile(r"running: ssh -p (\d+) (\S+)@")
