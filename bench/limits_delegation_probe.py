"""The delegated subtree on a real cgroup v2 host, without podman: run as root there.

Root makes the subtree with `cgroups.make_delegated_subtree` for an unprivileged uid and starts a
child in its daemon leaf, which drops to that uid. As the uid, the child then does what podman and
runc do for a container in cgroupfs mode with --cgroup-parent (runtime/cgroups.py says where each
comes from): `cgroups.placement` must find the subtree, `prepare_bookings` makes PARENT and enables
the controllers, two container-like cgroups get memory.max / memory.swap.max / pids.max, and a
process moves itself into each (the kernel's common-ancestor rule). A 1 GiB hog in the first must
be OOM-killed at its 256 MiB; a 64 MiB process in the second must finish; a fork bomb in the
first must stop at pids.max. Prints one JSON object; exit 0 only when all of that held.

    python3 bench/limits_delegation_probe.py [UID]     # from the repository root, as root
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpubook.runtime import cgroups  # noqa: E402

NAME = "gpubook-probe"
LIMIT = 256 << 20
PIDS = 50


def as_account(uid: int) -> dict[str, object]:
    placed = cgroups.placement(euid=uid, env={})
    result: dict[str, object] = {"own": cgroups.own_cgroup(), "placement": placed.__dict__,
                                 "problem": cgroups.delegation_problem(uid)}
    if placed.parent is None:
        return result
    cgroups.prepare_bookings(placed.parent)
    parent = cgroups.ROOT / placed.parent.lstrip("/")
    made = {}
    for name in ("libpod-a", "libpod-b"):
        folder = parent / name
        folder.mkdir(exist_ok=True)
        (folder / "memory.max").write_text(str(LIMIT))
        (folder / "memory.swap.max").write_text("0")
        (folder / "pids.max").write_text(str(PIDS))
        made[name] = folder

    def into(folder: Path):  # runc writes the container's init into its cgroup.procs the same way
        return lambda: (folder / "cgroup.procs").write_text(str(os.getpid()))

    hog = subprocess.run([sys.executable, "-c", "b = bytearray(1 << 30); b[::4096] = b'x' * len(b[::4096])"],
                         preexec_fn=into(made["libpod-a"]), capture_output=True, timeout=120)  # noqa: PLW1509
    other = subprocess.run([sys.executable, "-c", "b = bytearray(64 << 20); b[::4096] = b'x' * len(b[::4096]); "
                            "print('fine')"], preexec_fn=into(made["libpod-b"]),  # noqa: PLW1509
                           capture_output=True, text=True, timeout=120)
    bomb = subprocess.run(["sh", "-c", "i=0; while [ $i -lt 200 ]; do sleep 3 & i=$((i+1)); done; wait"],
                          preexec_fn=into(made["libpod-a"]), capture_output=True, text=True,  # noqa: PLW1509
                          timeout=120)
    events = dict(line.split() for line in (made["libpod-a"] / "memory.events").read_text().splitlines())
    pids_events = dict(line.split() for line in (made["libpod-a"] / "pids.events").read_text().splitlines())
    result.update(hog_returncode=hog.returncode, oom_kill=int(events.get("oom_kill", 0)),
                  other=other.stdout.strip(), other_returncode=other.returncode,
                  pids_max_hits=int(pids_events.get("max", 0)), bomb_stderr=bomb.stderr[-200:],
                  memory_max=(made["libpod-a"] / "memory.max").read_text().strip())
    result["ok"] = (hog.returncode == -9 and result["oom_kill"] >= 1 and other.stdout.strip() == "fine"
                    and result["pids_max_hits"] >= 1)
    return result


def main() -> int:
    uid = int(sys.argv[1]) if len(sys.argv) > 1 else 4242
    steps = cgroups.make_delegated_subtree(uid, uid, name=NAME)
    read, write = os.pipe()
    child = os.fork()
    if child == 0:
        os.close(read)
        try:
            cgroups.enter(os.getpid(), name=NAME)
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            os.chdir("/")
            out = as_account(uid)
        except Exception as error:  # noqa: BLE001 - reported, not raised, across the fork
            out = {"error": f"{type(error).__name__}: {error}"}
        os.write(write, json.dumps(out).encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        text = pipe.read()
    os.waitpid(child, 0)
    report = {"steps": steps, "commands": cgroups.delegation_commands(str(uid), name=NAME),
              "account": json.loads(text or "{}")}
    for folder in sorted((cgroups.ROOT / NAME).rglob("*"), key=lambda p: -len(p.parts)):
        if folder.is_dir():
            folder.rmdir()
    (cgroups.ROOT / NAME).rmdir()
    print(json.dumps(report, indent=2))
    return 0 if report["account"].get("ok") else 1


if __name__ == "__main__":
    sys.exit(main())
