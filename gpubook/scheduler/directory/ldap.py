"""Reading the group's members from an LDAP directory (ldap3), over LDAPS or StartTLS only, and which
of the configured [groups.NAME] (projects) each member is in; and checking one user's password by a
bind as that user (the page's auth "ldap", web/directory_login.py)."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import ssl
from collections.abc import Mapping
from typing import Any

from gpubook.scheduler.directory.errors import DirectoryError
from gpubook.scheduler.directory.settings import DirectoryConfig
from gpubook.scheduler.directory.users import RawEntry

log = logging.getLogger(__name__)
GROUP_ATTRIBUTES = ["memberUid", "member", "uniqueMember"]
_NO_PROJECTS: Mapping[str, str] = {}


def _connection(settings: DirectoryConfig, *, as_user: tuple[str, str] | None = None) -> Any:
    """A bound connection: as gpubook's own bind_dn, or `as_user` (DN, password) and nothing else."""
    import ldap3  # the optional extra `ldap`

    url = settings.url or ""
    timeout = max(1, math.ceil(settings.timeout_seconds))  # ldap3 packs it into a socket option: whole seconds
    if url.startswith("ldap://") and not settings.start_tls:
        raise DirectoryError(f"{url}: plain ldap:// without start_tls is refused")
    tls = ldap3.Tls(validate=ssl.CERT_REQUIRED, version=ssl.PROTOCOL_TLS_CLIENT,
                    ca_certs_file=str(settings.ca_file) if settings.ca_file else None)
    server = ldap3.Server(url, use_ssl=url.startswith("ldaps://"), tls=tls, get_info=ldap3.NONE,
                          connect_timeout=timeout)
    user, password = as_user if as_user is not None else (settings.bind_dn, settings.bind_password)
    connection = ldap3.Connection(server, user=user, password=password,
                                  receive_timeout=timeout, raise_exceptions=True,
                                  read_only=True, auto_bind=ldap3.AUTO_BIND_NONE)
    try:
        connection.open()
        if settings.start_tls:
            connection.start_tls()
        connection.bind()
    except Exception:
        with contextlib.suppress(Exception):  # the error to raise is the first one
            connection.unbind()  # closes the socket: a refused bind (a wrong password at a login) leaves none open
        raise
    return connection


def _values(attributes: dict[str, Any], name: str) -> list[str]:
    value = attributes.get(name)
    if value is None:
        return []
    items = value if isinstance(value, list) else [value]
    return [item.decode() if isinstance(item, bytes) else str(item) for item in items]


def _members(connection: Any, group: str) -> tuple[set[str], set[str]]:
    """The group's memberUid names and member DNs (lowercase)."""
    connection.search(group, "(objectClass=*)", search_scope="BASE", attributes=GROUP_ATTRIBUTES)
    if not connection.entries:
        raise DirectoryError(f"the group {group} was not found")
    attributes = connection.response[0]["attributes"]
    names = set(_values(attributes, "memberUid"))
    dns = {dn.lower().replace(", ", ",") for dn in (*_values(attributes, "member"),
                                                    *_values(attributes, "uniqueMember"))}
    return names, dns


def _projects(connection: Any, projects: Mapping[str, str]) -> dict[str, tuple[set[str], set[str]]]:
    """Each project's members (memberUid names, member DNs), by its [groups.NAME]; a group that is not
    found has none (said), so one wrong DN never takes the directory's users away."""
    from ldap3.core.exceptions import LDAPNoSuchObjectResult

    found: dict[str, tuple[set[str], set[str]]] = {}
    for name, dn in projects.items():
        try:
            found[name] = _members(connection, dn)
        except (DirectoryError, LDAPNoSuchObjectResult):
            log.warning("directory: the group %s of [groups.%s] was not found: nobody is in %s", dn, name, name)
            found[name] = (set(), set())
    return found


def _is_member(entry: RawEntry, members: tuple[set[str], set[str]]) -> bool:
    return bool(set(entry.name) & members[0]) or entry.dn.lower().replace(", ", ",") in members[1]


def read(settings: DirectoryConfig, projects: Mapping[str, str] = _NO_PROJECTS) -> list[RawEntry]:
    """Every entry of the filter that is a member of the group (all of them without a group), each with
    the `projects` ([groups.NAME] → the LDAP group's DN) whose group lists it, in their order."""
    import ldap3
    from ldap3.core.exceptions import LDAPException

    names = [settings.name_attribute, "uidNumber", "gidNumber", *settings.mail_attributes, settings.key_attribute]
    try:
        connection = _connection(settings)
        try:
            members = _members(connection, settings.group) if settings.group else None
            listed = _projects(connection, projects)
            found = connection.extend.standard.paged_search(settings.base, settings.user_filter,
                                                            search_scope=ldap3.SUBTREE, attributes=names,
                                                            paged_size=500, generator=False)
        finally:
            connection.unbind()
    except LDAPException as error:
        raise DirectoryError(f"{settings.url}: {type(error).__name__}: {error}") from None
    entries = []
    for item in found:
        if item.get("type") != "searchResEntry":
            continue
        attributes = item["attributes"]
        entry = RawEntry(
            dn=item["dn"], name=_values(attributes, settings.name_attribute),
            uid=_values(attributes, "uidNumber"), gid=_values(attributes, "gidNumber"),
            emails=[v for a in settings.mail_attributes for v in _values(attributes, a)],
            ssh_keys=_values(attributes, settings.key_attribute))
        if members is not None and not _is_member(entry, members):
            continue
        entries.append(dataclasses.replace(entry, groups=tuple(name for name, group in listed.items()
                                                              if _is_member(entry, group))))
    return entries


def escaped(value: str) -> str:
    """`value` as a literal in an LDAP filter (RFC 4515): its `\\`, `*`, `(`, `)` and NUL as \\XX."""
    return "".join(f"\\{ord(c):02x}" if c in "\\*()\0" else c for c in value)


def login_filter(settings: DirectoryConfig, name: str) -> str:
    """The filter finding the one entry named `name` among the directory's users."""
    return f"(&{settings.user_filter}({settings.name_attribute}={escaped(name)}))"


def password_matches(settings: DirectoryConfig, name: str, password: str) -> bool:
    """Whether `password` is the directory password of the user `name`: their entry found with gpubook's
    own bind (one entry of the filter whose name attribute is `name` exactly), then a bind as that entry
    with `password`, on a connection of its own. An empty password is refused before any bind: a simple
    bind with a DN and no password is an "unauthenticated" bind, which many servers let succeed.
    DirectoryError: the directory did not answer (or refused gpubook's own bind)."""
    from ldap3 import SUBTREE
    from ldap3.core.exceptions import LDAPException, LDAPOperationResult, LDAPSizeLimitExceededResult

    if not password or not name:
        return False
    try:
        connection = _connection(settings)
        try:
            connection.search(settings.base, login_filter(settings, name), search_scope=SUBTREE,
                              attributes=[settings.name_attribute], size_limit=2)
            found = [item for item in connection.response or () if item.get("type") == "searchResEntry"]
        except LDAPSizeLimitExceededResult:
            found = []  # more than one entry of that name: none of them is believed
        finally:
            connection.unbind()
        if len(found) != 1 or name not in _values(found[0]["attributes"], settings.name_attribute):
            return False
        try:
            _connection(settings, as_user=(found[0]["dn"], password)).unbind()
        except LDAPOperationResult:  # a wrong password; a locked or disabled account (the server's answer)
            return False
    except LDAPException as error:
        raise DirectoryError(f"{settings.url}: {type(error).__name__}: {error}") from None
    return True
