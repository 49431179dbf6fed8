"""`gpubook setup`'s plan for hosts described as facts: what --dry-run prints, with no host touched.

The steps are pure functions of setup_host.Facts, so each host state here is a plain value; the
real run on this machine (a fresh account, the wheel, a booking through it) is tests/test_install.py.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from gpubook.scheduler.commands import setup, setup_host, setup_steps
from gpubook.scheduler.commands.setup_host import (
    DELEGATE_CONF,
    UDEV_RULE,
    Account,
    AppendLine,
    DataRoot,
    Facts,
    Run,
    SetupError,
    Write,
)

ROOT = Path(__file__).resolve().parents[1]
NAME, DATA = "gpubook", Path("/srv/gpubook")
OTHERS = "gpubook-test:100000:65536\nlab:165536:65536\n"
PACKAGED_UNIT = (ROOT / "gpubook" / "systemd" / "gpubook.service").read_text()
BINARY = Path("/opt/gpubook/venv/bin/gpubook")
OPTIONS = setup_steps.Options(account=NAME, data_root=DATA, binary=BINARY, config_text="[host]\n",
                              image="localhost/gpubook/debian-ssh:12", home=Path("/home/gpubook"))

# A Debian 12 machine as installed: no gpubook account, a data folder nowhere, /dev/net/tun 0600.
FRESH = Facts(account=None, subids=(OTHERS, OTHERS), systemd=True, lingering=False, udev=True,
              data_root=DataRoot(exists=False, owner=None, nosuid_nodev=False), fstab="# static file system info\n",
              tun_mode=0o600, udev_rule=False, delegate_conf=None, cgroup_v2=True, subtree_owner=None,
              runtime_dir=False, storage_conf=None, stores=(), config=False, unit=None, unit_enabled=False,
              mmdebstrap=True, image=False)
ACCOUNT = Account(NAME, 1001, 1001, Path("/home/gpubook"))
MINE = f"{NAME}:231072:65536\n"
# The same machine after `gpubook setup`: what a second run finds.
SET_UP = dataclasses.replace(
    FRESH, account=ACCOUNT, subids=(OTHERS + MINE, OTHERS + MINE), lingering=True, runtime_dir=True,
    subtree_owner=1001, data_root=DataRoot(exists=True, owner=1001, nosuid_nodev=True),
    fstab=FRESH.fstab + setup_steps.fstab_line(DATA),
    tun_mode=0o666, udev_rule=True, delegate_conf=setup_steps.DELEGATE_TEXT, storage_conf=setup_steps.STORAGE_TEXT,
    stores=("overlay",), config=True, unit=setup_steps.unit_text(PACKAGED_UNIT, BINARY), unit_enabled=True, image=True)
NO_SYSTEMD = {"systemd": False, "udev": False, "lingering": False, "unit_enabled": False}


@pytest.fixture(autouse=True)
def without_cgroups_module(monkeypatch: pytest.MonkeyPatch) -> None:
    """Plans as by a gpubook without gpubook.runtime.cgroups' subtree functions, unless a test gives them."""
    monkeypatch.setattr(setup_steps, "delegation_module", lambda: None)


def plan(facts: Facts) -> dict[str, setup_steps.Step]:
    return {step.name: step for step in setup_steps.steps(facts, OPTIONS)}


def shell(step: setup_steps.Step) -> list[str]:
    return [action.shell() for action in step.actions]


def test_a_fresh_systemd_host_gets_every_step_in_order() -> None:
    steps = plan(FRESH)
    assert list(steps) == ["account", "subids", "linger", "data_root", "data_root mount", "storage.conf",
                           "/dev/net/tun", "cgroup delegation", "config", "image", "unit"]
    assert all(step.state == "change" for step in steps.values()), steps
    assert shell(steps["account"]) == ["useradd --create-home --shell /bin/bash --comment 'gpubook daemon' gpubook"]
    # A range after every other one, in both files: no two accounts' containers share host ids.
    assert shell(steps["subids"]) == ["usermod --add-subuids 231072-296607 --add-subgids 231072-296607 gpubook"]
    assert shell(steps["linger"]) == ["loginctl enable-linger gpubook"]
    assert shell(steps["data_root mount"]) == [
        "mount --bind /srv/gpubook /srv/gpubook", "mount -o remount,bind,nosuid,nodev /srv/gpubook",
        "echo '/srv/gpubook /srv/gpubook none bind,nosuid,nodev 0 0' >> /etc/fstab"]
    assert steps["/dev/net/tun"].actions == (Run(("chmod", "0666", "/dev/net/tun")),
                                             Write(UDEV_RULE, 'KERNEL=="tun", MODE="0666"\n'))
    delegate = Write(DELEGATE_CONF, "[Service]\nDelegate=cpu cpuset io memory pids\n")
    assert steps["cgroup delegation"].actions == (delegate, Run(("systemctl", "daemon-reload")))
    assert shell(steps["unit"])[-1] == "systemctl --user -M gpubook@ enable --now gpubook"


def test_files_in_the_accounts_home_are_written_by_the_account_with_their_mode() -> None:
    steps = plan(FRESH)
    made, filled = steps["config"].actions
    assert isinstance(made, Run) and isinstance(filled, Run)
    assert made.argv[:3] == ("runuser", "-u", NAME) and made.argv[-5:] == (
        "install", "-D", "-m", "0600", "/dev/null", "/home/gpubook/.config/gpubook/gpubook.toml")[-5:]
    assert "-m" in made.argv and made.argv[made.argv.index("-m") + 1] == "0600"  # mode set before the text
    assert filled.argv[-2:] == ("tee", "/home/gpubook/.config/gpubook/gpubook.toml") and filled.stdin == "[host]\n"
    assert "PYTHONPATH" not in " ".join(filled.argv) and "env" in filled.argv  # a clean environment
    storage = steps["storage.conf"].actions[1]
    assert isinstance(storage, Run) and storage.stdin == '[storage]\ndriver = "overlay"\n'
    image = steps["image"].actions[0]
    assert isinstance(image, Run) and image.argv[-6:] == (
        str(BINARY), "templates", "--config", "/home/gpubook/.config/gpubook/gpubook.toml", "build", "debian-ssh")


def test_a_host_without_systemd_gets_a_runtime_folder_and_the_command_that_starts_the_daemon() -> None:
    facts = dataclasses.replace(FRESH, account=ACCOUNT, **NO_SYSTEMD)
    steps = plan(facts)
    assert shell(steps["linger"]) == ["install -d -m 0700 -o gpubook -g gpubook /run/user/1001"]
    assert "systemd is not PID 1" in steps["linger"].text
    assert "no udev runs here" in steps["/dev/net/tun"].text and len(steps["/dev/net/tun"].actions) == 1
    assert steps["cgroup delegation"].state == "skipped" and steps["cgroup delegation"].actions == ()
    assert "limits are not enforced" in steps["cgroup delegation"].text
    unit = steps["unit"]
    assert not any("systemctl" in line for line in shell(unit))
    assert f"XDG_RUNTIME_DIR=/run/user/1001 LANG=C.UTF-8 {BINARY} run --config /home/gpubook/.config/gpubook/" \
           "gpubook.toml" in unit.text


class Cgroups:
    """Stands in for gpubook.runtime.cgroups' two functions setup calls (the limits work, another branch)."""

    def __init__(self) -> None:
        self.made: list[tuple[int, int]] = []

    def delegation_commands(self, user: str) -> list[str]:
        return ["mkdir -p /sys/fs/cgroup/gpubook/daemon", f"chown {user}: /sys/fs/cgroup/gpubook"]

    def make_delegated_subtree(self, uid: int, gid: int) -> list[str]:
        self.made.append((uid, gid))
        return ["made /sys/fs/cgroup/gpubook", "gave it to the account"]


def test_without_systemd_a_delegated_subtree_comes_from_gpubooks_own_cgroups_code(
        monkeypatch: pytest.MonkeyPatch) -> None:
    cgroups = Cgroups()
    monkeypatch.setattr(setup_steps, "delegation_module", lambda: cgroups)
    facts = dataclasses.replace(FRESH, account=ACCOUNT, **NO_SYSTEMD)
    steps = plan(facts)
    step = steps["cgroup delegation"]
    assert step.state == "change" and len(step.actions) == 1
    assert step.actions[0].shell() == ("mkdir -p /sys/fs/cgroup/gpubook/daemon\n"
                                       "  $ chown gpubook: /sys/fs/cgroup/gpubook")
    assert setup_host.perform(step.actions[0]) == "made /sys/fs/cgroup/gpubook; gave it to the account"
    assert cgroups.made == [(1001, 1001)]
    # The daemon started by hand goes into the subtree's leaf, where its containers' limits hold.
    assert "systemd is not PID 1 here: start the daemon as gpubook yourself: sh -c 'echo $$ > " \
           "/sys/fs/cgroup/gpubook/daemon/cgroup.procs && exec \"$@\"' sh runuser -u gpubook -- " in steps["unit"].text
    assert plan(dataclasses.replace(facts, subtree_owner=1001))["cgroup delegation"].state == "already"
    v1 = plan(dataclasses.replace(facts, cgroup_v2=False))
    assert v1["cgroup delegation"].state == "skipped" and "cgroups v1" in v1["cgroup delegation"].text
    assert "sh -c" not in v1["unit"].text


def test_a_dry_run_before_the_account_exists_names_its_uid_for_the_shell() -> None:
    facts = dataclasses.replace(FRESH, **NO_SYSTEMD)
    assert shell(plan(facts)["linger"]) == ['install -d -m 0700 -o gpubook -g gpubook "/run/user/$(id -u gpubook)"']


@pytest.mark.parametrize("systemd", [True, False])
def test_a_second_run_changes_nothing(systemd: bool) -> None:
    facts = SET_UP if systemd else dataclasses.replace(SET_UP, **NO_SYSTEMD)
    steps = plan(facts)
    assert all(step.actions == () for step in steps.values()), [s for s in steps.values() if s.actions]
    expected_skipped = set() if systemd else {"linger", "cgroup delegation", "unit"}
    assert {name for name, step in steps.items() if step.state == "skipped"} == expected_skipped
    assert all(step.state == "already" for name, step in steps.items() if name not in expected_skipped)


def test_subids_partly_there_get_only_the_missing_half_after_every_range() -> None:
    facts = dataclasses.replace(SET_UP, subids=(OTHERS + MINE, OTHERS + "far:900000:65536\n"))
    step = plan(facts)["subids"]
    assert shell(step) == ["usermod --add-subgids 965536-1031071 gpubook"]


def test_an_account_whose_subids_overlap_another_accounts_needs_the_admin() -> None:
    overlapping = OTHERS + f"{NAME}:200000:65536\n"
    step = plan(dataclasses.replace(SET_UP, subids=(overlapping, overlapping)))["subids"]
    assert step.state == "attention" and step.actions == ()
    assert "overlap those of lab" in step.text


def test_a_too_small_subid_range_counts_as_missing() -> None:
    small = OTHERS + f"{NAME}:231072:1000\n"
    step = plan(dataclasses.replace(SET_UP, subids=(small, small)))["subids"]
    assert shell(step) == ["usermod --add-subuids 232072-297607 --add-subgids 232072-297607 gpubook"]


def test_the_data_root_mount() -> None:
    line = setup_steps.fstab_line(DATA)
    after_reboot_unmounted = dataclasses.replace(SET_UP, data_root=DataRoot(True, 1001, nosuid_nodev=False))
    assert shell(plan(after_reboot_unmounted)["data_root mount"]) == ["mount /srv/gpubook"]
    assert AppendLine.__name__ not in str(plan(after_reboot_unmounted)["data_root mount"].actions)
    unsafe_line = dataclasses.replace(after_reboot_unmounted, fstab="/dev/sdb1 /srv/gpubook ext4 defaults 0 2\n")
    step = plan(unsafe_line)["data_root mount"]
    assert step.state == "attention" and step.actions == () and "without nosuid,nodev" in step.text
    # A data_root on a nosuid,nodev mount of the admin's own (a tmpfs, a whole disk): left alone.
    own_mount = dataclasses.replace(SET_UP, fstab="/dev/sdb1 /srv ext4 nosuid,nodev 0 2\n")
    assert plan(own_mount)["data_root mount"].state == "already"
    assert setup_steps.fstab_entry(f"# {line}\n", DATA) is None  # a commented-out line mounts nothing
    wrong_owner = dataclasses.replace(SET_UP, data_root=DataRoot(True, 0, nosuid_nodev=True))
    assert shell(plan(wrong_owner)["data_root"]) == ["chown -h gpubook: /srv/gpubook"]  # never a link's target


def test_storage_conf_and_an_existing_vfs_store() -> None:
    vfs_store = plan(dataclasses.replace(FRESH, stores=("vfs",)))["storage.conf"]
    assert vfs_store.state == "change" and "podman system reset" in vfs_store.text
    says_vfs = plan(dataclasses.replace(SET_UP, storage_conf='[storage]\ndriver = "vfs"\n'))["storage.conf"]
    assert says_vfs.state == "attention" and says_vfs.actions == () and "driver vfs" in says_vfs.text
    overlay_over_vfs = plan(dataclasses.replace(SET_UP, stores=("vfs", "overlay")))["storage.conf"]
    assert overlay_over_vfs.state == "attention" and "podman system reset" in overlay_over_vfs.text


def test_missing_pieces_are_named_with_their_fix() -> None:
    no_tun = plan(dataclasses.replace(SET_UP, tun_mode=None))["/dev/net/tun"]
    assert no_tun.state == "attention" and "modprobe tun" in no_tun.text
    no_mmdebstrap = plan(dataclasses.replace(SET_UP, image=False, mmdebstrap=False))["image"]
    assert no_mmdebstrap.state == "attention" and "apt-get install mmdebstrap" in no_mmdebstrap.text
    # Offline, the way without mmdebstrap is named: an archive made elsewhere, loaded as the account.
    assert "podman save -o debian-ssh.tar localhost/gpubook/debian-ssh:12" in no_mmdebstrap.text
    assert "gpubook templates import debian-ssh debian-ssh.tar" in no_mmdebstrap.text
    edited_unit = plan(dataclasses.replace(SET_UP, unit="[Service]\nExecStart=/elsewhere\n"))["unit"]
    assert edited_unit.state == "attention" and edited_unit.actions == ()
    other_delegation = plan(dataclasses.replace(SET_UP, delegate_conf="[Service]\nDelegate=yes\n"))
    assert other_delegation["cgroup delegation"].state == "attention"


def test_the_installed_unit_runs_the_installed_gpubook() -> None:
    text = setup_steps.unit_text(PACKAGED_UNIT, Path("/opt/lab venv/bin/gpubook"))
    exec_lines = [line for line in text.splitlines() if line.startswith("ExecStart=")]
    assert exec_lines == ["ExecStart=/opt/lab venv/bin/gpubook run --config %E/gpubook/gpubook.toml"]
    assert text.replace(exec_lines[0], "") == PACKAGED_UNIT.replace(
        next(line for line in PACKAGED_UNIT.splitlines() if line.startswith("ExecStart=")), "")
    # No Documentation= to a path no install makes (it pointed into /opt/gpubook before).
    assert "/opt/gpubook" not in PACKAGED_UNIT


@pytest.mark.parametrize(("text", "expected"), [
    ('[host]\nname = "a"\n', '[host]\nname = "a"\n\n[storage]\ndata_root = "/srv/gpubook"\n'),
    ('[storage]\nquota_gb = 5\n[ssh]\nport_min = 2200\n',
     '[storage]\ndata_root = "/srv/gpubook"\nquota_gb = 5\n[ssh]\nport_min = 2200\n'),
    ('[storage]\ndata_root = "/data"  # old\npersistent_home = true\n',
     '[storage]\ndata_root = "/srv/gpubook"\npersistent_home = true\n'),
    ('# [storage]\n# data_root = "/x"\n', '# [storage]\n# data_root = "/x"\n\n[storage]\ndata_root = "/srv/gpubook"\n'),
])
def test_the_config_gets_the_data_root(text: str, expected: str) -> None:
    assert setup_steps.with_data_root(text, DATA, source="f.toml") == expected


def test_a_config_that_is_not_toml_is_refused_in_one_sentence() -> None:
    with pytest.raises(SetupError, match=r"^f.toml is not valid TOML"):
        setup_steps.with_data_root("[storage\n", DATA, source="f.toml")
    with pytest.raises(SetupError, match=r"cannot set \[storage\] data_root"):
        setup_steps.with_data_root('storage = {quota_gb = 5}\n', DATA, source="f.toml")


def test_the_packaged_example_becomes_a_valid_config(tmp_path: Path) -> None:
    text = setup.config_text(None, DATA)
    assert 'data_root = "/srv/gpubook"' in text
    wrong = tmp_path / "wrong.toml"
    wrong.write_text('[host]\nname = "x"\n[enigne]\nname = "podman"\n')
    with pytest.raises(SetupError, match="is not a valid gpubook config"):
        setup.config_text(wrong, DATA)


def test_input_is_checked_before_anything_is_done() -> None:
    with pytest.raises(SetupError, match="must run as root; --dry-run shows"):
        setup.check_input(account=NAME, data_root="/srv/gpubook", euid=1000, dry_run=False)
    assert setup.check_input(account=NAME, data_root="/srv/gpubook/", euid=1000, dry_run=True) == DATA
    for account in ("Gpubook", "root", "a b", "-x", "x" * 33):
        with pytest.raises(SetupError, match="--user"):
            setup.check_input(account=account, data_root="/srv/gpubook", euid=0, dry_run=False)
    for root in ("srv/gpubook", "/", "/srv/gpu book"):
        with pytest.raises(SetupError, match="--data-root"):
            setup.check_input(account=NAME, data_root=root, euid=0, dry_run=False)


def test_a_gpubook_other_accounts_cannot_run_is_refused() -> None:
    with tempfile.TemporaryDirectory(dir="/tmp") as folder:  # /tmp itself is open to all; pytest's tmp_path is not
        closed = Path(folder) / "root-only"
        (closed / "bin").mkdir(parents=True)
        binary = closed / "bin" / "gpubook"
        binary.write_text("#!/usr/bin/python3\n")
        binary.chmod(0o755)
        Path(folder).chmod(0o755)
        closed.chmod(0o700)
        with pytest.raises(SetupError, match=f"cannot be run by other accounts \\({closed} is closed"):
            setup.check_binary(binary)
        closed.chmod(0o755)
        setup.check_binary(binary)
        binary.write_text(f"#!{closed}/python\n")  # its interpreter is not there
        with pytest.raises(SetupError, match="which does not exist"):
            setup.check_binary(binary)


def test_dry_run_on_this_host_changes_nothing() -> None:
    """The real command, from the source tree, by whoever runs the tests (root or not)."""
    before = Path("/etc/fstab").read_text(), Path("/etc/subuid").read_text()
    result = subprocess.run([sys.executable, "-m", "gpubook", "setup", "--user", "gpubook-setup-never",
                             "--data-root", "/srv/gpubook-setup-never", "--dry-run"],
                            capture_output=True, text=True, timeout=120, cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "account: would change: make gpubook-setup-never" in result.stdout
    assert "gpubook setup: dry run, nothing was changed" in result.stdout
    assert (Path("/etc/fstab").read_text(), Path("/etc/subuid").read_text()) == before
    assert not Path("/srv/gpubook-setup-never").exists() and not Path("/home/gpubook-setup-never").exists()


def test_setup_runs_its_doctor_in_the_daemon_leaf_where_the_account_owns_one(tmp_path: Path) -> None:
    """On a host without systemd the daemon runs in the delegated subtree's leaf; a doctor run from
    root's cgroup said "limits NOT enforced" there although the daemon's bookings had them."""
    from gpubook.scheduler.commands import setup

    assert setup.daemon_leaf(os.getuid(), root=tmp_path) is None  # no subtree: doctor runs where it is
    leaf = tmp_path / "gpubook" / "daemon"
    leaf.mkdir(parents=True)
    assert setup.daemon_leaf(os.getuid(), root=tmp_path) == leaf
    assert setup.daemon_leaf(os.getuid() + 1, root=tmp_path) is None  # another account's subtree
    assert setup.daemon_leaf(None, root=tmp_path) is None  # the account does not exist yet (dry run)


def test_a_data_root_that_is_a_link_or_under_a_folder_others_control_is_refused(tmp_path: Path) -> None:
    """Round 3, M5: setup (root, run again after reboots) chowned and mounted what data_root's link
    pointed to: the account, owning the folder above, swapped data_root for a link to /etc and the
    next setup gave /etc to it. A scratch tree; the folders above tmp_path are this test's account's,
    counted as root's where the case is not about their owner."""
    mine = frozenset({0, os.geteuid()})
    base = tmp_path / "lab"
    base.mkdir()
    base.chmod(0o755)
    etc = base / "etc"
    etc.mkdir()
    home = base / "home"
    home.mkdir()
    if os.geteuid() == 0:
        os.chown(home, 65534, 65534)  # the account's own folder (nobody here; as an account, its own)
    (home / "data").symlink_to(etc)
    with pytest.raises(SetupError, match=r"the folder /.* above it is (owned by uid [1-9][0-9]*|writable by others): "):
        setup.check_input(account=NAME, data_root=str(home / "data"), euid=0, dry_run=False)
    link = base / "data"
    link.symlink_to(etc)
    assert "/lab/data is a symbolic link; give the real path" in str(setup_host.data_root_problem(link, owners=mine))
    assert "/lab/data is a symbolic link" in str(setup_host.data_root_problem(link / "x", owners=mine))
    shared = base / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # a lab folder any account may write
    assert "shared above it is writable by others" in str(setup_host.data_root_problem(shared / "d", owners=mine))
    assert setup_host.data_root_problem(base / "fine", owners=mine) is None
    with pytest.raises(SetupError, match="symbolic link|above it is (owned|writable)"):  # again before each step
        setup.facts_for(dataclasses.replace(OPTIONS, data_root=home / "data"), setup_steps.step_data_root)
    assert etc.stat().st_uid == os.geteuid()  # nothing was given away


def test_setup_reads_no_fifo_link_or_endless_file_of_the_accounts(tmp_path: Path) -> None:
    """Round 3, L6: setup read the account's storage.conf and unit as root: a FIFO there hung it, a
    link to /dev/zero ate its memory. Each is refused with a sentence; an ordinary file is read."""
    fifo = tmp_path / "storage.conf"
    os.mkfifo(fifo)
    with pytest.raises(SetupError, match="is not a regular file"):
        setup_host.read_text(fifo)
    zero = tmp_path / "gpubook.service"
    zero.symlink_to("/dev/zero")
    with pytest.raises(SetupError, match="is a symbolic link"):
        setup_host.read_text(zero)
    big = tmp_path / "big.conf"
    big.write_bytes(b"#" * (setup_host.READ_LIMIT + 1))
    with pytest.raises(SetupError, match=f"is larger than {setup_host.READ_LIMIT // 1024} KiB"):
        setup_host.read_text(big)
    fine = tmp_path / "fine.conf"
    fine.write_text('[storage]\ndriver = "overlay"\n')
    assert setup_host.read_text(fine) == '[storage]\ndriver = "overlay"\n'
    assert setup_host.read_text(tmp_path / "absent") is None
