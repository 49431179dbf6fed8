"""On a real GPU: a booking's container sees exactly its GPUs, with the host's driver.

Containers come from the host's own root file system (hostroot.py), started by rootful podman
with the podman engine's `gpu_args(injection)`, as gpubook's podman engine starts them.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import pytest

from gpubook.runtime import nvidia
from tests.kits import hostroot

pytestmark = pytest.mark.gpu


def run(argv: Sequence[str], *, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, check=False)


def in_container(
    image: str,
    command: Sequence[str],
    *,
    injection: nvidia.GpuInjection | None,
    extra: Sequence[str] = (),
    timeout: float = 300,
) -> subprocess.CompletedProcess[str]:
    return run(hostroot.run_argv(image, command, injection=injection, extra=extra), timeout=timeout)


def ok(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 0, (
        f"exit {result.returncode}\nstdout: {result.stdout}\nstderr: {result.stderr}"
    )
    return result.stdout


@contextmanager
def running(image: str, injection: nvidia.GpuInjection) -> Iterator[str]:
    name = f"gpubook-gputest-{uuid.uuid4().hex[:8]}"
    ok(run(hostroot.run_argv(image, ["sleep", "600"], injection=injection, name=name, detach=True)))
    try:
        yield name
    finally:
        run([hostroot.PODMAN, "rm", "-f", "-t", "0", name])


def exec_in(name: str, command: Sequence[str]) -> subprocess.CompletedProcess[str]:
    # `podman exec` skips the shim; the library cache was built when the container started.
    return run([hostroot.PODMAN, "exec", name, *command])


def smi_uuids(output: str) -> list[str]:
    return [
        line.split("(UUID: ")[1].rstrip(")") for line in output.splitlines() if "(UUID: " in line
    ]


def test_booking_sees_exactly_its_gpu_with_the_host_driver(
    host_image, host_gpus, host_driver, booking
):
    # The last GPU too: on a multi-GPU host it checks the index -> device minor mapping.
    for gpu in dict.fromkeys((host_gpus[0], host_gpus[-1])):
        injection = booking(gpu.index)
        listed = ok(in_container(host_image, ["nvidia-smi", "-L"], injection=injection))
        assert smi_uuids(listed) == [gpu.uuid], listed
        query = ok(
            in_container(
                host_image,
                ["nvidia-smi", "--query-gpu=uuid,driver_version", "--format=csv,noheader"],
                injection=injection,
            )
        )
        assert query.strip() == f"{gpu.uuid}, {host_driver.version}"
        nvml = json.loads(
            ok(
                in_container(
                    host_image, ["python3", "-c", hostroot.NVML_SCRIPT], injection=injection
                )
            )
            .strip()
            .splitlines()[-1]
        )
        assert nvml == {
            "driver": host_driver.version,
            "gpus": [{"uuid": gpu.uuid, "minor": gpu.minor}],
        }


def test_library_folder_and_soname_links(host_image, booking):
    injection = booking(0)
    script = (
        f"readlink {injection.library_dir}/libcuda.so.1; "
        f"readlink {injection.library_dir}/libnvidia-ml.so.1; "
        f'ldconfig -p | grep -c "{injection.library_dir}/libcuda.so.1"'
    )
    out = ok(in_container(host_image, ["sh", "-c", script], injection=injection)).split()
    version = injection.driver_version
    assert out == [f"libcuda.so.{version}", f"libnvidia-ml.so.{version}", "1"]


def test_cuda_program_runs_on_the_booked_gpu(host_image, host_gpus, booking, torch_python):
    gpu = host_gpus[-1]
    program = (
        "import torch; a = torch.ones(2048, 2048, device='cuda'); "
        "print(torch.cuda.device_count(), (a @ a)[0, 0].item(), torch.cuda.get_device_name(0))"
    )
    out = ok(
        in_container(
            host_image,
            [torch_python, "-c", program],
            injection=booking(gpu.index),
            extra=hostroot.torch_bind(),
            timeout=600,
        )
    )
    count, value, name = out.strip().splitlines()[-1].split(" ", 2)
    assert (count, float(value), name) == ("1", 2048.0, gpu.name)


def test_without_injection_no_gpu(host_image, torch_python):
    nvml = json.loads(
        ok(in_container(host_image, ["python3", "-c", hostroot.NVML_SCRIPT], injection=None))
        .strip()
        .splitlines()[-1]
    )
    assert "error" in nvml
    nodes = ok(
        in_container(
            host_image, ["sh", "-c", "ls /dev | grep -c '^nvidia' || true"], injection=None
        )
    )
    assert nodes.strip() == "0"
    out = ok(
        in_container(
            host_image,
            [torch_python, "-c", "import torch; print(torch.cuda.is_available())"],
            injection=None,
            extra=hostroot.torch_bind(),
            timeout=600,
        )
    )
    assert out.strip().splitlines()[-1] == "False"


def test_two_bookings_each_see_only_their_own_gpu(host_image, two_gpus, booking):
    first, second = two_gpus
    with (
        running(host_image, booking(first.index)) as a,
        running(host_image, booking(second.index)) as b,
    ):
        for name, mine, other in ((a, first, second), (b, second, first)):
            assert smi_uuids(ok(exec_in(name, ["nvidia-smi", "-L"]))) == [mine.uuid]
            # NVML ran (nvidia-smi above); with MKNOD dropped it could not create the other's node.
            nodes = ok(exec_in(name, ["sh", "-c", "ls /dev | grep '^nvidia[0-9]'"])).split()
            assert nodes == [f"nvidia{mine.minor}"]
            probe = (
                "import os, stat, sys\n"
                f"path = '/dev/nvidia{other.minor}'\n"
                "try:\n    os.open(path, os.O_RDWR)\n"
                "except OSError as e:\n    print('open', e.errno)\n"
                "try:\n"
                f"    os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(195, {other.minor}))\n"
                "    print('mknod', 0)\nexcept OSError as e:\n    print('mknod', e.errno)\n"
            )
            assert ok(exec_in(name, ["python3", "-c", probe])).split() == [
                "open",
                "2",
                "mknod",
                "1",
            ]
            # /proc: no entry of the other GPU is readable (the gpus folder is masked)
            listing = ok(exec_in(name, ["sh", "-c", "ls -A /proc/driver/nvidia/gpus/ | wc -l"]))
            assert listing.strip() == "0"
            # (named files, not grep -r: some /proc/driver/nvidia files are power-management knobs)
            leaked = exec_in(
                name,
                [
                    "sh",
                    "-c",
                    "cat /proc/driver/nvidia/gpus/*/information "
                    f"/proc/driver/nvidia/gpus/{other.bus_id}/information 2>&1",
                ],
            )
            assert other.uuid not in leaked.stdout and "No such file" in leaked.stdout


def test_two_gpu_booking_runs_nccl_all_reduce(
    host_image, two_gpus, booking, torch_python, tmp_path
):
    # A file, not `python -c`: mp.spawn's children import the main module by its path.
    # pytest's tmp_path is mode 700 under /tmp/pytest-of-root: the container's root, a mapped
    # uid of the booking's user namespace, could not read it. A folder anyone can read instead.
    folder = Path(tempfile.mkdtemp(prefix="gpubook-nccl-"))
    folder.chmod(0o755)
    program = folder / "nccl_allreduce.py"
    program.write_text(r"""
import os, torch, torch.distributed as dist, torch.multiprocessing as mp
def work(rank):
    dist.init_process_group("nccl", init_method="tcp://127.0.0.1:29533", rank=rank, world_size=2)
    torch.cuda.set_device(rank)
    value = torch.full((1 << 20,), float(rank + 1), device="cuda")
    dist.all_reduce(value)
    torch.cuda.synchronize()
    assert value.min().item() == value.max().item() == 3.0, value
    if rank == 0:
        print("allreduce", value[0].item(), torch.cuda.device_count(), flush=True)
    dist.destroy_process_group()
if __name__ == "__main__":
    mp.spawn(work, nprocs=2)
""")
    program.chmod(0o644)
    injection = booking(two_gpus[0].index, two_gpus[1].index)
    out = ok(
        in_container(
            host_image,
            [torch_python, "/gpubook-test/nccl_allreduce.py"],
            injection=injection,
            extra=[
                *hostroot.torch_bind(),
                "-v",
                f"{folder}:/gpubook-test:ro",
                "-e",
                "NCCL_NVLS_ENABLE=0",
            ],
            timeout=600,
        )
    )
    assert "allreduce 3.0 2" in out
