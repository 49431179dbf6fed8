"""Reading the group's members from an LDAP directory (ldap3), over LDAPS or StartTLS only, and which
of the configured [groups.NAME] (projects) each member is in."""

from __future__ import annotations

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


def _connection(settings: DirectoryConfig) -> Any:
    import ldap3  # the optional extra `ldap`

    url = settings.url or ""
    timeout = max(1, math.ceil(settings.timeout_seconds))  # ldap3 packs it into a socket option: whole seconds
    if url.startswith("ldap://") and not settings.start_tls:
        raise DirectoryError(f"{url}: plain ldap:// without start_tls is refused")
    tls = ldap3.Tls(validate=ssl.CERT_REQUIRED, version=ssl.PROTOCOL_TLS_CLIENT,
                    ca_certs_file=str(settings.ca_file) if settings.ca_file else None)
    server = ldap3.Server(url, use_ssl=url.startswith("ldaps://"), tls=tls, get_info=ldap3.NONE,
                          connect_timeout=timeout)
    connection = ldap3.Connection(server, user=settings.bind_dn, password=settings.bind_password,
                                  receive_timeout=timeout, raise_exceptions=True,
                                  read_only=True, auto_bind=ldap3.AUTO_BIND_NONE)
    connection.open()
    if settings.start_tls:
        connection.start_tls()
    connection.bind()
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
