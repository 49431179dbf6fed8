"""An upgrade under running bookings, as an admin makes it (docs/guides/operate.md, "Upgrading"): gpubook
0.2.0's wheel (built from its commit, tagged v0.2.0) installed and set up for a fresh account, its
daemon running 4 bookings (an SSH session open in each) with 4 more accepted for later; then the daemon
stopped, this tree's wheel installed over it from a wheelhouse, the daemon started again. Every running
container is adopted (the same container, never restarted), every SSH session answers, the 4 later
bookings start, and the state database is migrated. Then the downgrade: 0.2.0 reinstalled refuses the
newer database with a sentence and leaves it byte for byte as it was.

Runs as root (marker install): it makes the account, its data mount and a venv under /opt, and removes
them afterwards (before, too). No GPU: the host declares 8 (`[gpus] count`), the containers get none.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import paramiko
import pytest

from gpubook.scheduler.commands.embedded import end_process
from gpubook.scheduler.state.schema import MIGRATIONS
from tests.kits.daemon_kit import book, description, key_line, port_range, soon, wait_for
from tests.kits.install_kit import Site, build_wheel, login, quiet

pytestmark = [pytest.mark.install, pytest.mark.caldav, pytest.mark.slow,
              pytest.mark.skipif(os.geteuid() != 0, reason="makes an account and a mount: root only")]

ROOT = Path(__file__).resolve().parents[1]
# 0.2.0's commit, tagged v0.2.0: named by its hash, which every full clone of main has (a clone need not
# carry the tags, which a push of main leaves behind).
OLD_COMMIT = "180c38e6fef2c9e543109a7c6942fe1483fa2cfa"
SITE = Site("gpubook-upgrade-it", Path("/srv/gpubook-upgrade-it"), Path("/opt/gpubook-upgrade-it"))
USERS = ("alice", "bob", "carol", "dave")
UPCOMING_AFTER = timedelta(seconds=120)  # from their booking: the upgrade (stop, install, start) fits before
RUNNING_LINE = re.compile(r"running: ssh -p (\d+) (\w+)@127\.0\.0\.1")
KNOWN_LINE = re.compile(r"known_hosts: (\[127\.0\.0\.1\]:\d+ \S+ \S+)")


class Wheels:
    def __init__(self, folder: Path) -> None:
        source = folder / "old-source"
        source.mkdir()
        listed = subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", f"{OLD_COMMIT}^{{commit}}"],
                                capture_output=True, text=True, check=False, timeout=60)
        assert listed.returncode == 0, f"0.2.0's commit {OLD_COMMIT[:7]} is not in this clone (a shallow one?)"
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", "-o", str(folder / "old.tar"),
                                  OLD_COMMIT], capture_output=True, check=False, timeout=120)
        assert archive.returncode == 0, archive.stderr
        subprocess.run(["tar", "-x", "-f", str(folder / "old.tar"), "-C", str(source)], check=True, timeout=120)
        self.old = build_wheel(source, folder / "old")
        self.old_constraints = source / "constraints.txt"
        self.new = build_wheel(ROOT, folder / "new")
        assert self.old.name == "gpubook-0.2.0-py3-none-any.whl" and self.new.name != self.old.name
        # The new wheel's dependencies fetched before any booking runs: the upgrade itself reads no index.
        self.house = folder / "wheelhouse"
        got = quiet([sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "-q", "-d",
                     str(self.house), "-c", str(ROOT / "constraints-runtime.txt"), str(self.new)])
        assert got.returncode == 0, got.stdout[-2000:] + got.stderr[-2000:]


@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> Wheels:
    return Wheels(tmp_path_factory.mktemp("wheels"))


@pytest.fixture
def site() -> Iterator[Site]:
    SITE.remove_everything()
    yield SITE
    SITE.remove_everything()


def config_text(calendar_url: str, keys: dict[str, paramiko.PKey]) -> str:
    """A config 0.2.0 reads (and so must every later gpubook): 8 GPUs declared, no GPU here."""
    low, high = port_range()
    lines = ['[host]', 'name = "127.0.0.1"', 'timezone = "UTC"',
             '[[calendar]]', f'url = "{calendar_url}"', 'username = "test"',
             '[gpus]', 'count = 8', '[engine]', 'runtime = "runc"', 'stop_grace_seconds = 1',
             '[ssh]', f'port_min = {low}', f'port_max = {high}', '[daemon]', 'poll_seconds = 5']
    for uid, user in enumerate(USERS, start=2001):
        lines += [f'[users.{user}]', f'uid = {uid}', f'ssh_keys = ["{key_line(keys[user])}"]']
    return "\n".join(lines) + "\n"


def set_up_old(site: Site, wheels: Wheels, config: Path) -> Path:
    """0.2.0 installed and its `gpubook setup` run, the image's root file system seeded as the lanes
    seed it (tools/lanes.py; both versions name it alike), so that setup's build runs no mmdebstrap."""
    site.install(wheels.old, constraints=wheels.old_constraints)
    made = quiet(["useradd", "--create-home", "--shell", "/bin/bash", site.account])
    assert made.returncode == 0, made.stderr
    entry = site.entry()
    seeded = sorted((Path.home() / ".cache" / "gpubook" / "rootfs").glob("*.tar"))
    if seeded:
        cache = Path(entry.pw_dir) / ".cache" / "gpubook" / "rootfs"
        site.as_account("mkdir", "-p", str(cache))
        shutil.copy2(seeded[-1], cache / seeded[-1].name)
        shutil.chown(cache / seeded[-1].name, entry.pw_uid, entry.pw_gid)
    done = quiet([str(site.binary), "setup", "--user", site.account, "--data-root", str(site.data),
                  "--config-from", str(config)], cwd="/", env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin",
                                                                "LANG": "C.UTF-8"})
    assert site.as_account("podman", "image", "exists", "localhost/gpubook/debian-ssh:12").returncode == 0, \
        done.stdout[-3000:] + done.stderr[-3000:]
    return Path(entry.pw_dir) / ".config" / "gpubook" / "gpubook.toml"


def run_daemon(site: Site, config: Path, log: Path) -> subprocess.Popen[bytes]:
    return site.popen_as_account([str(site.binary), "run", "--config", str(config)], log)


def stop_daemon(daemon: subprocess.Popen[bytes], log: Path) -> None:
    assert end_process(daemon, timeout=60) == 0, log.read_text()[-3000:]


def ssh_lines(calendar, uid: str) -> tuple[int, str, str] | None:  # type: ignore[no-untyped-def]
    text = description(calendar, uid)
    port, known = RUNNING_LINE.search(text), KNOWN_LINE.search(text)
    return (int(port.group(1)), port.group(2), known.group(1)) if port and known else None


def known_login(port: int, user: str, known: str, key: paramiko.PKey, folder: Path) -> paramiko.SSHClient | None:
    """The booker's login, trusting only the event's known_hosts line."""
    known_hosts = folder / f"known_hosts-{port}"
    known_hosts.write_text(known + "\n")
    return login(port, user, known_hosts, key)


def said(client: paramiko.SSHClient, command: str) -> str:
    _, stdout, _ = client.exec_command(command, timeout=30)
    return stdout.read().decode().strip()


def containers(site: Site) -> dict[str, tuple[str, str]]:
    """Each gpubook container's name → (its ID, when it started): the same pair after the upgrade
    means adopted, not started again."""
    listed = site.as_account("podman", "ps", "--format", "{{.Names}} {{.ID}} {{.StartedAt}}")
    assert listed.returncode == 0, listed.stderr
    found = {}
    for line in listed.stdout.splitlines():
        name, ident, started = line.split(" ", 2)
        if name.startswith("gpubook-"):
            found[name] = (ident, started)
    return found


def schema_version(database: Path) -> int:
    with sqlite3.connect(f"file:{database}?mode=ro", uri=True) as db:
        return int(db.execute("PRAGMA user_version").fetchone()[0])


def digest(folder: Path) -> dict[str, str]:
    """The state database's files (with its WAL, if any) by their SHA-256."""
    return {path.name: hashlib.sha256(path.read_bytes()).hexdigest()
            for path in sorted(folder.glob("state.sqlite*"))}


def test_an_upgrade_under_running_bookings_keeps_them_and_a_downgrade_is_refused(site: Site, wheels: Wheels,
                                                                                  tmp_path: Path, radicale) -> None:
    calendar = radicale.new_calendar()
    keys = {user: paramiko.ECDSAKey.generate(bits=256) for user in USERS}
    source = tmp_path / "gpubook-upgrade.toml"
    source.write_text(config_text(str(calendar.url), keys))
    source.chmod(0o600)
    config = set_up_old(site, wheels, source)
    state = Path(site.entry().pw_dir) / ".local" / "state" / "gpubook"
    log = tmp_path / "daemon.log"

    # gpubook 0.2.0 runs four bookings, an SSH session open in each.
    start = soon(25)
    for user in USERS:
        book(calendar, f"now-{user}@upgrade", user=user, start=start, end=start + timedelta(minutes=30))
    old = run_daemon(site, config, log)
    sessions: dict[str, paramiko.SSHClient] = {}
    try:
        for user in USERS:
            port, login_user, known = wait_for(f"{user}'s booking running under 0.2.0", lambda user=user: ssh_lines(
                calendar, f"now-{user}@upgrade"), timeout=240, interval=0.5)
            assert login_user == user
            sessions[user] = wait_for(f"{user}'s SSH login", lambda p=port, u=user, k=known: known_login(
                p, u, k, keys[u], tmp_path), timeout=60, interval=0.2)
            assert said(sessions[user], "id -un") == user
        # Four more, accepted by 0.2.0 for later.
        later = datetime.now(UTC).replace(microsecond=0) + UPCOMING_AFTER
        for user in USERS:
            book(calendar, f"later-{user}@upgrade", user=user, start=later, end=later + timedelta(minutes=30))
        for user in USERS:
            wait_for(f"{user}'s later booking accepted by 0.2.0", lambda user=user: "accepted:" in description(
                calendar, f"later-{user}@upgrade"), timeout=60, interval=0.5)
        before = containers(site)
        assert len(before) >= 4, before
        old_version = schema_version(state / "state.sqlite")
        assert old.poll() is None, log.read_text()[-3000:]
    finally:
        stop_daemon(old, log)

    # The upgrade: this tree's wheel over 0.2.0's, from the wheelhouse; the daemon started again.
    upgrading = time.monotonic()
    installed = quiet([str(site.venv / "bin" / "python"), "-m", "pip", "install", "--disable-pip-version-check",
                       "-q", "--no-index", "--find-links", str(wheels.house), "--upgrade", str(wheels.new)], cwd="/")
    assert installed.returncode == 0, installed.stdout[-2000:] + installed.stderr[-2000:]
    new = run_daemon(site, config, log)
    up_at = datetime.now(UTC)
    try:
        upgrade_seconds = time.monotonic() - upgrading
        assert up_at < later, f"the upgrade took {upgrade_seconds:.0f} s, past the later bookings' start"
        # `gpubook status` exits 0 once a daemon holds the state folder (3 while none does).
        wait_for("the new daemon holding the state", lambda: new.poll() is None and site.as_account(
            str(site.binary), "status", "--config", str(config)).returncode == 0, timeout=120, interval=1)
        assert new.poll() is None, log.read_text()[-3000:]
        assert schema_version(state / "state.sqlite") == len(MIGRATIONS) > old_version
        # Adopted: the same containers, not started again, and each session still answers.
        assert {name: pair for name, pair in containers(site).items() if name in before} == before
        for user in USERS:
            assert said(sessions[user], "echo alive; id -un") == f"alive\n{user}"
        # The later bookings start under the new daemon.
        for user in USERS:
            port, login_user, known = wait_for(f"{user}'s later booking running", lambda user=user: ssh_lines(
                calendar, f"later-{user}@upgrade"), timeout=UPCOMING_AFTER.total_seconds() + 180, interval=0.5)
            client = wait_for(f"{user}'s SSH login to the later booking", lambda p=port, u=user, k=known: known_login(
                p, u, k, keys[u], tmp_path), timeout=60, interval=0.2)
            assert said(client, "id -un") == user
            client.close()
        late = (datetime.now(UTC) - later).total_seconds()
        assert datetime.now(UTC) >= later
        print(f"\nupgrade: stop, install from the wheelhouse, start: {upgrade_seconds:.1f} s; the 4 later "
              f"bookings all logged in {late:.1f} s after their start; schema {old_version} -> {len(MIGRATIONS)}")
        assert new.poll() is None, log.read_text()[-3000:]
    finally:
        stop_daemon(new, log)
        for client in sessions.values():
            client.close()

    # The downgrade: 0.2.0 again refuses the database the new gpubook wrote, and changes nothing in it.
    kept = digest(state)
    assert "state.sqlite" in kept
    again = quiet([str(site.venv / "bin" / "python"), "-m", "pip", "install", "--disable-pip-version-check", "-q",
                   "--no-index", "--no-deps", "--force-reinstall", str(wheels.old)], cwd="/")
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
    assert site.as_account(str(site.binary), "--version").stdout.strip() == "gpubook 0.2.0"
    refused = site.as_account(str(site.binary), "run", "--config", str(config), timeout=120)
    assert refused.returncode != 0, refused.stdout[-2000:] + refused.stderr[-2000:]
    sentence = (f"has schema version {len(MIGRATIONS)}, newer than this gpubook")
    assert sentence in refused.stdout + refused.stderr, refused.stdout[-2000:] + refused.stderr[-2000:]
    assert digest(state) == kept
