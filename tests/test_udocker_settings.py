"""udocker's settings, without running it: the config refuses a network udocker cannot make with one
sentence, doctor says the same, and `gpubook status` names the engine's mode."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpubook.runtime import engines
from gpubook.runtime.engines import EngineSettings
from gpubook.runtime.errors import ConfigError
from gpubook.scheduler import config
from gpubook.scheduler.outbox.status import GpuSummary, HostStatus, Status, engine_line

MINIMAL = '[[calendar]]\nurl = "http://127.0.0.1:5232/lab/devbox1/"\n'
REFUSED = 'udocker has no network namespaces: set [engine] network = "host"'


def load(tmp_path: Path, engine: str) -> config.Config:
    path = tmp_path / "gpubook.toml"
    path.write_text(MINIMAL + "[engine]\n" + engine)
    return config.load(path)


@pytest.mark.parametrize("network", ["", 'network = "private"\n'])  # "private" is the default
def test_udocker_without_the_host_network_is_refused_at_load(tmp_path: Path, network: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load(tmp_path, 'name = "udocker"\n' + network)
    lines = str(caught.value).splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"{tmp_path / 'gpubook.toml'}: engine.network: {REFUSED}"), lines
    assert "bookers can reach each other's services" in lines[0]


def test_udocker_with_the_host_network_loads(tmp_path: Path) -> None:
    loaded = load(tmp_path, 'name = "udocker"\nnetwork = "host"\n')
    assert (loaded.engine.name, loaded.engine.network) == ("udocker", "host")
    assert load(tmp_path, 'name = "podman"\nnetwork = "private"\n').engine.network == "private"


def test_doctor_says_the_same_sentence() -> None:
    checks = engines.preflight(EngineSettings(name="udocker", network="private"))
    assert [(c.name, c.level) for c in checks] == [("engine network", "fail")]
    assert checks[0].detail.startswith(REFUSED), checks[0].detail
    assert engines.engine_network_problem(EngineSettings(name="udocker", network="host")) is None
    assert engines.engine_network_problem(EngineSettings(name="podman", network="private")) is None
    assert engines.engine_network_problem(EngineSettings(name="no.such:Engine", network="private")) is None


def test_status_names_the_engine_and_its_mode() -> None:
    udocker = engines.engine_from("udocker", network="host", runtime="/usr/sbin/runc")
    line = engine_line(udocker)
    assert line == "udocker R1, the host's runc (/usr/sbin/runc) in an unprivileged user namespace"
    report = Status(hosts=(HostStatus(name="local", gpus=GpuSummary(source="config", count=1)),), engine=line)
    assert f"Engine: {line}" in report.render("UTC")
    assert Status.from_json(report.to_json()).engine == line
    assert engine_line(engines.engine_from("podman")) == "podman"
