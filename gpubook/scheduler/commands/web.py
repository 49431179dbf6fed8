"""`gpubook web`: the status page on its own, beside a daemon that does not serve it (or on
another account that may read its state folder). It reads the status file the daemon writes after
each pass; it writes nothing anywhere."""

from __future__ import annotations

import signal
import threading
from types import FrameType

from gpubook.scheduler import config as config_module
from gpubook.scheduler.outbox.status_file import STATUS_FILE
from gpubook.scheduler.outbox.web import serve
from gpubook.scheduler.wiring import state_dir


def run(config_path: str) -> int:
    config = config_module.load(config_path)
    server = serve.start(config, status=serve.StatusFile(state_dir(config) / STATUS_FILE))
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
