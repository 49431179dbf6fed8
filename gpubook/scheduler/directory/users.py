"""The directory's users as plain values, checked one by one, and merged with the [users.NAME] tables.

Pure: the reader (directory/ldap.py) hands in what it read; a bad entry or key is left out with a
sentence, never the whole directory."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from gpubook.scheduler.settings import UserConfig, checks


@dataclass(frozen=True)
class DirectoryUser:
    """One member of the directory's group, as gpubook uses it."""

    name: str
    uid: int
    gid: int
    emails: tuple[str, ...]
    ssh_keys: tuple[str, ...]
    dn: str = ""
    groups: tuple[str, ...] = ()  # the [groups.NAME] whose directory group lists them, in the config's order

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> DirectoryUser:
        return cls(name=str(data["name"]), uid=int(data["uid"]), gid=int(data["gid"]),
                   emails=tuple(data["emails"]), ssh_keys=tuple(data["ssh_keys"]), dn=str(data.get("dn", "")),
                   groups=tuple(map(str, data.get("groups", ()))))


@dataclass(frozen=True)
class RawEntry:
    """An entry as read: each attribute's values as text."""

    dn: str
    name: list[str]
    uid: list[str]
    gid: list[str]
    emails: list[str]
    ssh_keys: list[str]
    groups: tuple[str, ...] = ()  # the [groups.NAME] whose directory group lists this entry


def _number(values: list[str]) -> int | None:
    try:
        return int(values[0]) if len(values) == 1 else None
    except ValueError:
        return None


def _address(value: str) -> str:
    """An address as written in mail or proxyAddresses ("SMTP:alice@lab.example")."""
    return value.split(":", 1)[1] if value[:5].lower() == "smtp:" else value


def checked(entries: Iterable[RawEntry]) -> tuple[list[DirectoryUser], list[str]]:
    """The valid users and a sentence for each entry, key or address left out."""
    users: list[DirectoryUser] = []
    problems: list[str] = []
    uids: dict[int, str] = {}
    owners: dict[str, str] = {}
    for entry in entries:
        name = entry.name[0] if len(entry.name) == 1 else ""
        if not name or (problem := checks.user_name(name)):
            problems.append(f"directory entry {entry.dn}: left out: its name {entry.name!r} is not a user name"
                            + (f" ({problem})" if name else ""))
            continue
        uid, gid = _number(entry.uid), _number(entry.gid)
        if uid is None or checks.uid(uid):
            problems.append(f"directory user {name}: left out: uidNumber {entry.uid!r} is not a uid of 1 or more")
            continue
        if gid is None or checks.uid(gid):
            gid = uid
        if (other := uids.setdefault(uid, name)) != name:
            problems.append(f"directory user {name}: left out: uid {uid} is also {other}'s")
            continue
        emails: list[str] = []
        for value in dict.fromkeys(_address(v.strip()) for v in entry.emails):
            owner = owners.get(value.lower())
            if checks.email(value):
                problems.append(f"directory user {name}: address {value!r} left out: not an e-mail address")
            elif owner is not None and owner != name:
                problems.append(f"directory user {name}: address {value} left out: it is also {owner}'s")
            else:
                owners[value.lower()] = name
                emails.append(value)
        keys: list[str] = []
        for number, key in enumerate(entry.ssh_keys, 1):
            if problem := checks.ssh_key(key.strip()):
                problems.append(f"directory user {name}: SSH key {number} left out: {problem}")
            else:
                keys.append(key.strip())
        users.append(DirectoryUser(name=name, uid=uid, gid=gid, emails=tuple(emails), ssh_keys=tuple(keys),
                                   dn=entry.dn, groups=entry.groups))
    return users, problems


def as_user(user: DirectoryUser, tables: Mapping[str, UserConfig], overrides: Mapping[str, UserConfig]) -> UserConfig:
    """A directory user as gpubook sees them: their [users.NAME] table's limits with the directory's uid,
    gid, addresses and keys (plus the table's own addresses and keys), and the table's groups, then the
    directory's."""
    table = tables.get(user.name) or overrides.get(user.name) or UserConfig(name=user.name, uid=user.uid, gid=user.gid)
    return dataclasses.replace(table, uid=user.uid, gid=user.gid,
                               email=tuple(dict.fromkeys((*user.emails, *table.email))),
                               ssh_keys=tuple(dict.fromkeys((*user.ssh_keys, *table.ssh_keys))),
                               groups=tuple(dict.fromkeys((*table.groups, *user.groups))))


def with_departed(users: Mapping[str, UserConfig], departed: Iterable[DirectoryUser],
                  tables: Mapping[str, UserConfig], overrides: Mapping[str, UserConfig]) -> dict[str, UserConfig]:
    """`users` and the directory users who left its group, each as before (their running bookings run
    to their end): one whose name, uid or an address another user now has is left out."""
    result = dict(users)
    uids = {user.uid for user in users.values()}
    addresses = {address.lower() for user in users.values() for address in user.email}
    for user in departed:
        kept = as_user(user, tables, overrides)
        if user.name in result or kept.uid in uids or any(a.lower() in addresses for a in kept.email):
            continue
        result[user.name] = kept
    return result


def merge(found: Iterable[DirectoryUser], tables: Mapping[str, UserConfig],
          overrides: Mapping[str, UserConfig]) -> tuple[dict[str, UserConfig], list[str]]:
    """The users gpubook sees: each directory user with its [users.NAME] table's limits (its uid, gid,
    addresses and keys are the directory's, plus the table's own addresses and keys), and the tables of
    users the directory does not have. `overrides` are tables without a uid, which only a directory
    user can fill."""
    result: dict[str, UserConfig] = {}
    problems: list[str] = []
    for user in found:
        result[user.name] = as_user(user, tables, overrides)
    for name in sorted(set(overrides) - set(result)):
        problems.append(f"users.{name}: left out: it has no uid and the directory has no member {name}")
    uids = {user.uid: user.name for user in result.values()}
    owners = {address.lower(): user.name for user in result.values() for address in user.email}
    for name, table in tables.items():
        if name in result:
            continue
        if (other := uids.get(table.uid)) is not None:
            problems.append(f"users.{name}: left out: uid {table.uid} is the directory user {other}'s")
            continue
        if clash := [a for a in table.email if owners.get(a.lower(), name) != name]:
            problems.append(f"users.{name}: left out: {', '.join(clash)} belongs to a directory user")
            continue
        result[name] = table
    return result, problems
