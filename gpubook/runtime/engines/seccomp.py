"""The seccomp filter of udocker bookings: podman's default profile, made into the OCI spec's form.

podman and Docker give every container their default profile; runc, given udocker's spec, gave none,
and a udocker booker reached the kernel's whole system-call surface (round 3 of the hostile review,
L2). The profile is containers-common's (`/usr/share/containers/seccomp.json`, the one podman uses;
where it is missing, the copy packaged beside this file, containers-common 0.50.1, Apache-2.0),
filtered for this machine and the container's capabilities the way the engines do it: an entry
applies when the capabilities and architectures it includes are all there and none it excludes is.
"""

from __future__ import annotations

import json
import platform
from collections.abc import Collection
from pathlib import Path
from typing import Any

SYSTEM_PROFILE = Path("/usr/share/containers/seccomp.json")
PACKAGED_PROFILE = Path(__file__).parent / "data" / "seccomp.json"
# platform.machine() → the Go name the profile's `arches` use
GO_ARCH = {"x86_64": "amd64", "aarch64": "arm64", "ppc64le": "ppc64le", "s390x": "s390x", "riscv64": "riscv64"}
SCMP_ARCH = {"amd64": "SCMP_ARCH_X86_64", "arm64": "SCMP_ARCH_AARCH64", "ppc64le": "SCMP_ARCH_PPC64LE",
             "s390x": "SCMP_ARCH_S390X", "riscv64": "SCMP_ARCH_RISCV64"}


def load_profile() -> dict[str, Any]:
    path = SYSTEM_PROFILE if SYSTEM_PROFILE.is_file() else PACKAGED_PROFILE
    profile = json.loads(path.read_text())
    if not isinstance(profile, dict) or not isinstance(profile.get("syscalls"), list):
        raise ValueError(f"seccomp profile {path}: no syscalls list")
    return profile


def oci_seccomp(profile: dict[str, Any], *, capabilities: Collection[str], machine: str | None = None
                ) -> dict[str, Any]:
    """`linux.seccomp` of an OCI spec for a process with `capabilities`, on `machine`'s architecture."""
    arch = GO_ARCH.get(machine or platform.machine(), machine or platform.machine())
    caps = set(capabilities)
    syscalls = []
    for entry in profile["syscalls"]:
        includes, excludes = entry.get("includes") or {}, entry.get("excludes") or {}
        if not set(includes.get("caps") or ()) <= caps or (includes.get("arches") and arch not in includes["arches"]):
            continue
        if caps & set(excludes.get("caps") or ()) or arch in (excludes.get("arches") or ()):
            continue
        rule: dict[str, Any] = {"names": list(entry["names"]), "action": entry["action"]}
        if entry.get("args"):
            rule["args"] = [{k: a[k] for k in ("index", "value", "valueTwo", "op") if k in a} for a in entry["args"]]
        if entry.get("errnoRet") is not None:
            rule["errnoRet"] = entry["errnoRet"]
        syscalls.append(rule)
    architectures: list[str] = []
    for mapped in profile.get("archMap") or ():
        if mapped.get("architecture") == SCMP_ARCH.get(arch):
            architectures = [mapped["architecture"], *(mapped.get("subArchitectures") or ())]
    seccomp: dict[str, Any] = {"defaultAction": profile["defaultAction"], "architectures": architectures,
                               "syscalls": syscalls}
    if profile.get("defaultErrnoRet") is not None:
        seccomp["defaultErrnoRet"] = profile["defaultErrnoRet"]
    return seccomp
