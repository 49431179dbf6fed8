"""A booking as its container sees it: /run/gpubook/booking.json (its id and UID, title, booker,
start, end, GPUs, template, host and port), written by gpubook on the host and kept up to date.

- The file lives on the host, in a folder of the daemon's (`card_folder`: one per container under
  the cache folder), bound read-only into the container at `CARD_TARGET`; the entrypoint links
  /run/gpubook/booking.json to it. The booker is root inside: they may change their own view (the
  link), never the file, and gpubook never reads anything back from the container.
- The folder is bound, not the file: a later end (the booker moved it in the calendar, and the
  daemon agreed) is written through a fresh temporary file and a rename, which the container sees
  at once (a bound file would keep showing the inode it was bound with).
- Written with O_EXCL|O_NOFOLLOW in a folder that is a real folder of the daemon's, mode 0755: a
  symlink or file planted under the temporary name is never written through.
- One key a line, so that the overlay's `gpubook-booking` (POSIX sh and awk, any image) can read it;
  ASCII only (json escapes the rest), so no byte of a hostile title reaches a terminal raw.
"""

from __future__ import annotations

import json
import os
import stat
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, tzinfo
from pathlib import Path
from typing import Any

from gpubook.runtime.errors import GpubookError

CARD_TARGET = "/.gpubook-booking"  # the folder bound read-only into the container
CARD_FILE = "booking.json"
TITLE_KEPT = 200  # characters of the event's title kept in the file


class CardError(GpubookError):
    """booking.json cannot be written safely (its folder is not the daemon's own)."""


@dataclass(frozen=True)
class Card:
    """What booking.json says. Times are aware; written in `zone` (ISO 8601 with its offset)."""

    booking: str
    uid: str
    title: str
    user: str
    start: datetime | None
    end: datetime
    gpus: tuple[int, ...]
    template: str
    host: str
    port: int
    # What is known of its provenance at the start (runtime/booking/provenance.py): image, template, GPUs,
    # driver, the start; its end is in /data/output/.gpubook/provenance.json once it ended.
    provenance: Mapping[str, Any] | None = None

    def to_json(self, *, zone: tzinfo | None) -> dict[str, Any]:
        def iso(moment: datetime | None) -> str | None:
            return moment.astimezone(zone).isoformat(timespec="seconds") if moment is not None else None

        return {"booking": self.booking, "uid": self.uid, "title": self.title[:TITLE_KEPT], "user": self.user,
                "start": iso(self.start), "end": iso(self.end), "end_epoch": int(self.end.timestamp()),
                "gpus": list(self.gpus), "template": self.template, "host": self.host, "port": self.port,
                **({"provenance": dict(self.provenance)} if self.provenance is not None else {})}


def card_folder(cache_dir: Path, name: str) -> Path:
    """The folder of container `name`'s booking.json on the host."""
    return cache_dir / "bookings" / name


def write_card(cache_dir: Path, name: str, card: Card, *, zone: tzinfo | None) -> Path:
    """Write container `name`'s booking.json (made or replaced whole); its folder, for the bind."""
    folder = _own_folder(card_folder(cache_dir, name))
    _write(folder / CARD_FILE, render(card.to_json(zone=zone)))
    return folder


def move_end(cache_dir: Path, name: str, end: datetime, *, zone: tzinfo | None) -> bool:
    """Write the agreed later `end` into container `name`'s booking.json; False where it has none
    (it does not run on this host, or runs from before booking.json existed)."""
    path = card_folder(cache_dir, name) / CARD_FILE
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    with os.fdopen(fd, "rb") as file:
        data = json.loads(file.read())
    data.update(end=end.astimezone(zone).isoformat(timespec="seconds"), end_epoch=int(end.timestamp()))
    _write(path, render(data))
    return True


def forget_card(cache_dir: Path, name: str) -> None:
    """A stopped container's booking.json goes with it."""
    folder = card_folder(cache_dir, name)
    (folder / CARD_FILE).unlink(missing_ok=True)
    try:
        folder.rmdir()
    except OSError:
        pass


def render(data: Mapping[str, Any]) -> bytes:
    """JSON, one key a line (lists inline), ASCII only."""
    lines = [f"  {json.dumps(key)}: {json.dumps(value)}" for key, value in data.items()]
    return ("{\n" + ",\n".join(lines) + "\n}\n").encode("ascii")


def _own_folder(folder: Path) -> Path:
    """`folder` made (mode 0755, its parent 0711), or checked: a real folder of ours that nobody
    else may write to."""
    folder.parent.mkdir(mode=0o711, parents=True, exist_ok=True)
    folder.mkdir(mode=0o755, exist_ok=True)
    info = os.lstat(folder)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid():
        raise CardError(f"{folder} is not a folder of this daemon's own (a symbolic link, or someone else's): "
                        f"remove it (it is made again)")
    if stat.S_IMODE(info.st_mode) != 0o755:
        os.chmod(folder, 0o755)  # noqa: S103 - read by the booker inside (not root there): read-only bound
    return folder


def _write(path: Path, data: bytes) -> None:
    """Through a fresh temporary file beside `path` (O_EXCL|O_NOFOLLOW, mode 0644) and a rename."""
    partial = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}")
    partial.unlink(missing_ok=True)
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    with os.fdopen(fd, "wb") as file:
        os.fchmod(file.fileno(), 0o644)  # whatever the umask: the booker (not root inside) reads it
        file.write(data)
    partial.replace(path)


def gpus_text(gpus: Sequence[int]) -> str:
    """GPUBOOK_GPUS: the host's GPU indices, comma-separated ("" for none)."""
    return ",".join(str(gpu) for gpu in gpus)
