"""The CLI engines' images: present or pulled before a start (`ensure_image`), built and imported
(the Builder capability), and what runtime/templates/images.py drives for registries (pull with the site's
credentials, tag, remove, facts, images in use, the store's path).
"""

from __future__ import annotations

import builtins
import json
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from gpubook.runtime.engines.cli_transport import QUICK_TIMEOUT, CliTransport, message_of
from gpubook.runtime.engines.spec import permanent
from gpubook.runtime.templates import images

log = logging.getLogger(__name__)

BUILD_TIMEOUT = 3600.0  # seconds for building an image (apt-get inside)
PROGRESS_SECONDS = 0.5  # how often a pull's downloaded bytes are measured
LABEL_WARM = "gpubook.warm"  # "1" on a container made only to pay an image's first start ahead
WARM_PREFIX = "gpubook-warm-"  # a container made only to pay an image's first start ahead (PodmanEngine.warm)


def _remove_dead_pulls(parent: Path) -> None:
    """The scratch folders of pulls that cannot be running any more (older than a pull's own time
    limit: their daemon was killed mid-pull), which would hold GBs of blobs for ever."""
    deadline = time.time() - BUILD_TIMEOUT
    for folder in parent.glob("gpubook-pull-*"):
        try:
            if folder.lstat().st_mtime < deadline:
                shutil.rmtree(folder)
                log.info("removed %s: the scratch folder of a pull that ended without its daemon", folder)
        except OSError as error:
            log.warning("%s: a dead pull's scratch folder not removed: %s", folder, error)


def folder_bytes(folder: Path) -> int:
    """The bytes of the files under `folder` (those that vanish meanwhile count nothing)."""
    total = 0
    for root, _dirs, files in os.walk(folder):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                continue
    return total


class CliImages(CliTransport):
    """A CLI engine's images: `ensure_image`, `Builder` and `images.ImageEngine`."""

    def ensure_image(self, image: str, *, pull: bool = False) -> None:
        if self.image_exists(image):
            return
        if not pull:
            raise permanent(
                f"image {image} is not present in {self.name}'s storage; build or "
                f"import it first (gpubook templates build NAME)"
            )
        self._call(["pull", image], timeout=BUILD_TIMEOUT)


    def build(self, tag: str, context: Path, *, containerfile: str = "Containerfile") -> None:
        self.unused(tag)
        # Host network: these machines have no slirp4netns for the unprivileged user.
        self._call(
            [
                "build",
                "--network",
                "host",
                "--tag",
                tag,
                "--file",
                str(context / containerfile),
                str(context),
            ],
            timeout=BUILD_TIMEOUT,
        )

    def import_rootfs(self, tarball: Path, tag: str) -> None:
        self.unused(tag)
        self._call(["import", str(tarball), tag], timeout=BUILD_TIMEOUT)

    def load(self, archive: Path) -> builtins.list[str]:
        """Load an image archive (`podman save` or `docker save`: docker-archive or OCI) into the store;
        the names (or ids) the engine says it loaded."""
        done = self._process(["load", "--input", str(archive)], timeout=BUILD_TIMEOUT)
        if done.returncode != 0:
            raise permanent(f"{archive} could not be loaded: {message_of(done)}")
        loaded: builtins.list[str] = []
        for line in done.stdout.splitlines():  # "Loaded image: X", "Loaded image(s): X,Y", "Loaded image ID: sha256:…"
            head, colon, names = line.partition(":")
            if colon and head.strip().lower().startswith("loaded image"):
                loaded += [name.strip() for name in names.split(",") if name.strip()]
        for name in loaded:
            self.unused(name)
        return loaded


    def pull(self, image: str, *, auth_file: Path | None = None,
             progress: Callable[[int], None] | None = None) -> None:
        """Pull one reference, with the site's credentials; raises PullError with the reason.
        `progress` is told the bytes downloaded so far, about twice a second, where the engine
        downloads into a folder of ours (`pull_scratch`)."""
        images.parse_reference(image)  # a reference, never an option
        self.unused(image)
        with tempfile.TemporaryDirectory(prefix="gpubook-auth-") as folder, self._watched(progress) as env:
            before, after = self.auth_args(auth_file, Path(folder))
            done = self._process([*before, "pull", *after, "--", image], timeout=BUILD_TIMEOUT, env=env)
        if done.returncode != 0:
            message = message_of(done)
            raise images.PullError(images.classify(message), message)

    def auth_args(self, auth_file: Path | None, folder: Path) -> tuple[builtins.list[str], builtins.list[str]]:
        """Flags before and after `pull` that name the credentials (auth.json format)."""
        raise NotImplementedError

    def pull_scratch(self) -> Path | None:
        """A folder on the store's file system where the pull's blobs may be downloaded (TMPDIR
        of the pull); None where the engine downloads elsewhere (dockerd)."""
        return None

    @contextmanager
    def _watched(self, progress: Callable[[int], None] | None) -> Iterator[Mapping[str, str] | None]:
        """The pull's environment: its downloads in a scratch folder of ours whose size is told
        to `progress` until the pull ends (then the folder is removed)."""
        parent = self.pull_scratch() if progress is not None else None
        if progress is None or parent is None:
            yield None
            return
        try:
            parent.mkdir(parents=True, exist_ok=True)
            _remove_dead_pulls(parent)
            scratch = Path(tempfile.mkdtemp(prefix="gpubook-pull-", dir=parent))
        except OSError as error:  # the pull goes on where the engine puts it, without progress
            log.warning("no folder for the pull's progress in %s (%s): it shows no progress", parent, error)
            yield None
            return
        ended = threading.Event()

        def watch() -> None:
            while not ended.wait(PROGRESS_SECONDS):
                progress(folder_bytes(scratch))

        watcher = threading.Thread(target=watch, name="gpubook-pull-progress", daemon=True)
        watcher.start()
        try:
            yield {**os.environ, "TMPDIR": str(scratch)}
        finally:
            ended.set()
            watcher.join()
            shutil.rmtree(scratch, ignore_errors=True)

    def tag(self, image: str, target: str) -> None:
        self.unused(target)
        self._call(["tag", image, target])

    def remove_image(self, image: str) -> None:
        self.unused(image)
        self._call(["rmi", image])  # refused while a container uses it

    def image_facts(self, image: str) -> images.ImageFacts | None:
        done = self._process(["image", "inspect", image], timeout=QUICK_TIMEOUT)
        if done.returncode != 0:
            return None
        raw = (json.loads(done.stdout) or [{}])[0]
        config = raw.get("Config")
        env = config.get("Env") if isinstance(config, dict) else None
        return images.ImageFacts(id=str(raw.get("Id", "")), size=int(raw.get("Size") or 0),
                                 digests=tuple(raw.get("RepoDigests") or ()), created=str(raw.get("Created", "")),
                                 env=tuple(str(entry) for entry in env) if isinstance(env, list) else ())

    def images_in_use(self) -> set[str]:
        """The images of the engine's containers, save a warm-up's (never started; one a crash cut
        short stays behind, and would keep its image from every cleanup). A warm-up is told by its
        label, never its name: a booking whose UID begins with "warm-" has a name like one (round 3, L5)."""
        ids = self._call(["ps", "--all", "--no-trunc", "--quiet"]).split()
        if not ids:
            return set()
        done = self._process(["inspect", "--format", '{{.Image}} {{index .Config.Labels "' + LABEL_WARM + '"}}',
                              *ids], timeout=QUICK_TIMEOUT)
        used = [line.split() for line in done.stdout.splitlines()]
        return {fields[0].removeprefix("sha256:") for fields in used if fields and fields[1:] != ["1"]}

    def storage_path(self) -> Path:
        raise NotImplementedError


    def image_exists(self, image: str) -> bool:
        raise NotImplementedError

