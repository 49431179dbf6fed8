"""`gpubook doctor`: every check, each problem with its fix, exit 1 if any failed."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from gpubook.runtime.checks import Check
from gpubook.scheduler import config as config_module
from gpubook.scheduler.commands import doctor as doctor_module
from tests.kits import safe_data, servers

REPO = Path(__file__).resolve().parents[1]

KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIB6v3b9c0p7s5xXl0bN3cYk2s9mJ0b2cZc8n8kq0tq0Q"  # the example config's


def doctor(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gpubook.scheduler.commands.cli", "doctor", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=120, check=False)


@pytest.mark.caldav
def test_doctor_checks_calendar_storage_and_the_static_inventory(
        tmp_path: Path, radicale_server: servers.CalendarServer) -> None:
    calendar = radicale_server.new_calendar()
    missing = tmp_path / "no-such-folder"
    config = tmp_path / "gpubook.toml"
    config.write_text(f"""
[[calendar]]
url = "{calendar.url}"
[[calendar]]
url = "http://127.0.0.1:{servers.free_port()}/gone/"
[gpus]
count = 2
[storage]
data_root = "{missing}"
""")
    done = doctor("--config", str(config))
    lines = done.stdout.splitlines()
    assert done.returncode == 1, done.stdout + done.stderr
    assert any(line.startswith("ok    config: ") for line in lines)
    assert any(line.startswith(f"ok    calendar {calendar.url}: 0 object(s)") for line in lines)
    assert any(line.startswith("FAIL  calendar http://127.0.0.1:") and "connection refused" in line
               for line in lines)
    assert f"FAIL  data_root: {missing} does not exist" in lines
    assert f"      fix: create it and give it to the daemon's user (mkdir -p {missing})" in lines
    if not Path("/dev/nvidiactl").exists():
        assert any(line.startswith("ok    driver: no NVIDIA driver; the config's [gpus] count = 2") for line in lines)
    missing.mkdir()
    config.write_text(f"""
[[calendar]]
url = "{calendar.url}"
[gpus]
count = 2
[storage]
data_root = "{missing}"
""")
    done = doctor("--config", str(config))
    failed = [line for line in done.stdout.splitlines() if line.startswith("FAIL")]
    assert (done.returncode == 1) == bool(failed), done.stdout
    assert any(line.startswith(f"FAIL  data_root: data_root {missing} is on a mount without nosuid,nodev")
               for line in failed), done.stdout
    with safe_data.data_root() as safe:
        config.write_text(config.read_text().replace(str(missing), str(safe)))
        done = doctor("--config", str(config))
        assert f"ok    data_root: {safe} (nosuid,nodev)" in done.stdout.splitlines()


@pytest.mark.slow  # a second or more: out of the fast lane
def test_doctor_with_a_broken_config_names_the_fault(tmp_path: Path) -> None:
    config = tmp_path / "gpubook.toml"
    config.write_text("[[calendar]]\nurl = 'ftp://x'\n")
    done = doctor("--config", str(config))
    assert done.returncode == 1
    assert f"FAIL  config: {config}: calendar[0].url: must be an http:// or https:// URL" in done.stdout
    assert "Traceback" not in done.stderr


def test_doctor_names_a_busy_sftp_port_and_users_the_service_cannot_serve(tmp_path: Path) -> None:
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        busy = doctor_module.port_check("127.0.0.1", port)
    assert not busy.ok and f"port {port} on 127.0.0.1 is taken" in busy.detail and "[sftp] port" in busy.fix
    assert doctor_module.port_check("127.0.0.1", port).ok  # free again
    config = tmp_path / "gpubook.toml"
    config.write_text('[[calendar]]\nurl = "http://127.0.0.1:9/cal/"\n'
                      '[storage]\ndata_root = "/srv"\n[sftp]\nenabled = true\n'
                      f'[users.root]\nuid = 3001\nssh_keys = ["{KEY} x"]\n'
                      '[users.carol]\nuid = 3002\n'
                      f'[users.dave]\nuid = 3003\nssh_keys = ["{KEY} x"]\n')
    check = doctor_module.sftp_key_check(config_module.load(config))
    assert not check.ok
    assert "user root: the name is one of the service's own accounts" in check.detail
    assert "user carol: no ssh_keys" in check.detail and "dave" not in check.detail


def test_doctor_names_ssh_ports_inside_the_ephemeral_range_with_the_host_network(tmp_path: Path) -> None:
    """With the host network a booking's sshd binds its port only at the booking's start (an armed
    container waits): an outgoing connection's local port taken from the same range meanwhile
    steals it. Doctor says so where the ranges overlap, and not where they do not."""
    ephemeral = tmp_path / "ip_local_port_range"
    ephemeral.write_text("32768\t60999\n")

    def config(ports: str, network: str) -> config_module.Config:
        path = tmp_path / f"{network}-{ports}.toml"
        low, high = ports.split("-")
        path.write_text(f'[[calendar]]\nurl = "http://127.0.0.1:9/cal/"\n[engine]\nnetwork = "{network}"\n'
                        f'[ssh]\nport_min = {low}\nport_max = {high}\n')
        return config_module.load(path)

    inside = doctor_module.ports_check(config("40000-40099", "host"), ephemeral=ephemeral)
    assert not inside.ok and "overlap the kernel's ephemeral range 32768-60999" in inside.detail
    assert inside.fix is not None and "below 32768" in inside.fix
    assert doctor_module.ports_check(config("2200-2299", "host"), ephemeral=ephemeral).ok
    assert doctor_module.ports_check(config("32000-32768", "private"), ephemeral=ephemeral).ok  # held at start


def test_a_host_with_a_driver_and_only_the_optional_cdi_warning_is_not_called_driverless() -> None:
    """Seen on the GPU host: with [gpus] count set, the CDI WARN made doctor say "no NVIDIA driver …
    containers get no GPU" while bookings ran on the GPUs."""
    driver = [Check("NVIDIA driver", True, "580.159.04"),
              Check("CDI spec", False, "no CDI spec", "gpubook works without it", optional=True)]
    assert doctor_module.driver_section(driver, gpu_count=2) == driver
    missing = [Check("NVIDIA driver", False, "no NVIDIA driver on this machine", "install it")]
    assert [c.detail for c in doctor_module.driver_section(missing, gpu_count=2)] == [
        "no NVIDIA driver; the config's [gpus] count = 2 is used and containers get no GPU"]
    assert doctor_module.driver_section(missing, gpu_count=None) == missing


def test_doctor_names_an_mps_pipe_folder_without_nosuid(tmp_path: Path) -> None:
    """issue 22, finding 4: with [gpus] mps, GPU bookings are refused while MPS runs from a folder
    without nosuid,nodev; doctor says so before the first booking does."""
    pipes = tmp_path / "nvidia-mps"
    pipes.mkdir()
    environ = {"CUDA_MPS_PIPE_DIRECTORY": str(pipes)}
    assert doctor_module.mps_check(environ).ok  # no control daemon: nothing is bound
    (pipes / "control").touch()
    unsafe = doctor_module.mps_check(environ)
    assert not unsafe.ok and "without nosuid" in unsafe.detail and "CUDA_MPS_PIPE_DIRECTORY" in unsafe.fix
    with safe_data.data_root() as safe:
        (safe / "control").touch()
        assert doctor_module.mps_check({"CUDA_MPS_PIPE_DIRECTORY": str(safe)}).ok
