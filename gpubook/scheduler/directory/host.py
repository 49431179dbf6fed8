"""Reading the group's members from this host's name service ([directory] source = "host"): whatever NSS
gives (/etc/passwd and /etc/group, SSSD, nslcd), through Python's grp and pwd, as `getent` would.

The members are the group's member list and the accounts whose primary group it is (found by
enumerating the accounts: SSSD enumerates only with `enumerate = true`, so list such members in the
group itself there). Calendar identities come from `mail_pattern`, SSH keys from `keys_command` run for
each member (argv only, `{user}` replaced by a checked login; `sss_ssh_authorizedkeys` for SSSD)."""

from __future__ import annotations

import grp
import logging
import pwd
import subprocess
from collections.abc import Mapping

from gpubook.scheduler.directory.errors import DirectoryError
from gpubook.scheduler.directory.settings import DirectoryConfig
from gpubook.scheduler.directory.users import RawEntry
from gpubook.scheduler.settings import checks

log = logging.getLogger(__name__)
_NO_PROJECTS: Mapping[str, str] = {}


def members(group: str) -> list[pwd.struct_passwd]:
    """The accounts of `group`: its member list, then those whose primary group it is, each once."""
    try:
        entry = grp.getgrnam(group)
    except KeyError:
        raise DirectoryError(f"the host group {group!r} does not exist (getent group {group})") from None
    found: dict[str, pwd.struct_passwd] = {}
    for name in entry.gr_mem:
        try:
            found.setdefault(name, pwd.getpwnam(name))
        except KeyError:
            log.warning("host group %s: member %r has no account (getent passwd %s): left out", group, name, name)
    for account in pwd.getpwall():
        if account.pw_gid == entry.gr_gid:
            found.setdefault(account.pw_name, account)
    return list(found.values())


def keys(settings: DirectoryConfig, login: str) -> list[str]:
    """The output lines of `keys_command` for `login`; none (said) when it fails or takes too long."""
    if not settings.keys_command:
        return []
    argv = [part.replace("{user}", login) for part in settings.keys_command]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=settings.timeout_seconds, check=False,
                              stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as error:
        log.warning("directory: keys of %s not read: %s: %s", login, argv[0], error)
        return []
    if done.returncode != 0:
        said = (done.stderr or done.stdout).strip()[-300:]
        log.warning("directory: keys of %s not read: %s exited %d: %s", login, argv[0], done.returncode, said)
        return []
    return [line.strip() for line in done.stdout.splitlines() if line.strip() and not line.startswith("#")]


def _project_members(projects: Mapping[str, str]) -> dict[str, set[str]]:
    """Each project's logins, by its [groups.NAME]; a host group that does not exist has none (said)."""
    found: dict[str, set[str]] = {}
    for name, group in projects.items():
        try:
            found[name] = {account.pw_name for account in members(group)}
        except DirectoryError:
            log.warning("host group %r of [groups.%s] does not exist: nobody is in %s", group, name, name)
            found[name] = set()
    return found


def read(settings: DirectoryConfig, projects: Mapping[str, str] = _NO_PROJECTS) -> list[RawEntry]:
    """Every member of the host group `group`, as the LDAP reader gives its entries, each with the
    `projects` ([groups.NAME] → host group name) whose host group has them, in their order."""
    listed = _project_members(projects)
    entries = []
    for account in members(settings.group or ""):
        login = account.pw_name
        valid = checks.user_name(login) is None  # a login that is no gpubook name: checked() says so
        emails = [settings.mail_pattern.replace("{user}", login)] if settings.mail_pattern and valid else []
        entries.append(RawEntry(dn=f"host account {login}", name=[login], uid=[str(account.pw_uid)],
                                gid=[str(account.pw_gid)], emails=emails,
                                ssh_keys=keys(settings, login) if valid else [],
                                groups=tuple(name for name, logins in listed.items() if login in logins)))
    return entries
