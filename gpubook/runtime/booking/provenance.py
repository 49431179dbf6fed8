"""A booking's provenance card, for reproducible research: what ran, on what, and when.

The card holds the image (the template's reference, the engine's image id and the manifest digest
it records), the template (its name, the `version` its admin gave it, the sha256 of its file), the
host's NVIDIA driver and the CUDA version that driver supports (both from NVML), the CUDA and
cuDNN versions the image declares (its config's environment: CUDA_VERSION, NV_CUDNN_VERSION or
CUDNN_VERSION, as NVIDIA's images set them; read from the engine's image inspect, never by running
anything of the booker's), each booked GPU's model, UUID and MIG mode (NVML), MPS, and the actual
start and end.

- A value gpubook cannot know is None (JSON null), never guessed: no GPU (a CPU host), a template
  without CUDA, an image whose engine records no manifest digest, an engine that cannot inspect images.
- Every text is cut to printable ASCII and a bounded length before it goes anywhere: a GPU name, an
  image's environment or a template's version reach a calendar and the booker's terminal.
- It goes three places: booking.json at the start (what is known then: `Card.to_json`, end null),
  the event's ended block in two lines (`lines`), and /data/output/.gpubook/provenance.json at the
  end (gpubook/runtime/booking/provenance_file.py writes it without following a booker's symlink).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, tzinfo
from typing import Any

SCHEMA = 1
TEXT_KEPT = 120  # characters kept of any one text value (a GPU name, a version, an image reference)
LINE_KEPT = 400  # characters kept of each block line
FOLDER = ".gpubook"  # in the booker's output folder
FILE = "provenance.json"
CONTAINER_PATH = f"/data/output/{FOLDER}/{FILE}"
_VERSION = re.compile(r"^[0-9][0-9A-Za-z.+_~-]*$")  # what an image's CUDA_VERSION may look like
CUDA_ENV = ("CUDA_VERSION",)
CUDNN_ENV = ("NV_CUDNN_VERSION", "CUDNN_VERSION")


def clean(text: object, limit: int = TEXT_KEPT) -> str | None:
    """`text` as printable ASCII (anything else dropped), blanks collapsed, at most `limit`
    characters; None for None or for what is empty once cleaned."""
    if text is None:
        return None
    kept = "".join(c for c in str(text) if " " <= c <= "~")
    kept = " ".join(kept.split())[:limit]
    return kept or None


@dataclass(frozen=True)
class GpuFacts:
    """One booked GPU as NVML tells it; None where NVML does not say."""

    index: int
    name: str | None = None
    uuid: str | None = None
    mig: bool | None = None  # MIG mode (current): on, off, unknown

    def to_json(self) -> dict[str, Any]:
        return {"index": self.index, "name": clean(self.name), "uuid": clean(self.uuid), "mig": self.mig}


@dataclass(frozen=True)
class Card:
    """The provenance of one run of a booking. `ended` is None until it ended."""

    booking: str
    user: str
    template: str
    image: str  # the template's image reference
    template_version: str | None = None
    template_sha256: str | None = None
    image_id: str | None = None  # the engine's image id ("sha256:..."): the image's config digest
    # The manifest digest the engine records ("sha256:..."): a pulled image's is the registry's; podman
    # records one for an image built or imported here too; None where the engine records none.
    image_digest: str | None = None
    cuda_image: str | None = None  # CUDA_VERSION of the image's config
    cudnn_image: str | None = None  # NV_CUDNN_VERSION (or CUDNN_VERSION) of the image's config
    driver: str | None = None  # the host's NVIDIA driver (NVML)
    cuda_driver: str | None = None  # the newest CUDA that driver supports (NVML's CUDA driver version)
    gpus: tuple[GpuFacts, ...] = ()
    mps: bool | None = None  # the booking's GPUs shared through MPS; None: no GPU
    started: datetime | None = None
    ended: datetime | None = None
    notes: tuple[str, ...] = field(default=())  # why a value is missing, where gpubook knows

    @property
    def mig(self) -> bool | None:
        """MIG on any booked GPU; None where no GPU said."""
        modes = [gpu.mig for gpu in self.gpus if gpu.mig is not None]
        return any(modes) if modes else None

    def ended_at(self, moment: datetime) -> Card:
        return replace(self, ended=moment)

    def to_json(self, *, zone: tzinfo | None) -> dict[str, Any]:
        def iso(moment: datetime | None) -> str | None:
            return moment.astimezone(zone).isoformat(timespec="seconds") if moment is not None else None

        return {
            "schema": SCHEMA,
            "booking": clean(self.booking, 300),
            "user": clean(self.user),
            "template": {"name": clean(self.template), "version": clean(self.template_version),
                         "sha256": clean(self.template_sha256)},
            "image": {"reference": clean(self.image, 300), "id": clean(self.image_id),
                      "digest": clean(self.image_digest),
                      "cuda": clean(self.cuda_image), "cudnn": clean(self.cudnn_image)},
            "host": {"driver": clean(self.driver), "cuda": clean(self.cuda_driver)},
            "gpus": [gpu.to_json() for gpu in self.gpus],
            "mig": self.mig,
            "mps": self.mps,
            "start": iso(self.started),
            "end": iso(self.ended),
            "notes": [note for note in (clean(n, LINE_KEPT) for n in self.notes) if note],
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Card:
        """The card `to_json` wrote (State keeps it from the start to the end); KeyError or
        TypeError or ValueError for anything else."""
        template, image, host = data["template"], data["image"], data["host"]

        def moment(text: str | None) -> datetime | None:
            return datetime.fromisoformat(text) if text else None

        return cls(booking=str(data["booking"]), user=str(data["user"]), template=str(template["name"]),
                   template_version=template.get("version"), template_sha256=template.get("sha256"),
                   image=str(image["reference"]), image_id=image.get("id"), image_digest=image.get("digest"),
                   cuda_image=image.get("cuda"), cudnn_image=image.get("cudnn"), driver=host.get("driver"),
                   cuda_driver=host.get("cuda"),
                   gpus=tuple(GpuFacts(int(g["index"]), g.get("name"), g.get("uuid"), g.get("mig"))
                              for g in data.get("gpus") or ()),
                   mps=data.get("mps"), started=moment(data.get("start")), ended=moment(data.get("end")),
                   notes=tuple(str(n) for n in data.get("notes") or ()))


def image_versions(env: Sequence[str]) -> tuple[str | None, str | None]:
    """(CUDA, cuDNN) as an image's config environment declares them ("KEY=VALUE" entries); None
    where it declares none, or something that is not a version."""
    values = {}
    for entry in env:
        key, sep, value = str(entry).partition("=")
        if sep:
            values[key] = value.strip()

    def first(keys: Sequence[str]) -> str | None:
        for key in keys:
            value = values.get(key, "")
            if _VERSION.match(value) and len(value) <= 40:
                return value
        return None

    return first(CUDA_ENV), first(CUDNN_ENV)


def repo_digest(digests: Sequence[str]) -> str | None:
    """The manifest digest ("sha256:...") of the engine's first "repo@sha256:..." entry."""
    for entry in digests:
        _, sep, digest = str(entry).rpartition("@")
        if sep and digest.startswith("sha256:"):
            return digest
    return None


def cuda_driver_text(version: int | None) -> str | None:
    """NVML's CUDA driver version (12040) as "12.4"."""
    if version is None or version <= 0:
        return None
    return f"{version // 1000}.{version % 1000 // 10}"


def _short(digest: str, keep: int = 12) -> str:
    algorithm, _, hexes = digest.partition(":")
    return f"{algorithm}:{hexes[:keep]}…" if hexes and len(hexes) > keep else digest


def _gpus_text(gpus: Sequence[GpuFacts]) -> str:
    if not gpus:
        return "no GPU"
    indices = ",".join(str(gpu.index) for gpu in gpus)
    names = {clean(gpu.name) for gpu in gpus}
    uuids = [clean(gpu.uuid) for gpu in gpus]
    shown = ", ".join(f"{u[:12]}…" if len(u) > 12 else u for u in uuids if u)
    label = "GPU" if len(gpus) == 1 else "GPUs"
    if len(names) == 1 and None not in names:
        text = f"{label} {indices} {next(iter(names))}"
    elif names == {None}:
        text = f"{label} {indices}"
    else:
        text = f"{label} " + ", ".join(f"{gpu.index} {clean(gpu.name) or '?'}" for gpu in gpus)
    return f"{text} ({shown})" if shown else text


def lines(card: Card, *, zone: tzinfo | None, kept: bool) -> tuple[str, str]:
    """The two lines of the ended block: what ran on what, and when (and where the whole card is,
    when `kept`: provenance.json was written). Unknown values are left out, never guessed."""
    template = " ".join(part for part in (clean(card.template), clean(card.template_version)) if part)
    digest = clean(card.image_digest) or clean(card.image_id)
    image = f"image {_short(digest)} ({template})" if digest else f"image {clean(card.image, 200)} ({template})"
    versions = []
    if card.driver:
        versions.append(f"driver {clean(card.driver)}" + (f" (CUDA {clean(card.cuda_driver)})"
                                                           if card.cuda_driver else ""))
    declared = [f"CUDA {clean(card.cuda_image)}" if card.cuda_image else "",
                f"cuDNN {clean(card.cudnn_image)}" if card.cudnn_image else ""]
    if any(declared):
        versions.append("image " + ", ".join(part for part in declared if part))
    gpus = _gpus_text(card.gpus)
    if card.gpus and card.mig is not None:
        gpus += f", MIG {'on' if card.mig else 'off'}"
    if card.gpus and card.mps is not None:
        gpus += f", MPS {'on' if card.mps else 'off'}"
    first = "; ".join([image, *versions, gpus])

    def when(moment: datetime | None) -> str:
        return moment.astimezone(zone).strftime("%Y-%m-%d %H:%M:%S %z") if moment is not None else "unknown"

    second = f"ran from {when(card.started)} to {when(card.ended)}"
    if kept:
        second += f"; the whole card: {CONTAINER_PATH}"
    return (f"provenance: {first}"[:LINE_KEPT], f"provenance: {second}"[:LINE_KEPT])
