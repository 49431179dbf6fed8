"""[directory]: where gpubook's users come from, declared beside the readers (directory/ldap.py, host.py)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpubook.scheduler.settings import Section, checks, setting

SOURCES = ("file", "ldap", "host")
EXTERNAL = ("ldap", "host")  # the sources that give users beside the [users.NAME] tables


@dataclass(frozen=True)
class DirectoryConfig:
    """[directory]: "file" ([users.NAME] only), "ldap" (the lab's directory) or "host" (this host's name
    service), the last two with [users.NAME] tables for limits."""

    source: str = setting("file", '"file": the users are the [users.NAME] tables; "ldap": the members of `group` in '
                          'the LDAP directory at `url`; "host": the members of the host group `group` as this '
                          "host's name service (NSS: /etc/group, SSSD, nslcd) gives them; with [users.NAME] "
                          "tables setting the limits of either", check=checks.one_of(SOURCES))
    url: str | None = setting(None, "ldaps://HOST[:PORT], or ldap://HOST[:PORT] with start_tls = true",
                              sample="ldaps://ldap.lab.example")
    start_tls: bool = setting(False, "upgrade an ldap:// connection with StartTLS (required for ldap://)")
    ca_file: Path | None = setting(None, "the CA certificate(s) the directory's certificate is checked against "
                                   "(PEM); default: the system's", sample="/etc/ssl/certs/lab-ca.pem")
    bind_dn: str | None = setting(None, "the DN gpubook binds as; default: an anonymous bind",
                                  sample="cn=gpubook,ou=services,dc=lab,dc=example")
    bind_password: str | None = setting(None, "file holding the bind DN's password (mode 0600)",
                                        key="password_file", secret=True, sample="ldap-password")
    base: str = setting("", "the search base of users", sample="dc=lab,dc=example")
    user_filter: str = setting("(objectClass=posixAccount)", "LDAP filter of user entries")
    group: str | None = setting(None, "ldap: DN of the group whose members may book (posixGroup memberUid, "
                                "groupOfNames member, groupOfUniqueNames uniqueMember), default every user the "
                                "filter finds; host: the group's name (its members and the accounts whose "
                                "primary group it is)", sample="cn=gpu-users,ou=groups,dc=lab,dc=example")
    mail_pattern: str | None = setting(None, "host: each user's calendar identity, {user} standing for the "
                                       "login; default: none (a [users.NAME] table may give them)",
                                       sample="{user}@lab.example")
    keys_command: tuple[str, ...] = setting((), "host: the command (argv, {user} standing for the login) whose "
                                            "output lines are the user's SSH public keys; default: none",
                                            sample=("/usr/bin/sss_ssh_authorizedkeys", "{user}"))
    name_attribute: str = setting("uid", 'the attribute holding the user\'s name (Active Directory: "sAMAccountName")')
    mail_attributes: tuple[str, ...] = setting(("mail",), "attributes whose values are the user's calendar "
                                               'identities (e-mail addresses; "SMTP:" prefixes are dropped)')
    key_attribute: str = setting("sshPublicKey", "the attribute holding SSH public key lines (openssh-lpk)")
    refresh_minutes: float = setting(15.0, "minutes between reads of the directory by the daemon",
                                     check=checks.positive)
    timeout_seconds: float = setting(10.0, "seconds to connect and to wait for each answer", check=checks.positive)


def problems(settings: DirectoryConfig) -> Iterable[tuple[str, str]]:
    if settings.source == "host":
        if not settings.group:
            yield "group", 'is required with source = "host": the host group whose members may book'
        if settings.mail_pattern is not None and "{user}" not in settings.mail_pattern:
            yield "mail_pattern", "must hold {user}, which stands for the login"
        if settings.keys_command and not settings.keys_command[0].startswith("/"):
            yield "keys_command", f"must start with an absolute path, not {settings.keys_command[0]!r}"
        return
    if settings.source != "ldap":
        return
    if not settings.url:
        yield "url", 'is required with source = "ldap"'
    elif settings.url.startswith("ldap://"):
        if not settings.start_tls:
            yield "url", ("is plain ldap://: the bind password and the users would cross the network unencrypted; "
                          "use ldaps:// or set start_tls = true")
    elif not settings.url.startswith("ldaps://"):
        yield "url", f"must start with ldaps:// or ldap://, not {settings.url!r}"
    if not settings.base:
        yield "base", 'is required with source = "ldap"'
    if settings.bind_dn and settings.bind_password is None:
        yield "password_file", "is required with bind_dn"


def _problems(value: Any) -> Iterable[tuple[str, str]]:
    return problems(value)


SECTION = Section("directory", DirectoryConfig, "where the users come from: the [users.NAME] tables, or the lab's "
                  "LDAP directory", problems=_problems)
