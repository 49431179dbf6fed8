"""Fake NVIDIA driver trees for discovery tests: real (tiny) ELF files, named like a real driver.

`shared_object` writes a valid ELF shared object with a DT_SONAME: one PT_LOAD segment mapping the
whole file, one PT_DYNAMIC segment, a string table. `readelf -d` and the dynamic loader's own
checks accept it; it just has no code. Class and machine are parameters, so 32-bit and foreign
architecture files can be made to check that discovery skips them.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

EM_386, EM_X86_64, EM_AARCH64 = 3, 62, 183
VERSION = "580.65.06"
OLD_VERSION = "570.124.06"

PROC_VERSION_PROPRIETARY = (
    "NVRM version: NVIDIA UNIX x86_64 Kernel Module  {v}  Sun Jul 27 06:54:38 UTC 2025\n"
    "GCC version:  gcc version 13.3.0 (Ubuntu 13.3.0-6ubuntu2~24.04)\n"
)
PROC_VERSION_OPEN = (
    "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  {v}  Release Build  "
    "(dvs-builder@U22-I3-AF03-09-1)  Sun Jul 27 06:54:38 UTC 2025\n"
    "GCC version:  gcc version 13.3.0 (Ubuntu 13.3.0-6ubuntu2~24.04)\n"
)

COMPUTE_LIBS = (
    "libcuda.so",
    "libnvidia-ptxjitcompiler.so",
    "libnvidia-nvvm.so",
    "libnvidia-gpucomp.so",
)
UTILITY_LIBS = ("libnvidia-ml.so", "libnvidia-cfg.so")
SONAMES = {
    "libcuda.so": "libcuda.so.1",
    "libnvidia-ptxjitcompiler.so": "libnvidia-ptxjitcompiler.so.1",
    "libnvidia-nvvm.so": "libnvidia-nvvm.so.4",
    "libnvidia-gpucomp.so": None,
    "libnvidia-ml.so": "libnvidia-ml.so.1",
    "libnvidia-cfg.so": "libnvidia-cfg.so.1",
}


def shared_object(
    path: Path, soname: str | None, *, bits: int = 64, machine: int = EM_X86_64, elf_type: int = 3
) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    strtab = b"\0" + (soname.encode() + b"\0" if soname else b"")
    if bits == 64:
        ehsize, phentsize, dynsize = 64, 56, 16
    else:
        ehsize, phentsize, dynsize = 52, 32, 8
    phoff = ehsize
    dyn_off = phoff + 2 * phentsize
    dyn_entries = [(5, 0), (10, len(strtab))]  # DT_STRTAB (patched below), DT_STRSZ
    if soname:
        dyn_entries.append((14, 1))  # DT_SONAME at offset 1 of the string table
    dyn_entries.append((0, 0))
    str_off = dyn_off + dynsize * len(dyn_entries)
    size = str_off + len(strtab)
    vaddr = 0x1000 * 0  # segment mapped at address 0: file offset == address
    dyn_entries[0] = (5, vaddr + str_off)
    ident = b"\x7fELF" + bytes([2 if bits == 64 else 1, 1, 1, 0]) + b"\0" * 8
    if bits == 64:
        header = struct.pack(
            "<HHIQQQIHHHHHH", elf_type, machine, 1, 0, phoff, 0, 0, ehsize, phentsize, 2, 64, 0, 0
        )
        load = struct.pack("<IIQQQQQQ", 1, 5, 0, vaddr, vaddr, size, size, 0x1000)
        dynamic = struct.pack(
            "<IIQQQQQQ",
            2,
            6,
            dyn_off,
            vaddr + dyn_off,
            vaddr + dyn_off,
            dynsize * len(dyn_entries),
            dynsize * len(dyn_entries),
            8,
        )
        dyn = b"".join(struct.pack("<qQ", tag, value) for tag, value in dyn_entries)
    else:
        header = struct.pack(
            "<HHIIIIIHHHHHH", elf_type, machine, 1, 0, phoff, 0, 0, ehsize, phentsize, 2, 40, 0, 0
        )
        load = struct.pack("<IIIIIIII", 1, 0, vaddr, vaddr, size, size, 5, 0x1000)
        dynamic = struct.pack(
            "<IIIIIIII",
            2,
            dyn_off,
            vaddr + dyn_off,
            vaddr + dyn_off,
            dynsize * len(dyn_entries),
            dynsize * len(dyn_entries),
            6,
            4,
        )
        dyn = b"".join(struct.pack("<iI", tag, value) for tag, value in dyn_entries)
    data = ident + header + load + dynamic + dyn + strtab
    assert len(data) == size
    path.write_bytes(data)
    return path


def executable(path: Path, *, machine: int = EM_X86_64) -> Path:
    shared_object(path, None, machine=machine, elf_type=2)
    path.chmod(0o755)
    return path


def driver_libraries(
    folder: Path,
    version: str = VERSION,
    *,
    names=COMPUTE_LIBS + UTILITY_LIBS,
    links: bool = True,
    bits: int = 64,
    machine: int = EM_X86_64,
) -> None:
    """The driver's files as its installer leaves them: <name>.<version> plus the SONAME link."""
    for name in names:
        real = shared_object(
            folder / f"{name}.{version}", SONAMES.get(name), bits=bits, machine=machine
        )
        soname = SONAMES.get(name)
        if links and soname and not (folder / soname).exists():
            os.symlink(real.name, folder / soname)
        if links and name in ("libcuda.so", "libnvidia-ml.so") and not (folder / name).exists():
            os.symlink(soname or real.name, folder / name)


def proc_driver(
    root: Path,
    version: str = VERSION,
    *,
    gpus=(("0000:00:06.0", 0), ("0000:00:07.0", 1)),
    open_module: bool = False,
) -> None:
    proc = root / "proc/driver/nvidia"
    proc.mkdir(parents=True, exist_ok=True)
    template = PROC_VERSION_OPEN if open_module else PROC_VERSION_PROPRIETARY
    (proc / "version").write_text(template.format(v=version))
    for number, (bus, minor) in enumerate(gpus):
        entry = proc / "gpus" / bus
        entry.mkdir(parents=True, exist_ok=True)
        (entry / "information").write_text(
            "Model: \t\t NVIDIA H200\n"
            "IRQ:   \t\t 42\n"
            f"GPU UUID: \t GPU-{number:08x}-aaaa-bbbb-cccc-{minor:012x}\n"
            "Video BIOS: \t 96.00.af.00.01\n"
            "Bus Type: \t PCIe\n"
            "DMA Size: \t 52 bits\n"
            "DMA Mask: \t 0xfffffffffffff\n"
            f"Bus Location: \t {bus}\n"
            f"Device Minor: \t {minor}\n"
            "GPU Excluded:\t No\n"
        )


def device_nodes(root: Path, minors=(0, 1), *, uvm: bool = True) -> None:
    """Stand-ins for the device nodes (an unprivileged test cannot mknod): discovery only checks
    that they exist; the GPU tests check the real ones."""
    dev = root / "dev"
    dev.mkdir(parents=True, exist_ok=True)
    names = ["nvidiactl"] + [f"nvidia{m}" for m in minors]
    if uvm:
        names += ["nvidia-uvm", "nvidia-uvm-tools"]
    for name in names:
        (dev / name).touch()


def ld_cache_text(entries: list[tuple[str, str, str]]) -> str:
    """`ldconfig -p` output for (name, flags, path) entries."""
    lines = [f"{len(entries)} libs found in cache `/etc/ld.so.cache'"]
    lines += [f"\t{name} ({flags}) => {path}" for name, flags, path in entries]
    return "\n".join(lines) + "\n"
