"""Images prepared ahead: each booking's template image pulled and its sshd overlay built in the
background, hours before the start, so that a start never waits for a pull or an `apt-get`.

Each pass hands `want` the accepted bookings that start within `[images] prepare_hours` (one cheap
call: it only queues). A bounded pool of workers pulls (gpubook/runtime/templates/images.py: credentials, digests,
the template's mirror) and builds the overlay (gpubook/runtime/templates/overlay_image.py), one preparation per
template at a time; a start whose image is not ready yet queues it too (a booking accepted minutes
before its start) and is held with a note (`Preparing`). A failed pull is tried again after a
growing delay, never in a loop. Each image's state (queued, pulling, warming, building, ready,
failed: why, since when) is kept for the event's block ("image: ready" / "image: not ready: <why>"),
`gpubook status` and `gpubook images`; when something finishes, `on_done` wakes a pass.

A pull is followed as it goes: the bytes to download (the registry's manifest, less the layers the
store has: images.download_size) and the bytes downloaded so far (the engine's scratch folder), so a
booking waiting for its image reads "preparing image pytorch: 4.1 of 9.3 GB, ready about 10:42" in
its event and on the page. "Ready about" is the download's rate so far for what is left, plus the
time the steps after it (applying the layers, the warm-up) took per downloaded byte the last time
(a default before). What a first start would pay (rootless podman's copy of the layers chowned to
the bookings' id map: seconds per GB) is paid here, by the warm-up, never at a booking's start.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from datetime import UTC, datetime, timedelta, tzinfo
from pathlib import Path
from typing import Any

from gpubook.runtime.engines import Engine, KeepsSpares
from gpubook.runtime.errors import PREPARING_IMAGE, EngineError, GpubookError, Preparing
from gpubook.runtime.templates import images, overlay_image
from gpubook.runtime.templates.catalog import Template
from gpubook.scheduler import clock

log = logging.getLogger(__name__)

PRESENT_WARM_WAIT = 120.0  # seconds a start waits for the warm-up of an image that was here already
QUEUED, PULLING, WARMING, BUILDING, READY, FAILED = "queued", "pulling", "warming", "building", "ready", "failed"
RETRY_FIRST = timedelta(seconds=60)  # after a failed preparation; doubled each time
RETRY_MOST = timedelta(hours=1)
GB = 1_000_000_000
EVENT_REFRESH = timedelta(seconds=15)  # how often a busy preparation's sentence changes in events
# Seconds per downloaded byte for what follows the download, until a preparation measured it here:
# bench/results/sizes-2026-11-27 (2 cores): 39 s applying layers + 12-14 s chowned copy for 6.8 GB.
AFTER_DOWNLOAD = 8e-9
RATE_AFTER = timedelta(seconds=2)  # a download's rate is believed after this long


@dataclass(frozen=True)
class Preparation:
    """One template's image on its way to being ready."""

    template: str
    image: str  # as the template names it
    run_image: str  # what its bookings run (the image, its pinned tag or its overlay)
    state: str
    since: datetime
    why: str = ""  # failed: the reason in a booker's words (images.REFUSED, NOT_FOUND, ...)
    detail: str = ""  # failed: the engine's words; ready: which source served it
    attempts: int = 0
    retry_at: datetime | None = None
    size: int | None = None  # bytes of the run image, once ready
    total: int | None = None  # bytes the pull downloads (None: not known)
    done: int = 0  # bytes downloaded so far
    began: datetime | None = None  # when the download began
    downloaded: datetime | None = None  # when it ended
    ready_about: datetime | None = None  # the estimate, while busy
    # A booking started on the image while this was queued: its start makes the first chowned copy,
    # and the warm-up is left out (never two first starts of an image at once: a booking's `podman
    # run` and the warm-up's `create`).
    first_start_taken: bool = False
    present: bool = False  # the image was in the store already when its preparation looked

    @property
    def busy(self) -> bool:
        return self.state in (QUEUED, PULLING, WARMING, BUILDING)

    def line(self, zone: tzinfo = UTC) -> str | None:
        """The event block's line: ready, being made (how far, ready about when), or why not."""
        if self.state == READY:
            return "image: ready"
        if self.state == FAILED:
            return f"image: not ready: {self.why} ({self.image}); gpubook tries again"
        return self.sentence(zone)

    def sentence(self, zone: tzinfo = UTC) -> str:
        """"preparing image pytorch: 4.1 of 9.3 GB, ready about 10:42" (in `zone`, the bookers')."""
        if self.state == PULLING and self.total:
            unit, scale = ("GB", GB) if self.total >= GB else ("MB", 1_000_000)
            digits = 1 if unit == "GB" else 0
            where = f"{min(self.done, self.total) / scale:.{digits}f} of {self.total / scale:.{digits}f} {unit}"
            if self.done >= self.total:  # podman applies the layers before the pull ends
                where = f"{self.total / scale:.{digits}f} {unit} downloaded, unpacking"
        elif self.state == PULLING:
            where = f"{self.done / GB:.1f} GB downloaded" if self.done else "downloading"
        else:
            where = {QUEUED: "queued", WARMING: "downloaded, making its first start ready",
                     BUILDING: "building its sshd overlay"}.get(self.state, self.state)
        about = f", ready about {self.ready_about.astimezone(zone):%H:%M}" if self.ready_about else ""
        return f"{PREPARING_IMAGE}{self.template}: {where}{about}"


def key_of(template: Template) -> str:
    return f"{template.name} {template.image} {template.mirror or ''} {template.has_sshd}"


class ImagePreparer:
    """The background preparations of one host's engine."""

    def __init__(self, *, engine: Engine, ledger: images.Ledger, auth_file: Path | None = None,
                 min_free_gb: float = 0.0, workers: int = 2, zone: tzinfo = UTC,
                 on_done: Callable[[], None] | None = None) -> None:
        self.engine = engine
        self.zone = zone  # the bookers' time zone, for "ready about"
        self.after_download = AFTER_DOWNLOAD  # learned from each preparation
        self.ledger = ledger
        self.auth_file = auth_file
        self.min_free = int(min_free_gb * GB)
        self.on_done = on_done  # told when a preparation ends (the daemon wakes a pass)
        # Told each pull's outcome: "pulled", "present" (nothing to pull) or why it failed (images.REFUSED, ...).
        self.on_pull: Callable[[str], None] | None = None
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="gpubook-images")
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # told of every change of a preparation's state
        self._states: dict[str, Preparation] = {}
        self._wanted: dict[str, Template] = {}  # booking id → its template (the last pass's)
        self._storage: Path | None = None
        self._shown: dict[str, tuple[datetime, str, str]] = {}  # key → since when events show a sentence, its step

    # -- what the pass and the start call (cheap, never blocking on a pull) --------------------

    def want(self, bookings: Mapping[str, Template], *, now: datetime) -> None:
        """The accepted bookings starting within prepare_hours: queue what they need."""
        with self._lock:
            self._wanted = dict(bookings)
            for template in {key_of(t): t for t in bookings.values()}.values():
                self._queue_if_due(template, now=now)

    def ready(self, template: Template, *, now: datetime | None = None) -> str:
        """The image a booking of `template` runs, when ready; else it is queued (if it is not
        yet) and `Preparing` says what it waits for."""
        now = now or clock.now()
        with self._lock:
            current = self._states.get(key_of(template))
            if current is not None and current.state == READY:
                return current.run_image
        if current is None and self._present(template):  # made before gpubook knew of it
            with self._lock:
                self._states[key_of(template)] = Preparation(template.name, template.image,
                                                             overlay_image.run_image(template), READY, now)
            self._keep_spare(template)
            return overlay_image.run_image(template)
        if current is not None and current.state == FAILED and self._present(template):
            # Put there by hand since it failed (udocker's store is filled by an admin's `udocker
            # load`): the booking starts now, not at the retry, which may be an hour away.
            with self._lock:
                self._states[key_of(template)] = replace(current, state=READY, since=now, why="", retry_at=None,
                                                         detail="present (put there since it failed)")
            log.info("template %s: its image is ready (present since it failed)", template.name)
            self._keep_spare(template)
            return overlay_image.run_image(template)
        if current is not None and current.present and current.state in (PULLING, WARMING):
            # Here before its preparation looked (CI of 2026-11-29: the preparation queued by this very
            # pass had got that far before the start asked). Before its warm-up the booking takes the
            # first start, as while queued; during it, it waits for it here (a few seconds: the copy
            # it would make anyway), not held for a later pass.
            with self._lock:
                self._changed.wait_for(lambda: self._states[key_of(template)].state != WARMING,
                                       timeout=PRESENT_WARM_WAIT)
                current = self._states[key_of(template)]
                if current.state == READY:
                    return current.run_image
                if self._take_first_start(template, (QUEUED, PULLING)):
                    return overlay_image.run_image(template)
        if current is not None and current.state == QUEUED and self._present(template):
            # Queued by this very pass (a booking saved after its start) with the image here: the
            # booking runs it instead of waiting, and pays the first start itself; the preparation
            # goes on without its warm-up. (Pulled a moment ago and being warmed or built: it waits
            # for that, which it would pay at its start anyway, and starts when the image is ready.)
            with self._lock:
                if self._take_first_start(template, (QUEUED,)):
                    return overlay_image.run_image(template)
        with self._lock:
            current = self._queue_if_due(template, now=now)
            shown = self._shown_line(current, now=now)
        if current.state == FAILED:
            raise Preparing(f"image not ready: {current.why}: {current.detail}")
        raise Preparing(shown or current.sentence(self.zone))

    def _keep_spare(self, template: Template) -> None:
        """An image found here (not prepared by this daemon): the engine's spare of it made in the background
        where none fits, so that the next booking for now does not pay its copy (udocker: `KeepsSpares`)."""
        if isinstance(self.engine, KeepsSpares):
            self.engine.keep_spare(overlay_image.run_image(template))

    def _take_first_start(self, template: Template, states: tuple[str, ...]) -> bool:
        """(Under the lock.) A booking's start makes the image's first chowned copy itself, and the
        warm-up is left out: while the preparation is in one of `states`, for one taker only."""
        current = self._states.get(key_of(template))
        if current is None or current.state not in states or current.first_start_taken:
            return False
        self._states[key_of(template)] = replace(current, first_start_taken=True)
        return True

    def recheck(self, template: Template, *, now: datetime | None = None) -> bool:
        """After a start that failed: is the image it was told is ready still there? If not (an
        admin removed it, or a cleanup by hand), it is prepared again instead of failing every
        start from now on; the caller holds the booking with `Preparing`."""
        if self._present(template):
            return True
        with self._lock:
            self._states.pop(key_of(template), None)
            self._queue_if_due(template, now=now or clock.now())
        log.warning("template %s: its image %s is gone since it was prepared; it is prepared again",
                    template.name, overlay_image.run_image(template))
        return False

    def lines(self, *, now: datetime | None = None) -> dict[str, str]:
        """Booking id → its event's image line: ready, failed, or the sentence of one being made
        (changed at most every EVENT_REFRESH: each change is a write of the booker's event)."""
        now = now or clock.now()
        with self._lock:
            found = {b: self._states.get(key_of(t)) for b, t in self._wanted.items()}
            return {booking: line for booking, p in found.items()
                    if p is not None and (line := self._shown_line(p, now=now))}

    def _shown_line(self, preparation: Preparation, *, now: datetime) -> str | None:
        """`preparation.line()`, the one shown last while it is younger than EVENT_REFRESH (under the lock)."""
        key = f"{preparation.template} {preparation.image}"
        line = preparation.line(self.zone)
        if line is None or not preparation.busy:
            self._shown.pop(key, None)
            return line
        shown = self._shown.get(key)
        if shown is not None and now - shown[0] < EVENT_REFRESH and shown[2] == preparation.state:
            return shown[1]  # the same step: the sentence shown a moment ago (a new step shows at once)
        self._shown[key] = (now, line, preparation.state)
        return line

    def waiting(self) -> dict[str, str]:
        """Booking id → the live sentence of its image being made (the page's, not throttled)."""
        with self._lock:
            found = {b: self._states.get(key_of(t)) for b, t in self._wanted.items()}
        return {booking: p.sentence(self.zone) for booking, p in found.items() if p is not None and p.busy}

    def snapshot(self) -> dict[str, Any]:
        """For `gpubook status` and `gpubook images`: each preparation, its bookings, the disk."""
        with self._lock:
            states = list(self._states.values())
            wanted = dict(self._wanted)
        free = None
        if self._storage is not None:
            free = images.free_bytes_at(self._storage)
        rows = []
        for item in states:
            row = asdict(item)
            row.update({name: value.isoformat() for name in ("since", "retry_at", "began", "downloaded", "ready_about")
                        if isinstance(value := getattr(item, name), datetime)})
            row.update(bookings=sorted(b for b, t in wanted.items() if t.name == item.template),
                       sentence=item.sentence(self.zone) if item.busy else None)
            rows.append(row)
        return {"preparations": rows, "free_bytes": free, "min_free_bytes": self.min_free,
                "storage": str(self._storage) if self._storage else None}

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # -- the background work ---------------------------------------------------------------------

    def _queue_if_due(self, template: Template, *, now: datetime) -> Preparation:
        key = key_of(template)
        current = self._states.get(key)
        if current is not None and (current.busy or current.state == READY):
            return current
        if current is not None and current.retry_at is not None and current.retry_at > now:
            return current
        queued = Preparation(template.name, template.image, overlay_image.run_image(template), QUEUED, now,
                             attempts=current.attempts if current else 0)
        self._states[key] = queued
        log.info("template %s: its image %s is queued to be prepared", template.name, template.image)
        self._pool.submit(self._prepare, template)
        return queued

    def _set(self, template: Template, *, keep_since: bool = False, **changes: Any) -> Preparation:
        with self._lock:
            key = key_of(template)
            current = self._states[key]
            changed = replace(current, since=current.since if keep_since else clock.now(), **changes)
            self._states[key] = changed
            self._changed.notify_all()
            return changed

    def _estimate(self, total: int | None, done: int, began: datetime, *, now: datetime,
                  downloaded: datetime | None = None) -> datetime | None:
        """When the image should be ready: the download's rate so far for what is left, then the
        steps after it at the last preparation's pace per byte (from when the last byte came, once
        it came); None before the rate is known."""
        if total is None:
            return None
        after = timedelta(seconds=total * self.after_download)
        if downloaded is not None:
            return downloaded + after
        elapsed = (now - began).total_seconds()
        if done <= 0 or now - began < RATE_AFTER:
            return None
        return now + timedelta(seconds=max(0, total - done) * elapsed / done) + after

    def _learn(self, ready: Preparation) -> None:
        """The pace of what followed the download (applying the layers, the warm-up, the overlay)."""
        if ready.total and ready.total >= 100_000_000 and ready.downloaded is not None:
            self.after_download = max(0.0, (ready.since - ready.downloaded).total_seconds()) / ready.total

    def _warm(self, template: Template) -> None:
        """The first start's cost, paid now (the engine's `warm`: podman's chowned copy)."""
        warm = getattr(self.engine, "warm", None)
        if warm is None:
            return
        began = clock.now()
        with self._lock:  # the check and the state at once: ready() reads and sets it under this lock too
            current = self._states[key_of(template)]
            taken = current.first_start_taken
            if not taken:
                total = current.total or 0
                left = total * self.after_download - (began - (current.downloaded or began)).total_seconds()
                self._states[key_of(template)] = replace(
                    current, state=WARMING, done=total, since=began,
                    ready_about=began + timedelta(seconds=max(0.0, left)) if total else None)
        if taken:  # a spare (udocker's) is no first start: made aside for the next booking all the same
            log.info("template %s: its first start is a booking's own (started while it was queued)", template.name)
            self._keep_spare(template)
            return
        image = overlay_image.run_image(template)
        try:
            warm(image)
        except EngineError as error:  # the first start pays it instead; not a reason to hold bookings
            log.warning("template %s: its first start could not be made ready ahead (%s): the first booking's "
                        "start pays it", template.name, str(error).splitlines()[0] if str(error) else error)
            return
        log.info("template %s: its first start made ready in %.1f s (%s)", template.name,
                 (clock.now() - began).total_seconds(), image)

    def _prepare(self, template: Template) -> None:
        try:
            detail = self._pull(template)
            with self._lock:
                downloaded = self._states[key_of(template)].downloaded
            self._set(template, downloaded=downloaded or clock.now(), keep_since=True)
            if not template.has_sshd:
                self._set(template, state=BUILDING)
                log.info("template %s: building its sshd overlay in the background", template.name)
                tag = self._overlay(template)
                self.ledger.add(tag, kind="overlay")
            self._warm(template)
            size = self._size(overlay_image.run_image(template))
            ready = self._set(template, state=READY, detail=detail, why="", retry_at=None, size=size, ready_about=None)
            self._learn(ready)
            log.info("template %s: its image is ready (%s)", template.name, detail)
            self._clean()
        except GpubookError as error:
            self._failed(template, error)
        except Exception:  # a defect: logged, and the image is tried again later
            log.exception("template %s: preparing its image failed unexpectedly", template.name)
            self._failed(template, GpubookError("an unexpected error (see the log)"))
        finally:
            if self.on_done is not None:
                self.on_done()

    def _overlay(self, template: Template) -> str:
        try:
            return overlay_image.build_overlay(self.engine, template)
        except EngineError as error:
            if error.temporary or isinstance(self.engine, images.ImageEngine):
                raise
            # An engine that builds nothing (udocker): the image with sshd is missing from its store.
            raise images.PullError(images.NOT_FOUND, str(error)) from None

    def _pull(self, template: Template) -> str:
        """Make the template's image present; say which source served it (and tell `on_pull`)."""
        try:
            detail, outcome = self._fetch(template)
        except images.PullError as error:
            self._told(error.reason)
            raise
        self._told(outcome)
        return detail

    def _told(self, outcome: str) -> None:
        if self.on_pull is not None:
            self.on_pull(outcome)

    def _fetch(self, template: Template) -> tuple[str, str]:
        engine = self.engine
        reference = images.parse_reference(template.image)
        if not isinstance(engine, images.ImageEngine):  # udocker, a site's engine: its own store, present or not
            try:
                engine.ensure_image(overlay_image.base_image(template))
            except EngineError as error:
                if error.temporary:
                    raise
                raise images.PullError(images.NOT_FOUND, str(error)) from None  # the engine's sentence says how
            return "present", "present"
        if self._storage is None:
            self._storage = engine.storage_path()
        if reference.registry == "localhost" and not template.mirror and not engine.image_exists(template.image):
            raise images.PullError(images.NOT_FOUND, f"{template.image} is made on this machine, not pulled: "
                                   f"gpubook templates build {template.name}")
        self._clean()
        # No registry call for an image already here (each daemon start prepares every upcoming
        # template's), nor where the pull is not followed (dockerd pulls out of sight).
        here = engine.image_exists(reference.local_name() if reference.digest else template.image)
        if here:
            self._set(template, present=True, keep_since=True)
        followed = getattr(engine, "pull_scratch", lambda: None)() is not None and not here
        total = (images.download_size(engine, template.image, mirror=template.mirror, auth_file=self.auth_file)
                 if followed else None)
        began = clock.now()
        self._set(template, state=PULLING, total=total, done=0, began=began, downloaded=None,
                  ready_about=self._estimate(total, 0, began, now=began))
        log.info("template %s: pulling %s%s%s", template.name, template.image,
                 f" (mirror {template.mirror} first)" if template.mirror else "",
                 f" ({total / GB:.2f} GB to download)" if total is not None else "")

        def progress(measured: int) -> None:
            now = clock.now()
            with self._lock:
                current = self._states[key_of(template)]
            done = max(measured, current.done)  # the folder shrinks as podman applies the layers
            downloaded = current.downloaded or (now if total is not None and done >= total else None)
            self._set(template, done=done, downloaded=downloaded, keep_since=True,
                      ready_about=self._estimate(total, done, began, downloaded=downloaded, now=now))

        result = images.pull(engine, template.image, mirror=template.mirror, auth_file=self.auth_file,
                             progress=progress)
        if result.source:
            self.ledger.add(result.image, kind="pulled", source=result.source)
        return result.sentence(), "pulled" if result.source else "present"

    def _failed(self, template: Template, error: GpubookError) -> None:
        with self._lock:
            attempts = self._states[key_of(template)].attempts + 1
        delay = min(RETRY_FIRST * 2 ** (attempts - 1), RETRY_MOST)
        why = getattr(error, "reason", None) or images.classify(str(error))
        detail = str(error).splitlines()[0][-400:] if str(error) else type(error).__name__
        retry_at = clock.now() + delay
        self._set(template, state=FAILED, why=why, detail=detail, attempts=attempts, retry_at=retry_at)
        log.warning("template %s: its image is not ready: %s: %s; tried again in %d s", template.name, why,
                    detail, int(delay.total_seconds()))

    def _present(self, template: Template) -> bool:
        exists = getattr(self.engine, "image_exists", None)
        if exists is None:
            try:
                self.engine.ensure_image(overlay_image.run_image(template))
            except GpubookError:
                return False
            return True
        return bool(exists(overlay_image.run_image(template)))

    def _size(self, image: str) -> int | None:
        if not isinstance(self.engine, images.ImageEngine):
            return None
        facts = self.engine.image_facts(image)
        return facts.size if facts else None

    def _clean(self) -> None:
        """Under the free-space floor: gpubook's images no wanted booking needs, oldest first."""
        if not self.min_free or not isinstance(self.engine, images.ImageEngine):
            return
        with self._lock:
            keep = {name for t in self._wanted.values()
                    for name in (overlay_image.base_image(t), overlay_image.run_image(t))}
        images.clean(self.engine, self.ledger, keep=keep, min_free=self.min_free)
