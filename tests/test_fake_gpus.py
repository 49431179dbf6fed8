"""The tests' stand-in GPU monitor answers like NVML's live view."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gpubook.runtime.nvidia import nvml
from tests.kits import fake_gpus


def test_the_stand_in_reads_what_the_test_wrote(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    file = tmp_path / "gpus.json"
    monkeypatch.setenv(fake_gpus.ENV, str(file))
    assert nvml.monitor("tests.kits.fake_gpus:read")().problem is not None  # no file yet: said, not raised
    fake_gpus.write(file, [{"utilisation": 0}, {"utilisation": 97, "memory_used_mib": 512,
                                                "processes": [{"pid": os.getpid(), "used_memory_mib": 500}]}])
    view = nvml.monitor("tests.kits.fake_gpus:read")()
    assert view.driver_version == "550.54"
    assert [gpu.utilisation_percent for gpu in view.gpus] == [0, 97]
    assert view.gpus[1].processes[0].pid == os.getpid() and view.gpus[1].memory_used_mib == 512
