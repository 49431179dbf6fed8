"""The provenance card on a GPU host (issue 37, part 3): a booking of one GPU (two where the host has
them) runs to its end with the real daemon; its /data/output/.gpubook/provenance.json and the two
lines of its ended block must say the driver version, the CUDA version of the driver and each
booked GPU's model and UUID exactly as NVML tells them, MIG mode as NVML's current mode, and the
image's declared CUDA and cuDNN as the engine's image inspect has them (none for the test image).

Runs on the GPU test host with the bundle of tests/gpu/prepare_daemon_bundle.sh, like
test_daemon_gpu.py (see there how); skipped, with the reason, anywhere else:

    NCCL_NVLS_ENABLE=0 python3 -m pytest tests/gpu/test_provenance_gpu.py -m gpu -v -s --confcutdir=tests/gpu
"""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

import paramiko
import pytest

from gpubook.runtime.booking import provenance
from gpubook.runtime.engines import Engine, container_name
from gpubook.runtime.nvidia.model import Gpu
from tests.kits import servers
from tests.kits.daemon_kit import DaemonProcess, book, description, running_container, soon, wait_for, write_config
from tests.kits.gpu_daemon_kit import ENGINE_LINES, IMAGE, TEMPLATE, TEMPLATE_TOML

pytestmark = [pytest.mark.gpu, pytest.mark.caldav, pytest.mark.slow]

SECONDS = 40  # the booking's length: its start, SSH, then its end


def nvml_facts(indices: list[int]) -> tuple[str, str | None, dict[int, tuple[str, str, bool | None]]]:
    """The driver, its CUDA version ("12.4") and each GPU's (name, UUID, MIG on), straight from pynvml."""
    import pynvml

    pynvml.nvmlInit()
    try:
        driver = pynvml.nvmlSystemGetDriverVersion()
        cuda = provenance.cuda_driver_text(int(pynvml.nvmlSystemGetCudaDriverVersion()))
        gpus = {}
        for index in indices:
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            try:
                mig: bool | None = bool(pynvml.nvmlDeviceGetMigMode(handle)[0])
            except pynvml.NVMLError:
                mig = None  # a board without MIG says "not supported"
            gpus[index] = (text(pynvml.nvmlDeviceGetName(handle)), text(pynvml.nvmlDeviceGetUUID(handle)), mig)
        return text(driver), cuda, gpus
    finally:
        pynvml.nvmlShutdown()


def text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def test_the_card_says_what_nvml_says(tmp_path: Path, host_gpus: tuple[Gpu, ...], engine: Engine,
                                      data_mount: Path, radicale: servers.CalendarServer, bundle: Path) -> None:
    count = min(2, len(host_gpus))
    keys = {"alice": paramiko.ECDSAKey.generate(bits=256)}
    calendar = radicale.new_calendar()
    templates = tmp_path / "templates"
    templates.mkdir()
    (templates / f"{TEMPLATE}.toml").write_text(TEMPLATE_TOML)
    config = write_config(tmp_path, str(calendar.url), keys=keys, gpus=len(host_gpus), poll_seconds=60,
                          warn_minutes=0.1, template=TEMPLATE, templates_dir=templates, engine_lines=ENGINE_LINES)
    start = soon(10)
    end = start + timedelta(seconds=SECONDS)
    book(calendar, "prov-gpu@test", user="alice", start=start, end=end, gpus=str(count),
         description=f"template: {TEMPLATE}\n")
    daemon = DaemonProcess(config).start()
    try:
        info = wait_for("the container", lambda: running_container(engine, "prov-gpu@test"), timeout=60,
                        daemon=daemon)
        booked = sorted(info.gpus)
        assert len(booked) == count, info
        wait_for("the stop at the end", lambda: engine.inspect(container_name("prov-gpu@test")) is None,
                 timeout=SECONDS + 60, daemon=daemon)
        said = wait_for("the ended block's provenance lines",
                        lambda: (lambda d: d if "ended:" in d and "provenance: ran from" in d else None)(
                            description(calendar, "prov-gpu@test")), timeout=30, daemon=daemon)
    finally:
        daemon.stop()
        engine.stop(container_name("prov-gpu@test"), 0)

    driver, cuda, gpus = nvml_facts(booked)
    card = json.loads((tmp_path / "data" / "alice" / "output" / ".gpubook" / "provenance.json").read_text())
    assert card["host"] == {"driver": driver, "cuda": cuda}
    assert [(g["index"], g["name"], g["uuid"], g["mig"]) for g in card["gpus"]] == \
        [(index, *gpus[index]) for index in booked]
    modes = [mig for _, _, mig in gpus.values() if mig is not None]
    assert card["mig"] == (any(modes) if modes else None)
    assert card["mps"] is False  # the test config does not share GPUs through MPS
    facts = engine.image_facts(IMAGE)
    assert facts is not None
    assert (card["image"]["cuda"], card["image"]["cudnn"]) == provenance.image_versions(facts.env)
    assert card["template"]["name"] == TEMPLATE
    assert datetime.fromisoformat(card["start"]) >= start - timedelta(seconds=1)
    assert end <= datetime.fromisoformat(card["end"]) <= datetime.now(UTC)

    first = next(line.strip() for line in said.splitlines() if line.strip().startswith("provenance: image"))
    assert f"driver {driver}" in first and (cuda is None or f"(CUDA {cuda})" in first), first
    assert ",".join(map(str, booked)) in first and gpus[booked[0]][0] in first, first
    for _, uuid, _ in gpus.values():
        assert uuid[:12] in first, first
    print(f"provenance on this host: {first}", flush=True)
