"""What doctor and status say about bookings' networks (no engine runs here)."""

from __future__ import annotations

from pathlib import Path

from gpubook.runtime import network
from gpubook.runtime.engines import EngineSettings
from gpubook.scheduler.outbox.status import GpuSummary, HostStatus, Status, setup_findings


def test_host_network_is_a_finding_for_doctor_and_status() -> None:
    [check] = network.checks(EngineSettings(network="host"))
    assert not check.ok
    assert "bookers can reach each other's services and squat ports" in check.detail
    assert check.fix and 'network = "private"' in check.fix
    findings = setup_findings(EngineSettings(network="host"))
    report = Status(hosts=(HostStatus(name="local", gpus=GpuSummary(source="none", count=0)),), findings=findings)
    line = '  [engine] network = "host": bookers can reach each other\'s services and squat ports'
    assert line in report.render("UTC")
    assert Status.from_json(report.to_json()).findings == findings
    assert setup_findings(EngineSettings()) == ()


def test_private_network_needs_a_usable_tun_device_and_doctor_names_the_fix(tmp_path: Path) -> None:
    check = network.tun_check(str(tmp_path / "tun"))
    assert not check.ok and "is not usable by this user" in check.detail
    assert check.fix and "chmod 0666 /dev/net/tun" in check.fix
    assert network.checks(EngineSettings())[0].ok
