"""`gpubook users` and doctor's "directory" check: the users gpubook sees, and where they came from."""

from __future__ import annotations

import json
import sys

from gpubook.runtime.checks import Check
from gpubook.scheduler import config as config_module
from gpubook.scheduler import directory
from gpubook.scheduler.directory.settings import EXTERNAL


def _source(loaded: config_module.Config, name: str) -> str:
    if name in loaded.departed_users:
        return "departed"  # left the directory's group: only a booking that ran then runs on
    return "directory" if name in loaded.directory_users else "file"


def rows(loaded: config_module.Config) -> list[dict[str, object]]:
    return [{"name": user.name, "uid": user.uid, "gid": user.gid, "identities": list(user.email),
             "keys": len(user.ssh_keys), "source": _source(loaded, name), "groups": list(loaded.groups_of(name)),
             "left": left.isoformat() if (left := loaded.departed_users.get(name)) else None}
            for name, user in sorted(loaded.users.items())]


def run(config_path: str, *, as_json: bool = False) -> int:
    listed = rows(config_module.load(config_path, directory="read"))
    if as_json:
        json.dump({"users": listed}, sys.stdout, indent=2)
        print()
        return 0
    print(f"{'NAME':16} {'UID':>7} {'GID':>7} {'KEYS':>4} {'SOURCE':9} {'GROUPS':16} IDENTITIES")
    for row in listed:
        print(f"{row['name']:16} {row['uid']:>7} {row['gid']:>7} {row['keys']:>4} {row['source']:9} "
              f"{','.join(row['groups']) or '-':16} "  # type: ignore[arg-type]
              f"{', '.join(row['identities']) or '-'}")  # type: ignore[arg-type]
    return 0


def directory_check(loaded: config_module.Config, *, shown: int = 3) -> Check:
    """Whether the directory answers, how many users it gave, and its first problems."""
    settings = loaded.directory
    if settings is None or settings.source not in EXTERNAL:
        return Check("directory", True, 'source = "file": the users are the [users.NAME] tables')
    try:
        users, problems = directory.checked(directory.read(settings, directory.project_groups(loaded)))
    except directory.DirectoryError as error:
        fix = ("check [directory] group and this host's name service (getent group)" if settings.source == "host"
               else "check [directory] url, ca_file, bind_dn and the password file")
        return Check("directory", False, str(error), f"{fix}; the daemon keeps the last good copy meanwhile")
    detail = (f"{directory.source_name(settings)}: {len(users)} user(s), "
              f"{sum(1 for u in users if u.ssh_keys)} with keys, {sum(1 for u in users if u.emails)} with identities"
              + (f", {sum(1 for u in users if u.groups)} in a [groups] group" if loaded.groups else ""))
    if problems:
        more = f" (and {len(problems) - shown} more)" if len(problems) > shown else ""
        return Check("directory", False, f"{detail}; left out: {'; '.join(problems[:shown])}{more}",
                     "correct those entries in the directory", optional=True)
    return Check("directory", True, detail)
