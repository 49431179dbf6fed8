"""Live GPU utilisation and memory for the page, read from NVML at most every `max_age` seconds
(a page and its refreshes from several browsers share one reading; NVML calls take milliseconds
but an open session per request would add up)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from runtime.nvidia import nvml


@dataclass(frozen=True)
class LiveGpu:
    index: int
    name: str
    utilisation_percent: int | None
    memory_used_mib: int | None
    memory_total_mib: int | None


@dataclass(frozen=True)
class LiveGpus:
    gpus: tuple[LiveGpu, ...]
    problem: str | None = None  # why there is no GPU to show ("no GPU")
    read_at: float = 0.0  # time.time() of the reading


def read_nvml() -> LiveGpus:
    view = nvml.read(status=True)
    gpus = tuple(LiveGpu(index=g.index, name=g.name or "", utilisation_percent=g.utilisation_percent,
                         memory_used_mib=g.memory_used_mib, memory_total_mib=g.memory_total_mib) for g in view.gpus)
    problem = None if gpus else (view.problem or "NVML lists no GPU")
    return LiveGpus(gpus=gpus, problem=problem, read_at=time.time())


class CachedReading:
    """`reading()`: the last reading if younger than `max_age` seconds, else a new one."""

    def __init__(self, read: Callable[[], LiveGpus] = read_nvml, *, max_age: float = 2.0) -> None:
        self.read, self.max_age = read, max_age
        self._last: LiveGpus | None = None
        self._taken = 0.0
        self._lock = threading.Lock()

    def reading(self) -> LiveGpus:
        with self._lock:
            if self._last is None or time.monotonic() - self._taken >= self.max_age:
                self._last, self._taken = self.read(), time.monotonic()
            return self._last
