"""The policy gpubook's runc wrapper applies to udocker's OCI spec, and the engine's refusals: no
udocker, runc or GPU needed (the fast lane)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gpubook.runtime.engines import engine_from, seccomp, udocker
from gpubook.runtime.engines.udocker_runc import PolicyError, apply_policy, pump
from gpubook.runtime.errors import EngineError
from tests.kits.oci_policy import isolation_problems

UDOCKER_SPEC = {  # what `runc spec --rootless` gives, as udocker edits it (R1)
    "process": {"user": {"uid": 0, "gid": 0}, "args": ["/.gpubook/entrypoint.sh"], "cwd": "/",
                "env": ["PATH=/usr/bin:/bin", "container_root=/home/daemon/.udocker/containers/x/ROOT",
                        "container_ruser=daemon", "GPUBOOK_USER=alice"],
                "capabilities": {k: ["CAP_AUDIT_WRITE", "CAP_KILL", "CAP_NET_BIND_SERVICE", "CAP_SYS_ADMIN"]
                                 for k in ("bounding", "effective", "permitted", "ambient", "inheritable")},
                "noNewPrivileges": False},
    "mounts": [{"destination": "/proc", "type": "proc", "source": "proc"},
               {"destination": "/sys", "type": "none", "source": "/sys",
                "options": ["rbind", "nosuid", "noexec", "nodev", "ro"]},
               {"destination": "/.bind_host_files", "type": "none",
                "source": "/home/daemon/.udocker/gpubook/tmp/udocker-14429-0f1e-BIND_FILES",
                "options": ["rbind", "nosuid", "nodev", "rw"]},
               {"destination": "/data/input", "type": "none", "source": "/srv/in", "options": ["rbind", "rw"]}],
    "linux": {"uidMappings": [{"containerID": 0, "hostID": 12345, "size": 1}],
              "namespaces": [{"type": "pid"}, {"type": "ipc"}, {"type": "uts"}, {"type": "mount"},
                             {"type": "user"}, {"type": "network"}],
              "maskedPaths": ["/proc/kcore"], "resources": {"devices": [{"allow": False, "access": "rwm"}]}},
}
POLICY = {"args": ["/.gpubook/entrypoint.sh", "sleep"],
          "mounts": [{"source": "/srv/in", "target": "/data/input", "read_only": True},
                     {"source": "/srv/out", "target": "/data/output", "read_only": False}],
          "devices": [{"host": "/dev/null", "container": "/dev/nvidia1"}],
          "masked": ["/proc/driver/nvidia/gpus/0000:07:00.0"],
          "env": [["GPUBOOK_AS_BOOKER", "/.gpubook-host/as-booker"]], "private": "/home/daemon/.udocker"}


def test_the_policy_makes_binds_read_only_and_keeps_one_capability() -> None:
    spec = apply_policy(UDOCKER_SPEC, POLICY)
    mounts = {m["destination"]: m for m in spec["mounts"]}
    assert "ro" in mounts["/data/input"]["options"] and "rw" not in mounts["/data/input"]["options"]
    assert "rw" in mounts["/data/output"]["options"] and "nosuid" in mounts["/data/output"]["options"]
    assert [m["destination"] for m in spec["mounts"]].count("/data/input") == 1  # udocker's rw bind replaced
    process = spec["process"]
    assert process["capabilities"]["bounding"] == ["CAP_SETFCAP"]
    assert process["capabilities"]["ambient"] == [] and process["noNewPrivileges"] is True
    assert process["args"] == POLICY["args"]
    assert not [e for e in process["env"] if e.startswith(("container_root=", "container_ruser="))]
    assert "GPUBOOK_USER=alice" in process["env"] and "GPUBOOK_AS_BOOKER=/.gpubook-host/as-booker" in process["env"]


def test_the_policy_maps_only_the_daemons_id_and_gives_only_the_booked_devices() -> None:
    spec = apply_policy(UDOCKER_SPEC, POLICY)
    linux = spec["linux"]
    assert linux["uidMappings"] == [{"containerID": 0, "hostID": os.getuid(), "size": 1}]
    assert linux["gidMappings"] == [{"containerID": 0, "hostID": os.getgid(), "size": 1}]
    assert [d["path"] for d in linux["devices"]] == ["/dev/nvidia1"]
    assert "/proc/driver/nvidia/gpus/0000:07:00.0" in linux["maskedPaths"] and "/proc/kcore" in linux["maskedPaths"]
    assert {ns["type"] for ns in linux["namespaces"]} == {"pid", "ipc", "uts", "mount", "user", "cgroup"}
    assert "resources" not in linux
    assert UDOCKER_SPEC["linux"]["uidMappings"][0]["hostID"] == 12345  # the input is not changed


def test_the_log_pump_keeps_two_halves(tmp_path: Path) -> None:
    read_end, write_end = os.pipe()
    log = tmp_path / "gpubook.log"
    pid = os.fork()
    if pid == 0:  # the writer: 3 MB in 1000-byte lines
        os.close(read_end)
        for _ in range(3000):
            os.write(write_end, b"x" * 999 + b"\n")
        os._exit(0)
    os.close(write_end)
    pump(read_end, log, 1_000_000)
    os.waitpid(pid, 0)
    sizes = [log.stat().st_size, log.with_name("gpubook.log.1").stat().st_size]
    assert all(0 < size <= 500_000 for size in sizes), sizes


def test_udocker_refuses_the_private_network_with_a_sentence() -> None:
    with pytest.raises(EngineError, match='no network namespaces: set \\[engine\\] network = "host"'):
        engine_from("udocker")
    assert engine_from("udocker", network="host").name == "udocker"


def test_the_as_booker_program_runs_the_host_unshare_with_the_bookers_ids() -> None:
    script = udocker.as_booker_script(2001, 2002)
    assert "--map-user=2001 --map-group=2002 --" in script and script.startswith("#!/bin/sh\nexec ")


def test_the_policy_gives_dev_shm_the_bookings_size() -> None:
    # udocker's spec makes /dev/shm 2 GiB (runc's own default: 64 MiB); the template's shm_size must win.
    runc_shm = {"destination": "/dev/shm", "type": "tmpfs", "source": "shm",
                "options": ["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"]}
    config = {**UDOCKER_SPEC, "mounts": [*UDOCKER_SPEC["mounts"], runc_shm]}
    shm = [m for m in apply_policy(config, {**POLICY, "shm_size": "8g"})["mounts"] if m["destination"] == "/dev/shm"]
    assert len(shm) == 1 and "size=8g" in shm[0]["options"] and "size=65536k" not in shm[0]["options"], shm
    assert {"nosuid", "nodev", "noexec"} <= set(shm[0]["options"])
    made = [m for m in apply_policy(UDOCKER_SPEC, {**POLICY, "shm_size": "1g"})["mounts"]
            if m["destination"] == "/dev/shm"]
    assert made and "size=1g" in made[0]["options"] and made[0]["type"] == "tmpfs", made
    unchanged = [m for m in apply_policy(config, POLICY)["mounts"] if m["destination"] == "/dev/shm"]
    assert unchanged == [runc_shm]


def test_udockers_own_binds_are_read_only_and_the_cgroup_tree_is_hidden() -> None:
    """Round 3, H2: /sys's read-only bind left the host's cgroup tree writable below it (udocker
    removes runc's own /sys/fs/cgroup mount). H1: udocker's FileBind folder stays writable (the
    entrypoint writes /etc/passwd through it) but only from udocker's private folder."""
    made = seccomp.oci_seccomp(seccomp.load_profile(), capabilities=("CAP_SETFCAP",))
    spec = apply_policy(UDOCKER_SPEC, {**POLICY, "seccomp": made})
    assert isolation_problems(spec, writable={"/data/output", "/.bind_host_files"}) == []
    mounts = {m["destination"]: m for m in spec["mounts"]}
    assert {"rw", "nosuid", "nodev"} <= set(mounts["/.bind_host_files"]["options"])
    assert {"ro", "rro", "noexec"} <= set(mounts["/sys"]["options"])
    assert mounts["/proc"] == UDOCKER_SPEC["mounts"][0]  # the kernel's, as it was
    # the check itself: udocker's spec as it came fails it
    found = isolation_problems({**UDOCKER_SPEC, "process": {**UDOCKER_SPEC["process"]}}, writable={"/data/output"})
    assert any("/sys" in p for p in found) and any("cgroup tree" in p for p in found)


def test_udockers_filebind_folder_in_tmp_fails_the_start_with_a_sentence() -> None:
    """Round 3, H1: in /tmp (udocker's default, TMPDIR) a set-uid file a booker made there was the
    daemon's account for any host login. The engine points udocker at its private folder; a spec
    that still names another place is refused, not run."""
    in_tmp = {**UDOCKER_SPEC, "mounts": [
        {"destination": "/.bind_host_files", "type": "none", "source": "/tmp/udocker-1-x-BIND_FILES",
         "options": ["rbind", "nosuid", "nodev", "rw"]}]}
    with pytest.raises(PolicyError, match=r"/tmp/udocker-1-x-BIND_FILES\) is outside its private folder"):
        apply_policy(in_tmp, POLICY)


def test_a_udocker_booking_gets_podmans_default_seccomp_filter_for_its_one_capability() -> None:
    """Round 3, L2: runc, given udocker's spec, set no seccomp filter: the kernel's whole surface
    (bpf, kexec_load, init_module, …). Podman's default profile, filtered for SETFCAP alone on this
    architecture: the namespace calls the booker's nested namespace needs stay allowed."""
    profile = seccomp.load_profile()
    made = seccomp.oci_seccomp(profile, capabilities=("CAP_SETFCAP",), machine="x86_64")
    assert made["defaultAction"] == "SCMP_ACT_ERRNO" and made["architectures"][0] == "SCMP_ARCH_X86_64"
    allowed = {name for rule in made["syscalls"] if rule["action"] == "SCMP_ACT_ALLOW" for name in rule["names"]}
    assert {"unshare", "clone", "mount", "read", "arch_prctl"} <= allowed  # the nested namespace, amd64's own
    assert not {"bpf", "perf_event_open", "add_key", "kexec_load", "init_module", "open_by_handle_at"} & allowed
    assert "arm_fadvise64_64" not in allowed  # another architecture's
    admin = seccomp.oci_seccomp(profile, capabilities=("CAP_SYS_ADMIN",), machine="x86_64")
    assert "bpf" in {n for r in admin["syscalls"] if r["action"] == "SCMP_ACT_ALLOW" for n in r["names"]}
    spec = apply_policy(UDOCKER_SPEC, {**POLICY, "seccomp": made})
    assert spec["linux"]["seccomp"] == made
    assert "seccomp" not in apply_policy(UDOCKER_SPEC, POLICY)["linux"]  # none asked, none made up
