"""The SFTP data service's files: OpenSSH's sshd with internal-sftp, one chroot per user.

gpubook writes, into one folder that the service container mounts read-only at /etc/gpubook-sftp,
everything sshd reads: its config, its host key, `passwd` and `group` (the container's /etc/passwd
and /etc/group are symlinks to them, so a rewrite is seen at the next login without a restart)
and one authorized-keys file per user. sshd reads the keys and the accounts at every login: adding
or removing a user or a key is a file rewrite, and only a changed sshd_config needs a SIGHUP, which
sshd answers by re-executing its listener while every open session goes on.

Each user is chrooted into `<data_root>/<user>`, which belongs to the container's root (the daemon
user) with the user's group and mode 0750: sshd's ChrootDirectory rule holds (root's, not writable
by group or others), the user may list and enter it, and nobody else on the host may.

Every file here is plain text built from checked names (runtime.names) and public key lines
checked by the config; nothing reaches a shell.
"""

from __future__ import annotations

import errno
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from gpubook.runtime.booking.ssh import host_key_pair
from gpubook.runtime.data.usage_walk import Measure
from gpubook.runtime.errors import GpubookError
from gpubook.runtime.names import USER_NAME
from gpubook.runtime.ports import bind_error
from gpubook.runtime.private import write_private

ETC_TARGET = "/etc/gpubook-sftp"
DATA_TARGET = "/srv/gpubook-data"
SERVICE_NAME = "gpubook-sftp"
LABEL_SERVICE = "gpubook.service"
# Accounts the service container needs itself; a gpubook user of one of these names or ids is left out.
RESERVED_NAMES = frozenset({"root", "sshd", "nogroup", "nobody"})
SSHD_UID = 65534
OVER_QUOTA_GROUP = "gpubook-over-quota"  # sshd's Match Group: members may read and delete, not write
OVER_QUOTA_GID = 65533
OVER_QUOTA_FILE = "OVER-QUOTA.txt"
RESERVED_IDS = frozenset({0, SSHD_UID, OVER_QUOTA_GID})
OVER_QUOTA_BANNER = ("gpubook: you are over your storage quota: uploads are refused until you delete files "
                     "(rm in input/ or output/). OVER-QUOTA.txt in your folder says how much you use.")
# Requests refused to a user over quota: every way to add bytes. Reading, listing, removing and
# renaming stay, so that they can free space.
OVER_QUOTA_DENIED = ("write", "copy-data", "mkdir", "symlink", "hardlink")
# The container's command: the account files are gpubook's, then sshd in the foreground (-e: its
# log lines go to the engine's log). A fixed argv: no name or path from the config is in it.
COMMAND = (
    "/bin/sh", "-c",
    f"ln -sf {ETC_TARGET}/passwd /etc/passwd && ln -sf {ETC_TARGET}/group /etc/group && "
    f"mkdir -p /run/sshd && exec /usr/sbin/sshd -D -e -f {ETC_TARGET}/sshd_config",
)
# What sshd's monitor needs as root of the container: change to the user's ids, chroot, and end a
# session (of a user removed or over quota). Everything else is dropped: no DAC_OVERRIDE, so root
# too meets the files' modes.
CAPABILITIES = ("SETUID", "SETGID", "SYS_CHROOT", "KILL", "AUDIT_WRITE")
# The calls that set a file's mode, with the mode's argument index: chmod's three, and the three
# that create a file (internal-sftp's OPEN hands the client's `a.perm`, set-id bits included, to
# open(2); glibc passes 0 as the mode of an open without O_CREAT).
_CHMOD_CALLS = {"chmod": 1, "fchmod": 1, "fchmodat": 2, "open": 2, "openat": 3, "creat": 1}
# Calls whose mode cannot be filtered (fchmodat2's flags aside, openat2's is in a struct): ENOSYS,
# so that glibc and any caller fall back to fchmodat and openat above, whatever the host's profile allows.
_UNFILTERED_CALLS = ("fchmodat2", "openat2")
_ENOSYS = 38
_SET_ID_BITS = 0o6000
WALK_GRACE = 30.0  # seconds a measure may take beyond its walk's bound (podman unshare, Python's start)
DEFAULT_SECCOMP = Path("/usr/share/containers/seccomp.json")


class SftpError(GpubookError):
    """The SFTP service cannot be set up (its files, its image, its port)."""


@dataclass(frozen=True)
class SftpUser:
    """One account: its container ids (those of its bookings), its keys, and whether it is over
    its quota (then `quota_note` is the sentence OVER-QUOTA.txt in its folder says)."""

    name: str
    uid: int
    gid: int
    keys: tuple[str, ...]
    quota_note: str | None = None


def usable(users: Iterable[SftpUser]) -> tuple[list[SftpUser], list[str]]:
    """The users the service can serve, and one sentence for each it leaves out."""
    kept, left = [], []
    for user in users:
        if not USER_NAME.fullmatch(user.name):
            left.append(f"user {user.name!r}: not a valid user name")
        elif user.name in RESERVED_NAMES:
            left.append(f"user {user.name}: the name is one of the service's own accounts")
        elif user.uid in RESERVED_IDS or user.gid in RESERVED_IDS:
            left.append(f"user {user.name}: uid or gid 0, {OVER_QUOTA_GID} or {SSHD_UID} is one of the "
                        f"service's own ids")
        elif not user.keys:
            left.append(f"user {user.name}: no ssh_keys, so no login")
        else:
            kept.append(user)
    return kept, left


def sshd_config(*, port: int, listen: str) -> str:
    """sshd's config: keys only, internal-sftp only, chrooted, nothing forwarded. It names no user:
    who may log in (passwd, keys) and who is over quota (a group) are files sshd reads at each
    login, so no change of users ever makes sshd reload (a reload re-binds its port: a login in
    that moment would be refused)."""
    lines = [
        "# Written by gpubook.",
        f"Port {port}",
        *(f"ListenAddress {address}" for address in listen_addresses(listen)),
        f"HostKey {ETC_TARGET}/host_key",
        f"AuthorizedKeysFile {ETC_TARGET}/keys/%u",
        "AuthenticationMethods publickey",
        "PubkeyAuthentication yes",
        "PasswordAuthentication no",
        "KbdInteractiveAuthentication no",
        "HostbasedAuthentication no",
        "PermitRootLogin no",
        "DenyUsers root sshd",
        "UsePAM no",
        "PermitEmptyPasswords no",
        "DisableForwarding yes",
        "AllowTcpForwarding no",
        "AllowAgentForwarding no",
        "AllowStreamLocalForwarding no",
        "X11Forwarding no",
        "PermitTunnel no",
        "PermitTTY no",
        "PermitUserRC no",
        "PermitUserEnvironment no",
        "StrictModes yes",
        "LoginGraceTime 30",
        "MaxStartups 30:50:200",
        "ClientAliveInterval 60",
        "ClientAliveCountMax 5",
        "LogLevel VERBOSE",
        "Subsystem sftp internal-sftp",
        f"ChrootDirectory {DATA_TARGET}/%u",
        "ForceCommand internal-sftp -u 0022",
        f"Match Group {OVER_QUOTA_GROUP}",
        f"    Banner {ETC_TARGET}/over-quota",
        f"    ForceCommand internal-sftp -u 0022 -P {','.join(OVER_QUOTA_DENIED)}",
    ]
    return "\n".join(lines) + "\n"


def listen_addresses(listen: str) -> tuple[str, ...]:
    """The addresses sshd binds for `listen`: a wildcard means both families. OpenSSH binds an IPv6
    listener IPV6_V6ONLY, so "0.0.0.0" alone would leave [::]:PORT to any other local account, and
    IPv6 clients would reach that squatter instead of the service."""
    if listen in ("0.0.0.0", "::"):  # noqa: S104 - the configured wildcard
        return ("0.0.0.0", "::")  # noqa: S104
    return (listen,)


def taken_address(port: int, addresses: Sequence[str]) -> str | None:
    """The first of `addresses` where another process already listens on `port` (a bind of our own
    fails with EADDRINUSE), None when every one is free. An address family the host lacks (no
    IPv6) is free: nobody can squat it either."""
    return next((address for address in addresses if bind_error(address, port) == errno.EADDRINUSE), None)


def bind_failures(log_text: str, port: int) -> list[str]:
    """The addresses sshd's log says it could not bind `port` on because another process holds it
    ("Bind to port 2222 on :: failed: Address already in use."), on a line of its own: sshd's
    "Invalid user NAME from …" carries any name a client sends, that very sentence too, and the
    service would stop on it (round 3, L1)."""
    found = re.findall(rf"^Bind to port {port} on (\S+) failed: Address already in use\.?\r?$", log_text,
                       flags=re.MULTILINE)
    return sorted(set(found))


def passwd(users: Sequence[SftpUser]) -> str:
    lines = ["root:x:0:0:root:/root:/usr/sbin/nologin", f"sshd:x:{SSHD_UID}:{SSHD_UID}::/run/sshd:/usr/sbin/nologin"]
    lines += [f"{user.name}:x:{user.uid}:{user.gid}::/:/usr/sbin/nologin" for user in users]
    return "\n".join(lines) + "\n"


def group(users: Sequence[SftpUser]) -> str:
    lines = ["root:x:0:", f"nogroup:x:{SSHD_UID}:"]
    names: dict[int, str] = {}
    for user in users:
        names.setdefault(user.gid, user.name)
    lines += [f"{name}:x:{gid}:" for gid, name in names.items()]
    over = ",".join(user.name for user in users if user.quota_note is not None)
    lines.append(f"{OVER_QUOTA_GROUP}:x:{OVER_QUOTA_GID}:{over}")
    return "\n".join(lines) + "\n"


def authorized_keys(user: SftpUser) -> str:
    # `restrict`: no pty, no forwarding of any kind, whatever sshd_config says.
    return "".join(f"restrict {key.strip()}\n" for key in user.keys)


@dataclass(frozen=True)
class Written:
    """What a rewrite of the service's files changed."""

    config_changed: bool  # sshd_config differs (a new gpubook's): sshd needs a SIGHUP
    removed: tuple[SftpUser, ...]  # users gone since the last write: their sessions are ended
    host_key: str  # the service's public host key line


def write_files(etc: Path, *, port: int, listen: str, users: Sequence[SftpUser],
                previous: Sequence[SftpUser] = ()) -> Written:
    """(Re)write the folder sshd reads; each file replaced whole (rename), never half-written."""
    keys = etc / "keys"
    for folder in (etc, keys):
        folder.mkdir(mode=0o755, exist_ok=True)
        os.chmod(folder, 0o755)  # noqa: S103 - sshd's StrictModes: no folder on the way may be group/other-writable
    public = host_key(etc)
    changed = write_public(etc / "sshd_config", sshd_config(port=port, listen=listen))
    write_public(etc / "over-quota", OVER_QUOTA_BANNER + "\n")
    write_public(etc / "passwd", passwd(users))
    write_public(etc / "group", group(users))
    names = {user.name for user in users}
    for user in users:
        write_public(keys / user.name, authorized_keys(user))
    for path in keys.iterdir():
        if path.name not in names:
            path.unlink(missing_ok=True)
    removed = tuple(user for user in previous if user.name not in names)
    return Written(config_changed=changed, removed=removed, host_key=public)


def write_public(path: Path, text: str) -> bool:
    """Write `text` to `path` (mode 0644: sshd's accounts and keys, a user's quota note) unless it
    is there already; True when it changed."""
    try:
        if path.read_text() == text:
            return False
    except (FileNotFoundError, UnicodeDecodeError):
        pass
    write_private(path, text.encode())
    os.chmod(path, 0o644)  # noqa: S103 - public by design: read by sshd as the container's root
    return True


def host_key(etc: Path) -> str:
    """The service's ed25519 host key (made once, kept across restarts): its public line."""
    return host_key_pair(etc / "host_key", etc / "host_key.pub")


def seccomp_profile(base: Path = DEFAULT_SECCOMP) -> dict[str, object]:
    """The engine's default seccomp profile where chmod can never set the setuid or setgid bit.

    internal-sftp passes a client's SETSTAT mode to chmod(2) and its OPEN mode to open(2), with
    those bits; the data folders' nosuid mount already takes their power away, this also keeps them
    off the files. The chmod and create calls leave the allow lists and come back allowed only when
    `mode & 06000 == 0`; any other mode gets EPERM ("Permission denied" in the client);
    fchmodat2 and openat2 get ENOSYS (their callers fall back to the filtered calls).
    Without the engine's file (Docker alone installs none), the profile allows everything else.
    """
    try:
        profile: dict[str, object] = json.loads(base.read_text())
    except FileNotFoundError:
        profile = {"defaultAction": "SCMP_ACT_ALLOW", "syscalls": []}
    except (OSError, ValueError) as error:
        raise SftpError(f"seccomp profile {base}: {error}") from None
    rules = profile.get("syscalls")
    if not isinstance(rules, list):
        raise SftpError(f"seccomp profile {base}: no syscalls list")
    for rule in rules:
        if rule.get("action") == "SCMP_ACT_ALLOW":
            rule["names"] = [name for name in rule.get("names", [])
                             if name not in _UNFILTERED_CALLS and name not in _CHMOD_CALLS]
    rules.append({"names": list(_UNFILTERED_CALLS), "action": "SCMP_ACT_ERRNO", "errnoRet": _ENOSYS})
    for name, index in _CHMOD_CALLS.items():
        rules.append({"names": [name], "action": "SCMP_ACT_ALLOW",
                      "args": [{"index": index, "value": _SET_ID_BITS, "valueTwo": 0, "op": "SCMP_CMP_MASKED_EQ"}]})
        for bits in (0o4000, 0o2000, 0o6000):
            rules.append({"names": [name], "action": "SCMP_ACT_ERRNO", "errnoRet": 1,
                          "args": [{"index": index, "value": _SET_ID_BITS, "valueTwo": bits,
                                    "op": "SCMP_CMP_MASKED_EQ"}]})
    return profile


def write_seccomp(path: Path, base: Path = DEFAULT_SECCOMP) -> Path:
    write_public(path, json.dumps(seccomp_profile(base), indent=1))
    return path


def measure(folder: Path, *, owner_argv: Sequence[str] | None, seconds: float, stop_bytes: int | None = None,
            stop_files: int | None = None) -> Measure:
    """A user's folder measured (usage_walk) as the owner of every booker's file: `owner_argv` is
    the engine's way to become it (rootless podman: `podman unshare`; [] when the daemon is that
    owner already). None: nothing can; the walk runs as the daemon's user, and whatever it cannot
    read makes the measure incomplete (a lower bound), never a silent 0."""
    argv = [*(owner_argv or ()), sys.executable, "-P", "-m", "gpubook.runtime.data.usage_walk",
            "--seconds", f"{seconds:g}",
            *(["--stop-bytes", str(stop_bytes)] if stop_bytes is not None else []),
            *(["--stop-files", str(stop_files)] if stop_files is not None else []), "--", str(folder)]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=seconds + WALK_GRACE, check=False,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise SftpError(f"measuring {folder} took more than {seconds + WALK_GRACE:g} s") from None
    except OSError as error:
        raise SftpError(f"measuring {folder}: {error}") from None
    try:
        data = json.loads(done.stdout)
        return Measure(bytes=int(data["bytes"]), files=int(data["files"]), complete=bool(data["complete"]),
                       timed_out=bool(data["timed_out"]), unreadable=int(data["unreadable"]))
    except (ValueError, KeyError, TypeError):
        why = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise SftpError(f"measuring {folder} failed (exit status {done.returncode}): {why}") from None
