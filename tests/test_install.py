"""The install an admin makes, proven on this Debian 12 machine: the wheel built from this tree, a venv
outside the checkout, `gpubook setup` for a fresh account, and a CalDAV booking that reaches SSH through
that install (the installed `gpubook run`, no PYTHONPATH, no checkout), stopped by `gpubook stop`.

Runs as root (marker install). Everything it makes is removed afterwards, and before, in case an
earlier run was killed: the account with its processes and podman store, the bind mount, its
/etc/fstab line, the data folder, the venv. `-s` prints setup's time (with and without the image
build) for BENCHMARKS.md.
"""

from __future__ import annotations

import os
import pwd
import re
import subprocess
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import paramiko
import pytest

from gpubook.runtime.engines import container_name
from gpubook.scheduler.commands.embedded import end_process
from gpubook.scheduler.commands.setup_steps import fstab_line
from tests.kits.daemon_kit import book, description, key_line, port_range, soon, wait_for
from tests.kits.install_kit import FSTAB, Site, account_env, build_wheel, login, mounted, quiet

pytestmark = [pytest.mark.install,
              pytest.mark.skipif(os.geteuid() != 0, reason="gpubook setup makes an account and a mount: root only")]

ROOT = Path(__file__).resolve().parents[1]
ACCOUNT = "gpubook-setup-it"
DATA = Path("/srv/gpubook-setup-it")
PREFIX = Path("/opt/gpubook-it")  # outside the checkout, readable by the account
VENV = PREFIX / "venv"
BINARY = VENV / "bin" / "gpubook"
BOOKING = "install@test"
STEPS = ("account", "subids", "linger", "data_root", "data_root mount", "storage.conf", "/dev/net/tun",
         "cgroup delegation", "config", "image", "unit")


SITE = Site(ACCOUNT, DATA, PREFIX)
_quiet = quiet
_account_env = account_env
as_account = SITE.as_account
remove_everything = SITE.remove_everything


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The wheel built from this tree and installed into a venv outside the checkout, once for the
    module: setup and the page's steps only read the venv."""
    remove_everything()
    install_wheel(tmp_path_factory.mktemp("install"))
    yield
    remove_everything()


@pytest.fixture
def clean_host(installed: None) -> Iterator[None]:
    remove_everything(keep_venv=True)
    yield
    remove_everything(keep_venv=True)
    assert mounted(DATA) == 0 and fstab_line(DATA) not in FSTAB.read_text()
    assert _quiet(["id", ACCOUNT]).returncode != 0


def install_wheel(folder: Path) -> None:
    """pip wheel from the tree, a venv of Debian's python outside the checkout, the wheel in it."""
    SITE.install(build_wheel(ROOT, folder), constraints=ROOT / "constraints-runtime.txt")


def timed_setup(*extra: str) -> tuple[int, list[tuple[float, str]]]:
    """`gpubook setup` as root from the venv; its exit status and each output line with its time."""
    started = time.monotonic()
    process = subprocess.Popen([str(BINARY), "setup", "--user", ACCOUNT, "--data-root", str(DATA), *extra],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd="/",
                               env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"})
    assert process.stdout is not None
    lines = [(time.monotonic() - started, line.rstrip("\n")) for line in process.stdout]
    return process.wait(timeout=60), lines


def step_lines(lines: list[tuple[float, str]]) -> dict[str, tuple[float, str]]:
    """Each step's first line by its name (`name: state: what`)."""
    found = {}
    for at, line in lines:
        name, _, rest = line.partition(": ")
        if name in STEPS and name not in found:
            found[name] = (at, rest)
    return found


def write_config(folder: Path, calendar_url: str, key: paramiko.PKey) -> Path:
    """The config setup gives the account (--config-from); setup adds data_root."""
    low, high = port_range()
    path = folder / "gpubook-it.toml"
    path.write_text("\n".join([
        '[host]', 'name = "127.0.0.1"', 'timezone = "UTC"',
        '[[calendar]]', f'url = "{calendar_url}"', 'username = "test"',
        '[gpus]', 'count = 1',  # no GPU on this machine: a GPU-less host declared as such
        '[engine]', 'runtime = "runc"', 'stop_grace_seconds = 1',
        '[ssh]', f'port_min = {low}', f'port_max = {high}',
        '[users.alice]', 'uid = 2001', f'ssh_keys = ["{key_line(key)}"]', '']))
    path.chmod(0o600)  # read by setup as root, copied into the account's home by the account
    return path


def test_an_admin_install_by_gpubook_setup_runs_a_caldav_booking_to_ssh(clean_host: None, tmp_path: Path,
                                                                          radicale) -> None:
    version = _quiet([str(BINARY), "--version"], cwd="/")
    assert re.fullmatch(r"gpubook \d+\.\d+\.\d+\S*\n", version.stdout), version.stdout + version.stderr
    calendar = radicale.new_calendar()
    key = paramiko.ECDSAKey.generate(bits=256)
    source = write_config(tmp_path, str(calendar.url), key)

    status, first = timed_setup("--config-from", str(source))
    output = "\n".join(line for _, line in first)
    steps = step_lines(first)
    assert list(steps) == list(STEPS), output
    for name in ("account", "data_root", "data_root mount", "storage.conf", "config", "image", "unit"):
        assert steps[name][1].startswith("change: "), (name, output)
    entry = pwd.getpwnam(ACCOUNT)
    flags = os.statvfs(DATA).f_flag
    assert flags & os.ST_NOSUID and flags & os.ST_NODEV and mounted(DATA) == 1
    assert Path(DATA).stat().st_uid == entry.pw_uid
    assert FSTAB.read_text().splitlines().count(fstab_line(DATA)) == 1
    home = Path(entry.pw_dir)
    config = home / ".config/gpubook/gpubook.toml"
    assert config.stat().st_mode & 0o777 == 0o600 and config.stat().st_uid == entry.pw_uid
    assert f'data_root = "{DATA}"' in config.read_text()
    assert f"ExecStart={BINARY} run --config" in (home / ".config/systemd/user/gpubook.service").read_text()
    # Setup's verdict is doctor's, run by the account itself.
    doctor = as_account(str(BINARY), "doctor", "--config", str(config))
    assert status == (0 if doctor.returncode == 0 else 1), output + doctor.stdout
    for fine in ("ok    data_root:", "ok    engine storage: driver overlay", "ok    tun device", "ok    calendar"):
        assert fine in doctor.stdout, doctor.stdout
    image_seconds = steps["unit"][0] - steps["image"][0]
    print(f"\ngpubook setup on a fresh account: {first[-1][0]:.1f} s in all, the image build {image_seconds:.1f} s, "
          f"without it {first[-1][0] - image_seconds:.1f} s")

    again_started = time.monotonic()
    status_again, second = timed_setup("--config-from", str(source))
    again = step_lines(second)
    assert list(again) == list(STEPS)
    assert all(rest.startswith(("already: ", "skipped: ")) for _, rest in again.values()), second
    assert not any(line.startswith("  $ ") and "doctor" not in line for _, line in second), second
    assert status_again == status and FSTAB.read_text().splitlines().count(fstab_line(DATA)) == 1
    print(f"gpubook setup again (all already): {time.monotonic() - again_started:.1f} s")

    # The installed package, not the checkout: the account's python finds gpubook in the venv.
    where = as_account(str(VENV / "bin" / "python"), "-c", "import gpubook; print(gpubook.__file__)")
    assert where.stdout.startswith(str(VENV)), where.stdout + where.stderr

    start = soon(20)
    book(calendar, BOOKING, user="alice", start=start, end=start + timedelta(minutes=10))
    log = tmp_path / "daemon.log"
    with log.open("wb") as stream:
        daemon = subprocess.Popen([str(BINARY), "run", "--config", str(config)], stdout=stream, stderr=stream,
                                  stdin=subprocess.DEVNULL, cwd=home, env=_account_env(entry), user=entry.pw_uid,
                                  group=entry.pw_gid, extra_groups=[])
    try:
        def ssh_lines() -> tuple[int, str] | None:
            text = description(calendar, BOOKING)
            port = re.search(r"running: ssh -p (\d+) alice@127\.0\.0\.1", text)
            known = re.search(r"known_hosts: (\[127\.0\.0\.1\]:\d+ \S+ \S+)", text)
            if daemon.poll() is not None:
                raise AssertionError(f"the daemon exited ({daemon.returncode}): {log.read_text()[-3000:]}")
            return (int(port.group(1)), known.group(1)) if port and known else None

        port, known_line = wait_for("the event's ssh and known_hosts lines", ssh_lines, timeout=180, interval=0.5)
        known_hosts = tmp_path / "known_hosts"
        known_hosts.write_text(known_line + "\n")
        client = wait_for("an SSH login with the event's host key", lambda: login(port, "alice", known_hosts, key),
                          timeout=60, interval=0.2)
        try:
            _, stdout, _ = client.exec_command("id -un", timeout=30)
            assert stdout.read().decode().strip() == "alice"
        finally:
            client.close()
    finally:
        assert end_process(daemon, timeout=30) == 0, log.read_text()[-3000:]

    name = container_name(BOOKING)
    assert as_account("podman", "container", "exists", name).returncode == 0  # it outlives the daemon
    stopped = as_account(str(BINARY), "stop", BOOKING, "--config", str(config))
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    wait_for("the booking's container gone", lambda: as_account("podman", "container", "exists", name).returncode == 1,
             timeout=60, interval=0.5)


def install_md_script(*, systemd: bool, tun_mode: int, image: bool = False, config_edit: str = "") -> str:
    """docs/guides/install.md's steps as one root shell script for ACCOUNT, each block chosen as its
    "only where ..." line says for this host; doctor left out (the caller runs it, to read it), and the
    image's build (the long one) unless `image`. Its import from another machine is never taken.
    `config_edit`: shell run after step 9, the admin's edit of the config ("Then edit it")."""
    text = (ROOT / "docs" / "guides" / "install.md").read_text()
    steps = text[text.index("## The steps"):text.index("## Config and secrets")]
    blocks = re.findall(r"```sh\n(.*?)```", steps, re.S)
    conditions = {"# only where systemd runs": systemd, "# only where systemd does not run": not systemd,
                  "# only if the check shows none": False,  # useradd gives a range here (setup checks it)
                  "# only where /dev/net/tun is 0600": tun_mode & 0o066 != 0o066,
                  "# only where data_root is not on a nosuid,nodev mount": True}  # /srv is on / here
    chosen = []
    for block in blocks[1:]:
        first = block.splitlines()[0]
        condition = next((value for tag, value in conditions.items() if first.startswith(tag)), None)
        assert condition is not None or not first.startswith("# only"), f"a condition the test does not know: {first}"
        if condition is False or " doctor " in block or "podman save" in block:
            continue
        if "build debian-ssh" in block and not image:
            continue
        chosen.append(block)
        if "config/gpubook.example.toml" in block:
            chosen.append(config_edit)
    names = f"account={ACCOUNT} data_root={DATA} venv={VENV}\nhome=/home/$account\n"
    assert blocks[0].startswith("account="), blocks[0]
    return "set -eu\n" + names + "".join(chosen)


def test_install_md_by_hand_leaves_gpubook_setup_nothing_to_do_but_the_image(clean_host: None) -> None:
    """The manual page and the command are one procedure: after the page's steps, setup says "already"."""
    statvfs = os.statvfs("/srv")
    assert not statvfs.f_flag & os.ST_NOSUID, "this test expects /srv without nosuid (the bind-mount branch)"
    script = install_md_script(systemd=Path("/run/systemd/system").is_dir(),
                               tun_mode=Path("/dev/net/tun").stat().st_mode & 0o777)
    by_hand = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=300, check=False,
                             cwd="/", env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"})
    assert by_hand.returncode == 0, script + by_hand.stdout + by_hand.stderr
    status, lines = timed_setup("--dry-run")
    found = step_lines(lines)
    assert status == 0 and list(found) == list(STEPS), lines
    left = {name: rest for name, (_, rest) in found.items() if not rest.startswith(("already: ", "skipped: "))}
    assert list(left) == ["image"] and left["image"].startswith("would change: "), left


def test_install_md_steps_1_to_12_as_written_end_with_doctor_and_status_true(clean_host: None, tmp_path: Path,
                                                                            radicale) -> None:
    """The page's twelve steps as an admin types them on a host without systemd, the config edited to a
    real calendar: doctor, run as step 12 writes it (as the account, from root's shell, outside the
    daemon's cgroup), passes; the daemon started as step 11 says, `status` as the account shows no
    problem the host does not have. The one problem this VM truly has is its cgroup v1 hierarchy, where
    rootless limits cannot hold (docs/guides/limits.md): there, and only there, doctor's WARN and
    status's line about the limits are the truth and are read as such; on a cgroup v2 host with the
    subtree delegated (step 8) the same test wants doctor's limits ok and no status problem at all."""
    calendar = radicale.new_calendar()
    key = paramiko.ECDSAKey.generate(bits=256)
    edited = write_config(tmp_path, str(calendar.url), key).read_text() + f'\n[storage]\ndata_root = "{DATA}"\n'
    edit = (f"$as_account tee \"$home/.config/gpubook/gpubook.toml\" > /dev/null <<'GPUBOOK_CONFIG'\n"
            f"{edited}GPUBOOK_CONFIG\n")
    script = install_md_script(systemd=Path("/run/systemd/system").is_dir(),
                               tun_mode=Path("/dev/net/tun").stat().st_mode & 0o777, image=True, config_edit=edit)
    assert "templates --config" in script and "build debian-ssh" in script and "podman save" not in script
    # The image's root file system as the lanes seed it (tools/lanes.py): step 10's build runs as written,
    # without a second mmdebstrap of the same Debian.
    seeded = sorted((Path.home() / ".cache" / "gpubook" / "rootfs").glob("*.tar"))
    if seeded:
        seed = (f'$as_account mkdir -p "$home/.cache/gpubook/rootfs"\n'
                f'install -o "$account" -g "$account" -m 0644 {seeded[-1]} "$home/.cache/gpubook/rootfs/"\n')
        build = '$as_account "$venv/bin/gpubook" templates'
        script = script.replace(build, seed + build, 1)
    by_hand = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=900, check=False,
                             cwd="/", env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"})
    assert by_hand.returncode == 0, script + by_hand.stdout + by_hand.stderr
    entry = pwd.getpwnam(ACCOUNT)
    config = Path(entry.pw_dir) / ".config/gpubook/gpubook.toml"
    cgroup_v1 = not Path("/sys/fs/cgroup/cgroup.controllers").is_file()

    # Step 12, as written: doctor as the account.
    doctor = as_account(str(BINARY), "doctor", "--config", str(config))
    lines = doctor.stdout.splitlines()
    failed = [line for line in lines if line.startswith("FAIL")]
    for fine in ("ok    data_root:", "ok    engine storage: driver overlay", "ok    tun device", "ok    calendar",
                 "ok    image debian-ssh: localhost/gpubook/debian-ssh:12 is in the engine's store"):
        assert any(line.startswith(fine) for line in lines), doctor.stdout
    assert (doctor.returncode, failed) == (0, []), doctor.stdout + doctor.stderr
    limits = next(line for line in lines if line.startswith(("ok    engine limits", "WARN  engine limits")))
    # cgroup v1: the limits cannot hold, and doctor warns saying why; v2 with the subtree delegated: they hold.
    assert limits.startswith("WARN") == cgroup_v1 and ("cgroups v1" in limits) == cgroup_v1, limits

    # Step 11 without systemd: the daemon started by hand as the account; then `status` as the account.
    log = tmp_path / "daemon.log"
    with log.open("wb") as stream:
        daemon = subprocess.Popen([str(BINARY), "run", "--config", str(config)], stdout=stream, stderr=stream,
                                  stdin=subprocess.DEVNULL, cwd=entry.pw_dir, env=_account_env(entry),
                                  user=entry.pw_uid, group=entry.pw_gid, extra_groups=[])
    try:
        status_file = Path(entry.pw_dir) / ".local/state/gpubook/daemon-status.json"
        wait_for("the daemon's first pass", lambda: daemon.poll() is None and status_file.is_file(), timeout=180,
                 interval=0.5)
        assert daemon.poll() is None, log.read_text()[-3000:]
        shown = as_account(str(BINARY), "status", "--config", str(config))
        assert shown.returncode == 0, shown.stdout + shown.stderr
        problems = [line for line in shown.stdout.splitlines() if re.search(r"problem|NOT |FAIL|WARN", line)]
        if cgroup_v1:
            assert all("limit" in line or "cgroup" in line for line in problems), shown.stdout
        else:
            assert problems == [], shown.stdout
        assert "not running" not in shown.stdout, shown.stdout
    finally:
        assert end_process(daemon, timeout=30) == 0, log.read_text()[-3000:]
