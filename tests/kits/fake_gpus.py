"""A stand-in GPU monitor for machines without a GPU: `[gpus] monitor = "tests.kits.fake_gpus:read"`.

It answers what NVML's live view would (utilisation, memory, the processes on each GPU) from a JSON
file the test writes and rewrites while the daemon runs, named by $GPUBOOK_FAKE_GPUS:

    {"driver": "550.54", "gpus": [{"utilisation": 0, "memory_used_mib": 0,
                                   "processes": [{"pid": 1234, "used_memory_mib": 100}]}, ...]}

PIDs are real processes the test started (in a booking's container or outside), so what the daemon
makes of them (whose they are) is the real thing; only NVML's reading is stood in for. Where a GPU
exists, tests/gpu reads the real NVML instead.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from gpubook.runtime.nvidia.model import Gpu, GpuProcess
from gpubook.runtime.nvidia.nvml import NvmlView

ENV = "GPUBOOK_FAKE_GPUS"


def write(path: Path, gpus: list[dict[str, Any]], *, driver: str = "550.54") -> None:
    """Replace the file the daemon reads (atomically: it may read it at any moment)."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps({"driver": driver, "gpus": gpus}))
    partial.replace(path)


def read() -> NvmlView:
    name = os.environ.get(ENV)
    if not name:
        return NvmlView(None, problem=f"${ENV} names no file")
    try:
        data = json.loads(Path(name).read_text())
    except (OSError, ValueError) as error:
        return NvmlView(None, problem=f"fake GPUs unreadable: {error}", broken=True)
    gpus = tuple(
        Gpu(index=index, uuid=f"GPU-fake-{index}", name="Fake GPU", memory_total_mib=gpu.get("memory_total_mib", 81559),
            memory_used_mib=gpu.get("memory_used_mib", 0), utilisation_percent=gpu.get("utilisation"),
            processes=tuple(GpuProcess(pid=p["pid"], name=p.get("name"), used_memory_mib=p.get("used_memory_mib"))
                            for p in gpu.get("processes", ())))
        for index, gpu in enumerate(data["gpus"]))
    return NvmlView(data.get("driver", "550.54"), gpus)
