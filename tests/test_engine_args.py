"""Each engine's own `run` argv for a GPU booking, its registry, and the per-version driver search.

No engine runs here: the argv is what the engine would pass, built from a fake driver tree
(tests/kits/nvidia_fake_driver.py); the real engines run these flags in test_nvidia_podman.py and
test_docker_engine.py.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from gpubook.runtime import nvidia
from gpubook.runtime.engines import ContainerSpec, EngineSettings, ServiceSpec, engine_from, make_engine, register
from gpubook.runtime.engines.cli_engine import LOG_MAX_SIZE
from gpubook.runtime.engines.cli_transport import message_of
from gpubook.runtime.errors import DriverError, EngineError
from gpubook.runtime.mounts import missing_mount_flags
from tests.kits import safe_data
from tests.kits.nvidia_fake_driver import OLD_VERSION, VERSION, device_nodes, driver_libraries, proc_driver

LIBS = "usr/lib/x86_64-linux-gnu"


@pytest.fixture
def two_gpu_root(tmp_path: Path) -> Path:
    root = tmp_path / "root"
    driver_libraries(root / LIBS)
    proc_driver(root)  # two GPUs, minors 0 and 1
    device_nodes(root)
    return root


def booking(injection: nvidia.GpuInjection) -> ContainerSpec:
    return ContainerSpec(
        booking_id="20261121-alice", user="alice", uid=2001, gid=2001, image="debian-ssh",
        port=2222, end=datetime.now(UTC) + timedelta(hours=1), gpus=injection.gpus, gpu=injection,
    )


def one_of_two(root: Path, tmp_path: Path) -> nvidia.GpuInjection:
    driver = nvidia.discover(root=root, environ={}, use_nvml=False, machine="x86_64", ld_cache="")
    return nvidia.inject(driver, [1], cache_dir=tmp_path / "cache")


def test_docker_gpu_booking_on_one_of_two_gpus_never_gets_podmans_mask(
        two_gpu_root: Path, tmp_path: Path) -> None:
    injection = one_of_two(two_gpu_root, tmp_path)
    assert injection.hidden_proc_paths  # GPU 0 is not booked: podman would mask its /proc entry
    argv = engine_from("docker").run_args(booking(injection))  # type: ignore[attr-defined]
    assert not any("mask=" in arg for arg in argv), argv
    assert "--security-opt" not in argv
    assert f"{two_gpu_root}/dev/nvidia1:/dev/nvidia1:rw" in argv  # the booked GPU is still given


def test_docker_says_once_per_start_that_proc_entries_stay_visible(
        two_gpu_root: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    spec = booking(one_of_two(two_gpu_root, tmp_path))
    with caplog.at_level(logging.WARNING, logger="gpubook.runtime.engines.docker"):
        engine_from("docker").run_args(spec)  # type: ignore[attr-defined]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "booking 20261121-alice" in warnings[0] and "/proc/driver/nvidia/gpus" in warnings[0]


def test_podman_masks_the_other_gpus_proc_entries(two_gpu_root: Path, tmp_path: Path) -> None:
    argv = engine_from("podman").run_args(booking(one_of_two(two_gpu_root, tmp_path)))  # type: ignore[attr-defined]
    assert argv[argv.index("--security-opt") + 1] == "mask=/proc/driver/nvidia/gpus"
    driver = nvidia.discover(root=two_gpu_root, environ={}, use_nvml=False, machine="x86_64", ld_cache="")
    every_gpu = nvidia.inject(driver, [0, 1], cache_dir=tmp_path / "cache")
    assert "--security-opt" not in engine_from("podman").run_args(booking(every_gpu))  # type: ignore[attr-defined]


# --- registry ------------------------------------------------------------------------------------


def test_engines_by_name_and_by_dotted_path() -> None:
    assert make_engine(EngineSettings(name="podman")).name == "podman"
    assert make_engine(EngineSettings(name="docker", binary="/usr/bin/docker")).name == "docker"
    dotted = make_engine(EngineSettings(name="gpubook.runtime.engines.docker:DockerEngine"))
    assert dotted.name == "docker"
    with pytest.raises(EngineError, match='unknown engine .lxc. \\(known: "podman", "docker"'):
        make_engine(EngineSettings(name="lxc"))
    with pytest.raises(EngineError, match="cannot load gpubook.runtime.engines.docker:NoSuchEngine"):
        make_engine(EngineSettings(name="gpubook.runtime.engines.docker:NoSuchEngine"))
    with pytest.raises(EngineError, match="network"):
        make_engine(EngineSettings(network="bridge"))


def test_a_new_engine_is_one_registration_line() -> None:
    from gpubook.runtime.engines import REGISTRY
    from gpubook.runtime.engines.podman import PodmanEngine

    class Apptainer(PodmanEngine):  # a stand-in: any class taking (settings, options)
        name = "apptainer"

    register("apptainer", Apptainer)
    try:
        assert make_engine(EngineSettings(name="apptainer")).name == "apptainer"
    finally:
        REGISTRY.unregister("apptainer")


def test_podman_follows_the_users_storage_driver_unless_told() -> None:
    assert EngineSettings().storage_driver is None
    default = engine_from("podman").global_argv()  # type: ignore[attr-defined]
    assert "--storage-driver" not in default
    explicit = engine_from("podman", storage_driver="vfs").global_argv()  # type: ignore[attr-defined]
    assert explicit[explicit.index("--storage-driver") + 1] == "vfs"


def test_engine_preflight_names_a_missing_binary() -> None:
    checks = make_engine(EngineSettings(name="docker", binary="/nonexistent/docker")).preflight()
    assert [c.ok for c in checks] == [False]
    assert "not installed" in checks[0].detail and "apt-get install docker.io" in (checks[0].fix or "")


# --- the driver search, kept per driver version --------------------------------------------------


def test_a_second_start_with_the_same_driver_searches_no_files(two_gpu_root: Path, tmp_path: Path) -> None:
    def start() -> nvidia.GpuInjection:
        return nvidia.injection([1], root=two_gpu_root, environ={}, use_nvml=False, machine="x86_64",
                                ld_cache="", cache_dir=tmp_path / "cache")

    def bound(injection: nvidia.GpuInjection) -> set[str]:
        return {m.target.rsplit("/", 1)[-1] for m in injection.binds}

    first = start()
    assert f"libnvidia-cfg.so.{VERSION}" in bound(first)
    # Files vanish, the version stays: a search would notice, the cached result does not.
    for name in (f"libnvidia-cfg.so.{VERSION}", "libnvidia-cfg.so.1"):
        (two_gpu_root / LIBS / name).unlink()
    assert f"libnvidia-cfg.so.{VERSION}" in bound(start())
    # A driver upgrade changes the version the kernel module reports: the files are searched again.
    driver_libraries(two_gpu_root / LIBS, OLD_VERSION)
    proc_driver(two_gpu_root, OLD_VERSION)
    upgraded = start()
    assert upgraded.driver_version == OLD_VERSION
    assert f"libcuda.so.{OLD_VERSION}" in bound(upgraded) and f"libcuda.so.{VERSION}" not in bound(upgraded)


def test_gpus_and_ipc_are_read_afresh_at_each_start(two_gpu_root: Path, tmp_path: Path) -> None:
    def start() -> nvidia.GpuInjection:
        return nvidia.injection([0], root=two_gpu_root, environ={}, use_nvml=False, machine="x86_64",
                                ld_cache="", cache_dir=tmp_path / "cache", mps=True)  # a site with [gpus] mps

    assert "/tmp/nvidia-mps" not in {m.target for m in start().binds}
    with safe_data.data_root() as pipes:  # a nosuid,nodev mount, as the MPS pipe folder must be on
        (two_gpu_root / "tmp").mkdir()
        (two_gpu_root / "tmp/nvidia-mps").symlink_to(pipes)
        (pipes / "control").touch()  # MPS started while the driver stayed
        assert "/tmp/nvidia-mps" in {m.target for m in start().binds}


def test_an_mps_pipe_folder_without_nosuid_is_never_bound(two_gpu_root: Path, tmp_path: Path) -> None:
    """issue 22, finding 4: root inside owns what it writes in the (writable) MPS pipe folder, on the
    host; where that folder's mount lacks nosuid, a setuid file made there works for host logins."""
    assert missing_mount_flags(tmp_path), "the test's tmp folder is nosuid: nothing to check"
    (two_gpu_root / "tmp/nvidia-mps").mkdir(parents=True)
    (two_gpu_root / "tmp/nvidia-mps/control").touch()
    with pytest.raises(DriverError, match="MPS pipe folder .* without nosuid"):
        nvidia.injection([0], root=two_gpu_root, environ={}, use_nvml=False, machine="x86_64", ld_cache="",
                         cache_dir=tmp_path / "cache", mps=True)
    without = nvidia.injection([0], root=two_gpu_root, environ={}, use_nvml=False, machine="x86_64", ld_cache="",
                               cache_dir=tmp_path / "cache")  # a site without [gpus] mps is not concerned
    assert "/tmp/nvidia-mps" not in {m.target for m in without.binds}


def plain_booking() -> ContainerSpec:
    return ContainerSpec(booking_id="20261121-alice", user="alice", uid=2001, gid=2001, image="debian-ssh",
                         port=2222, end=datetime.now(UTC) + timedelta(hours=1))


def network_of(argv: list[str]) -> tuple[str | None, list[str]]:
    network = argv[argv.index("--network") + 1] if "--network" in argv else None
    published = [argv[i + 1] for i, word in enumerate(argv) if word == "--publish"]
    return network, published


def test_private_network_is_the_default_with_only_the_ssh_port_published() -> None:
    assert EngineSettings().network == "private"
    podman = network_of(engine_from("podman").run_args(plain_booking()))  # type: ignore[attr-defined]
    rootless = "slirp4netns:port_handler=rootlesskit,allow_host_loopback=false"
    # Rootful podman: a network of the booking's own (finding 13), and conmon holds 0.0.0.0 alone for
    # `2222:2222`: both families by name (finding 19).
    rootful = ["0.0.0.0:2222:2222", "[::]:2222:2222"] if socket.has_ipv6 else ["2222:2222"]  # noqa: S104
    assert podman == ((plain_booking().name, rootful) if os.geteuid() == 0 else (rootless, ["2222:2222"]))
    assert network_of(engine_from("docker").run_args(plain_booking())) == ("bridge", ["2222:2222"])  # type: ignore[attr-defined]


def test_host_network_is_an_explicit_choice_with_nothing_published() -> None:
    for name in ("podman", "docker"):
        argv = engine_from(name, network="host").run_args(plain_booking())  # type: ignore[attr-defined]
        assert network_of(argv) == ("host", [])


@pytest.mark.parametrize(("name", "driver"), [("podman", "k8s-file"), ("docker", "json-file")])
def test_every_container_log_is_capped_and_the_sftp_service_has_memory_and_pids_limits(name: str, driver: str) -> None:
    """issue 22, finding 6: a booking's log (and the SFTP service's) is the engine's file to cap, with
    a driver that honours max-size whatever the site's default is; the service gets memory and pids."""
    engine = engine_from(name, host_memory=32 << 30, host_gpus=2, cgroup_manager="cgroupfs")
    service = ServiceSpec(name="gpubook-sftp", service="sftp", image="debian-ssh", port=2222, listen="127.0.0.1",
                          command=("/usr/sbin/sshd", "-D"), pids_limit=4096, memory="1g")
    for argv in (engine.run_args(plain_booking()), engine.service_args(service)):  # type: ignore[attr-defined]
        assert argv[argv.index("--log-driver") + 1] == driver
        assert f"max-size={LOG_MAX_SIZE}" in argv
    argv = engine.service_args(service)  # type: ignore[attr-defined]
    assert argv[argv.index("--memory") + 1] == "1g" and argv[argv.index("--memory-swap") + 1] == "1g"
    assert argv[argv.index("--pids-limit") + 1] == "4096"


# --- capabilities: what an engine with the core protocol alone is told -----------------------------


class CoreOnly:
    """An engine with the core `Engine` members only (issue 25's udocker: no build, no chown)."""

    name = "core"

    def ensure_image(self, image: str, *, pull: bool = False) -> None:
        raise EngineError(f"image {image} is not present")

    def start(self, spec: ContainerSpec) -> object:
        raise NotImplementedError

    def stop(self, name: str, grace: float) -> None: ...

    def list(self) -> list[object]:
        return []

    def inspect(self, name: str) -> None:
        return None

    def exec(self, name: str, argv: object, *, user: str | None = None, timeout: float | None = None) -> object:
        raise NotImplementedError

    def logs(self, name: str, *, tail: int | None = None) -> str:
        return ""

    def preflight(self) -> list[object]:
        return []


def test_an_engine_without_a_capability_is_told_in_one_sentence_what_is_missing(tmp_path: Path) -> None:
    from dataclasses import replace

    from gpubook.runtime import engines
    from gpubook.runtime.templates import overlay_image
    from gpubook.runtime.templates.catalog import get_template
    from gpubook.scheduler.hosts.sftp import SftpService, SftpSettings

    engine = CoreOnly()
    assert isinstance(engine, engines.Engine)
    assert not isinstance(engine, engines.Builder | engines.ServiceRunner | engines.IdMapper)
    without_sshd = replace(get_template("debian-ssh"), has_sshd=False)
    with pytest.raises(EngineError) as refused:
        overlay_image.build_overlay(engine, without_sshd)  # type: ignore[arg-type]
    assert str(refused.value) == ("template debian-ssh's sshd overlay (its image has no sshd) needs an engine "
                                  "that builds images, and engine 'core' cannot")
    settings = SftpSettings(port=2022, listen="127.0.0.1", data_root=tmp_path, users=())
    with pytest.raises(EngineError, match=r"^the SFTP service \(\[sftp\] enabled\) needs an engine that runs "
                                          r"service containers, and engine 'core' cannot$"):
        SftpService(engine=engine, settings=settings, etc_dir=tmp_path, image=lambda: "i")  # type: ignore[arg-type]
    # No IdMapper: containers run on the host's ids, and folders are given away as root gives them.
    assert engines.host_owner(engine, 2001, 2002) == (2001, 2002)  # type: ignore[arg-type]
    assert engines.chown_for(engine) is None  # type: ignore[arg-type]


# What podman 4.3 wrote here (2026-11-27) once its pause process was gone while a container it
# had recorded as running had lost its conmon: no "Error:" line, only logrus's error after a warning.
LOST_PAUSE = ('time="2026-11-27T08:02:38Z" level=warning msg="\\"/\\" is not a shared mount, this could cause '
              'issues or missing mounts with rootless containers"\n'
              'time="2026-11-27T08:02:38Z" level=error msg="invalid internal status, try resetting the pause '
              'process with \\"podman system migrate\\": could not find any running process: no such process"\n')


def test_a_podman_error_logged_without_an_error_line_is_told_by_that_error() -> None:
    """Before, the whole text came back, the shared-mount warning first: an event said "\\"/\\" is
    not a shared mount…" for a start that failed because podman's namespace was lost."""
    failed = subprocess.CompletedProcess(["podman", "import"], 125, stdout="", stderr=LOST_PAUSE)
    assert message_of(failed) == ('invalid internal status, try resetting the pause process with "podman system '
                                  'migrate": could not find any running process: no such process (exit status 125)')
    both = subprocess.CompletedProcess(["podman", "run"], 126, stdout="",
                                       stderr=LOST_PAUSE + "Error: runc: OCI permission denied\n")
    assert message_of(both) == "runc: OCI permission denied"  # an "Error:" line still wins
    plain = subprocess.CompletedProcess(["docker", "run"], 1, stdout="", stderr="no such image\n")
    assert message_of(plain) == "no such image (exit status 1)"
