"""The outbox's deliverers, as a pass wakes them: the calendar write-back (one lane per calendar,
gpubook/scheduler/outbox/writeback.py) and the notices (a lane of their own: a slow mail server
holds no pass). Both read what was recorded; neither is ever waited for by a pass or a start.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import datetime

from gpubook.runtime.errors import GpubookError
from gpubook.scheduler.outbox import notices as notices_module
from gpubook.scheduler.outbox.writeback import WriteBack
from gpubook.scheduler.settings import Config
from gpubook.scheduler.state import State

log = logging.getLogger(__name__)


class Delivery:
    def __init__(self, config: Config, state: State,
                 notices: Callable[[notices_module.Message], None] | None = None, *,
                 address: Callable[[str], str] | None = None) -> None:
        """`notices`: where a notice goes (None: the configured channels); `address`: where a booker
        logs in to a booking on a host (the backend's)."""
        self.state = state
        self.notices = notices
        self.writeback = WriteBack(config, state, address=address)
        self._lane = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gpubook-notices")
        self._delivery: Future[None] | None = None

    def notices_after(self, now: datetime) -> None:
        """The notices queued so far, delivered in their lane (one delivery at a time)."""
        if self._delivery is not None and not self._delivery.done():
            return
        self._delivery = self._lane.submit(self._deliver, now)

    def notices_now(self, now: datetime) -> None:
        """The notices queued so far, delivered before this returns."""
        notices_module.deliver_pending(self.state, self.notices, now=now)

    def _deliver(self, now: datetime) -> None:
        try:
            notices_module.deliver_pending(self.state, self.notices, now=now)
        except GpubookError as error:
            log.warning("notices wait for a later pass: %s", error)

    def close(self) -> None:
        """Wait for the notices and the write-back."""
        self._lane.shutdown(wait=True)
        self.writeback.close()
