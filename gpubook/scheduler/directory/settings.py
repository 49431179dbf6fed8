"""[directory]: where gpubook's users come from, declared beside the reader (directory/ldap.py)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpubook.scheduler.settings import Section, checks, setting


@dataclass(frozen=True)
class DirectoryConfig:
    """[directory]: "file" ([users.NAME] only) or "ldap" (the lab's directory, plus [users.NAME])."""

    source: str = setting("file", '"file": the users are the [users.NAME] tables; "ldap": the members of `group` in '
                          "the LDAP directory at `url`, with [users.NAME] tables setting their limits",
                          check=checks.one_of(("file", "ldap")))
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
    group: str | None = setting(None, "DN of the group whose members may book (posixGroup memberUid, "
                                "groupOfNames member, groupOfUniqueNames uniqueMember); default: every user "
                                "the filter finds", sample="cn=gpu-users,ou=groups,dc=lab,dc=example")
    name_attribute: str = setting("uid", 'the attribute holding the user\'s name (Active Directory: "sAMAccountName")')
    mail_attributes: tuple[str, ...] = setting(("mail",), "attributes whose values are the user's calendar "
                                               'identities (e-mail addresses; "SMTP:" prefixes are dropped)')
    key_attribute: str = setting("sshPublicKey", "the attribute holding SSH public key lines (openssh-lpk)")
    refresh_minutes: float = setting(15.0, "minutes between reads of the directory by the daemon",
                                     check=checks.positive)
    timeout_seconds: float = setting(10.0, "seconds to connect and to wait for each answer", check=checks.positive)


def problems(settings: DirectoryConfig) -> Iterable[tuple[str, str]]:
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
