"""Just enough of ELF to pick driver files: class, machine, type and the SONAME.

A driver folder can hold 32-bit compatibility libraries, another architecture's files (a
multi-arch host) or files that are not ELF at all (linker scripts, stale copies); binding those
into a container makes the loader fail in ways that are hard to trace. The dynamic section is read
through the program headers, which every shared object keeps, not through section headers, which
`strip` may remove. Standard library only: no readelf or pyelftools on a minimal host.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

ELF_MAGIC = b"\x7fELF"
ELFCLASS32, ELFCLASS64 = 1, 2
ET_EXEC, ET_DYN = 2, 3
PT_LOAD, PT_DYNAMIC = 1, 2
DT_NULL, DT_STRTAB, DT_SONAME = 0, 5, 14
EM_386, EM_PPC64, EM_X86_64, EM_AARCH64 = 3, 21, 62, 183

_MAX_PHNUM = 256  # real objects have about ten; more is a damaged or hostile file
_MAX_DYNAMIC = 1 << 20
_MAX_NAME = 4096


@dataclass(frozen=True)
class ElfInfo:
    bits: int  # 32 or 64
    machine: int  # e_machine, e.g. EM_X86_64
    type: int  # e_type: ET_DYN for libraries (and PIE executables), ET_EXEC for others
    soname: str | None


class ElfFormatError(ValueError):
    """The file starts like ELF but its headers are inconsistent."""


def read_elf(path: Path) -> ElfInfo | None:
    """The ELF facts of `path`; None if it is not an ELF file at all."""
    with path.open("rb") as file:
        ident = file.read(16)
        if len(ident) < 16 or ident[:4] != ELF_MAGIC:
            return None
        bits = {ELFCLASS32: 32, ELFCLASS64: 64}.get(ident[4])
        endian = {1: "<", 2: ">"}.get(ident[5])
        if bits is None or endian is None:
            raise ElfFormatError(f"{path}: unknown ELF class {ident[4]} or encoding {ident[5]}")
        header_format = endian + ("HHIQQQIHHHHHH" if bits == 64 else "HHIIIIIHHHHHH")
        header = _unpack(file, header_format, path)
        e_type, e_machine, e_phoff = header[0], header[1], header[4]
        soname = _soname(
            file,
            path,
            bits=bits,
            endian=endian,
            phoff=e_phoff,
            phentsize=header[8],
            phnum=header[9],
        )
        return ElfInfo(bits=bits, machine=e_machine, type=e_type, soname=soname)


def _unpack(file, layout: str, path: Path) -> tuple[int, ...]:
    size = struct.calcsize(layout)
    data = file.read(size)
    if len(data) != size:
        raise ElfFormatError(f"{path}: truncated ELF header")
    return struct.unpack(layout, data)


def _soname(
    file, path: Path, *, bits: int, endian: str, phoff: int, phentsize: int, phnum: int
) -> str | None:
    phdr_format = endian + ("IIQQQQQQ" if bits == 64 else "IIIIIIII")
    if phnum > _MAX_PHNUM or (phnum and phentsize < struct.calcsize(phdr_format)):
        raise ElfFormatError(f"{path}: implausible program headers ({phnum} x {phentsize} bytes)")
    loads: list[tuple[int, int, int]] = []  # (vaddr, offset, filesz)
    dynamic: tuple[int, int] | None = None  # (offset, filesz)
    for number in range(phnum):
        file.seek(phoff + number * phentsize)
        fields = _unpack(file, phdr_format, path)
        if bits == 64:
            p_type, _flags, p_offset, p_vaddr, _paddr, p_filesz = fields[:6]
        else:
            p_type, p_offset, p_vaddr, _paddr, p_filesz = fields[:5]
        if p_type == PT_LOAD:
            loads.append((p_vaddr, p_offset, p_filesz))
        elif p_type == PT_DYNAMIC:
            dynamic = (p_offset, p_filesz)
    if dynamic is None:
        return None
    entry_format = endian + ("qQ" if bits == 64 else "iI")
    entry_size = struct.calcsize(entry_format)
    file.seek(dynamic[0])
    table = file.read(min(dynamic[1], _MAX_DYNAMIC))
    strtab = soname_offset = None
    for start in range(0, len(table) - entry_size + 1, entry_size):
        tag, value = struct.unpack_from(entry_format, table, start)
        if tag == DT_NULL:
            break
        if tag == DT_STRTAB:
            strtab = value
        elif tag == DT_SONAME:
            soname_offset = value
    if strtab is None or soname_offset is None:
        return None
    # DT_STRTAB is a memory address; the PT_LOAD segment holding it says where it is in the file.
    for vaddr, offset, filesz in loads:
        if vaddr <= strtab < vaddr + filesz:
            file.seek(offset + (strtab - vaddr) + soname_offset)
            raw = file.read(_MAX_NAME)
            end = raw.find(b"\0")
            if end < 0:
                raise ElfFormatError(f"{path}: SONAME is not terminated")
            return raw[:end].decode("utf-8", "replace")
    raise ElfFormatError(f"{path}: the dynamic string table lies outside every loaded segment")
