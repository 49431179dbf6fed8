"""The isolation a udocker booking's OCI spec must hold (round 3 of the hostile review): checked on
the policy's output (tests/test_udocker_policy.py) and on the spec runc received for a real booking
(tests/test_udocker_engine.py)."""

from __future__ import annotations

from typing import Any


def isolation_problems(spec: dict[str, Any], *, writable: set[str]) -> list[str]:
    """What in the OCI spec runc receives breaks the udocker booking's isolation (round 3): every bind
    but the booking's `writable` ones read-only, recursively, with no set-uid file and no device;
    the host's cgroup tree hidden; namespaces of its own; one capability; no new privileges."""
    problems = []
    for mount in spec["mounts"]:
        options = mount.get("options") or []
        if mount.get("type") in ("none", "bind") or "rbind" in options or "bind" in options:
            where = f"{mount['destination']} ({mount['source']})"
            if not {"nosuid", "nodev"} <= set(options):
                problems.append(f"{where} allows set-uid files or devices: {options}")
            if mount["destination"] not in writable and not {"ro", "rro"} <= set(options):
                problems.append(f"{where} is not read-only recursively: {options}")
            if mount["destination"] in writable and "ro" in options:
                problems.append(f"{where} should be writable: {options}")
    linux, process = spec["linux"], spec["process"]
    if "/sys/fs/cgroup" not in linux.get("maskedPaths", []):
        problems.append("the host's cgroup tree (/sys/fs/cgroup) is not masked")
    namespaces = {ns["type"] for ns in linux["namespaces"] if not ns.get("path")}
    if namespaces != {"pid", "ipc", "uts", "mount", "user", "cgroup"}:
        problems.append(f"namespaces: {sorted(namespaces)}")
    if process["capabilities"]["bounding"] != ["CAP_SETFCAP"] or process["capabilities"]["ambient"]:
        problems.append(f"capabilities: {process['capabilities']}")
    if process.get("noNewPrivileges") is not True:
        problems.append("new privileges can be gained")
    if not (linux.get("seccomp") or {}).get("syscalls"):
        problems.append("no seccomp filter: the kernel's whole system-call surface is open")
    return problems

