"""Data folders: made on first use, names and paths checked, nothing made on bad input."""

from __future__ import annotations

import os
from datetime import UTC, datetime, timedelta
from pathlib import Path

import paramiko
import pytest

from gpubook.runtime.data import storage
from gpubook.runtime.engines import engine_from
from gpubook.runtime.errors import StorageError
from gpubook.runtime.templates.catalog import get_template
from gpubook.scheduler.hosts import Booker, StartRequest
from gpubook.scheduler.hosts.local import LocalHost
from tests.kits import safe_data


def test_folders_are_made_once_and_bound_as_asked(tmp_path: Path) -> None:
    folders = storage.prepare(tmp_path, "alice", uid=os.getuid(), gid=os.getgid(), home=True)
    assert folders.input == tmp_path.resolve() / "alice" / "input" and folders.input.is_dir()
    mounts = {mount.target: mount for mount in folders.mounts()}
    assert mounts["/data/input"].read_only and not mounts["/data/output"].read_only
    assert mounts["/home/alice"].source == tmp_path.resolve() / "alice" / "home"
    (folders.output / "kept").write_text("x")
    assert (
        storage.prepare(tmp_path, "alice", uid=os.getuid(), gid=os.getgid()).output
        == folders.output
    )
    assert (folders.output / "kept").read_text() == "x"


@pytest.mark.parametrize(
    "name", ["../../etc", "alice/../bob", "Alice", "", "a" * 33, ".hidden", "al ice", "alice\n"]
)
def test_bad_user_names_make_nothing(tmp_path: Path, name: str) -> None:
    with pytest.raises(StorageError, match="not allowed"):
        storage.prepare(tmp_path, name, uid=os.getuid(), gid=os.getgid())
    assert list(tmp_path.iterdir()) == []


def test_missing_root(tmp_path: Path) -> None:
    with pytest.raises(StorageError, match="does not exist"):
        storage.prepare(tmp_path / "nowhere", "alice", uid=1, gid=1)
    assert not (tmp_path / "nowhere").exists()


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere")
def test_root_not_writable(tmp_path: Path) -> None:
    root = tmp_path / "locked"
    root.mkdir(mode=0o555)
    with pytest.raises(StorageError, match="not writable"):
        storage.prepare(root, "alice", uid=1, gid=1)
    assert list(root.iterdir()) == []


def test_symlinks_out_of_the_root_are_refused(tmp_path: Path) -> None:
    root = tmp_path / "root"
    outside = tmp_path / "elsewhere"
    root.mkdir()
    outside.mkdir()
    (root / "alice").symlink_to(outside)
    with pytest.raises(StorageError, match="not a plain folder"):
        storage.prepare(root, "alice", uid=1, gid=1)
    (root / "alice").unlink()
    (root / "alice").mkdir()
    (root / "alice" / "output").symlink_to("/etc")
    with pytest.raises(StorageError, match="not a plain folder"):
        storage.prepare(root, "alice", uid=os.getuid(), gid=os.getgid())
    assert list(outside.iterdir()) == []


def test_a_data_root_without_nosuid_nodev_is_named_with_the_fix(tmp_path: Path) -> None:
    """A setuid file a container made there would run as its owner on the host."""
    if storage.mount_problem(tmp_path) is None:
        pytest.skip(f"{tmp_path} is on a nosuid,nodev mount already")
    problem = storage.mount_problem(tmp_path)
    assert problem is not None and "without nosuid,nodev" in problem and "mount it with nosuid,nodev" in problem
    with safe_data.data_root() as safe:
        assert storage.mount_problem(safe) is None


def test_the_per_user_folder_is_the_daemons(tmp_path: Path) -> None:
    """Only input/output are the booker's: who owns `<root>/<user>` may swap them for symlinks."""
    gid = 4242 if os.geteuid() == 0 else os.getgid()
    folders = storage.prepare(tmp_path, "alice", uid=os.getuid(), gid=gid)
    user_dir = folders.output.parent
    assert user_dir.stat().st_uid == os.geteuid() and user_dir.stat().st_mode & 0o777 == 0o750
    # Its group is the booker's (the SFTP service's chroot): they may list it, not write it.
    assert user_dir.stat().st_gid == gid
    assert folders.output.stat().st_mode & 0o777 == 0o755


def test_a_booking_is_refused_on_a_data_root_without_nosuid_nodev(tmp_path: Path) -> None:
    if storage.mount_problem(tmp_path) is None:
        pytest.skip(f"{tmp_path} is on a nosuid,nodev mount already")
    host = LocalHost(engine=engine_from("podman"), gpus=(0,), driver_version=None,
                     probe_key=paramiko.ECDSAKey.generate(bits=256), cache_dir=tmp_path, data_root=tmp_path)
    request = StartRequest(booking_id="b@test", booker=Booker(name="alice", uid=2001, gid=2001),
                           template=get_template("debian-ssh"), gpus=(), port=2222,
                           end=datetime.now(UTC) + timedelta(hours=1))
    with pytest.raises(StorageError, match="mount it with nosuid,nodev") as refused:
        host.start(request)
    assert not refused.value.temporary
    assert list(tmp_path.iterdir()) == []


HOST_MOUNTINFO = """\
22 1 8:1 / / rw,relatime - ext4 /dev/sda1 rw
40 22 0:40 / /srv/gpubook rw,nosuid,nodev,relatime - tmpfs gpubook-data rw,size=8g
41 22 0:41 / /srv/with\\040space rw,nosuid,nodev - tmpfs other rw
"""
# Rootless podman's pause process started before /srv/gpubook was mounted, on a host whose / is private.
PODMAN_MOUNTINFO = "622 621 8:1 / / rw,relatime - ext4 /dev/sda1 rw\n"


def test_a_data_root_missing_from_podmans_mount_namespace_is_found() -> None:
    """Seen on the GPU host (no systemd, / private): every start failed with 'podman unshare chown
    DATA_ROOT/alice: No such file or directory' while the host had the nosuid,nodev mount."""
    assert storage.mountinfo_problem(HOST_MOUNTINFO, Path("/srv/gpubook")) is None
    assert storage.mountinfo_problem(HOST_MOUNTINFO, Path("/srv/gpubook/alice")) is None
    assert storage.mountinfo_problem(HOST_MOUNTINFO, Path("/srv/with space")) is None
    assert storage.mountinfo_problem(PODMAN_MOUNTINFO, Path("/srv/gpubook")) == (
        "/srv/gpubook lies on / there, mounted without nosuid,nodev")
    assert storage.mountinfo_problem(HOST_MOUNTINFO, Path("/srv/gpubook-other")) == (
        "/srv/gpubook-other lies on / there, mounted without nosuid,nodev")


def test_a_data_root_given_as_a_symbolic_link_is_judged_where_it_leads(tmp_path: Path) -> None:
    """Seen on the GPU host (issue 41): data_root ~/install-test/data, a link into the nosuid,nodev mount
    /srv/gpubook-data, was taken for a folder on / and doctor failed while every booking's folders held."""
    link = tmp_path / "data"
    link.symlink_to("/srv/gpubook/alice")
    assert storage.mountinfo_problem(HOST_MOUNTINFO, link) is None
    assert storage.mountinfo_problem(PODMAN_MOUNTINFO, link) == (
        f"{link} (that is, /srv/gpubook/alice) lies on / there, mounted without nosuid,nodev")


@pytest.mark.podman
def test_doctor_looks_for_the_data_root_in_rootless_podmans_namespace(tmp_path: Path) -> None:
    """The test data mount was made before this account's podman first ran: podman's namespace has
    it; a folder on a plain mount is found lacking there (the same look that finds a missing mount)."""
    from gpubook.scheduler import config as config_module
    from gpubook.scheduler.commands import doctor

    if os.geteuid() == 0:
        pytest.skip("rootless podman's namespace: run as the unprivileged test user")
    if storage.mount_problem(tmp_path) is None:
        pytest.skip(f"{tmp_path} is on a nosuid,nodev mount already")

    def config(root: Path) -> config_module.Config:
        path = tmp_path / "gpubook.toml"
        path.write_text(f'[host]\nname = "t"\n[gpus]\ncount = 1\n[storage]\ndata_root = "{root}"\n'
                        '[engine]\nruntime = "runc"\n[[calendar]]\nurl = "http://127.0.0.1:9/c/"\n')
        return config_module.load(path)

    with safe_data.data_root() as safe:
        assert doctor.namespace_check(config(safe)) is None
    found = doctor.namespace_check(config(tmp_path))
    assert found is not None and not found.ok and "not in rootless podman's mount namespace" in found.detail


def test_a_data_root_others_may_write_in_is_refused(tmp_path: Path) -> None:
    """issue 22, finding 12: another host user who may write in data_root could make `<root>/alice`
    (or a symlink by that name) before gpubook does, and alice's folders would be theirs."""
    root = tmp_path / "data"
    root.mkdir()
    root.chmod(0o1777)  # as /tmp is: the sticky bit keeps nobody from making a new name
    with pytest.raises(StorageError, match=f"data_root {root} is writable by its group or others"):
        storage.prepare(root, "alice", uid=os.getuid(), gid=os.getgid())
    assert not (root / "alice").exists()
    root.chmod(0o755)
    assert storage.prepare(root, "alice", uid=os.getuid(), gid=os.getgid()).output.is_dir()
