"""What the Slurm tests share beyond the cluster itself (slurm_kit): bookings and their acceptance
for a sync, the daemon's account running Slurm's clients and podman, the daemon's config on the
cluster and what the tests read back from it (reservations, jobs, a booker's login on a node).
"""

from __future__ import annotations

import os
import pwd
import subprocess
import sys
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path

import paramiko

from gpubook.runtime.engines import EngineSettings
from gpubook.scheduler.core.bookings import Booking
from gpubook.scheduler.core.plan import Accepted
from gpubook.scheduler.hosts.slurm import Scontrol, parse
from gpubook.scheduler.hosts.slurm.jobs import SlurmJobs
from tests.kits import slurm_kit
from tests.kits.daemon_kit import key_line, port_range
from tests.kits.engine_suite import PODMAN

NOW = datetime(2026, 11, 23, 8, 0, tzinfo=UTC)
PREFIX = "gpubook-"
ENGINE = EngineSettings(**PODMAN)  # type: ignore[arg-type]


def booking(booking_id: str = "b1", *, start: datetime = NOW + timedelta(hours=1), hours: float = 1,
            gpus: int = 2) -> Booking:
    return Booking(id=booking_id, uid=booking_id, user="alice", template="base", gpu_count=gpus, gpu_indices=None,
                   start=start, end=start + timedelta(hours=hours), created=None, dtstamp=None,
                   calendar_url="http://calendar/", href="/e.ics")


def accepted(item: Booking, host: str = "node1") -> Accepted:
    return Accepted(item, tuple(range(item.gpu_count)), item.end, host)


# The source tree the account reads (quickstart copies a clone it cannot read to one it can).
REPO = Path(os.environ.get("GPUBOOK_TEST_TREE") or Path(__file__).resolve().parents[2])


class AsAccount(Scontrol):
    """A Slurm client run as the daemon's account with its own environment (the job inherits it, and
    its steps run rootless podman as that account)."""

    def __init__(self, user: str, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        account = pwd.getpwnam(user)
        self.user = user
        self.env = [f"HOME={account.pw_dir}", f"USER={user}", f"LOGNAME={user}",
                    f"XDG_RUNTIME_DIR=/run/user/{account.pw_uid}", f"PYTHONPATH={REPO}", "PYTHONDONTWRITEBYTECODE=1",
                    "PATH=/usr/local/bin:/usr/bin:/bin"]

    def argv(self, args: Sequence[str]) -> list[str]:
        return ["runuser", "-u", self.user, "--", "env", *self.env, f"SLURM_CONF={self.conf}", "TZ=UTC",
                *super().argv(args)]


def as_account(user: str, code: str) -> None:
    account = pwd.getpwnam(user)
    subprocess.run(["runuser", "-u", user, "--", "env", f"HOME={account.pw_dir}",
                    f"XDG_RUNTIME_DIR=/run/user/{account.pw_uid}", f"PYTHONPATH={REPO}", "PYTHONDONTWRITEBYTECODE=1",
                    sys.executable, "-c", code], cwd="/tmp", check=True, timeout=600)


class JobsOfAccount(SlurmJobs):
    """The test runs as root where the daemon runs as the account: the job folder is given to it."""

    def _make_folder(self, booking_id: str) -> Path:
        folder = super()._make_folder(booking_id)
        account = pwd.getpwnam(self.user)
        os.chown(folder, account.pw_uid, account.pw_gid)
        return folder

    def _write_order(self, path: Path, text: str) -> None:
        super()._write_order(path, text)
        account = pwd.getpwnam(self.user)
        os.chown(path, account.pw_uid, account.pw_gid)


def write_config(folder: Path, cluster: slurm_kit.Cluster, calendar_url: str, key: paramiko.PKey,
                 data: Path) -> Path:
    low, high = port_range()
    path = folder / "gpubook.toml"
    path.write_text("\n".join([
        '[host]', 'name = "login"', 'timezone = "UTC"', '',
        '[backend]', 'kind = "slurm"', f'slurm_conf = "{cluster.conf}"', f'shared_dir = "{folder / "shared"}"',
        'command_seconds = 5', '',
        '[[calendar]]', f'url = "{calendar_url}"', 'username = "test"', '',
        '[defaults]', 'template = "debian-ssh"', 'gpus = 1', 'warn_minutes = 0.1', '',
        '[engine]', 'name = "podman"', 'runtime = "runc"', 'storage_driver = "overlay"', 'stop_grace_seconds = 1', '',
        '[ssh]', f'port_min = {low}', f'port_max = {high}', '', '[storage]', f'data_root = "{data}"', '',
        '[daemon]', 'poll_seconds = 2', f'state_dir = "{folder / "state"}"', 'notice_seconds = 3',
        'restart_backoff_seconds = 1', '',
        '[users.alice]', 'uid = 2001', 'email = ["alice@lab.example"]', f'ssh_keys = ["{key_line(key)}"]', '',
    ]))
    path.chmod(0o644)
    return path


def reservations(cluster: slurm_kit.Cluster) -> dict[str, parse.Reservation]:
    text = subprocess.run(["scontrol", "show", "reservation", "--oneliner"], env={**cluster.env, "TZ": "UTC"},
                          capture_output=True, text=True, check=True).stdout
    return {r.name: r for r in parse.reservations(text) if r.name.startswith("gpubook-")}


def jobs(cluster: slurm_kit.Cluster) -> dict[str, str]:
    """gpubook's active jobs: name → job id."""
    text = subprocess.run(["squeue", "--noheader", "--format=%j %i %T"], env=cluster.env, capture_output=True,
                          text=True, check=True).stdout
    return {name: job for name, job, state in (line.split() for line in text.splitlines())
            if name.startswith("gpubook-") and state in ("PENDING", "RUNNING", "CONFIGURING")}


def login(address: str, port: int, key: paramiko.PKey) -> paramiko.SSHClient:
    client = paramiko.SSHClient()
    client.set_missing_host_key_policy(paramiko.AutoAddPolicy())  # noqa: S507 - a fresh container's host key
    client.connect(address, port=port, username="alice", pkey=key, timeout=10, look_for_keys=False,
                   allow_agent=False)
    return client


def run(client: paramiko.SSHClient, command: str) -> str:
    _, out, _ = client.exec_command(command, timeout=20)
    return out.read().decode()
