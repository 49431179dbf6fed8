"""Resource limits, pure: the default memory share, the engines' argv, and which cgroup manager and
parent podman gets on a host (read from a cgroup v2 tree laid out as the kernel shows it: this
machine has cgroups v1, so the real v2 proof is tests/test_limits_cgroup2.py on the GPU host)."""

from __future__ import annotations

import os
import socket
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from gpubook.runtime import cgroups
from gpubook.runtime.engines import ContainerSpec, engine_from
from gpubook.runtime.errors import ConfigError
from gpubook.scheduler import config
from tests.kits.nvidia_fake_driver import proc_driver

GIB = 1 << 30
MIB = 1 << 20


def spec(*, gpus: tuple[int, ...] = (0,), memory: str | None = None) -> ContainerSpec:
    return ContainerSpec(booking_id="20261126-alice", user="alice", uid=2001, gid=2001, image="debian-ssh",
                         port=2222, end=datetime.now(UTC) + timedelta(hours=1), gpus=gpus, memory=memory)


# -- the default memory share --------------------------------------------------------------


def test_a_gpu_server_keeps_ten_percent_and_shares_the_rest_by_gpu() -> None:
    total = 1024 * GIB  # an 8-GPU server with 1 TiB: 10 % (102.4 GiB) is more than 4 GiB
    assert cgroups.reserve(total) == int(total * 0.10)
    one = cgroups.memory_share(total, booked=1, host_gpus=8)
    assert one == (total - int(total * 0.10)) // 8 // MIB * MIB
    assert cgroups.memory_share(total, booked=4, host_gpus=8) == (total - int(total * 0.10)) * 4 // 8 // MIB * MIB
    assert cgroups.memory_share(total, booked=8, host_gpus=8) <= total - cgroups.reserve(total)


def test_a_small_host_keeps_four_gib_but_never_more_than_half() -> None:
    assert cgroups.reserve(32 * GIB) == 4 * GIB
    assert cgroups.memory_share(32 * GIB, booked=1, host_gpus=2) == 14 * GIB
    assert cgroups.reserve(4 * GIB) == 2 * GIB  # a laptop-sized test host still gets a share
    assert cgroups.memory_share(4 * GIB, booked=2, host_gpus=16) == 256 * MIB


def test_a_host_without_gpus_gives_a_booking_the_whole_pool() -> None:
    assert cgroups.memory_share(32 * GIB, booked=0, host_gpus=0) == 28 * GIB
    assert cgroups.memory_share(32 * GIB, booked=2, host_gpus=0) == 28 * GIB  # [gpus] count without a driver


def test_host_facts_are_read_from_proc(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24683912 kB\nMemFree:        1000 kB\n")
    assert cgroups.mem_total(meminfo) == 24683912 * 1024
    assert cgroups.mem_total() > 0  # this host's own
    proc_driver(tmp_path)  # the driver's /proc/driver/nvidia/gpus with two GPUs
    assert cgroups.host_gpu_count(tmp_path / "proc/driver/nvidia/gpus") == 2
    assert cgroups.host_gpu_count(tmp_path / "absent") == 0


# -- the engines' argv ----------------------------------------------------------------------


@pytest.mark.parametrize("name", ["podman", "docker"])
def test_both_engines_pass_the_default_share_as_memory_and_swap(name: str) -> None:
    engine = engine_from(name, host_memory=32 * GIB, host_gpus=2, cgroup_manager="cgroupfs")
    argv = engine.run_args(spec(gpus=(1,)))  # type: ignore[attr-defined]
    assert argv[argv.index("--memory") + 1] == "14336m"
    assert argv[argv.index("--memory-swap") + 1] == "14336m"  # no swap beyond the limit
    assert argv[argv.index("--pids-limit") + 1] == "4096"  # [engine] pids_limit's default


@pytest.mark.parametrize("name", ["podman", "docker"])
def test_template_memory_and_engine_memory_come_first_and_none_turns_it_off(name: str) -> None:
    facts = {"host_memory": 32 * GIB, "host_gpus": 2, "cgroup_manager": "cgroupfs"}
    template = engine_from(name, memory="8g", **facts).run_args(spec(memory="2g"))  # type: ignore[attr-defined]
    assert template[template.index("--memory") + 1] == "2g"
    site = engine_from(name, memory="8g", **facts).run_args(spec())  # type: ignore[attr-defined]
    assert site[site.index("--memory") + 1] == "8g"
    off = engine_from(name, memory="none", pids_limit=0, **facts).run_args(spec())  # type: ignore[attr-defined]
    assert "--memory" not in off and "--memory-swap" not in off and "--pids-limit" not in off


def test_the_default_follows_this_hosts_memory() -> None:
    argv = engine_from("docker").run_args(spec(gpus=(0, 1)))  # type: ignore[attr-defined]
    expected = cgroups.memory_share(cgroups.mem_total(), booked=2, host_gpus=cgroups.host_gpu_count())
    assert argv[argv.index("--memory") + 1] == f"{expected // MIB}m"


def test_config_takes_none_and_refuses_other_words(tmp_path: Path) -> None:
    path = tmp_path / "gpubook.toml"
    calendar = '[[calendar]]\nurl = "http://127.0.0.1:5232/lab/devbox1/"\n'
    path.write_text(calendar + '[engine]\nmemory = "none"\n')
    assert config.load(path).engine.memory == "none"
    path.write_text(calendar)
    assert config.load(path).engine.memory is None  # the default share
    path.write_text(calendar + '[engine]\nmemory = "lots"\n')
    with pytest.raises(ConfigError, match=r"engine.memory: must be like '512m' or '32g', or \"none\""):
        config.load(path)


# -- where rootless podman puts containers ---------------------------------------------------


def v2_tree(root: Path, *, subtree_control: str = "cpu memory pids", top: str = "cpuset cpu io memory pids") -> Path:
    """A cgroup v2 hierarchy as `make_delegated_subtree` leaves it, owned by this test's uid."""
    (root / "gpubook" / "daemon").mkdir(parents=True)
    (root / "cgroup.controllers").write_text("cpuset cpu io memory hugetlb pids rdma misc\n")
    (root / "cgroup.subtree_control").write_text(top + "\n")
    folder = root / "gpubook"
    (folder / "cgroup.controllers").write_text(top + "\n")
    (folder / "cgroup.subtree_control").write_text(subtree_control + "\n")
    (folder / "cgroup.procs").write_text("")
    return folder


def test_a_delegated_subtree_puts_containers_beside_the_daemon(tmp_path: Path) -> None:
    v2_tree(tmp_path)
    assert cgroups.delegation_problem(os.geteuid(), root=tmp_path, own="/gpubook/daemon") is None
    placed = cgroups.placement(euid=os.geteuid() or 1000, env={}, root=tmp_path, version=2, own="/gpubook/daemon")
    if os.geteuid() == 0:  # the tree belongs to root here: as root, limits hold anyway
        placed = cgroups.placement(euid=1000, env={}, root=tmp_path, version=2, own="/gpubook/daemon")
        assert not placed.enforced and "uid 0" in placed.how
        return
    assert placed == cgroups.Placement("cgroupfs", "/gpubook/bookings", True,
                                       "containers go under the delegated cgroup /gpubook/bookings")


def test_run_outside_the_subtree_the_limits_judged_are_those_the_containers_get(tmp_path: Path) -> None:
    """Issue 41: doctor (or status) run from an admin's shell, outside the daemon's leaf, said the limits
    were NOT enforced on a host where `gpubook setup` had delegated the subtree and they held. Judged
    from the subtree the containers go under, not from the shell's own cgroup."""
    uid = os.geteuid() or 1000
    v2_tree(tmp_path)
    if os.geteuid() == 0:  # the tree must belong to the account judged
        for path in (tmp_path / "gpubook", tmp_path / "gpubook" / "cgroup.procs",
                     tmp_path / "gpubook" / "cgroup.subtree_control"):
            os.chown(path, uid, uid)
    outside = cgroups.placement(euid=uid, env={}, root=tmp_path, version=2, own="/user.slice")
    assert outside.enforced and outside.parent == "/gpubook/bookings", outside
    assert "this process runs outside it" in outside.how
    # Without that subtree (or not the account's), the shell's own cgroup decides, as before.
    (tmp_path / "gpubook" / "cgroup.subtree_control").write_text("memory\n")
    missing = cgroups.placement(euid=uid, env={}, root=tmp_path, version=2, own="/user.slice")
    assert not missing.enforced and "is not inside a subtree its account owns" in missing.how


def test_delegation_problems_name_the_file_and_the_missing_controllers(tmp_path: Path) -> None:
    uid = os.geteuid()
    v2_tree(tmp_path, subtree_control="memory")
    assert cgroups.delegation_problem(uid, root=tmp_path, own="/gpubook/daemon") == (
        f"pids missing from {tmp_path}/gpubook/cgroup.subtree_control")
    (tmp_path / "gpubook" / "cgroup.controllers").write_text("memory\n")
    assert cgroups.delegation_problem(uid, root=tmp_path, own="/gpubook/daemon") == (
        f"pids missing from {tmp_path}/cgroup.subtree_control")
    assert f"belongs to uid {uid}, not to this account (uid {uid + 1})" in (
        cgroups.delegation_problem(uid + 1, root=tmp_path, own="/gpubook/daemon") or "")
    assert "is not inside a subtree its account owns" in (
        cgroups.delegation_problem(uid, root=tmp_path, own="/user.slice") or "")
    assert "is not a cgroup v2 hierarchy" in (cgroups.delegation_problem(uid, root=tmp_path / "gpubook" / "daemon",
                                                                         own="/gpubook/daemon") or "")


def test_cgroups_v1_and_root_need_no_delegation() -> None:
    v1 = cgroups.placement(euid=1000, env={}, version=1)
    assert (v1.manager, v1.parent, v1.enforced) == ("cgroupfs", None, False) and "cgroups v1" in v1.how
    assert cgroups.placement(euid=0, env={}, version=1).enforced


def test_a_user_systemd_manager_that_delegates_gets_the_systemd_manager(tmp_path: Path) -> None:
    service = tmp_path / "user.slice" / "user-1000.slice" / "user@1000.service"
    service.mkdir(parents=True)
    (tmp_path / "cgroup.controllers").write_text("cpu memory pids\n")
    (service / "cgroup.controllers").write_text("cpu memory pids\n")
    runtime = tmp_path / "run"
    runtime.mkdir()
    env = {"XDG_RUNTIME_DIR": str(runtime)}
    no_bus = cgroups.placement(euid=1000, env=env, root=tmp_path, version=2, own="/user.slice")
    assert not no_bus.enforced and "no user systemd manager answers" in no_bus.how
    with socket.socket(socket.AF_UNIX) as bus:
        bus.bind(str(runtime / "bus"))
        placed = cgroups.placement(euid=1000, env=env, root=tmp_path, version=2, own="/user.slice")
        assert (placed.manager, placed.parent, placed.enforced) == ("systemd", None, True)
        (service / "cgroup.controllers").write_text("memory\n")
        undelegated = cgroups.placement(euid=1000, env=env, root=tmp_path, version=2, own="/user.slice")
        assert not undelegated.enforced and "systemd delegates no pids to user@1000.service" in undelegated.how


def test_the_delegation_commands_match_the_docs() -> None:
    commands = cgroups.delegation_commands("gpubook")
    text = (Path(__file__).resolve().parents[1] / "docs" / "guides" / "limits.md").read_text()
    for command in commands:
        assert command in text, command


def test_podman_on_this_host_says_whether_limits_hold() -> None:
    """This machine: cgroups v1, so a rootless engine says NOT enforced and why; root: enforced."""
    engine = engine_from("podman")
    check = engine.limits_check()  # type: ignore[attr-defined]
    if os.geteuid() == 0:
        assert check.ok and "enforced" in check.detail
    elif cgroups.cgroup_version() == 1:
        assert not check.ok and "NOT enforced" in check.detail and "cgroups v1" in check.detail
        assert check.level == "warn" and "docs/guides/limits.md" in (check.fix or "")  # only a reboot helps
