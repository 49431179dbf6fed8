"""The runc that gpubook hands udocker (UDOCKER_USE_RUNC_EXECUTABLE): udocker writes its OCI spec,
this applies the booking's policy to it, then runs the host's runc and keeps the container's log.

udocker's R1 spec maps root to the daemon's user and binds `-v` folders read-write, with the
default capabilities. gpubook needs more than udocker can be told (its runc mode has no read-only
volume, no file bind, no masked path and no process wrapper), so the engine writes a policy file
beside the container and names it in GPUBOOK_RUNC_POLICY; udocker's environment reaches this
process, never the container's (no `--hostenv`). The policy gives:

- `mounts`: every bind of the booking with its mode (the input read-only), the driver's files;
- `devices`: the booked GPUs' nodes only (runc binds them: no mknod in a user namespace);
- `masked`: /proc paths to hide (the other GPUs' /proc/driver/nvidia entries);
- `shm_size`: the size of /dev/shm (the template's; udocker sets 2 GiB for every container);
- `env`: the environment udocker adds that must not reach the booker (the host's paths and user);
- `args`: the container's first process, run by the host's `unshare` (with the host's own loader
  and libc, so that any image runs it) in a nested user namespace where the daemon's one id is
  the booker's uid: without newuidmap an unprivileged user has exactly one id, and runc insists
  that it be root in the container's first namespace;
- `runc_id_file`: where the runc id udocker chose is written, for the engine's `runc state`;
- `log`, `log_max`: where the container's output goes, in two files of at most `log_max` bytes;
- `seccomp`: the system-call filter (podman's default profile for the one capability kept);
- `private`: udocker's own store, where its FileBind folder must lie.

One capability is kept (SETFCAP, which making the nested namespace needs) and no new privilege
can be gained.
Standard library only: this runs as a separate program, from udocker.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

POLICY_ENV = "GPUBOOK_RUNC_POLICY"
RUNC_ENV = "GPUBOOK_RUNC"
# What udocker puts in a container's environment that tells the booker about the host.
UDOCKER_ENV = ("container_ruser", "container_root", "container_uuid", "container_execmode",
               "container_names", "PS1", "SHLVL", "USERNAME", "USER", "LOGNAME", "HOME")
CHUNK = 65536
SHM = "/dev/shm"  # noqa: S108 - the container's own tmpfs, not a host path
KEPT_CAPABILITIES = ("CAP_SETFCAP",)  # the one capability of a udocker booking's first process
MASKED = ("/sys/fs/cgroup",)  # hidden from every booking (H2): the host's cgroup tree
FILEBIND = "/.bind_host_files"  # udocker's folder of the host's files it gives a container


def apply_policy(config: dict[str, Any], policy: dict[str, Any]) -> dict[str, Any]:
    """udocker's OCI spec with the booking's policy applied (a new dict; `config` is untouched)."""
    spec = json.loads(json.dumps(config))
    linux = spec.setdefault("linux", {})
    uid, gid = os.getuid(), os.getgid()
    linux["uidMappings"] = [{"containerID": 0, "hostID": uid, "size": 1}]
    linux["gidMappings"] = [{"containerID": 0, "hostID": gid, "size": 1}]
    namespaces = [ns for ns in linux.get("namespaces", []) if ns.get("type") != "network"]
    for wanted in ("pid", "ipc", "uts", "mount", "user", "cgroup"):
        if not any(ns.get("type") == wanted for ns in namespaces):
            namespaces.append({"type": wanted})
    linux["namespaces"] = namespaces
    process = spec.setdefault("process", {})
    process["user"] = {"uid": 0, "gid": 0}
    process["noNewPrivileges"] = True
    process["terminal"] = False
    # SETFCAP alone: Linux 5.12 on asks it of a process that maps its namespace's uid 0 into a new
    # one (the nested namespace of the booker's uid); the booker's processes there have none.
    kept = list(KEPT_CAPABILITIES)
    process["capabilities"] = {"bounding": kept, "effective": kept, "permitted": kept, "inheritable": [],
                               "ambient": []}
    process["args"] = list(policy["args"])
    process["cwd"] = "/"
    env = [line for line in process.get("env", []) if line.split("=", 1)[0] not in UDOCKER_ENV]
    process["env"] = [*env, *(f"{name}={value}" for name, value in policy.get("env", []))]
    wanted_targets = {mount["target"] for mount in policy.get("mounts", [])}
    mounts = [_held(m, private=policy.get("private")) for m in spec.get("mounts", [])
              if m.get("destination") not in wanted_targets]
    for mount in policy.get("mounts", []):
        options = ["rbind", "nosuid", "nodev", *(("ro", "rro") if mount["read_only"] else ("rw",))]
        mounts.append({"destination": mount["target"], "type": "none", "source": mount["source"],
                       "options": options})
    if policy.get("shm_size"):
        mounts = [*[m for m in mounts if m.get("destination") != SHM], shm_mount(mounts, policy["shm_size"])]
    spec["mounts"] = mounts
    devices = []
    for device in policy.get("devices", []):
        info = os.stat(device["host"])
        devices.append({"path": device["container"], "type": "c", "major": os.major(info.st_rdev),
                        "minor": os.minor(info.st_rdev), "fileMode": 0o666, "uid": 0, "gid": 0})
    linux["devices"] = devices
    # udocker deletes runc's read-only /sys/fs/cgroup mount: under /sys the host's cgroup tree would
    # be writable where its files are the daemon's (a user unit's cgroup), so a booker could freeze
    # or kill the daemon and every booking (round 3, H2). Masked (an empty read-only tmpfs), and a
    # cgroup namespace of its own.
    linux["maskedPaths"] = [*linux.get("maskedPaths", []), *MASKED, *policy.get("masked", [])]
    linux.pop("resources", None)  # no cgroup of its own: rootless runc without a delegated tree
    if policy.get("seccomp"):  # podman's default filter (engines/seccomp.py); runc had none (round 3, L2)
        linux["seccomp"] = policy["seccomp"]
    return spec


def _held(mount: dict[str, Any], *, private: str | None) -> dict[str, Any]:
    """A mount of udocker's own, kept: every bind read-only, recursively (/sys's plain read-only bind
    left its submounts, the host's cgroup tree, writable: round 3, H2), with no set-uid file and no
    device. One stays writable: udocker's FileBind folder (/.bind_host_files: the container's
    /etc/passwd and group are links into it, which the entrypoint writes). It was made in /tmp
    (0755, the daemon's), where a set-uid file a booker made there was the daemon's for every host
    account (H1): it must lie in udocker's private folder (`private`, 0700), or the start fails."""
    options = list(mount.get("options") or [])
    if mount.get("type") not in (None, "none", "bind") and "bind" not in options and "rbind" not in options:
        return mount  # proc, tmpfs, devpts, mqueue: the kernel's, not the host's files
    options = [o for o in options if o not in ("rw", "ro", "rro", "suid", "dev")]
    options += [o for o in ("nosuid", "nodev") if o not in options]
    if mount.get("destination") == FILEBIND:
        source = os.path.realpath(str(mount.get("source", "")))
        if not (private and Path(source).is_relative_to(os.path.realpath(private))):
            raise PolicyError(f"udocker's folder for {FILEBIND} ({source}) is outside its private folder "
                              f"({private}), where every account could reach what a booker leaves in it")
        return {**mount, "options": [*options, "rw"]}
    return {**mount, "options": [*options, "ro", "rro"]}


class PolicyError(Exception):
    """udocker's spec cannot be made safe: the start fails with this sentence."""


def shm_mount(mounts: list[dict[str, Any]], size: str) -> dict[str, Any]:
    """The shared-memory tmpfs as udocker's spec has it (size=2g there), with the booking's size."""
    current = next((m for m in mounts if m.get("destination") == SHM), None)
    options = (current or {}).get("options") or ["nosuid", "noexec", "nodev", "mode=1777"]
    return {"destination": SHM, "type": "tmpfs", "source": "shm",
            "options": [*(o for o in options if not o.startswith("size=")), f"size={size}"]}


def pump(source: int, log: Path, limit: int) -> None:
    """Copy `source` to `log` until its end, keeping at most `limit` bytes in `log` and `log`.1
    (the older half): what a booker writes there never fills the disk."""
    out = open(log, "ab")  # noqa: SIM115 - rotated below
    try:
        while chunk := os.read(source, CHUNK):
            if out.tell() + len(chunk) > limit // 2:
                out.close()
                os.replace(log, log.with_name(log.name + ".1"))
                out = open(log, "ab")  # noqa: SIM115
            out.write(chunk)
            out.flush()
    finally:
        out.close()


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    runc = os.environ.get(RUNC_ENV, "runc")
    policy_path = os.environ.get(POLICY_ENV)
    if not (policy_path and "run" in args and "--bundle" in args):
        os.execvp(runc, [runc, *args])  # noqa: S606 - argv list; `spec`, `--version`: udocker's own calls
    policy = json.loads(Path(policy_path).read_text())
    config_path = Path(args[args.index("--bundle") + 1]) / "config.json"
    try:
        config_path.write_text(json.dumps(apply_policy(json.loads(config_path.read_text()), policy)))
    except PolicyError as refused:
        Path(policy["log"]).write_text(f"gpubook: {refused}\n")
        return 1
    Path(policy["runc_id_file"]).write_text(args[-1])  # `run --bundle DIR ID`: how the engine finds it
    read_end, write_end = os.pipe()
    process = subprocess.Popen([runc, *args], stdin=subprocess.DEVNULL, stdout=write_end, stderr=write_end)
    os.close(write_end)
    pump(read_end, Path(policy["log"]), int(policy["log_max"]))
    return process.wait()


if __name__ == "__main__":
    sys.exit(main())
