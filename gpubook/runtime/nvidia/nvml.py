"""Everything gpubook reads from NVML (nvidia-ml-py's pynvml), in one place.

NVML is optional: without pynvml, without a driver, or with a broken install, each reader says why
in one line (`NvmlView.problem`) instead of raising, and callers fall back to /proc or the config.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpubook.runtime.nvidia.model import Gpu, GpuProcess, normalise_bus_id
from gpubook.runtime.plugins import load_callable

log = logging.getLogger(__name__)
MIB = 1024 * 1024
CACHE_SECONDS = 2.0  # a live view is read at most this often, however many pages and scrapes ask


@dataclass(frozen=True)
class NvmlView:
    driver_version: str | None
    gpus: tuple[Gpu, ...] = ()
    problem: str | None = None  # why NVML could not be read, one line; None when it was
    broken: bool = False  # NVML started but failed while listing: worth a warning, not a debug line


class _Unavailable(Exception):
    pass


def _text(value: bytes | str) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


@contextmanager
def _session() -> Iterator[Any]:
    """pynvml, initialised, and shut down afterwards; _Unavailable says why it cannot be."""
    try:
        import pynvml
    except ImportError:
        raise _Unavailable("nvidia-ml-py (pynvml) is not installed") from None
    try:
        pynvml.nvmlInit()
    except Exception as error:  # NVMLError_* subclasses, OSError from a broken library
        raise _Unavailable(f"NVML cannot be read ({_text(str(error))})") from None
    try:
        yield pynvml
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception as error:
            log.debug("nvmlShutdown: %s", error)


def driver_version() -> str | None:
    """The driver version NVML reports, or None (why is logged at debug level)."""
    try:
        with _session() as pynvml:
            return _text(pynvml.nvmlSystemGetDriverVersion())
    except _Unavailable as why:
        log.debug("NVML unavailable: %s", why)
    except Exception as error:
        log.debug("NVML could not tell the driver version: %s", error)
    return None


def read(*, status: bool = False) -> NvmlView:
    """The driver version and the GPUs in NVML's order; with `status`, memory and processes too."""
    try:
        with _session() as pynvml:
            gpus = tuple(
                _gpu(pynvml, index, status=status) for index in range(pynvml.nvmlDeviceGetCount())
            )
            return NvmlView(_text(pynvml.nvmlSystemGetDriverVersion()), gpus)
    except _Unavailable as why:
        return NvmlView(None, problem=str(why))
    except Exception as error:
        return NvmlView(None, problem=f"NVML failed while listing GPUs ({error})", broken=True)


def _gpu(pynvml: Any, index: int, *, status: bool) -> Gpu:
    handle = pynvml.nvmlDeviceGetHandleByIndex(index)
    memory = pynvml.nvmlDeviceGetMemoryInfo(handle) if status else None
    return Gpu(
        index=index,
        minor=_optional(pynvml.nvmlDeviceGetMinorNumber, handle),
        bus_id=_optional(lambda h: normalise_bus_id(_text(pynvml.nvmlDeviceGetPciInfo(h).busId)), handle),
        uuid=_text(pynvml.nvmlDeviceGetUUID(handle)),
        name=_text(pynvml.nvmlDeviceGetName(handle)),
        memory_total_mib=memory.total // MIB if memory is not None else None,
        memory_used_mib=memory.used // MIB if memory is not None else None,
        utilisation_percent=_optional(lambda h: int(pynvml.nvmlDeviceGetUtilizationRates(h).gpu), handle)
        if status else None,
        processes=_processes(pynvml, handle) if status else (),
    )


def _optional(getter: Any, handle: Any) -> Any:
    # Some boards and vGPUs refuse single queries; the rest of the GPU's data is still worth having.
    try:
        return getter(handle)
    except Exception as error:
        log.debug("NVML %s: %s", getattr(getter, "__name__", "query"), error)
        return None


def _process_name(pynvml: Any, pid: int) -> str | None:
    try:
        return _text(pynvml.nvmlSystemGetProcessName(pid))
    except Exception:  # NVML refuses for processes of other users or namespaces
        try:
            return Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            return None


def _processes(pynvml: Any, handle: Any) -> tuple[GpuProcess, ...]:
    seen: dict[int, GpuProcess] = {}
    for getter in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses"):
        try:
            running = getattr(pynvml, getter)(handle)
        except Exception as error:
            log.debug("%s: %s", getter, error)
            continue
        for process in running:
            used = getattr(process, "usedGpuMemory", None)
            seen.setdefault(
                process.pid,
                GpuProcess(
                    pid=process.pid,
                    name=_process_name(pynvml, process.pid),
                    used_memory_mib=used // MIB if isinstance(used, int) and used >= 0 else None,
                ),
            )
    return tuple(sorted(seen.values(), key=lambda p: p.pid))


@dataclass(frozen=True)
class ProvenanceFacts:
    """What a booking's provenance card takes from NVML; None where NVML does not say."""

    driver_version: str | None
    cuda_driver_version: int | None  # NVML's form: 12040 for CUDA 12.4
    gpus: tuple[tuple[int, str | None, str | None, bool | None], ...] = ()  # (index, name, UUID, MIG on)
    problem: str | None = None


def provenance(indices: Sequence[int]) -> ProvenanceFacts:
    """The driver, the CUDA version it supports and the GPUs `indices` (name, UUID, current MIG
    mode), for a booking's provenance card; never raises (`problem` says why NVML could not be read)."""
    try:
        with _session() as pynvml:
            cuda = _optional(lambda _: int(_cuda_driver(pynvml)), None)
            gpus = []
            for index in indices:
                handle = pynvml.nvmlDeviceGetHandleByIndex(index)
                mig = _optional(lambda h: bool(pynvml.nvmlDeviceGetMigMode(h)[0]), handle)
                gpus.append((index, _optional(lambda h: _text(pynvml.nvmlDeviceGetName(h)), handle),
                             _optional(lambda h: _text(pynvml.nvmlDeviceGetUUID(h)), handle), mig))
            return ProvenanceFacts(_text(pynvml.nvmlSystemGetDriverVersion()), cuda, tuple(gpus))
    except _Unavailable as why:
        return ProvenanceFacts(None, None, problem=str(why))
    except Exception as error:
        return ProvenanceFacts(None, None, problem=f"NVML failed while reading the GPUs ({error})")


def _cuda_driver(pynvml: Any) -> Any:
    getter = getattr(pynvml, "nvmlSystemGetCudaDriverVersion_v2", None) or pynvml.nvmlSystemGetCudaDriverVersion
    return getter()


def read_live() -> NvmlView:
    """The GPUs with their memory, utilisation and processes: what a live view shows."""
    return read(status=True)


Monitor = Callable[[], NvmlView]  # what reads the GPUs' live view: NVML, or a plug-in


def monitor(name: str = "nvml") -> Monitor:
    """The live-view reader `[gpus] monitor` names: "nvml" (this module), or "package.module:function"
    returning an `NvmlView` (another source of utilisation and processes, e.g. DCGM's exporter, or the
    tests' stand-in where no GPU exists). Raises ValueError naming what cannot be loaded."""
    if name == "nvml":
        return read_live
    return load_callable(name, what="GPU monitor")  # type: ignore[no-any-return]


class CachedView:
    """`view()`: NVML's live view, read at most every `seconds` (the daemon's status page and its
    /metrics, and several browsers and Prometheus servers, share one reading). `read_at`: the wall
    time of the reading `view()` gave last."""

    def __init__(self, read: Callable[[], NvmlView] = read_live, *,
                 seconds: float = CACHE_SECONDS, clock: Callable[[], float] = time.monotonic) -> None:
        self.read, self.seconds, self.clock = read, seconds, clock
        self._lock = threading.Lock()
        self._view: NvmlView | None = None
        self._at = 0.0
        self.read_at = 0.0

    def view(self) -> NvmlView:
        with self._lock:
            now = self.clock()
            if self._view is None or now - self._at >= self.seconds:
                self._view, self._at, self.read_at = self.read(), now, time.time()
            return self._view
