"""What the SFTP tests share: the bookers' keys as files and OpenSSH's own clients, trusting only
the known_hosts file the test wrote (StrictHostKeyChecking=yes)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import paramiko


def key_files(folder: Path, keys: dict[str, paramiko.PKey]) -> dict[str, Path]:
    """Each user's private key in `folder`, mode 600 (OpenSSH refuses others)."""
    files = {}
    for name, key in keys.items():
        path = folder / f"{name}.key"
        key.write_private_key_file(str(path))
        path.chmod(0o600)
        files[name] = path
    return files


def openssh(program: str, *args: str, port: int, key_file: Path, known_hosts: Path,
            stdin: str = "") -> subprocess.CompletedProcess[str]:
    """`sftp` or `ssh` as a booker runs it, with one key and no agent, never asking anything."""
    port_flag = "-P" if program == "sftp" else "-p"
    argv = [program, port_flag, str(port), "-i", str(key_file), "-o", "IdentitiesOnly=yes", "-o", "BatchMode=yes",
            "-o", f"UserKnownHostsFile={known_hosts}", "-o", "StrictHostKeyChecking=yes",
            "-o", "ConnectTimeout=10", *args]
    return subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=60, check=False)


def sftp_batch(user: str, commands: str, *, port: int, key_file: Path,
               known_hosts: Path) -> subprocess.CompletedProcess[str]:
    """`sftp -b -` with `commands` on stdin: stops at the first that fails, exit status 1 then."""
    return openssh("sftp", "-b", "-", f"{user}@127.0.0.1", port=port, key_file=key_file, known_hosts=known_hosts,
                   stdin=commands)
