"""Users from the lab's directory ([directory] source = "ldap"), merged with the [users.NAME] tables.

The daemon reads the directory when its config is loaded (start, SIGHUP) and every `refresh_minutes`.
A directory that does not answer keeps the last good copy: the one this process read, else the copy
cached in the state folder (`directory.json`, mode 0600), so a restart while it is down still has its
users. That it is down is logged once, until it answers again."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from pathlib import Path

from gpubook.scheduler.directory.ldap import DirectoryError, read
from gpubook.scheduler.directory.settings import DirectoryConfig
from gpubook.scheduler.directory.users import DirectoryUser, checked, merge
from gpubook.scheduler.settings import Config

__all__ = ["DirectoryConfig", "DirectoryError", "DirectoryUser", "Snapshot", "cache_path", "checked", "fetch", "read",
           "with_users"]

log = logging.getLogger(__name__)
CACHE_NAME = "directory.json"
_last_good: dict[str, list[DirectoryUser]] = {}
_down: set[str] = set()


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """What one read gave: the valid users, a sentence per entry left out, and where they came from."""

    users: list[DirectoryUser]
    problems: list[str]
    origin: str  # "directory", "last good copy", "cache", or "none"
    error: str | None = None


def cache_path(config: Config) -> Path:
    if config.daemon.state_dir is not None:
        return config.daemon.state_dir / CACHE_NAME
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "gpubook" / CACHE_NAME


def _write_cache(path: Path, users: list[DirectoryUser]) -> None:
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        temporary = path.with_suffix(".tmp")
        descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(descriptor, "w") as file:
            json.dump([user.to_json() for user in users], file)
        os.replace(temporary, path)
    except OSError as error:
        log.warning("directory cache %s not written: %s", path, error.strerror)


def _read_cache(path: Path) -> list[DirectoryUser] | None:
    try:
        return [DirectoryUser.from_json(item) for item in json.loads(path.read_text())]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def fetch(config: Config) -> Snapshot:
    """The directory's users now, else the last good copy (this process's, else the cache)."""
    settings = config.directory or DirectoryConfig()
    key = settings.url or ""
    cache = cache_path(config)
    try:
        users, problems = checked(read(settings))
    except DirectoryError as error:
        kept = _last_good.get(key)
        origin = "last good copy"
        if kept is None:
            kept, origin = _read_cache(cache), "cache"
        if kept is None:
            kept, origin = [], "none"
        if key not in _down:
            _down.add(key)
            log.error("directory %s does not answer (%s); keeping the %s of %d user(s) until it does",
                      key, error, "users cached in " + str(cache) if origin == "cache" else origin, len(kept))
        return Snapshot(kept, [], origin, str(error))
    if key in _down:
        _down.discard(key)
        log.warning("directory %s answers again: %d user(s)", key, len(users))
    for problem in problems:
        log.warning("%s", problem)
    _last_good[key] = users
    _write_cache(cache, users)
    return Snapshot(users, problems, "directory")


def with_users(config: Config, snapshot: Snapshot | None = None) -> Config:
    """`config` with the directory's users merged in (unchanged for source = "file")."""
    if config.directory is None or config.directory.source != "ldap":
        return config
    snapshot = snapshot or fetch(config)
    tables = config.users if config.file_users is None else config.file_users
    users, problems = merge(snapshot.users, tables, config.user_overrides)
    for problem in problems:
        log.warning("%s", problem)
    return dataclasses.replace(config, users=users, directory_users=frozenset(u.name for u in snapshot.users),
                               file_users=tables)
