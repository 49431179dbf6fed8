"""`gpubook web`: the status page on its own, beside a daemon that does not serve it (or on
another account that may read its state folder). It reads the status file the daemon writes after
each pass; it writes nothing anywhere. With a directory, auth "ldap" lets in the users of the
daemon's last copy of it (directory.json), read again when the daemon writes it again."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Collection
from types import FrameType

from gpubook.scheduler import config as config_module
from gpubook.scheduler import directory
from gpubook.scheduler.outbox.status_file import STATUS_FILE
from gpubook.scheduler.outbox.web import serve
from gpubook.scheduler.outbox.web.directory_login import login_names
from gpubook.scheduler.settings import Config
from gpubook.scheduler.wiring import state_dir


def _members(base: Config) -> Callable[[], Collection[str]]:
    """The names that may log in now: `base`'s users merged with the daemon's copy of the directory,
    merged again when the copy changes."""
    path = directory.cache_path(base)
    seen: list[tuple[int, Collection[str]]] = []

    def members() -> Collection[str]:
        try:
            stamp = path.stat().st_mtime_ns
        except OSError:
            stamp = -1
        if not seen or seen[0][0] != stamp:
            seen[:] = [(stamp, login_names(directory.with_users(base, cached=True)))]
        return seen[0][1]

    return members


def run(config_path: str) -> int:
    base = config_module.load(config_path, directory="none")
    config = directory.with_users(base, cached=True)
    server = serve.start(config, status=serve.StatusFile(state_dir(config) / STATUS_FILE), members=_members(base))
    print(f"gpubook: the status page is on http://{server.address}/ (auth {config.web.auth}); Ctrl-C ends it",
          flush=True)
    stop = threading.Event()

    def stopping(number: int, frame: FrameType | None) -> None:
        stop.set()

    for number in (signal.SIGTERM, signal.SIGINT):
        signal.signal(number, stopping)
    stop.wait()
    server.stop()
    return 0
