"""Docker (the nvidia-docker sites): the podman engine with another binary and a few flags fewer.

Docker has no per-container user namespace: a container shares dockerd's (the host's, unless
dockerd runs with `userns-remap`). The booker's uid inside is therefore the same number on the
host, so bound folders chown'ed to the booker (as root) stay the booker's. Root inside a Docker
container is host root with the capabilities below only; sites that need the stronger boundary
use podman (rootless or with its per-container --uidmap).
"""

from __future__ import annotations

from collections.abc import Sequence

from runtime.engines import ContainerSpec
from runtime.engines.podman import QUICK_TIMEOUT, PodmanEngine


class DockerEngine(PodmanEngine):
    name = "docker"

    def __init__(
        self,
        *,
        binary: str = "docker",
        network: str = "host",
        ulimits: Sequence[str] = (),
        global_args: Sequence[str] = (),
    ) -> None:
        # OCI runtime, storage driver and cgroups are dockerd's own settings, not the client's.
        super().__init__(
            binary=binary,
            runtime=None,
            storage_driver=None,
            cgroup_manager=None,
            network=network,
            ulimits=ulimits,
            global_args=global_args,
        )

    def global_argv(self) -> list[str]:
        return [self.binary, *self.global_args]

    def userns_args(self, spec: ContainerSpec) -> list[str]:
        return []

    def host_owner(self, uid: int, gid: int) -> tuple[int, int]:
        return uid, gid

    def default_ulimits(self) -> list[str]:
        return []

    def image_exists(self, image: str) -> bool:
        return self._process(["image", "inspect", image], timeout=QUICK_TIMEOUT).returncode == 0
