"""An admin's install on this machine, for the root tests that make one (tests/test_install.py,
tests/test_upgrade.py): a fresh account with its own data folder and venv prefix, the account's
commands run as `runuser` with a clean environment would run them, and everything removed again
(before, too, in case an earlier run was killed)."""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import paramiko

from gpubook.scheduler.commands.setup_steps import fstab_line

FSTAB = Path("/etc/fstab")


def quiet(argv: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
    """Without the checkout on PYTHONPATH (quickstart exports it for the tests): a venv's pip would
    take the checkout's gpubook for installed and skip the wheel ("Requirement already satisfied")."""
    kwargs.setdefault("env", {k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    return subprocess.run(argv, capture_output=True, text=True, timeout=600, check=False, **kwargs)  # type: ignore[call-overload]


def account_env(entry: pwd.struct_passwd) -> dict[str, str]:
    """What `runuser` with a clean environment gives: no PYTHONPATH, no checkout anywhere."""
    return {"HOME": entry.pw_dir, "USER": entry.pw_name, "LOGNAME": entry.pw_name, "LANG": "C.UTF-8",
            "PATH": "/usr/local/bin:/usr/bin:/bin", "XDG_RUNTIME_DIR": f"/run/user/{entry.pw_uid}"}


def mounted(path: Path) -> int:
    """How many mounts sit on `path` (os.path.ismount misses a bind mount within one file system)."""
    points = [line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()]
    return points.count(str(path))


@dataclass(frozen=True)
class Site:
    """One install: `account`, its data_root `data` and the venv under `prefix` (outside the checkout,
    readable by the account)."""

    account: str
    data: Path
    prefix: Path

    @property
    def venv(self) -> Path:
        return self.prefix / "venv"

    @property
    def binary(self) -> Path:
        return self.venv / "bin" / "gpubook"

    def entry(self) -> pwd.struct_passwd:
        return pwd.getpwnam(self.account)

    def as_account(self, *argv: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        entry = self.entry()
        return subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, check=False,
                              cwd=entry.pw_dir, env=account_env(entry), user=entry.pw_uid, group=entry.pw_gid,
                              extra_groups=[])

    def popen_as_account(self, argv: list[str], log: Path) -> subprocess.Popen[bytes]:
        """A long-running command of the account's (the daemon), its output appended to `log`."""
        entry = self.entry()
        with log.open("ab") as stream:
            return subprocess.Popen(argv, stdout=stream, stderr=stream, stdin=subprocess.DEVNULL, cwd=entry.pw_dir,
                                    env=account_env(entry), user=entry.pw_uid, group=entry.pw_gid, extra_groups=[])

    def remove_everything(self, *, keep_venv: bool = False) -> None:
        """Undo gpubook setup and the test: each piece only if it is there (the installed venv too,
        unless `keep_venv`)."""
        try:
            entry = self.entry()
        except KeyError:
            entry = None
        if entry is not None:
            if Path(entry.pw_dir).is_dir():
                self.as_account("podman", "rm", "--all", "--force", "--time", "0")
                self.as_account("podman", "system", "reset", "--force")  # the store's files belong to its subuids
            for pid in quiet(["pgrep", "-u", str(entry.pw_uid)]).stdout.split():
                try:
                    os.kill(int(pid), signal.SIGKILL)  # the account's own leftovers (podman's pause process)
                except ProcessLookupError:
                    pass
            quiet(["userdel", "--remove", self.account])
            shutil.rmtree(f"/run/user/{entry.pw_uid}", ignore_errors=True)
        for _ in range(mounted(self.data)):  # a bind mount made twice (by a killed earlier run) is stacked
            quiet(["umount", str(self.data)])
        lines = FSTAB.read_text().splitlines(keepends=True)
        kept = [line for line in lines if line.strip() != fstab_line(self.data)]
        if kept != lines:
            FSTAB.write_text("".join(kept))
        for path in (Path("/etc/subuid"), Path("/etc/subgid")):
            text = path.read_text() if path.is_file() else ""
            kept_ids = "".join(line for line in text.splitlines(keepends=True)
                               if not line.startswith(f"{self.account}:"))
            if kept_ids != text:
                path.write_text(kept_ids)
        shutil.rmtree(self.data, ignore_errors=True)
        if not keep_venv:
            shutil.rmtree(self.prefix, ignore_errors=True)

    def install(self, wheel: Path, *, constraints: Path | None) -> None:
        """`wheel` into the venv (made from Debian's python if it is not there), at `constraints`' versions;
        a venv that has gpubook gets this wheel instead (an upgrade or a downgrade)."""
        if not (self.venv / "bin" / "python").is_file():
            self.prefix.mkdir(mode=0o755, parents=True, exist_ok=True)
            made = quiet(["/usr/bin/python3", "-m", "venv", str(self.venv)])
            assert made.returncode == 0, made.stderr
        pinned = ["-c", str(constraints)] if constraints is not None and constraints.is_file() else []
        installed = quiet([str(self.venv / "bin" / "python"), "-m", "pip", "install", "--disable-pip-version-check",
                           "--force-reinstall", "--no-deps", str(wheel)], cwd="/")
        assert installed.returncode == 0, installed.stdout[-2000:] + installed.stderr[-2000:]
        deps = quiet([str(self.venv / "bin" / "python"), "-m", "pip", "install", "--disable-pip-version-check",
                      *pinned, str(wheel)], cwd="/")
        assert deps.returncode == 0, deps.stdout[-2000:] + deps.stderr[-2000:]
        assert self.binary.is_file(), f"pip installed no {self.binary}: {installed.stdout[-2000:]}"


def build_wheel(source: Path, into: Path) -> Path:
    """`pip wheel --no-deps` of a source tree (a copy: setuptools would take stale files from a tree's build/)."""
    copy = into / "source"
    shutil.copytree(source, copy, ignore=shutil.ignore_patterns(
        ".git", "build", "*.egg-info", "__pycache__", ".*_cache", ".hypothesis", "dist", ".bundle-*"))
    wheels = into / "wheels"
    built = quiet([sys.executable, "-m", "pip", "wheel", "--no-deps", "--disable-pip-version-check",
                   "--wheel-dir", str(wheels), str(copy)])
    assert built.returncode == 0, built.stdout + built.stderr
    (wheel,) = wheels.glob("gpubook-*.whl")
    return wheel


def login(port: int, user: str, known_hosts: Path, key: paramiko.PKey) -> paramiko.SSHClient | None:
    """SSH as `user`, trusting only the host keys of `known_hosts` (the event's line); None while sshd
    does not answer yet. Another host key raises."""
    client = paramiko.SSHClient()
    client.load_host_keys(str(known_hosts))
    client.set_missing_host_key_policy(paramiko.RejectPolicy())
    try:
        client.connect("127.0.0.1", port=port, username=user, pkey=key, look_for_keys=False, allow_agent=False,
                       timeout=5, banner_timeout=5, auth_timeout=5)
    except paramiko.BadHostKeyException:
        raise
    except (OSError, EOFError, paramiko.SSHException):
        client.close()
        return None
    return client
