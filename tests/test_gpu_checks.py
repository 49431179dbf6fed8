"""The GPU end-to-end test's own checks (tests/kits/booker.py) fail where a booking sees more or
other GPUs than it booked. Runs everywhere (no GPU needed): the outputs below are of the form seen
inside a booking on the GPU host (cudacheck, `nvidia-smi -L`, the open loop, /proc)."""

from __future__ import annotations

import pytest

from gpubook.runtime.nvidia.model import Gpu
from tests.kits import booker

A = Gpu(index=0, minor=0, bus_id="0000:00:06.0", uuid="GPU-295df82b-1be4-49cd-f42f-9a20fcc9ca7b")
B = Gpu(index=1, minor=1, bus_id="0000:00:07.0", uuid="GPU-6da34fe0-309f-f4f9-48d4-b50df7b6a8d7")
EVERY = (A, B)


def kernel(*gpus: Gpu, result: str = "ok") -> str:
    lines = [f"devices {len(gpus)}"]
    lines += [f"device {n} {gpu.uuid} {gpu.bus_id} kernel {result}" for n, gpu in enumerate(gpus)]
    return "\n".join(lines) + "\n"


def smi(*gpus: Gpu) -> str:
    return "".join(f"GPU {n}: NVIDIA H200 (UUID: {gpu.uuid})\n" for n, gpu in enumerate(gpus))


def seen(*, ran: tuple[Gpu, ...] = (A,), listed: tuple[Gpu, ...] = (A,), opens: str = "0 open\n1 refused\n",
         proc: str = "", status: int = 0, result: str = "ok") -> booker.Seen:
    return booker.seen_from(kernel_status=status, kernel=kernel(*ran, result=result), smi=smi(*listed),
                            opens=opens, proc=proc)


def test_a_booking_that_sees_exactly_its_gpu_passes() -> None:
    booker.assert_exactly(seen(proc="0000:00:06.0\n"), mine=[A], every=EVERY, booking_id="b")
    both = seen(ran=EVERY, listed=EVERY, opens="0 open\n1 open\n")
    booker.assert_exactly(both, mine=[A, B], every=EVERY, booking_id="b")


@pytest.mark.parametrize("wrong", [
    {"opens": "0 open\n1 open\n"},  # the other GPU's node opened
    {"opens": "0 refused\n1 refused\n"},  # its own GPU's node did not open
    {"listed": EVERY},  # nvidia-smi lists the other GPU too
    {"ran": (B,), "listed": (B,), "opens": "0 refused\n1 open\n"},  # given the other GPU instead
    {"proc": "0000:00:06.0\n0000:00:07.0\n"},  # /proc/driver/nvidia/gpus shows the other GPU
    {"status": 1, "result": "WRONG"},  # the kernel's results were wrong
    {"ran": EVERY},  # the kernel ran on two devices
])
def test_a_booking_that_sees_more_or_other_gpus_fails(wrong: dict[str, object]) -> None:
    with pytest.raises(AssertionError):
        booker.assert_exactly(seen(**wrong), mine=[A], every=EVERY, booking_id="b")  # type: ignore[arg-type]
