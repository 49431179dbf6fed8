"""CDI spec, the CUDA/driver table, and the no-GPU behaviour of `gpubook gpus` and doctor."""

from __future__ import annotations

import argparse
import io
import json
import re
from pathlib import Path

import pytest

from gpubook.runtime import nvidia
from gpubook.runtime.checks import format_checks
from gpubook.runtime.errors import DriverError
from gpubook.runtime.nvidia import cdi, cuda, gpus
from tests.kits.nvidia_fake_driver import VERSION, device_nodes, driver_libraries, executable, proc_driver


def fake_driver(tmp_path: Path, **kwargs) -> nvidia.Driver:
    root = tmp_path / "root"
    driver_libraries(root / "usr/lib/x86_64-linux-gnu")
    executable(root / "usr/bin/nvidia-smi")
    proc_driver(root)
    device_nodes(root)
    return nvidia.discover(
        root=root, environ={}, use_nvml=False, machine="x86_64", ld_cache="", **kwargs
    )


# --- CDI -----------------------------------------------------------------------------------------

NAME = re.compile(r"^[a-zA-Z0-9][a-zA-Z0-9_.:-]*$")


def test_cdi_spec_structure(tmp_path: Path) -> None:
    driver = fake_driver(tmp_path)
    document = json.loads(cdi.render(cdi.spec(driver, cache_dir=tmp_path / "cache")))
    assert document["kind"] == "nvidia.com/gpu"
    # index names start with a digit: 0.5.0 is the first version that allows it
    assert document["cdiVersion"] == "0.5.0"
    assert set(document) == {"cdiVersion", "kind", "devices", "containerEdits"}
    names = [d["name"] for d in document["devices"]]
    assert names == [
        "0",
        "1",
        "GPU-00000000-aaaa-bbbb-cccc-000000000000",
        "GPU-00000001-aaaa-bbbb-cccc-000000000001",
        "all",
    ]
    assert all(NAME.match(n) for n in names)
    by_name = {d["name"]: d["containerEdits"] for d in document["devices"]}
    assert [n["path"] for n in by_name["1"]["deviceNodes"]] == ["/dev/nvidia1"]
    assert by_name["GPU-00000001-aaaa-bbbb-cccc-000000000001"] == by_name["1"]
    assert [n["path"] for n in by_name["all"]["deviceNodes"]] == ["/dev/nvidia0", "/dev/nvidia1"]
    common = document["containerEdits"]
    assert [n["path"] for n in common["deviceNodes"]] == [
        "/dev/nvidiactl",
        "/dev/nvidia-uvm",
        "/dev/nvidia-uvm-tools",
    ]
    mounts = {m["containerPath"]: m for m in common["mounts"]}
    lib = nvidia.CONTAINER_LIBRARY_DIR
    assert mounts[f"{lib}/libcuda.so.{VERSION}"]["options"] == ["ro", "nosuid", "nodev", "bind"]
    assert Path(mounts[lib]["hostPath"], "libcuda.so.1").is_symlink()
    assert nvidia.LD_SO_CONF in mounts and "/usr/bin/nvidia-smi" in mounts
    assert all(Path(m["hostPath"]).exists() for m in common["mounts"])
    assert "NVIDIA_DRIVER_CAPABILITIES=utility,compute" in common["env"]
    # a fake root's device nodes differ from their container paths: hostPath says where they are
    assert all(n["hostPath"].startswith(str(tmp_path)) for n in common["deviceNodes"])


def test_cdi_minimum_version_rules() -> None:
    base = {
        "cdiVersion": "",
        "kind": "nvidia.com/gpu",
        "devices": [{"name": "all", "containerEdits": {"deviceNodes": [{"path": "/dev/nvidia0"}]}}],
        "containerEdits": {"mounts": [{"hostPath": "/a", "containerPath": "/a"}]},
    }
    assert cdi.minimum_version(base) == "0.3.0"
    typed = json.loads(json.dumps(base))
    typed["containerEdits"]["mounts"][0]["type"] = "bind"
    assert cdi.minimum_version(typed) == "0.4.0"
    numbered = json.loads(json.dumps(base))
    numbered["devices"][0]["name"] = "0"
    assert cdi.minimum_version(numbered) == "0.5.0"
    annotated = json.loads(json.dumps(numbered))
    annotated["annotations"] = {"a": "b"}
    assert cdi.minimum_version(annotated) == "0.6.0"
    dotted = json.loads(json.dumps(base))
    dotted["kind"] = "vendor.com/gpu.v2"
    assert cdi.minimum_version(dotted) == "0.6.0"


def test_cdi_write_is_atomic_and_readable(tmp_path: Path) -> None:
    driver = fake_driver(tmp_path)
    target = tmp_path / "etc/cdi/gpubook-nvidia.json"
    cdi.write(cdi.spec(driver, cache_dir=tmp_path / "cache"), target)
    assert json.loads(target.read_text())["kind"] == "nvidia.com/gpu"
    assert target.stat().st_mode & 0o777 == 0o644
    assert [p.name for p in target.parent.iterdir()] == ["gpubook-nvidia.json"]


def test_cdi_without_gpus_is_an_error(tmp_path: Path) -> None:
    root = tmp_path / "root"
    driver_libraries(root / "usr/lib64")
    proc_driver(root, gpus=())
    device_nodes(root, minors=())
    driver = nvidia.discover(root=root, environ={}, use_nvml=False, machine="x86_64", ld_cache="")
    with pytest.raises(DriverError, match="lists no GPU"):
        cdi.spec(driver, cache_dir=tmp_path / "cache")


# --- CUDA versus driver --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cuda_version", "driver", "ok"),
    [
        ("8.0", "375.26", True),
        ("8.0", "375.20", False),
        ("9.0", "384.81", True),
        ("9.0", "384.59", False),
        ("10.0", "410.48", True),
        ("12.0", "525.60.13", True),
        ("12.0", "525.60.12", False),
        ("12.4", "525.60.13", True),  # minor version compatibility
        ("12.9", "520.61.05", False),
        ("13.0", "580.65.06", True),
        ("13.0", "575.57.08", False),
        ("11.0", "450.51.05", True),
        ("11.8", "450.80.02", True),
        ("11.8", "450.51.06", False),
        ("none", "1.0", True),
        ("9.0", "580.159.04", True),
    ],
)
def test_check_cuda(cuda_version: str, driver: str, ok: bool) -> None:
    reason = cuda.check_cuda(cuda_version, driver)
    assert (reason is None) is ok
    if not ok:
        assert driver in reason and cuda_version in reason


def test_table_values_from_the_release_notes() -> None:
    assert cuda.TOOLKIT_DRIVER[(8, 0)] == "375.26"
    assert cuda.TOOLKIT_DRIVER[(9, 0)] == "384.81"
    assert cuda.TOOLKIT_DRIVER[(12, 0)] == "525.60.13"
    assert cuda.TOOLKIT_DRIVER[(13, 0)] == "580.65.06"
    keys = sorted(cuda.TOOLKIT_DRIVER)
    drivers = [cuda._driver_key(cuda.TOOLKIT_DRIVER[k]) for k in keys]
    assert drivers == sorted(drivers)  # a newer CUDA never needs an older driver


def test_unknown_versions_are_reasons_not_crashes() -> None:
    assert "not in gpubook's table" in cuda.check_cuda("14.0", "600.10")
    assert "not like" in cuda.check_cuda("twelve", "580.65.06")
    assert "not an NVIDIA driver version" in cuda.check_cuda("12.4", "latest")
    assert cuda.check_cuda("12.7", "525.60.13") is None  # never released; the 12.x minimum holds


def test_validate_templates_against_driver() -> None:
    checks = cuda.validate_against_driver(
        [
            ("digits-cuda8", "8.0"),
            ("tensorflow-cuda9", "9.0"),
            ("torch-cu124", "12.4"),
            ("torch-cu130", "13.0"),
            ("debian-ssh", "none"),
        ],
        "535.54.03",
    )
    by_name = {c.name: c for c in checks}
    assert by_name["digits-cuda8"].problem is None and by_name["tensorflow-cuda9"].problem is None
    assert (
        by_name["torch-cu124"].problem is None
        and "minor version compatibility" in by_name["torch-cu124"].note
    )
    assert "580.65.06" in by_name["torch-cu130"].problem
    lines, status = cuda.format_checks(checks, "535.54.03")
    assert status == 1 and any(line.startswith("torch-cu130: REJECTED") for line in lines)
    _, status = cuda.format_checks(
        cuda.validate_against_driver([("a", "9.0")], "580.65.06"), "580.65.06"
    )
    assert status == 0


# --- no GPU on this machine ----------------------------------------------------------------------


def no_gpu_here() -> bool:
    return not Path("/proc/driver/nvidia/version").exists()


@pytest.mark.skipif(not no_gpu_here(), reason="this machine has an NVIDIA driver")
def test_gpus_on_a_machine_without_gpu_says_so_in_one_line() -> None:
    out = io.StringIO()
    assert gpus.cli_gpus(argparse.Namespace(json=False), out=out) == 1
    lines = out.getvalue().splitlines()
    assert len(lines) == 1 and lines[0].startswith("no NVIDIA GPU visible on this machine")
    out = io.StringIO()
    assert gpus.cli_gpus(argparse.Namespace(json=True), out=out) == 1
    assert json.loads(out.getvalue())["count"] == 0


@pytest.mark.skipif(not no_gpu_here(), reason="this machine has an NVIDIA driver")
def test_gpus_falls_back_to_config_count() -> None:
    out = io.StringIO()
    assert gpus.cli_gpus(argparse.Namespace(json=False), static_count=4, out=out) == 0
    assert out.getvalue().startswith("4 GPU(s) from the config's [gpus] count")
    inv = gpus.inventory(static_count=4)
    assert inv.source == "config" and [g.index for g in inv.gpus] == [0, 1, 2, 3]


@pytest.mark.skipif(not no_gpu_here(), reason="this machine has an NVIDIA driver")
def test_doctor_without_driver_is_one_problem() -> None:
    lines, status = format_checks(gpus.driver_checks())
    assert status == 1
    assert len(lines) == 2 and lines[0].startswith("FAIL  NVIDIA driver: no NVIDIA driver")
    assert lines[1].startswith("      fix: ")


@pytest.mark.skipif(not no_gpu_here(), reason="this machine has an NVIDIA driver")
def test_cdi_command_without_driver_is_one_line(tmp_path: Path) -> None:
    out = io.StringIO()
    assert cdi.cli_gpus_cdi(argparse.Namespace(output=str(tmp_path / "x.json")), out=out) == 1
    assert len(out.getvalue().splitlines()) == 1 and not (tmp_path / "x.json").exists()


def test_doctor_on_a_fake_driver_tree(tmp_path: Path) -> None:
    fake_driver(tmp_path)
    root = tmp_path / "root"
    checks = gpus.driver_checks(
        gpus.DoctorOptions(root=root, use_nvml=False, environ={}, cdi_dirs=(tmp_path / "cdi",))
    )
    by_name = {c.name: c for c in checks}
    assert by_name["NVIDIA driver"].ok and VERSION in by_name["NVIDIA driver"].detail
    assert by_name["device nodes"].ok and "1=/dev/nvidia1" in by_name["device nodes"].detail
    assert not by_name["CDI spec"].ok and "gpubook gpus cdi" in by_name["CDI spec"].fix
    (root / "dev/nvidia1").unlink()
    checks = gpus.driver_checks(
        gpus.DoctorOptions(root=root, use_nvml=False, environ={}, cdi_dirs=(tmp_path / "cdi",))
    )
    missing = [c for c in checks if c.name == f"device {root}/dev/nvidia1"]
    assert missing and not missing[0].ok and "nvidia-modprobe" in missing[0].fix
