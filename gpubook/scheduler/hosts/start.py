"""One start, one place: everything a booking's container is put together from, in the order a
start takes it. The StartHandler (apply/handlers.py) calls `prepare` (the first three) once; the arm
ahead of a start (apply/ahead.py) takes the same three one by one; the local host (hosts/local.py)
calls `run` for a start and `arm` for an arm, which take the rest:

1. `usable_template`: the template the booking names, if its host's driver can run it;
2. `port_for`: its SSH port (held, or the lowest free one; State keeps it);
3. `request`: what the host gets (`StartRequest`: the booker, template, GPUs, port, start and end);
4. `provenance`: the booking's provenance card as known at its start (image, driver, GPUs);
5. `folders`: the booker's data folders (only on a nosuid,nodev data root);
6. `gpus`: the injection of the host's NVIDIA driver for exactly the booked GPUs;
7. `host_key`: the booking's own SSH host key;
8. `card`: its booking.json (what the booker reads inside);
9. `spec`: the container's spec (`runtime/booking/launch.py`'s `booking_spec` over the runtime's `Tenancy`),
   which `runtime/booking/launch.py`'s `start_booking` runs on the engine, with the SSH probe after it.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from datetime import UTC, datetime, tzinfo
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import paramiko

from gpubook.runtime import engines
from gpubook.runtime.booking import booking_json, jupyter, launch, ssh
from gpubook.runtime.booking import provenance as prov
from gpubook.runtime.data import storage
from gpubook.runtime.engines import (
    ContainerInfo,
    ContainerSpec,
    Engine,
    SpecTaken,
    booking_id_problem,
    container_name,
    info_from_labels,
)
from gpubook.runtime.errors import PREPARING_IMAGE, EngineError, GpubookError, Preparing, StorageError
from gpubook.runtime.nvidia import cuda
from gpubook.runtime.templates import images, overlay_image
from gpubook.runtime.templates.catalog import Template, TemplateSet
from gpubook.scheduler import clock
from gpubook.scheduler.hosts import Booker, Started, StartRequest
from gpubook.scheduler.settings import Config, UserConfig
from gpubook.scheduler.state import State

if TYPE_CHECKING:
    from gpubook.runtime.nvidia import GpuInjection
    from gpubook.scheduler.core.bookings import Booking
    from gpubook.scheduler.hosts.images import ImagePreparer


log = logging.getLogger(__name__)


class Place(Protocol):
    """What a host puts a start together with (hosts/local.py's LocalHost is one)."""

    name: str
    engine: Engine
    probe_address: str
    cache_dir: Path
    probe_key: paramiko.PKey
    data_root: Path | None
    persistent_home: bool
    driver_version: str | None
    driver_roots: tuple[Path, ...]
    mps: bool
    timezone: tzinfo | None
    images: ImagePreparer
    gates: launch.Gates  # one engine start per container at a time, and a bounded number in all


def prepare(config: Config, state: State, templates: TemplateSet, booking: Booking, *, gpus: tuple[int, ...],
            driver_version: str | None, port: int | None, now: datetime) -> StartRequest | str:
    """The start's first three steps, for the StartHandler: the request its host gets, or the sentence
    refusing the booking. Nothing is taken for a refused booking: its id and template are checked
    before its port is (`port`: the port its armed container already publishes, adopted)."""
    problem = booking_id_problem(booking.id)
    if problem:
        return problem
    template, problem = usable_template(templates, booking.template, driver_version=driver_version)
    if template is None:
        return problem
    if port is not None:
        state.adopt_port(booking.id, port, now=now)
    else:
        port = port_for(config, state, booking.id, now=now)
    return request(booking, config.users[booking.user], template=template, gpus=gpus, port=port)


def usable_template(templates: TemplateSet, name: str, *, driver_version: str | None) -> tuple[Template | None, str]:
    """The template a booking names, if it exists and suits the host's driver; else None and why
    (the start refuses the booking with that sentence; an arm ahead simply leaves it to the start)."""
    template = templates.templates.get(name)
    if template is None:
        problem = templates.errors.get(name, f"there is no template {name!r}")
        return None, f"the template {name} cannot be used: {problem.splitlines()[0]}"
    if driver_version is not None and template.cuda:
        reason = cuda.check_cuda(template.cuda, driver_version)
        if reason:
            return None, reason
    return template, ""


def port_for(config: Config, state: State, booking_id: str, *, now: datetime) -> int:
    """The booking's SSH port (held, or the lowest free one), never the SFTP service's."""
    sftp = config.sftp
    return state.port_for(booking_id, port_min=config.ssh.port_min, port_max=config.ssh.port_max, now=now,
                          reserved=frozenset({sftp.port}) if sftp.enabled else frozenset())


def request(booking: Booking, user: UserConfig, *, template: Template, gpus: tuple[int, ...],
            port: int) -> StartRequest:
    """What a host gets to start (or arm) a booking: one function, so both build the same spec."""
    return StartRequest(booking_id=booking.id, booker=Booker(user.name, user.uid, user.gid, user.ssh_keys),
                        template=template, gpus=gpus, port=port, end=booking.end, start=booking.start,
                        uid=booking.uid, title=booking.summary)


def folders(place: Place, booker: Booker) -> storage.DataFolders:
    """The booker's data folders, made (owned by the booker's ids as the engine maps them) on a data
    root whose mount is nosuid,nodev, checked at every start (a remount may drop the flags)."""
    if place.data_root is None:
        return storage.no_folders(booker.name)
    problem = storage.mount_problem(place.data_root)
    if problem is not None:
        raise StorageError(problem)
    (owner_uid, owner_gid), chown = engines.ownership(place.engine, booker.uid, booker.gid)
    return storage.prepare(place.data_root, booker.name, uid=owner_uid, gid=owner_gid, home=place.persistent_home,
                           chown=chown)


def gpus(place: Place, booked: tuple[int, ...]) -> GpuInjection | None:
    """The host's driver for exactly the booked GPUs (None: no driver here, or no GPU booked)."""
    if place.driver_version is None or not booked:
        return None
    from gpubook.runtime import nvidia  # only hosts with a driver need it

    return nvidia.injection(booked, extra_roots=place.driver_roots, cache_dir=place.cache_dir, mps=place.mps)


def host_key(place: Place, name: str) -> ssh.HostKey:
    """The booking's host key, handed to the host ids of its container's root."""
    owner, chown = engines.ownership(place.engine, 0, 0)
    return ssh.booking_host_key(place.cache_dir, name, owner=owner, chown=chown)


def card(place: Place, name: str, request: StartRequest, provenance: prov.Card | None) -> Path:
    """The booking's booking.json, written anew at each arm and start (its title and end as the
    calendar has them now, and its provenance as known then); the folder is what the container binds."""
    written = booking_json.Card(booking=request.booking_id, uid=request.uid or request.booking_id,
                                title=request.title, user=request.booker.name, start=request.start,
                                end=request.end, gpus=request.gpus, template=request.template.name,
                                host=request.address, port=request.port,
                                provenance=provenance.to_json(zone=place.timezone) if provenance else None)
    return booking_json.write_card(place.cache_dir, name, written, zone=place.timezone)


def spec(place: Place, request: StartRequest, *, check_image: bool = True,
         provenance: prov.Card | None = None) -> ContainerSpec:
    """The booking's container, the same whether it is armed ahead or run at its start: its image
    (ready, never pulled here; not asked again for the container armed with it), folders, GPU
    injection, host key and the booking's start."""
    booker, template = request.booker, request.template
    # The folders first: a data_root refused for its mount is the admin's to fix, whatever the image.
    made = folders(place, booker)
    if check_image:  # Preparing until pulled and built in the background (never here)
        place.images.ready(template)
    injection = gpus(place, request.gpus)
    name = container_name(request.booking_id)
    key = host_key(place, name)
    written = card(place, name, request, provenance)
    end = request.end.astimezone(place.timezone)  # GPUBOOK_END in the zone bookers read
    return launch.booking_spec(
        template,
        launch.Tenancy(booking_id=request.booking_id, user=booker.name, uid=booker.uid, gid=booker.gid,
                        ssh_keys=tuple(booker.ssh_keys), port=request.port, end=end,
                        start=request.start, gpus=request.gpus, gpu=injection,
                        not_before=clock.real(request.start) if request.start is not None else None),
        launch.HostFiles(probe_key=place.probe_key, cache_dir=place.cache_dir, host_key=key,
                          folders=made, card=written))


def provenance(place: Place, request: StartRequest, *, started: datetime | None) -> prov.Card:
    """What is known of the booking's provenance at its start: its template and image (the engine's
    inspect of the template's image: id, registry digest, the CUDA and cuDNN its config declares),
    the host's driver and the booked GPUs (NVML). A value not known stays None."""
    template = request.template
    notes: list[str] = []
    facts: images.ImageFacts | None = None
    inspect = getattr(place.engine, "image_facts", None)  # engines that inspect images (not udocker)
    if inspect is not None:
        try:
            facts = inspect(overlay_image.base_image(template))
        except (GpubookError, OSError, ValueError) as error:
            notes.append(f"the image could not be inspected: {error}")
    else:
        notes.append(f"engine {place.engine.name} does not inspect images: no image id or digest")
    cuda_image, cudnn_image = prov.image_versions(facts.env) if facts else (None, None)
    image_id = facts.id if facts and facts.id else None
    if image_id and ":" not in image_id:
        image_id = f"sha256:{image_id}"  # podman gives the bare hex
    pinned = template.image.rpartition("@")[2] if "@" in template.image else None
    card = prov.Card(booking=request.booking_id, user=request.booker.name, template=template.name,
                     template_version=template.version, template_sha256=template.sha256, image=template.image,
                     image_id=image_id, image_digest=pinned or (prov.repo_digest(facts.digests) if facts else None),
                     cuda_image=cuda_image, cudnn_image=cudnn_image, started=started, notes=tuple(notes))
    if place.driver_version is None or not request.gpus:
        return card
    from gpubook.runtime.nvidia import nvml  # only hosts with a driver need it

    seen = nvml.provenance(request.gpus)
    gpus = tuple(prov.GpuFacts(index, name, uuid, mig) for index, name, uuid, mig in seen.gpus) or \
        tuple(prov.GpuFacts(index) for index in request.gpus)
    return replace(card, driver=seen.driver_version or place.driver_version,
                   cuda_driver=prov.cuda_driver_text(seen.cuda_driver_version), gpus=gpus, mps=place.mps,
                   notes=card.notes + ((f"NVML: {seen.problem}",) if seen.problem else ()))


def run(place: Place, request: StartRequest) -> Started:
    """Run the booking's container (an armed one, run ahead with this very spec, is taken as it is:
    the engine sees the same spec hash) and wait until its SSH lets the probe in."""
    card = provenance(place, request, started=clock.now())
    built = spec(place, request, check_image=not request.armed, provenance=card)
    # Its armed container, listed by this pass with this very spec: no engine call, the probe only
    # (a container that died since is seen by the probe's check).
    running = (info_from_labels(name=built.name, id="", state="running", image=built.image, labels=built.labels())
               if request.armed and request.armed == built.spec_hash else None)
    if running is None and request.armed:
        # Armed with another spec (its template edited since, or the daemon's clock told otherwise): nobody
        # is in it (SSH opens at the start), so it goes and the start runs it anew, now, instead of
        # finding its name taken and waiting for a retry.
        log.info("booking %s: its container run ahead has another spec than its start's; run again",
                 request.booking_id)
        place.engine.stop(built.name, 0)
        place.images.ready(request.template)
    def start(running: ContainerInfo | None) -> launch.Ready:
        return launch.start_booking(place.engine, built, probe_key=place.probe_key, host=place.probe_address,
                                    gate=place.gates.of(built.name), running=running)

    try:
        try:
            ready = start(running)
        except SpecTaken as taken:
            if not _before_its_start(taken.current):
                raise
            # A container run ahead for another slot of this booking (moved since, and the pass's removal of
            # it not done yet), whose SSH has not opened: nobody is in it. It goes; the start runs anew.
            log.info("booking %s: its container run ahead for %s has not opened; run again for this start",
                     request.booking_id, taken.current.start)
            place.engine.stop(built.name, 0)
            ready = start(None)
    except EngineError:
        if not place.images.recheck(request.template):
            raise Preparing(f"{PREPARING_IMAGE}{request.template.name}: again, it was "
                            f"removed from the engine's storage after it was prepared") from None
        raise
    lab = jupyter.availability(place.engine, built.name) if request.template.jupyter else None
    return Started(info=replace(ready.info, host=place.name), seconds_to_ssh=ready.seconds, jupyter=lab,
                   provenance=card.to_json(zone=UTC))


def _before_its_start(current: ContainerInfo) -> bool:
    """A container whose booking's start (its label) is still to come: its entrypoint keeps SSH shut."""
    return current.start is not None and current.start > clock.now()


def arm(place: Place, request: StartRequest) -> ContainerInfo:
    """Before the booking's start: run its container with exactly the spec its start will build
    (`spec`), with no probe. Its entrypoint makes the account and keys and then waits for
    `request.start` before sshd or anything of the booker's runs; at the start, `run` finds it running
    with the same spec hash and only probes SSH. A failed run leaves nothing behind."""
    if request.start is None:
        raise EngineError(f"booking {request.booking_id}: no start to arm its container for")
    built = spec(place, request, provenance=provenance(place, request, started=None))
    with place.gates.of(built.name):
        info = place.engine.start(built)
    return replace(info, host=place.name)
