"""Driver discovery and injection against driver trees built in tmp_path, named like real drivers.

These check the logic (which files, which version, which device minors, which flags); the proof
that a container then really sees exactly its GPUs is in tests/gpu/, on a GPU host.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from gpubook.runtime import nvidia
from gpubook.runtime.engines import engine_from
from gpubook.runtime.errors import DriverError, EngineError
from gpubook.runtime.nvidia.elf import read_elf
from tests.kits import safe_data
from tests.kits.nvidia_fake_driver import (
    EM_386,
    EM_AARCH64,
    OLD_VERSION,
    VERSION,
    device_nodes,
    driver_libraries,
    executable,
    ld_cache_text,
    proc_driver,
    shared_object,
)

DEBIAN_LIBS = "usr/lib/x86_64-linux-gnu"
NO_ENV: dict[str, str] = {}


def discover(root: Path, **kwargs):
    kwargs.setdefault("environ", NO_ENV)
    kwargs.setdefault("use_nvml", False)
    kwargs.setdefault("machine", "x86_64")
    kwargs.setdefault("ld_cache", "")
    return nvidia.discover(root=root, **kwargs)


def inject(root: Path, gpus, tmp_path: Path, *, mps: bool = False, **kwargs):
    driver = discover(root, **kwargs)
    return nvidia.inject(driver, gpus, cache_dir=tmp_path / "cache", mps=mps)


@pytest.fixture
def debian(tmp_path: Path) -> Path:
    """Debian/Ubuntu multiarch layout, as the distribution's nvidia packages install it."""
    root = tmp_path / "debian"
    driver_libraries(root / DEBIAN_LIBS)
    executable(root / "usr/bin/nvidia-smi")
    executable(root / "usr/bin/nvidia-debugdump")
    proc_driver(root)
    device_nodes(root)
    return root


def names(driver: nvidia.Driver) -> set[str]:
    return {f.name for f in driver.libraries}


def test_debian_multiarch_layout(debian: Path) -> None:
    driver = discover(debian)
    assert driver.version == VERSION
    assert names(driver) == {
        f"{n}.{VERSION}"
        for n in (
            "libcuda.so",
            "libnvidia-ptxjitcompiler.so",
            "libnvidia-nvvm.so",
            "libnvidia-gpucomp.so",
            "libnvidia-ml.so",
            "libnvidia-cfg.so",
        )
    }
    cuda = next(f for f in driver.libraries if f.name.startswith("libcuda.so"))
    assert cuda.soname == "libcuda.so.1"
    assert cuda.host_path == debian / DEBIAN_LIBS / f"libcuda.so.{VERSION}"
    assert cuda.capability == "compute"
    assert {b.name for b in driver.binaries} == {"nvidia-smi", "nvidia-debugdump"}
    assert [g.minor for g in driver.gpus] == [0, 1]
    assert [d.container for d in driver.control_devices] == [
        "/dev/nvidiactl",
        "/dev/nvidia-uvm",
        "/dev/nvidia-uvm-tools",
    ]


def test_rhel_lib64_layout(tmp_path: Path) -> None:
    root = tmp_path / "rhel"
    driver_libraries(root / "usr/lib64")
    executable(root / "usr/bin/nvidia-smi")
    proc_driver(root, open_module=True)  # RHEL's precompiled streams ship the open module
    device_nodes(root)
    driver = discover(root)
    assert driver.version == VERSION
    assert f"libcuda.so.{VERSION}" in names(driver)
    assert all(f.host_path.parent == root / "usr/lib64" for f in driver.libraries)


def test_usr_local_nvidia_layout_found_through_ld_cache(tmp_path: Path) -> None:
    # The GPU test host: the driver in /usr/local/nvidia/{lib64,bin}, listed in ld.so.cache.
    root = tmp_path / "gpuhost"
    driver_libraries(root / "usr/local/nvidia/lib64")
    executable(root / "usr/local/nvidia/bin/nvidia-smi")
    proc_driver(root)
    device_nodes(root)
    cache = ld_cache_text(
        [
            ("libnvidia-ml.so.1", "libc6,x86-64", "/usr/local/nvidia/lib64/libnvidia-ml.so.1"),
            ("libcuda.so.1", "libc6,x86-64", "/usr/local/nvidia/lib64/libcuda.so.1"),
        ]
    )
    driver = discover(root, ld_cache=cache)
    assert {f.host_path.parent for f in driver.libraries} == {root / "usr/local/nvidia/lib64"}
    assert [b.host_path for b in driver.binaries] == [root / "usr/local/nvidia/bin/nvidia-smi"]


def test_ld_cache_folder_wins_over_usual_folders(tmp_path: Path) -> None:
    root = tmp_path / "root"
    driver_libraries(root / "opt/vendor/nvidia/lib")  # only the cache knows this folder
    driver_libraries(root / DEBIAN_LIBS, names=("libnvidia-ml.so",))
    proc_driver(root)
    device_nodes(root)
    cache = ld_cache_text(
        [
            ("libcuda.so.1", "libc6,x86-64", "/opt/vendor/nvidia/lib/libcuda.so.1"),
            (
                "libcuda.so.1",
                "libc6",
                "/opt/vendor/nvidia/lib32/libcuda.so.1",
            ),  # i386 entry: ignored
        ]
    )
    driver = discover(root, ld_cache=cache)
    ml = next(f for f in driver.libraries if f.name.startswith("libnvidia-ml"))
    assert ml.host_path.parent == root / "opt/vendor/nvidia/lib"


def test_real_ldconfig_cache_of_the_tree(tmp_path: Path) -> None:
    ldconfig = shutil.which("ldconfig") or "/sbin/ldconfig"
    if not os.access(ldconfig, os.X_OK):
        pytest.skip("no ldconfig on this machine")
    root = tmp_path / "root"
    folder = root / "opt/nv/lib64"
    driver_libraries(folder, links=False)
    proc_driver(root)
    device_nodes(root)
    (root / "etc").mkdir()
    # ldconfig builds the cache as it would for the tree (-X: leave the links alone).
    subprocess.run(
        [ldconfig, "-X", "-f", "/dev/null", "-C", str(root / "etc/ld.so.cache"), str(folder)],
        check=True,
        capture_output=True,
    )
    text = nvidia.read_ld_cache(root)
    assert "libcuda.so.1 (libc6,x86-64)" in text
    driver = discover(root, ld_cache=None)
    assert {f.host_path.parent for f in driver.libraries} == {folder}


def test_two_driver_versions_side_by_side_take_the_running_one(tmp_path: Path) -> None:
    root = tmp_path / "root"
    driver_libraries(root / DEBIAN_LIBS, OLD_VERSION)  # left over from before the upgrade
    driver_libraries(root / DEBIAN_LIBS, VERSION, links=False)
    driver_libraries(root / "usr/local/nvidia/lib64", OLD_VERSION)
    proc_driver(root, VERSION)
    device_nodes(root)
    driver = discover(root)
    assert driver.version == VERSION
    assert all(f.name.endswith(VERSION) for f in driver.libraries)
    assert all(OLD_VERSION not in str(f.host_path) for f in driver.libraries)


def test_libraries_of_another_version_only_is_a_clear_error(tmp_path: Path) -> None:
    root = tmp_path / "root"
    driver_libraries(root / DEBIAN_LIBS, OLD_VERSION)
    proc_driver(root, VERSION)  # upgraded on disk? no: module newer than the files
    device_nodes(root)
    with pytest.raises(
        DriverError, match=rf"libnvidia-ml\.so\.{VERSION} .*found libnvidia-ml\.so\.{OLD_VERSION}"
    ):
        discover(root)


def test_tree_without_libcuda(tmp_path: Path) -> None:
    root = tmp_path / "root"
    driver_libraries(root / DEBIAN_LIBS, names=("libnvidia-ml.so", "libnvidia-cfg.so"))
    proc_driver(root)
    device_nodes(root)
    with pytest.raises(DriverError, match=rf"libcuda\.so\.{VERSION} of the running driver"):
        discover(root)
    # utility alone does not need libcuda
    driver = discover(root, capabilities="utility")
    assert names(driver) == {f"libnvidia-ml.so.{VERSION}", f"libnvidia-cfg.so.{VERSION}"}


def test_32_bit_and_foreign_architecture_files_are_skipped(tmp_path: Path) -> None:
    root = tmp_path / "root"
    # The first folder searched holds only wrong-architecture copies; the right ones come later.
    driver_libraries(root / "usr/local/nvidia/lib64", bits=32, machine=EM_386, links=False)
    driver_libraries(root / "usr/lib64", machine=EM_AARCH64, links=False)
    driver_libraries(root / DEBIAN_LIBS)
    proc_driver(root)
    device_nodes(root)
    driver = discover(root)
    assert {f.host_path.parent for f in driver.libraries} == {root / DEBIAN_LIBS}
    # and on an aarch64 host the aarch64 copies are the ones taken
    arm = discover(root, machine="aarch64")
    assert {f.host_path.parent for f in arm.libraries} == {root / "usr/lib64"}


def test_not_elf_file_named_like_a_library_is_skipped(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "usr/lib64").mkdir(parents=True)
    (root / f"usr/lib64/libcuda.so.{VERSION}").write_text("/* GNU ld script */\n")
    driver_libraries(root / DEBIAN_LIBS)
    proc_driver(root)
    device_nodes(root)
    cuda = next(f for f in discover(root).libraries if f.name.startswith("libcuda"))
    assert cuda.host_path.parent == root / DEBIAN_LIBS


def test_real_linker_made_library_soname(tmp_path: Path) -> None:
    libz = next(
        (
            p
            for p in (
                Path("/usr/lib/x86_64-linux-gnu/libz.so.1.2.13"),
                Path("/lib/x86_64-linux-gnu/libz.so.1"),
            )
            if p.exists()
        ),
        None,
    )
    if libz is None:
        pytest.skip("no libz on this machine")
    info = read_elf(libz)
    assert info is not None and info.soname == "libz.so.1" and info.bits == 64


def test_symlinks_resolved_inside_the_root(tmp_path: Path) -> None:
    # /usr/lib/x86_64-linux-gnu/nvidia/current -> /usr/lib/nvidia-580 (absolute link, Debian style)
    root = tmp_path / "root"
    driver_libraries(root / "usr/lib/nvidia-580")
    (root / DEBIAN_LIBS / "nvidia").mkdir(parents=True)
    os.symlink("/usr/lib/nvidia-580", root / DEBIAN_LIBS / "nvidia/current")
    proc_driver(root)
    device_nodes(root)
    driver = discover(root)
    assert {f.host_path.parent for f in driver.libraries} == {root / "usr/lib/nvidia-580"}


def test_version_from_proc_formats() -> None:
    proprietary = (
        "NVRM version: NVIDIA UNIX x86_64 Kernel Module  384.81  Sat Sep  2 02:43:11 PDT 2017\n"
    )
    open_module = (
        "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.159.04  Release Build  "
        "(dvs-builder@U22)  Thu Oct  9 2025\n"
    )
    arm = "NVRM version: NVIDIA UNIX Open Kernel Module for aarch64  570.26  Release Build\n"
    assert nvidia.parse_proc_version(proprietary) == "384.81"
    assert nvidia.parse_proc_version(open_module) == "580.159.04"
    assert nvidia.parse_proc_version(arm) == "570.26"
    assert nvidia.parse_proc_version("garbage") is None


def test_version_from_libcuda_suffix_without_kernel_module(tmp_path: Path) -> None:
    root = tmp_path / "root"
    driver_libraries(root / DEBIAN_LIBS)
    assert nvidia.driver_version(root, use_nvml=False, library_dirs=[root / DEBIAN_LIBS]) == VERSION
    driver_libraries(root / DEBIAN_LIBS, OLD_VERSION, links=False)
    with pytest.raises(DriverError, match="several driver versions"):
        nvidia.driver_version(root, use_nvml=False, library_dirs=[root / DEBIAN_LIBS])
    with pytest.raises(DriverError, match="no NVIDIA driver found"):
        nvidia.driver_version(tmp_path / "empty", use_nvml=False, library_dirs=[])


def test_device_minor_is_not_the_index(tmp_path: Path) -> None:
    root = tmp_path / "root"
    driver_libraries(root / DEBIAN_LIBS)
    # Three GPUs whose minors are not in bus order (seen on hosts after a GPU was replaced).
    proc_driver(root, gpus=(("0000:41:00.0", 2), ("0000:01:00.0", 1), ("0000:c1:00.0", 0)))
    device_nodes(root, minors=(0, 1, 2))
    driver = discover(root)
    assert [(g.index, g.bus_id, g.minor) for g in driver.gpus] == [
        (0, "0000:01:00.0", 1),
        (1, "0000:41:00.0", 2),
        (2, "0000:c1:00.0", 0),
    ]
    booked = nvidia.inject(driver, [1], cache_dir=tmp_path / "cache")
    gpu_nodes = [d.container for d in booked.devices if d.container[len("/dev/nvidia") :].isdigit()]
    assert gpu_nodes == ["/dev/nvidia2"]
    assert booked.hidden_proc_paths == ("/proc/driver/nvidia/gpus",)


def test_bus_id_forms() -> None:
    assert nvidia.normalise_bus_id("00000000:06:00.0") == "0000:06:00.0"
    assert nvidia.normalise_bus_id("0000:C1:00.0") == "0000:c1:00.0"
    with pytest.raises(DriverError):
        nvidia.normalise_bus_id("GPU-1234")


def test_injection_of_one_gpu(debian: Path, tmp_path: Path) -> None:
    booked = inject(debian, [1], tmp_path)
    assert booked.driver_version == VERSION and booked.gpus == (1,)
    assert [d.container for d in booked.devices] == [
        "/dev/nvidiactl",
        "/dev/nvidia-uvm",
        "/dev/nvidia-uvm-tools",
        "/dev/nvidia1",
    ]
    assert "/dev/nvidia0" not in {d.container for d in booked.devices}
    env = booked.env
    assert env["CUDA_VISIBLE_DEVICES"] == "0"
    assert env["NVIDIA_VISIBLE_DEVICES"] == "GPU-00000001-aaaa-bbbb-cccc-000000000001"
    assert env["NVIDIA_DRIVER_CAPABILITIES"] == "utility,compute"
    assert env["GPUBOOK_LIBRARY_DIR"] == nvidia.CONTAINER_LIBRARY_DIR == booked.library_dir
    assert booked.hidden_proc_paths == ("/proc/driver/nvidia/gpus",)
    lib = nvidia.CONTAINER_LIBRARY_DIR
    binds = {b.target: b for b in booked.binds}
    assert (
        binds[f"{lib}/libcuda.so.{VERSION}"].source == debian / DEBIAN_LIBS / f"libcuda.so.{VERSION}"
    )
    assert binds["/usr/bin/nvidia-smi"].source == debian / "usr/bin/nvidia-smi"
    assert all(b.read_only for b in booked.binds)
    assert (f"{lib}/libcuda.so.1", f"libcuda.so.{VERSION}") in booked.soname_links
    assert (f"{lib}/libcuda.so", "libcuda.so.1") in booked.soname_links
    assert (f"{lib}/libnvidia-ml.so.1", f"libnvidia-ml.so.{VERSION}") in booked.soname_links


def test_link_folder_holds_links_placeholders_and_ld_conf(debian: Path, tmp_path: Path) -> None:
    booked = inject(debian, [0], tmp_path)
    lib = nvidia.CONTAINER_LIBRARY_DIR
    folder = next(b.source for b in booked.binds if b.target == lib)
    assert os.readlink(folder / "libcuda.so.1") == f"libcuda.so.{VERSION}"
    assert os.readlink(folder / "libcuda.so") == "libcuda.so.1"
    assert (folder / f"libcuda.so.{VERSION}").is_file()  # the mount point of the real file
    assert (folder / f"libcuda.so.{VERSION}").stat().st_size == 0
    conf = next(b.source for b in booked.binds if b.target == nvidia.LD_SO_CONF)
    assert conf.read_text().splitlines()[-1] == lib
    # a second injection reuses the folder
    again = inject(debian, [1], tmp_path)
    assert next(b.source for b in again.binds if b.target == lib) == folder


def test_two_gpus_and_errors(debian: Path, tmp_path: Path) -> None:
    both = inject(debian, [0, 1], tmp_path)
    assert both.env["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert both.hidden_proc_paths == ()
    driver = discover(debian)
    with pytest.raises(DriverError, match="GPU 5 does not exist"):
        nvidia.inject(driver, [5], cache_dir=tmp_path)
    with pytest.raises(DriverError, match="booked twice"):
        nvidia.inject(driver, [0, 0], cache_dir=tmp_path)
    with pytest.raises(DriverError, match="at least one"):
        nvidia.inject(driver, [], cache_dir=tmp_path)
    with pytest.raises(DriverError, match="unknown driver capabilities bogus"):
        discover(debian, capabilities="compute,bogus")


def test_missing_device_node_is_a_clear_error(debian: Path, tmp_path: Path) -> None:
    (debian / "dev/nvidia1").unlink()
    with pytest.raises(DriverError, match=r"/dev/nvidia1 \(GPU 1, bus 0000:00:07.0\) is missing"):
        inject(debian, [1], tmp_path)
    (debian / "dev/nvidia-uvm").unlink()
    with pytest.raises(DriverError, match="/dev/nvidia-uvm is missing"):
        discover(debian)


def test_display_capability_adds_modeset_only_then(debian: Path, tmp_path: Path) -> None:
    (debian / "dev/nvidia-modeset").touch()
    plain = inject(debian, [0], tmp_path)
    assert "/dev/nvidia-modeset" not in {d.container for d in plain.devices}
    display = inject(debian, [0], tmp_path, capabilities="compute,utility,display")
    assert "/dev/nvidia-modeset" in {d.container for d in display.devices}


def test_mig_instance_gets_parent_and_only_its_caps(debian: Path, tmp_path: Path) -> None:
    caps = debian / "proc/driver/nvidia/capabilities/gpu1/mig"
    for gi, ci, gi_minor, ci_minor in ((1, 0, 21, 22), (2, 0, 30, 31)):
        (caps / f"gi{gi}/ci{ci}").mkdir(parents=True)
        (caps / f"gi{gi}/access").write_text(f"DeviceFileMinor: {gi_minor}\nDeviceFileMode: 292\n")
        (caps / f"gi{gi}/ci{ci}/access").write_text(
            f"DeviceFileMinor: {ci_minor}\nDeviceFileMode: 292\n"
        )
    (debian / "dev/nvidia-caps").mkdir()
    for minor in (21, 22, 30, 31):
        (debian / f"dev/nvidia-caps/nvidia-cap{minor}").touch()
    booked = inject(debian, [nvidia.MigInstance(gpu=1, gi=2, ci=0)], tmp_path)
    nodes = [d.container for d in booked.devices]
    assert "/dev/nvidia1" in nodes and "/dev/nvidia0" not in nodes
    assert [n for n in nodes if "caps" in n] == [
        "/dev/nvidia-caps/nvidia-cap30",
        "/dev/nvidia-caps/nvidia-cap31",
    ]
    assert booked.env["NVIDIA_VISIBLE_DEVICES"] == "void"
    assert booked.hidden_proc_paths == ("/proc/driver/nvidia/gpus",)
    with pytest.raises(DriverError, match="gi7"):
        inject(debian, [nvidia.MigInstance(gpu=1, gi=7, ci=0)], tmp_path)


def test_ipc_persistenced_and_mps(debian: Path, tmp_path: Path) -> None:
    (debian / "var/run/nvidia-persistenced").mkdir(parents=True)
    (debian / "var/run/nvidia-persistenced/socket").touch()
    with safe_data.data_root() as pipes:  # the MPS pipe folder must be on a nosuid,nodev mount
        (debian / "tmp").mkdir(exist_ok=True)
        (debian / "tmp/nvidia-mps").symlink_to(pipes)
        without_mps = inject(debian, [0], tmp_path)
        binds = {b.target: b for b in without_mps.binds}
        assert (
            binds["/run/nvidia-persistenced/socket"].source
            == debian / "var/run/nvidia-persistenced/socket"
        )
        assert "/tmp/nvidia-mps" not in binds  # folder there, but no MPS control daemon
        (pipes / "control").touch()
        with_mps = {b.target: b for b in inject(debian, [0], tmp_path, mps=True).binds}
        assert with_mps["/tmp/nvidia-mps"].read_only is False


def test_mps_pipe_is_not_bound_unless_the_site_asks(debian: Path, tmp_path: Path) -> None:
    """A running MPS control daemon's pipe folder is writable by every client: bound into every GPU
    container, any booker could stop or reconfigure MPS for all. Only `[gpus] mps = true` binds it."""
    (debian / "tmp/nvidia-mps").mkdir(parents=True)
    (debian / "tmp/nvidia-mps/control").touch()
    binds = inject(debian, [0], tmp_path).binds
    assert not any(b.target == "/tmp/nvidia-mps" or b.source == debian / "tmp/nvidia-mps" for b in binds)


def test_extra_roots_from_config(tmp_path: Path) -> None:
    root = tmp_path / "root"
    driver_libraries(root / "srv/nvidia-580/lib64")
    executable(root / "srv/nvidia-580/bin/nvidia-smi")
    proc_driver(root)
    device_nodes(root)
    with pytest.raises(DriverError):
        discover(root)
    driver = discover(root, extra_roots=[Path("/srv/nvidia-580")])
    assert {f.host_path.parent for f in driver.libraries} == {root / "srv/nvidia-580/lib64"}
    assert driver.binaries[0].host_path == root / "srv/nvidia-580/bin/nvidia-smi"


def test_ld_library_path_is_searched(tmp_path: Path) -> None:
    root = tmp_path / "root"
    driver_libraries(root / "home/admin/driver")
    proc_driver(root)
    device_nodes(root)
    driver = discover(root, environ={"LD_LIBRARY_PATH": "relative/ignored:/home/admin/driver"})
    assert {f.host_path.parent for f in driver.libraries} == {root / "home/admin/driver"}


def test_container_args_podman(debian: Path, tmp_path: Path) -> None:
    booked = inject(debian, [1], tmp_path)
    args = engine_from("podman").gpu_args(booked)  # type: ignore[attr-defined]
    assert args[:2] == ["--cap-drop", "MKNOD"]
    pairs = list(zip(args[::2], args[1::2], strict=True))
    assert ("--device", f"{debian}/dev/nvidia1:/dev/nvidia1:rw") in pairs
    assert not any(flag == "--device" and "/dev/nvidia0:" in value for flag, value in pairs)
    assert (
        "-v",
        f"{debian}/{DEBIAN_LIBS}/libcuda.so.{VERSION}:"
        f"{nvidia.CONTAINER_LIBRARY_DIR}/libcuda.so.{VERSION}:ro",
    ) in pairs
    assert ("-e", "CUDA_VISIBLE_DEVICES=0") in pairs
    assert ("--security-opt", "mask=/proc/driver/nvidia/gpus") in pairs
    # the folder bind comes before the files bound into it
    volumes = [value.split(":")[1] for flag, value in pairs if flag == "-v"]
    assert volumes.index(nvidia.CONTAINER_LIBRARY_DIR) < volumes.index(
        f"{nvidia.CONTAINER_LIBRARY_DIR}/libcuda.so.{VERSION}"
    )


def test_container_args_docker_has_no_mask_flag(debian: Path, tmp_path: Path) -> None:
    args = engine_from("docker").gpu_args(inject(debian, [1], tmp_path))  # type: ignore[attr-defined]
    assert "--security-opt" not in args and "--cap-drop" in args
    with pytest.raises(EngineError, match="unknown engine"):
        engine_from("lxc")


def test_container_args_refuse_paths_the_cli_would_split(tmp_path: Path) -> None:
    root = tmp_path / "a:b"
    driver_libraries(root / DEBIAN_LIBS)
    proc_driver(root)
    device_nodes(root)
    with pytest.raises(DriverError, match="contains ':'"):
        engine_from("podman").gpu_args(inject(root, [0], tmp_path))  # type: ignore[attr-defined]


def test_injection_is_frozen_and_hashable_for_the_engine(debian: Path, tmp_path: Path) -> None:
    import dataclasses
    import json

    booked = inject(debian, [0], tmp_path)
    with pytest.raises(dataclasses.FrozenInstanceError):
        booked.gpus = (1,)  # type: ignore[misc]
    assert json.dumps(dataclasses.asdict(booked), default=str)  # ContainerSpec.spec_hash does this
    assert hash(booked)


def test_no_driver_at_all(tmp_path: Path) -> None:
    with pytest.raises(DriverError, match="no NVIDIA driver found"):
        discover(tmp_path)


def test_shared_object_fixture_is_what_readelf_reads(tmp_path: Path) -> None:
    readelf = shutil.which("readelf")
    if readelf is None:
        pytest.skip("no readelf (binutils) here")
    path = shared_object(tmp_path / "libx.so.1.0", "libx.so.1")
    out = subprocess.run(
        [readelf, "-d", str(path)], capture_output=True, text=True, check=True
    ).stdout
    assert "Library soname: [libx.so.1]" in out
