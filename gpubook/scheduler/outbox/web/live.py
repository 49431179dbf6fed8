"""Live GPU utilisation and memory for the page, from an `nvml.CachedView` (NVML read at most every
2 s: a page and its refreshes from several browsers, and the daemon's /metrics, share one reading;
NVML calls take milliseconds but a session per request would add up)."""

from __future__ import annotations

from dataclasses import dataclass

from gpubook.runtime.nvidia import nvml


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


def of(gpus: nvml.CachedView) -> LiveGpus:
    """The page's live GPUs from the shared cached NVML view (the daemon's metrics read the same)."""
    view = gpus.view()
    found = tuple(LiveGpu(index=g.index, name=g.name or "", utilisation_percent=g.utilisation_percent,
                          memory_used_mib=g.memory_used_mib, memory_total_mib=g.memory_total_mib) for g in view.gpus)
    problem = None if found else (view.problem or "NVML lists no GPU")
    return LiveGpus(gpus=found, problem=problem, read_at=gpus.read_at)
