"""The availability calendar: each booked stretch of the host's GPUs as a busy event, subscribable
(webcal/https) from the page's /free.ics (and /free/<model>.ics where the host has several GPU
models) and printed by `gpubook free --ics`.

Busy events rather than VFREEBUSY: a subscribed calendar of VEVENTs with TRANSP:OPAQUE is what
every common client (Thunderbird, Apple Calendar, Outlook, Google, khal/vdirsyncer) shows beside
the booker's own week, like a colleague's shared calendar, and counts as busy when it looks for
free time; a published VFREEBUSY object is read by few clients and shown by fewer.

Names: an event says "busy: GPU 0,1" and nothing of who holds it. Only the booking's own booker,
known to the page by its login (auth basic or header), sees their name on their own bookings, as
only they see their ssh line (outbox/web/page.py): a subscription is synced to phones and shared
with others, so it tells nobody else who booked what. The UID is a digest of the booking's id,
stable across fetches (so a client updates an event in place) and telling nothing of the booking.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Collection, Iterable, Mapping
from datetime import datetime, timedelta

import icalendar

from gpubook.scheduler.core.free import Block
from gpubook.scheduler.core.plan import LOCAL
from gpubook.scheduler.outbox.status import Status

BUSY_KINDS = ("booked", "running", "held")  # a timeline's segments that hold their GPUs
REFRESH = timedelta(minutes=5)  # how often a client should fetch the feed again (RFC 7986)
_PRODID = "-//gpubook//availability//EN"


def blocks_of(status: Status | None) -> list[Block]:
    """The busy blocks in the daemon's last status (each booking's GPU timelines joined)."""
    if status is None:
        return []
    joined: dict[tuple[str, str, str, str, str], set[int]] = {}
    for host in status.hosts:
        for lane in host.timeline:
            for segment in lane.segments:
                if segment.kind in BUSY_KINDS:
                    key = (host.name, segment.booking, segment.user, segment.start, segment.end)
                    joined.setdefault(key, set()).add(lane.gpu)
    found = [Block(host=host, gpus=tuple(sorted(gpus)), start=datetime.fromisoformat(start),
                   end=datetime.fromisoformat(end), booking=booking, user=user)
             for (host, booking, user, start, end), gpus in joined.items()]
    return sorted(found, key=lambda b: (b.start, b.host, b.gpus, b.booking))


def slug(model: str) -> str:
    """A GPU model's name as a path part: "NVIDIA A100-SXM4-80GB" → "a100-sxm4-80gb"."""
    text = re.sub(r"^nvidia\s+", "", model.strip(), flags=re.IGNORECASE)
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "unknown"


def model_gpus(models: Mapping[int, str]) -> dict[str, tuple[int, ...]]:
    """Each model's slug → its GPU indices (from GPU index → model name)."""
    found: dict[str, list[int]] = {}
    for index, name in sorted(models.items()):
        if name:
            found.setdefault(slug(name), []).append(index)
    return {name: tuple(gpus) for name, gpus in found.items()}


def only_gpus(found: Iterable[Block], gpus: Collection[int], *, host: str = LOCAL) -> list[Block]:
    """The blocks on these GPUs of `host` (a model's feed), each cut to them."""
    kept = []
    for block in found:
        chosen = tuple(gpu for gpu in block.gpus if gpu in gpus) if block.host == host else ()
        if chosen:
            kept.append(Block(host=block.host, gpus=chosen, start=block.start, end=block.end, booking=block.booking,
                              user=block.user))
    return kept


def feed(found: Iterable[Block], *, host_name: str, viewer: str | None, now: datetime, model: str = "") -> bytes:
    """The availability calendar as iCalendar bytes. `viewer`: who asks (None: nobody known), who
    alone sees their own name on their bookings; `model`: the GPU model the feed covers ("": all)."""
    blocks = list(found)
    hosts = {block.host for block in blocks}
    calendar = icalendar.Calendar()
    title = f"{host_name} {model} GPUs: busy" if model else f"{host_name} GPUs: busy"
    calendar.add("prodid", _PRODID)
    calendar.add("version", "2.0")
    calendar.add("calscale", "GREGORIAN")
    calendar.add("method", "PUBLISH")
    calendar.add("name", title)  # RFC 7986
    calendar.add("x-wr-calname", title)
    calendar.add("x-wr-caldesc", f"When the GPUs of {host_name} are booked (gpubook); the gaps are free")
    calendar.add("refresh-interval", REFRESH, parameters={"VALUE": "DURATION"})
    calendar.add("x-published-ttl", icalendar.vDuration(REFRESH))
    for block in blocks:
        calendar.add_component(_event(block, host_name=host_name, viewer=viewer, now=now,
                                      several_hosts=len(hosts) > 1 or block.host != LOCAL))
    return calendar.to_ical()


def _event(block: Block, *, host_name: str, viewer: str | None, now: datetime, several_hosts: bool) -> icalendar.Event:
    where = f"{block.host} " if several_hosts else ""
    gpus = ",".join(map(str, block.gpus))
    summary = f"busy: {where}GPU {gpus}"
    if viewer is not None and viewer == block.user:
        summary += f" ({block.user})"
    event = icalendar.Event()
    digest = hashlib.sha256(f"{host_name}\0{block.host}\0{block.booking}\0{gpus}".encode()).hexdigest()[:32]
    event.add("uid", f"{digest}@gpubook")
    event.add("dtstamp", now)
    event.add("dtstart", block.start)
    event.add("dtend", block.end)
    event.add("summary", summary)
    event.add("transp", "OPAQUE")
    event.add("status", "CONFIRMED")
    event.add("location", f"{host_name} {where}GPU {gpus}")
    return event
