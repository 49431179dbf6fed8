"""One start, one place: everything a booking's container is put together from, in the order a
start takes it. The StartHandler (apply/handlers.py) and the arm ahead of a start (apply/ahead.py)
take the first three; the local host (hosts/local.py) the rest, for its start and its arm alike:

1. `usable_template`: the template the booking names, if its host's driver can run it;
2. `port_for`: its SSH port (held, or the lowest free one; State keeps it);
3. `request`: what the host gets (`StartRequest`: the booker, template, GPUs, port, start and end);
4. `folders`: the booker's data folders (only on a nosuid,nodev data root);
5. `gpus`: the injection of the host's NVIDIA driver for exactly the booked GPUs;
6. `host_key`: the booking's own SSH host key;
7. `card`: its booking.json (what the booker reads inside);
8. `spec`: the container's spec (`runtime/booking/launch.py`'s `booking_spec` over the runtime's `Tenancy`),
   which `runtime/booking/launch.py`'s `start_booking` runs on the engine.
"""

from __future__ import annotations

from datetime import datetime, tzinfo
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import paramiko

from gpubook.runtime import engines
from gpubook.runtime.booking import booking_json, launch, ssh
from gpubook.runtime.booking import provenance as prov
from gpubook.runtime.data import storage
from gpubook.runtime.engines import ContainerSpec, Engine, container_name
from gpubook.runtime.errors import StorageError
from gpubook.runtime.nvidia import cuda
from gpubook.runtime.templates.catalog import Template, TemplateSet
from gpubook.scheduler import clock
from gpubook.scheduler.hosts import Booker, StartRequest
from gpubook.scheduler.settings import Config, UserConfig
from gpubook.scheduler.state import State

if TYPE_CHECKING:
    from gpubook.runtime.nvidia import GpuInjection
    from gpubook.scheduler.core.bookings import Booking
    from gpubook.scheduler.hosts.images import ImagePreparer


class Place(Protocol):
    """What a host puts a start together with (hosts/local.py's LocalHost is one)."""

    engine: Engine
    cache_dir: Path
    probe_key: paramiko.PKey
    data_root: Path | None
    persistent_home: bool
    driver_version: str | None
    driver_roots: tuple[Path, ...]
    mps: bool
    timezone: tzinfo | None
    images: ImagePreparer


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
    owner_uid, owner_gid = engines.host_owner(place.engine, booker.uid, booker.gid)
    return storage.prepare(place.data_root, booker.name, uid=owner_uid, gid=owner_gid, home=place.persistent_home,
                           chown=engines.chown_for(place.engine))


def gpus(place: Place, booked: tuple[int, ...]) -> GpuInjection | None:
    """The host's driver for exactly the booked GPUs (None: no driver here, or no GPU booked)."""
    if place.driver_version is None or not booked:
        return None
    from gpubook.runtime import nvidia  # only hosts with a driver need it

    return nvidia.injection(booked, extra_roots=place.driver_roots, cache_dir=place.cache_dir, mps=place.mps)


def host_key(place: Place, name: str) -> ssh.HostKey:
    """The booking's host key, handed to the host ids of its container's root."""
    return ssh.booking_host_key(place.cache_dir, name, owner=engines.host_owner(place.engine, 0, 0),
                                chown=engines.chown_for(place.engine))


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
