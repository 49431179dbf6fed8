"""What a booker does inside a GPU booking over SSH, for tests/gpu/test_daemon_gpu.py: run a CUDA
kernel through the injected driver, list the GPUs with nvidia-smi, try to open every GPU's device
node, look at /proc/driver/nvidia/gpus, and keep the kernel's output in /data/output.

The kernel comes from `cudacheck` (tests/gpu/cudacheck.c, built by prepare_daemon_bundle.sh): the
image has no CUDA toolkit, only the driver gpubook injects. Each check returns what it saw; the
test compares it with the GPUs the booking was given.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import paramiko

from gpubook.runtime.nvidia.model import Gpu

UUID = re.compile(r"GPU-[0-9a-fA-F-]{36}")
KERNEL_LINE = re.compile(r"^device (\d+) (GPU-[0-9a-f-]{36}) (\S+) kernel (\S+)$", re.MULTILINE)
REMOTE_BINARY = "/tmp/cudacheck"  # noqa: S108 - inside the booking's container
OUTPUT = "/data/output/cudacheck.txt"


@dataclass(frozen=True)
class Seen:
    """What the booker saw inside the container."""

    kernel_status: int
    kernel_output: str
    kernel_uuids: frozenset[str]  # devices whose kernel result was right
    smi_uuids: frozenset[str]
    opened: frozenset[int]  # device minors whose /dev/nvidiaN opened read-write
    refused: frozenset[int]
    proc_gpus: frozenset[str]  # the names listed in /proc/driver/nvidia/gpus


def run(client: paramiko.SSHClient, command: str, *, stdin: bytes | None = None,
        timeout: float = 60) -> tuple[int, str]:
    """One command over the booker's SSH; stdout and stderr together."""
    channel_in, stdout, _ = client.exec_command(command, timeout=timeout)
    stdout.channel.set_combine_stderr(True)
    if stdin is not None:
        channel_in.write(stdin)
        channel_in.channel.shutdown_write()
    status = stdout.channel.recv_exit_status()
    return status, stdout.read().decode(errors="replace")


def look(client: paramiko.SSHClient, *, cudacheck: bytes, every: Sequence[Gpu], output: str = OUTPUT) -> Seen:
    """`output`: where the kernel's lines are kept (a booking without data folders: under /tmp)."""
    status, said = run(client, f"cat > {REMOTE_BINARY} && chmod 755 {REMOTE_BINARY}", stdin=cudacheck)
    assert status == 0, f"uploading cudacheck failed: {said}"
    kernel_status, kernel = run(client, f"{REMOTE_BINARY} > {output}; s=$?; cat {output}; exit $s")
    smi_status, smi = run(client, "nvidia-smi -L")
    assert smi_status == 0, f"nvidia-smi -L failed inside the booking: {smi}"
    minors = " ".join(str(gpu.device_minor) for gpu in every)
    # A character device, opened: `3<>` alone creates a plain file where the booker may write to
    # /dev (udocker's one id owns the container's /dev), which is no GPU (seen on the GPU host).
    _, opens = run(client, f"for m in {minors}; do if [ -c /dev/nvidia$m ] && (exec 3<>/dev/nvidia$m) 2>/dev/null; "
                           'then echo "$m open"; else echo "$m refused"; fi; done')
    _, proc = run(client, "ls /proc/driver/nvidia/gpus 2>/dev/null; true")
    return seen_from(kernel_status=kernel_status, kernel=kernel, smi=smi, opens=opens, proc=proc)


def seen_from(*, kernel_status: int, kernel: str, smi: str, opens: str, proc: str) -> Seen:
    """The outputs of cudacheck, `nvidia-smi -L`, the open loop and `ls /proc/...`, read."""
    lines = opens.splitlines()
    return Seen(
        kernel_status=kernel_status,
        kernel_output=kernel,
        kernel_uuids=frozenset(m.group(2).lower() for m in KERNEL_LINE.finditer(kernel) if m.group(4) == "ok"),
        smi_uuids=frozenset(u.lower() for u in UUID.findall(smi)),
        opened=frozenset(int(line.split()[0]) for line in lines if line.endswith(" open")),
        refused=frozenset(int(line.split()[0]) for line in lines if line.endswith(" refused")),
        proc_gpus=frozenset(proc.split()),
    )


def assert_exactly(seen: Seen, *, mine: Sequence[Gpu], every: Sequence[Gpu], booking_id: str) -> None:
    """The booking saw, used and could open exactly its own GPUs, and none of the others."""
    wanted = frozenset(str(gpu.uuid).lower() for gpu in mine)
    others = [gpu for gpu in every if gpu not in mine]
    assert seen.kernel_status == 0, f"{booking_id}: the CUDA kernel failed:\n{seen.kernel_output}"
    assert f"devices {len(mine)}\n" in seen.kernel_output, f"{booking_id}: {seen.kernel_output}"
    assert seen.kernel_uuids == wanted, f"{booking_id}: kernel ran on {seen.kernel_uuids}, booked {wanted}"
    assert seen.smi_uuids == wanted, f"{booking_id}: nvidia-smi -L listed {seen.smi_uuids}, booked {wanted}"
    assert seen.opened == {gpu.device_minor for gpu in mine}, f"{booking_id}: opened {sorted(seen.opened)}"
    assert seen.refused == {gpu.device_minor for gpu in others}, f"{booking_id}: refused {sorted(seen.refused)}"
    leaked = {str(gpu.bus_id).lower() for gpu in others} & {name.lower() for name in seen.proc_gpus}
    assert not leaked, f"{booking_id}: /proc/driver/nvidia/gpus shows the other GPUs {leaked}"

