"""Template images from registries: pulled ahead with the site's credentials, digests verified,
a mirror per template, and the engine's disk kept above a floor.

Image names come from admins' templates only (a booking names a template, never an image), and are
checked again here before they reach an argv: a name is a reference (`registry/path:tag`,
`path@sha256:...`, `path:tag@sha256:...`), never an option. Engines spell their own flags (podman
`--authfile FILE`, Docker `--config DIR`) behind `ImageEngine`; an engine without it (a site's
own) is only asked whether the image is there.

What a pull fails on is said in a booker's words: the registry refused (credentials), not found
(no such repository, tag or digest), no disk space, unreachable. gpubook records what it pulled or
built (`Ledger`), so `clean` removes only those, never an admin's own images.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import re
import shutil
import subprocess
import threading
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from gpubook.runtime.errors import EngineError, TemplateError

log = logging.getLogger(__name__)

# A registry host[:port], path components, then a tag and/or a digest. No component starts with '-'.
_REFERENCE = re.compile(
    r"^(?P<repository>[a-z0-9][a-z0-9._-]*(?::[0-9]{1,5})?(?:/[a-z0-9][a-z0-9._-]*)*)"
    r"(?::(?P<tag>[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}))?"
    r"(?:@(?P<digest>sha256:[0-9a-f]{64}))?$"
)
_MIRROR = re.compile(r"^[a-z0-9][a-z0-9._-]*(?::[0-9]{1,5})?(?:/[a-z0-9][a-z0-9._-]*)*$")
DEFAULT_REGISTRY = "docker.io"
_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
MANIFEST_TIMEOUT = 60.0  # seconds for the registry's manifest (skopeo)

REFUSED = "registry refused"
NOT_FOUND = "not found"
NO_SPACE = "no disk space"
UNREACHABLE = "unreachable"
FAILED = "pull failed"


@dataclass(frozen=True)
class Reference:
    """An image name taken apart: `repository` includes the registry host where one is named."""

    repository: str
    tag: str | None = None
    digest: str | None = None

    @property
    def registry(self) -> str:
        first = self.repository.split("/", 1)[0]
        named = "/" in self.repository and ("." in first or ":" in first or first == "localhost")
        return first if named else DEFAULT_REGISTRY

    @property
    def path(self) -> str:
        """The repository without its registry (docker.io's single names under library/)."""
        if self.registry != DEFAULT_REGISTRY or self.repository.startswith(DEFAULT_REGISTRY + "/"):
            rest = self.repository.split("/", 1)[1]
        else:
            rest = self.repository
        return rest if "/" in rest or self.registry != DEFAULT_REGISTRY else f"library/{rest}"

    def local_name(self) -> str:
        """The name a booking runs: the image itself, or for a pinned digest a tag made only from
        that digest (gpubook tags it after the pull verified it, from the mirror or the origin)."""
        if self.digest is None:
            return f"{self.repository}:{self.tag or 'latest'}"
        return f"{self.repository}:pinned-{self.digest.removeprefix('sha256:')[:16]}"

    def pull_name(self, mirror: str | None = None) -> str:
        base = f"{mirror}/{self.path}" if mirror else self.repository
        if self.digest is not None:
            return f"{base}@{self.digest}"  # the tag of repo:tag@digest says nothing the digest does not
        return f"{base}:{self.tag or 'latest'}"


def parse_reference(image: str) -> Reference:
    """An image name as a `Reference`; TemplateError (one sentence) for anything else."""
    matched = _REFERENCE.fullmatch(image)
    if matched is None or len(image) > 255:
        raise TemplateError(
            f"image {image!r} is not an image reference (registry/path:tag or path@sha256:<64 hex>; "
            f"lower-case, never starting with '-')"
        )
    return Reference(matched["repository"], matched["tag"], matched["digest"])


def mirror_problem(mirror: str) -> str | None:
    """None for a registry host[/path] prefix such as "127.0.0.1:5000/mirror", else what is wrong."""
    host = mirror.split("/", 1)[0]
    if _MIRROR.fullmatch(mirror) and ("." in host or ":" in host or host == "localhost"):
        return None
    return "must be a registry host with an optional path, such as '127.0.0.1:5000/mirror'"


@dataclass(frozen=True)
class ImageFacts:
    id: str
    size: int  # bytes
    digests: tuple[str, ...]  # "repo@sha256:..." as the engine recorded them
    created: str
    env: tuple[str, ...] = ()  # the image config's environment, "KEY=VALUE" (CUDA_VERSION, …)


@runtime_checkable
class ImageEngine(Protocol):
    """What pulling and cleaning need from an engine, beyond the `Engine` protocol."""

    def image_exists(self, image: str) -> bool: ...

    def pull(self, image: str, *, auth_file: Path | None = None,
             progress: Callable[[int], None] | None = None) -> None: ...

    def tag(self, image: str, target: str) -> None: ...

    def remove_image(self, image: str) -> None: ...

    def image_facts(self, image: str) -> ImageFacts | None: ...

    def images_in_use(self) -> set[str]:
        """Ids of the images any container (running or not) was made from."""
        ...

    def storage_path(self) -> Path: ...


class PullError(EngineError):
    """A pull that failed, with the reason in a booker's words (REFUSED, NOT_FOUND, ...)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def classify(message: str) -> str:
    """The reason behind an engine's pull error message (podman's and Docker's wording)."""
    text = message.lower()
    if "no space left" in text or "disk quota exceeded" in text:
        return NO_SPACE
    if any(word in text for word in ("unauthorized", "authentication required", "denied", "403 forbidden",
                                     "incorrect username or password")):
        return REFUSED
    if any(word in text for word in ("manifest unknown", "not found", "name unknown", "no such image")):
        return NOT_FOUND
    if any(word in text for word in ("connection refused", "no such host", "i/o timeout", "network is unreachable",
                                     "pinging container registry", "tls:", "x509:", "timeout")):
        return UNREACHABLE
    return FAILED


@dataclass(frozen=True)
class PullResult:
    image: str  # the name bookings run (Reference.local_name)
    source: str  # the name it was pulled as ("" when it was already there)
    failed: tuple[str, ...] = ()  # "SOURCE: reason: message" of each source tried before

    def sentence(self) -> str:
        served = f"pulled from {self.source}" if self.source else "already present"
        return served + "".join(f"; {line}" for line in self.failed)


def pull(engine: ImageEngine, image: str, *, mirror: str | None = None, auth_file: Path | None = None,
         progress: Callable[[int], None] | None = None) -> PullResult:
    """Make `image` present: from the mirror first (if the template names one), then its own
    registry; a pinned digest is verified and the image tagged as its local name. Raises
    PullError naming every source tried and why each failed."""
    reference = parse_reference(image)
    local = image if reference.digest is None else reference.local_name()
    if engine.image_exists(local):
        return PullResult(image=local, source="")
    if reference.digest is not None and engine.image_exists(reference.pull_name()):
        _verify(engine, reference.pull_name(), reference)  # put there by an admin, digest and all
        engine.tag(reference.pull_name(), local)
        return PullResult(image=local, source="")
    origin = image if reference.digest is None else reference.pull_name()
    sources = ([reference.pull_name(mirror)] if mirror else []) + [origin]
    failed: list[tuple[str, PullError]] = []
    for source in sources:
        try:
            engine.pull(source, auth_file=auth_file, progress=progress)
            _verify(engine, source, reference)
        except PullError as error:
            failed.append((source, error))
            log.warning("image %s: pulling %s failed: %s", image, source, error)
            continue
        if source != local:
            engine.tag(source, local)
        return PullResult(image=local, source=source, failed=tuple(_failure_line(s, e) for s, e in failed))
    reason = failed[-1][1].reason if len({e.reason for _, e in failed}) == 1 else failed[0][1].reason
    raise PullError(reason, "; ".join(_failure_line(s, e) for s, e in failed))


def download_size(engine: ImageEngine, image: str, *, mirror: str | None = None,
                  auth_file: Path | None = None) -> int | None:
    """The bytes a pull of `image` downloads: its layers' sizes in the registry's manifest (`skopeo
    inspect --raw`, with podman's own registry settings and the site's credentials; a multi-arch
    list's entry for this machine), less the layers whose content the engine's store has
    (`present_layers`: by the layer's digest, or by its content's digest from the image's config,
    as podman reuses them). None where skopeo is not installed or the registry does not tell (the
    pull goes on without a total: progress in bytes only)."""
    binary = shutil.which("skopeo")
    if binary is None:
        return None
    reference = parse_reference(image)
    source = reference.pull_name(mirror) if mirror else (image if reference.digest is None else reference.pull_name())
    manifest = _manifest(binary, source, auth_file)
    if manifest is not None and "manifests" in manifest:  # a multi-arch list: this machine's entry
        wanted = {"x86_64": "amd64", "aarch64": "arm64"}.get(platform.machine(), platform.machine())
        entry = next((m for m in manifest["manifests"] if isinstance(m, dict)
                      and (m.get("platform") or {}).get("os") == "linux"
                      and (m.get("platform") or {}).get("architecture") == wanted), None)
        digest = str((entry or {}).get("digest", ""))
        repository = parse_reference(source).repository
        source = f"{repository}@{digest}"
        manifest = _manifest(binary, source, auth_file) if _DIGEST.fullmatch(digest) else None
    layers = (manifest or {}).get("layers")
    if not isinstance(layers, list):
        return None
    present: set[str] = getattr(engine, "present_layers", set)()
    contents: list[Any] = []
    if present:  # the layers' content digests, in the same order (the image's config)
        config = _manifest(binary, source, auth_file, config=True) or {}
        contents = list((config.get("rootfs") or {}).get("diff_ids") or [])
    if len(contents) != len(layers):
        contents = [None] * len(layers)
    return sum(int(layer.get("size") or 0) for layer, content in zip(layers, contents, strict=True)
               if isinstance(layer, dict) and layer.get("digest") not in present and content not in present)


def _manifest(binary: str, source: str, auth_file: Path | None, *, config: bool = False) -> dict[str, Any] | None:
    """The registry's manifest of `source` (or with `config`, its image config), as JSON."""
    argv = [binary, "inspect", "--raw", *(["--config"] if config else []),
            *(["--authfile", str(auth_file)] if auth_file else []), f"docker://{source}"]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=MANIFEST_TIMEOUT, check=False,
                              stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as error:
        log.info("image %s: its manifest could not be read (%s): its pull shows no total", source, error)
        return None
    if done.returncode != 0:
        log.info("image %s: its manifest could not be read (%s): its pull shows no total", source,
                 (done.stderr.strip().splitlines() or ["skopeo failed"])[-1][:300])
        return None
    try:
        data = json.loads(done.stdout)
    except ValueError:
        return None
    return data if isinstance(data, dict) else None


def _failure_line(source: str, error: PullError) -> str:
    return f"{source}: {error.reason}: {str(error).splitlines()[0][-300:]}"


def _verify(engine: ImageEngine, name: str, reference: Reference) -> None:
    """A pinned digest must be one the engine recorded for what it pulled (it checks the content)."""
    if reference.digest is None:
        return
    facts = engine.image_facts(name)
    if facts is None or not any(d.endswith("@" + reference.digest) for d in facts.digests):
        found = ", ".join(d.split("@", 1)[-1][:19] for d in facts.digests) if facts else "nothing"
        raise PullError(NOT_FOUND, f"{name} is not {reference.digest} (found {found})")


# -- what gpubook pulled or built, and the disk ---------------------------------------------------


@dataclass(frozen=True)
class Entry:
    image: str
    kind: str  # "pulled", "overlay"
    at: str  # ISO 8601: when gpubook made it present
    source: str = ""


@dataclass
class Ledger:
    """The images gpubook made present (a JSON file beside its cache): the only ones it removes."""

    path: Path
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def entries(self) -> list[Entry]:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return []
        return [Entry(**item) for item in data if isinstance(item, dict)]

    def add(self, image: str, *, kind: str, source: str = "", now: datetime | None = None) -> None:
        with self._lock:
            kept = [e for e in self.entries() if e.image != image]
            at = (now or datetime.now(UTC)).isoformat()
            self._write([*kept, Entry(image=image, kind=kind, at=at, source=source)])

    def forget(self, image: str) -> None:
        with self._lock:
            self._write([e for e in self.entries() if e.image != image])

    def _write(self, entries: Sequence[Entry]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        partial = self.path.with_suffix(".partial")
        partial.write_text(json.dumps([e.__dict__ for e in entries], indent=1))
        partial.replace(self.path)


def free_bytes(engine: ImageEngine) -> int:
    return free_bytes_at(engine.storage_path())


def free_bytes_at(path: Path) -> int:
    """Bytes an unprivileged writer may still use on the file system holding `path`."""
    stats = os.statvfs(path)
    return stats.f_bavail * stats.f_frsize


def clean(engine: ImageEngine, ledger: Ledger, *, keep: Collection[str], min_free: int,
          free: Callable[[], int] | None = None) -> list[str]:
    """While free space is under `min_free` bytes, remove gpubook's own images that no upcoming
    booking needs (`keep`) and no container uses, oldest first. Gives the names removed."""
    measure = free or (lambda: free_bytes(engine))
    if measure() >= min_free:
        return []
    in_use = {i.removeprefix("sha256:") for i in engine.images_in_use()}
    removed: list[str] = []
    for entry in sorted(ledger.entries(), key=lambda e: e.at):
        if entry.image in keep:
            continue
        facts = engine.image_facts(entry.image)
        if facts is None:
            ledger.forget(entry.image)
            continue
        if facts.id.removeprefix("sha256:") in in_use:
            continue
        try:
            engine.remove_image(entry.image)
            if entry.source and entry.source != entry.image and engine.image_exists(entry.source):
                engine.remove_image(entry.source)  # the mirror's name of the same image
        except EngineError as error:
            log.warning("image %s: not removed: %s", entry.image, str(error).splitlines()[0] if str(error) else error)
            continue
        ledger.forget(entry.image)
        removed.append(entry.image)
        log.info("image %s: removed (made present %s, not needed by an upcoming booking) to free disk space",
                 entry.image, entry.at)
        if measure() >= min_free:
            break
    return removed
