"""The daemon's configuration file: one TOML file, read and validated as a whole.

Every problem is collected and reported together as `FILE: section.key: what is wrong`, with
"did you mean" for unknown keys. What each section holds is declared elsewhere, pure
(scheduler.settings, and each plug-in's settings beside it); this package reads a file into
those declarations (config.sections registers them, config.reader is the generic part), finds
the file (`config_path`), reads secrets files (kept out of repr()) and checks they are their
owner's only. `gpubook config reference` and the example config are made from the same
declarations (config.reference).
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, overload

from gpubook.runtime import engines
from gpubook.runtime.errors import ConfigError
from gpubook.scheduler import directory as users_module
from gpubook.scheduler.config.reader import Reader
from gpubook.scheduler.config.sections import FACTS, SECTIONS, group_problems, read_section, system_timezone
from gpubook.scheduler.directory.settings import EXTERNAL
from gpubook.scheduler.settings import (
    PASSWORD_ENV,
    CalendarConfig,
    Config,
    DaemonConfig,
    Defaults,
    HostConfig,
    PolicyConfig,
    UserConfig,
)

# The reader returns these: its callers may name them from here.
__all__ = ["PASSWORD_ENV", "CalendarConfig", "Config", "ConfigError", "DaemonConfig", "Defaults", "HostConfig",
           "PolicyConfig", "UserConfig", "advisories", "config_path", "load", "parse", "system_timezone"]


def _sftp_problems(reader: Reader, read: Mapping[str, Any]) -> None:
    """[sftp] against the sections it depends on."""
    sftp, storage = read["sftp"], read["storage"]
    if not sftp.enabled:
        return
    if storage.data_root is None:
        reader.error("sftp.enabled", "needs [storage] data_root: the service serves the folders there")
    owners: dict[int, str] = {}
    for user in read["users"].values():
        if user.uid == 0:
            continue  # a directory user's limits only: the directory gives its uid
        other = owners.setdefault(user.uid, user.name)
        if other != user.name:
            reader.error(f"users.{user.name}.uid", f"{user.uid} is also users.{other}'s: the SFTP service "
                         f"ends a removed or over-quota user's sessions by uid")


def _web_problems(reader: Reader, read: Mapping[str, Any]) -> None:
    """[web] against [directory]: auth "ldap" checks a password by a bind to the directory's server."""
    source = read["directory"].source if read["directory"] is not None else "file"
    if read["web"].auth == "ldap" and source != "ldap":
        reader.error("web.auth", f'"ldap" checks the page\'s passwords by a bind to the lab\'s directory: it needs '
                     f'[directory] source = "ldap" with its url, base and group (this config has source = '
                     f'"{source}")')


def parse(data: Mapping[str, Any], path: Path) -> Config:
    """Validate parsed TOML; raise ConfigError listing every problem."""
    reader = Reader(path, FACTS)
    reader.unknown(data, "", [section.name for section in SECTIONS])
    read = {section.name: read_section(reader, data, section) for section in SECTIONS}
    group_problems(reader, read["users"], read["groups"])
    _people_and_gpus(reader, read)  # beside the other problems, not after them: all are listed at once
    if not reader.errors:
        _sftp_problems(reader, read)
        _web_problems(reader, read)
        from_directory = read["directory"] is not None and read["directory"].source in EXTERNAL
        for position, calendar in enumerate(read["calendar"]):
            # A directory's member has no table: scheduler.directory says so once its users are merged.
            if calendar.user is not None and calendar.user not in read["users"] and not from_directory:
                reader.error(f"calendar[{position}].user", f"{calendar.user!r} is not a user of [users]")
        for section in SECTIONS:
            if section.refusal is not None and (problem := section.refusal(read[section.name])):
                reader.error(section.name, problem)
        if problem := engines.engine_network_problem(read["engine"]):
            reader.error("engine.network", problem)  # an engine that makes only some networks (udocker: "host")
        if read["gpus"].mps and (problem := engines.mps_problem(read["engine"])):
            reader.error("gpus.mps", problem)  # the engine's own reason (Docker: root inside is host root)
    if reader.errors:
        raise ConfigError("\n".join(reader.errors))
    return Config(
        path=path, host=read["host"], calendars=read["calendar"], defaults=read["defaults"],
        users={name: user for name, user in read["users"].items() if user.uid != 0},
        gpu_count=read["gpus"].count, templates_dir=read["templates"].dir,
        engine=read["engine"], storage=read["storage"], ssh=read["ssh"], nvidia=read["nvidia"],
        daemon=read["daemon"], notify=read["notify"], gpu_mps=read["gpus"].mps, policy=read["policy"],
        gpu_monitor=read["gpus"].monitor, sftp=read["sftp"], images=read["images"], web=read["web"],
        backend=read["backend"], directory=read["directory"],
        user_overrides={name: user for name, user in read["users"].items() if user.uid == 0},
        groups=read["groups"],
    )


def _people_and_gpus(reader: Reader, read: Mapping[str, Any]) -> None:
    """Cross-key problems a config's own values show: two users with one uid (one container account
    for two bookers), a calendar's GPUs beyond [gpus] count."""
    users: Mapping[str, UserConfig] = read["users"] or {}
    by_uid: dict[int, list[str]] = {}
    for name, user in users.items():
        if user.uid != 0:  # 0: a table that only sets a directory user's limits
            by_uid.setdefault(user.uid, []).append(name)
    for uid, names in sorted(by_uid.items()):
        if len(names) > 1:
            reader.error(f"users.{names[1]}.uid", f"{uid} is also {names[0]}'s: each booker needs a uid of their own "
                         "(it is the owner of their files and their account inside)")
    count = read["gpus"].count
    for position, calendar in enumerate(read["calendar"] or ()):
        beyond = sorted(gpu for gpu in calendar.gpus or () if count is not None and gpu >= count)
        if beyond:
            reader.error(f"calendar[{position}].gpus", f"GPU {', '.join(map(str, beyond))} beyond [gpus] count = "
                         f"{count} (the GPUs are 0 to {count - 1})")


def advisories(config: Config) -> list[str]:
    """What `gpubook config check` adds to a config that loads: a daemon could run it, but to no use."""
    said = []
    if not config.users and not (config.directory is not None and config.directory.source in EXTERNAL):
        said.append(f"{config.path}: users: no [users.NAME] table: nobody could book (add one per booker, or a "
                    "[directory])")
    return said


CONFIG_ENV = "GPUBOOK_CONFIG"
SYSTEM_CONFIG = Path("/etc/gpubook/gpubook.toml")


@overload
def config_path(given: str | os.PathLike[str] | None = None, *, required: Literal[True] = True,
                environ: Mapping[str, str] | None = None, home: Path | None = None) -> Path: ...
@overload
def config_path(given: str | os.PathLike[str] | None = None, *, required: bool,
                environ: Mapping[str, str] | None = None, home: Path | None = None) -> Path | None: ...
def config_path(given: str | os.PathLike[str] | None = None, *, required: bool = True,
                environ: Mapping[str, str] | None = None, home: Path | None = None) -> Path | None:
    """The config file a command reads: `--config` when given; else $GPUBOOK_CONFIG when set (it
    must then exist, as --config must); else the first that exists of
    $XDG_CONFIG_HOME/gpubook/gpubook.toml (~/.config/... without it) and /etc/gpubook/gpubook.toml.
    With none of those: ConfigError naming each path tried, or None when not `required`."""
    if given is not None:
        return Path(given)
    environ = os.environ if environ is None else environ
    if environ.get(CONFIG_ENV):
        return Path(environ[CONFIG_ENV])
    xdg = environ.get("XDG_CONFIG_HOME", "")
    user_base = Path(xdg) if os.path.isabs(xdg) else (home or Path.home()) / ".config"  # the spec: relative is ignored
    tried = [user_base / "gpubook" / "gpubook.toml", SYSTEM_CONFIG]
    found = next((path for path in tried if path.is_file()), None)
    if found is None and required:
        raise ConfigError(f"no config file: --config not given, ${CONFIG_ENV} not set, and none of "
                          f"{', '.join(map(str, tried))} exists")
    return found


def load(path: str | os.PathLike[str], *, directory: Literal["read", "cache", "none"] = "cache") -> Config:
    """Read and validate a config file; ConfigError says what is wrong, all at once. With [directory]
    source = "ldap" or "host", the directory's users are merged in (scheduler.directory): `directory` "read" asks
    the directory (the daemon, `gpubook users`, doctor), "cache" takes the daemon's last copy
    (`directory.json` in its state folder) without asking it (every other command), "none" neither."""
    path = Path(path)
    try:
        with path.open("rb") as file:
            data = tomllib.load(file)
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file") from None
    except OSError as error:
        raise ConfigError(f"{path}: cannot read: {error.strerror}") from None
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"{path}: not valid TOML: {error}") from None
    parsed = parse(data, path.resolve())
    if directory == "none":
        return parsed
    return users_module.with_users(parsed, cached=directory == "cache")
