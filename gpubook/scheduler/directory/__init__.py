"""Users from the lab's directory ([directory] source = "ldap", or "host": this host's name service),
merged with the [users.NAME] tables.

The daemon reads the directory when its config is loaded (start, SIGHUP) and every `refresh_minutes`.
A directory that does not answer keeps the last good copy: the one this process read, else the copy
cached in the state folder (`directory.json`, mode 0600), so a restart while it is down still has its
users. That it is down is logged once, until it answers again.

A member who leaves the group is kept, as departed, for [defaults] max_hours from the read that no
longer listed them (in the cache too): a booking of theirs that runs then runs to its end, which is
never later than that; every other booking of theirs is refused (core/plan.py)."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from pathlib import Path

from gpubook.scheduler.directory import host, ldap
from gpubook.scheduler.directory.errors import DirectoryError
from gpubook.scheduler.directory.settings import EXTERNAL, DirectoryConfig
from gpubook.scheduler.directory.users import DirectoryUser, RawEntry, checked, merge, with_departed
from gpubook.scheduler.settings import Config

__all__ = ["DirectoryConfig", "DirectoryError", "DirectoryUser", "Snapshot", "cache_path", "cached_snapshot", "checked",
           "fetch", "project_groups", "read", "source_name", "with_users"]

log = logging.getLogger(__name__)
CACHE_NAME = "directory.json"


@dataclasses.dataclass(frozen=True)
class Roster:
    """The group's members as last read, and those who left it, each with when that read was."""

    members: list[DirectoryUser]
    departed: Mapping[str, tuple[DirectoryUser, datetime]] = dataclasses.field(default_factory=dict)

    def to_json(self) -> dict[str, object]:
        return {"members": [user.to_json() for user in self.members],
                "departed": [{"user": user.to_json(), "since": since.isoformat()}
                             for user, since in self.departed.values()]}

    @classmethod
    def from_json(cls, data: object) -> Roster:
        if isinstance(data, list):  # the cache before departed members were kept: members only
            return cls([DirectoryUser.from_json(item) for item in data])
        assert isinstance(data, dict)
        departed = [(DirectoryUser.from_json(item["user"]), datetime.fromisoformat(item["since"]))
                    for item in data.get("departed", [])]
        return cls([DirectoryUser.from_json(item) for item in data["members"]],
                   {user.name: (user, since) for user, since in departed})

    def after(self, members: list[DirectoryUser], *, now: datetime, keep: timedelta) -> Roster:
        """The roster a new read gives: its members; departed, whoever this roster had and the read does
        not, since this read for the newly gone, kept for `keep`."""
        names = {user.name for user in members}
        departed = {name: (user, since) for name, (user, since) in self.departed.items()
                    if name not in names and now - since < keep}
        departed.update({user.name: (user, now) for user in self.members if user.name not in names})
        return Roster(members, departed)


def read(settings: DirectoryConfig, projects: Mapping[str, str] | None = None) -> list[RawEntry]:
    """The entries of the configured source (ldap or host), each with the `projects` ([groups.NAME] →
    the directory's group) that list it."""
    projects = projects or {}
    return host.read(settings, projects) if settings.source == "host" else ldap.read(settings, projects)


def project_groups(config: Config) -> dict[str, str]:
    """Each [groups.NAME]'s group in the directory: its `directory_group`, else for "host" the host
    group NAME, for "ldap" cn=NAME beside [directory] group (under its base without one)."""
    settings = config.directory or DirectoryConfig()
    if settings.source == "host":
        beside = ""
    elif settings.group and "," in settings.group:
        beside = "," + settings.group.split(",", 1)[1]
    else:
        beside = f",{settings.base}" if settings.base else ""
    return {name: group.directory_group or (name if settings.source == "host" else f"cn={name}{beside}")
            for name, group in config.groups.items()}


def source_name(settings: DirectoryConfig) -> str:
    """What names the directory in this process's memory and its sentences."""
    return f"host group {settings.group}" if settings.source == "host" else f"directory {settings.url or ''}"


_last_good: dict[str, Roster] = {}
_down: set[str] = set()


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """What one read gave: the valid users, a sentence per entry left out, and where they came from."""

    users: list[DirectoryUser]
    problems: list[str]
    origin: str  # "directory", "last good copy", "cache", or "none"
    error: str | None = None
    departed: Mapping[str, tuple[DirectoryUser, datetime]] = dataclasses.field(default_factory=dict)


def cache_path(config: Config) -> Path:
    if config.daemon.state_dir is not None:
        return config.daemon.state_dir / CACHE_NAME
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "gpubook" / CACHE_NAME


def _write_cache(path: Path, roster: Roster) -> None:
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        temporary = path.with_suffix(".tmp")
        descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(descriptor, "w") as file:
            json.dump(roster.to_json(), file)
        os.replace(temporary, path)
    except OSError as error:
        log.warning("directory cache %s not written: %s", path, error.strerror)


def _read_cache(path: Path) -> Roster | None:
    try:
        return Roster.from_json(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError, AssertionError):
        return None


def fetch(config: Config, *, now: datetime | None = None) -> Snapshot:
    """The directory's users now, else the last good copy (this process's, else the cache)."""
    settings = config.directory or DirectoryConfig()
    key = source_name(settings)
    cache = cache_path(config)
    try:
        users, problems = checked(read(settings, project_groups(config)))
    except DirectoryError as error:
        kept = _last_good.get(key)
        origin = "last good copy"
        if kept is None:
            kept, origin = _read_cache(cache), "cache"
        if kept is None:
            kept, origin = Roster([]), "none"
        if key not in _down:
            _down.add(key)
            log.error("%s does not answer (%s); keeping the %s of %d user(s) until it does",
                      key, error, "users cached in " + str(cache) if origin == "cache" else origin, len(kept.members))
        return Snapshot(kept.members, [], origin, str(error), kept.departed)
    if key in _down:
        _down.discard(key)
        log.warning("%s answers again: %d user(s)", key, len(users))
    for problem in problems:
        log.warning("%s", problem)
    before = _last_good.get(key) or _read_cache(cache) or Roster([])
    roster = before.after(users, now=now or datetime.now(UTC), keep=timedelta(hours=config.defaults.max_hours))
    for name in sorted(set(roster.departed) - set(before.departed)):
        log.warning("directory user %s is no longer in the group: a booking of theirs that runs runs to its end, "
                    "any other is refused", name)
    _last_good[key] = roster
    _write_cache(cache, roster)
    return Snapshot(users, problems, "directory", departed=roster.departed)


def cached_snapshot(config: Config) -> Snapshot:
    """The daemon's last copy (its cache), without asking the directory: for the commands that only
    show or use the users (the daemon asks, `gpubook users` and doctor too)."""
    roster = _read_cache(cache_path(config))
    if roster is None:
        return Snapshot([], [], "none", f"no copy of the directory's users in {cache_path(config)} yet")
    return Snapshot(roster.members, [], "cache", departed=roster.departed)


def with_users(config: Config, snapshot: Snapshot | None = None, *, cached: bool = False) -> Config:
    """`config` with the directory's users merged in (unchanged for source = "file"): those of
    `snapshot`, else of the daemon's cache (`cached`), else read now."""
    if config.directory is None or config.directory.source not in EXTERNAL:
        return config
    snapshot = snapshot or (cached_snapshot(config) if cached else fetch(config))
    tables = config.users if config.file_users is None else config.file_users
    users, problems = merge(snapshot.users, tables, config.user_overrides)
    for problem in problems:
        log.warning("%s", problem)
    everyone = with_departed(users, [user for user, _ in snapshot.departed.values()], tables, config.user_overrides)
    for position, calendar in enumerate(config.calendars):
        if calendar.user is not None and calendar.user not in everyone and snapshot.origin != "none":
            log.warning("calendar[%d].user %r is neither a member of the directory's group nor a [users] table: "
                        "its bookings are refused", position, calendar.user)
    # Only those kept as departed: one who left but has a [users.NAME] table with a uid is that file user.
    departed = {name: since for name, (_, since) in snapshot.departed.items() if name in everyone and name not in users}
    return dataclasses.replace(config, users=everyone, directory_users=frozenset(u.name for u in snapshot.users),
                               file_users=tables, departed_users=departed)
