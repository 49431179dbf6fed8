"""Can the host's driver run a template's CUDA version? NVIDIA's release-notes tables, as data.

Checked against NVIDIA's CUDA Toolkit Release Notes
(docs.nvidia.com/cuda/cuda-toolkit-release-notes, edition for 13.2 Update 2): Table 3 "CUDA
Toolkit and Corresponding Driver Versions", Linux x86_64 column, GA row of each version (8.0 is
"8.0.61 GA2", as the issue asks; 11.0 is "11.0.2 GA"), and Table 2 "Minimum Required Driver
Version for CUDA Minor Version Compatibility" (11.x >= 450, 12.x >= 525, 13.x >= 580, with the
footnote that 11.x needs 450.80.02). CUDA 12.7 was never released, so it is not in the table.

From CUDA 11 on, a program built with a later minor release runs on the first driver of its major
family ("minor version compatibility"), without the features that need the newer driver, notably
JIT compilation of newer PTX. So two minimums: the family's (what is needed to run at all: a
booking is rejected below it) and the toolkit's own (below it the template works with limits; the
validate command says so).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

# CUDA (major, minor) -> Linux driver shipped with that toolkit's GA release.
TOOLKIT_DRIVER: dict[tuple[int, int], str] = {
    (7, 0): "346.46",
    (7, 5): "352.31",
    (8, 0): "375.26",
    (9, 0): "384.81",
    (9, 1): "390.46",
    (9, 2): "396.26",
    (10, 0): "410.48",
    (10, 1): "418.39",
    (10, 2): "440.33",
    (11, 0): "450.51.05",
    (11, 1): "455.23",
    (11, 2): "460.27.03",
    (11, 3): "465.19.01",
    (11, 4): "470.42.01",
    (11, 5): "495.29.05",
    (11, 6): "510.39.01",
    (11, 7): "515.43.04",
    (11, 8): "520.61.05",
    (12, 0): "525.60.13",
    (12, 1): "530.30.02",
    (12, 2): "535.54.03",
    (12, 3): "545.23.06",
    (12, 4): "550.54.14",
    (12, 5): "555.42.02",
    (12, 6): "560.28.03",
    (12, 8): "570.26",
    (12, 9): "575.51.03",
    (13, 0): "580.65.06",
    (13, 1): "590.44.01",
    (13, 2): "595.45.04",
}
# CUDA major -> first driver of the family (minor version compatibility, Table 2 and its footnote).
FAMILY_DRIVER: dict[int, str] = {11: "450.80.02", 12: "525.60.13", 13: "580.65.06"}

_CUDA = re.compile(r"^(\d+)\.(\d+)(?:\.\d+)?$")
_DRIVER = re.compile(r"^\d+\.\d+(?:\.\d+)?$")


def _driver_key(version: str) -> tuple[int, int, int]:
    if not _DRIVER.match(version.strip()):
        raise ValueError(f"{version!r} is not an NVIDIA driver version such as 580.65.06")
    parts = [int(p) for p in version.strip().split(".")]
    return (parts + [0, 0])[0], (parts + [0, 0])[1], (parts + [0, 0])[2]


@dataclass(frozen=True)
class CudaRequirement:
    cuda: str
    minimum: str  # below this the driver cannot run it at all
    toolkit: str  # the driver the toolkit shipped with; below it only with minor-version limits


def requirement(cuda_version: str) -> CudaRequirement:
    """What a CUDA version needs; ValueError for a version gpubook has no figures for."""
    match = _CUDA.match(cuda_version.strip())
    if not match:
        raise ValueError(f"CUDA version {cuda_version!r} is not like '12.4' (or 'none')")
    key = int(match.group(1)), int(match.group(2))
    toolkit = TOOLKIT_DRIVER.get(key)
    family = FAMILY_DRIVER.get(key[0])
    if toolkit is None and family is None:
        low, high = min(TOOLKIT_DRIVER), max(TOOLKIT_DRIVER)
        known = f"{low[0]}.{low[1]} to {high[0]}.{high[1]}"
        raise ValueError(
            f"CUDA {cuda_version} is not in gpubook's table of NVIDIA's release notes ({known})"
        )
    if toolkit is None:
        # A minor release newer than the table within a known family: the family minimum holds,
        # the toolkit's own driver is unknown; say so rather than guess.
        assert family is not None
        return CudaRequirement(cuda_version, family, family)
    minimum = toolkit if family is None else min(toolkit, family, key=_driver_key)
    return CudaRequirement(cuda_version, minimum, toolkit)


def check_cuda(cuda_version: str, driver_version: str) -> str | None:
    """None if the driver can run programs built with `cuda_version`, else the reason, in one
    sentence a booker understands. "none" (a template without CUDA) always passes."""
    if cuda_version.strip().lower() == "none":
        return None
    try:
        needs = requirement(cuda_version)
        too_old = _driver_key(driver_version) < _driver_key(needs.minimum)
    except ValueError as error:
        return str(error)
    if too_old:
        return (
            f"the template needs CUDA {cuda_version}, which needs NVIDIA driver {needs.minimum} "
            f"or newer; this host has {driver_version}"
        )
    return None


def limitation(cuda_version: str, driver_version: str) -> str | None:
    """A note when the driver runs `cuda_version` only through minor version compatibility."""
    if cuda_version.strip().lower() == "none" or check_cuda(cuda_version, driver_version):
        return None
    needs = requirement(cuda_version)
    if _driver_key(driver_version) < _driver_key(needs.toolkit):
        return (
            f"runs through CUDA minor version compatibility (CUDA {cuda_version} shipped with "
            f"{needs.toolkit}): JIT of newer PTX and the newest driver features are unavailable"
        )
    return None


@dataclass(frozen=True)
class TemplateCheck:
    name: str
    cuda: str
    problem: str | None  # the booking would be rejected for this
    note: str | None = None  # it would run, with a limitation


def validate_against_driver(
    templates: Iterable[tuple[str, str]], driver_version: str
) -> list[TemplateCheck]:
    """Check (template name, cuda) pairs against a driver (`templates validate --driver`)."""
    try:
        _driver_key(driver_version)
    except ValueError as error:
        return [TemplateCheck(name, cuda, str(error)) for name, cuda in templates]
    return [
        TemplateCheck(
            name, cuda, check_cuda(cuda, driver_version), limitation(cuda, driver_version)
        )
        for name, cuda in templates
    ]


def format_checks(checks: Iterable[TemplateCheck], driver_version: str) -> tuple[list[str], int]:
    """Lines to print and the exit code (1 if a template would be rejected)."""
    lines, status = [], 0
    for check in checks:
        if check.problem:
            status = 1
            lines.append(f"{check.name}: REJECTED with driver {driver_version}: {check.problem}")
        elif check.note:
            lines.append(f"{check.name}: ok (CUDA {check.cuda}), {check.note}")
        else:
            lines.append(f"{check.name}: ok (CUDA {check.cuda})")
    return lines, status
