"""The registration of the config's sections: each top-level table by its declaration, in the order
they are read (and their errors listed). A plug-in's section is declared beside the plug-in and
registered here with one line; `[[calendar]]` and `[users.NAME]` have logic of their own."""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Callable, Mapping
from typing import Any

import tzlocal

from gpubook.runtime import engines
from gpubook.runtime.engines import EngineSettings
from gpubook.runtime.plugins import load_callable
from gpubook.scheduler import sources
from gpubook.scheduler.config.reader import Reader, join, kind_of
from gpubook.scheduler.directory.settings import EXTERNAL as DIRECTORY_SOURCES
from gpubook.scheduler.directory.settings import SECTION as DIRECTORY
from gpubook.scheduler.hosts.sftp_settings import SECTION as SFTP
from gpubook.scheduler.hosts.slurm.settings import SECTION as BACKEND
from gpubook.scheduler.outbox.settings import SECTION as NOTIFY
from gpubook.scheduler.outbox.web.settings import SECTION as WEB
from gpubook.scheduler.settings import (
    CalendarConfig,
    Check,
    DaemonConfig,
    Defaults,
    GpusSection,
    GroupConfig,
    HostConfig,
    ImagesConfig,
    NvidiaConfig,
    PolicyConfig,
    Section,
    SshConfig,
    StorageConfig,
    TemplatesSection,
    UserConfig,
    checks,
)
from gpubook.scheduler.settings.checks import timezone_problem
from gpubook.scheduler.settings.sections import ssh_problems
from gpubook.scheduler.sources import BaseSource, https_url, implied_kind, source_class
from gpubook.scheduler.sources.errors import redact_url


def _monitor_problem(name: str) -> str | None:
    if name == "nvml":
        return None
    try:
        load_callable(name, what="GPU monitor")
    except ValueError as error:
        return str(error)
    return None


# The rules of the engines' own checks (runtime.engines.SETTING_CHECKS), in words.
ENGINE_RULES = {
    "name": '"podman", "docker", "udocker" or a loadable "package.module:Class"',
    "network": 'one of "host", "private"',
    "stop_grace_seconds": "0 or more",
    "pids_limit": "0 or more",
    "memory": "like '512m' or '32g', or \"none\"",
}

# [engine] is runtime.engines.EngineSettings, declared where the scheduler cannot be imported: the
# engines give its checks, and its help is given here.
ENGINE = Section(
    "engine", EngineSettings, "the container engine every booking runs in, and the limits it sets",
    checks={name: Check(ENGINE_RULES.get(name, ""), test) for name, test in engines.SETTING_CHECKS.items()},
    helps={
        "name": '"podman", "docker", "udocker" (no podman, no setuid helper: needs network = "host"), or a dotted '
                'path "package.module:Class"',
        "binary": "the engine's command; default: the engine's name, looked up on PATH",
        "runtime": 'OCI runtime for podman ("runc", "crun"), the runc udocker runs (a path); default: the '
                   "engine's own (udocker: runc on PATH or in /usr/sbin)",
        "storage_driver": 'podman storage driver ("overlay", "vfs"); default: the podman store\'s own driver, so '
                          "gpubook and a plain `podman` see the same store (gpubook doctor checks they agree)",
        "network": '"private": each booking in its own network namespace with only its SSH port published '
                   '(rootless podman: slirp4netns); "host": the host\'s network, where bookers reach each other\'s '
                   "services and can squat ports (flagged by status and doctor); udocker makes only \"host\"",
        "ulimits": 'ulimits of every container, such as ["nofile=1024:1024"]',
        "pids_limit": "processes per container (--pids-limit, where cgroups enforce it) and per uid inside it "
                      "(the nproc ulimit); 0: no limit",
        "memory": 'a container\'s memory (--memory, like "32g") where its template sets none; default: the '
                  'host\'s memory less max(4 GiB, 10 %), shared by GPUs; "none": no limit',
        "stop_grace_seconds": "seconds between SIGTERM and SIGKILL when a booking's container is stopped",
    },
    samples={"binary": "/usr/bin/podman", "runtime": "runc", "storage_driver": "overlay", "memory": "32g"},
)

GPUS = Section("gpus", GpusSection, "the GPUs' inventory where NVML cannot be read, their live view, MPS",
               checks={"monitor": Check('"nvml" or a loadable "package.module:function"', _monitor_problem)})

# Every top-level table, in the order read.
SECTIONS: tuple[Section, ...] = (
    Section("host", HostConfig, "this machine: its name in ssh lines, its time zone"),
    Section("calendar", CalendarConfig, "a calendar whose events book GPUs of this host (one or more); the other "
            "keys a `kind` reads are its own (caldav and ics: username, password_file)", shape="tables"),
    Section("defaults", Defaults, "what a booking gets when it says nothing"),
    DIRECTORY,
    Section("users", UserConfig, "a user who may book ([users.NAME]); NAME is their account in containers",
            shape="named"),
    Section("groups", GroupConfig, "a group of users as a project ([groups.NAME]): its quotas, beside each "
            "member's (the tighter wins), and where a directory lists its members", shape="named"),
    GPUS,
    Section("templates", TemplatesSection, "the container templates bookings name"),
    ENGINE,
    Section("storage", StorageConfig, "data folders: input/, output/ (and home/) per user"),
    Section("ssh", SshConfig, "the host ports bookings' SSH servers are published on", problems=ssh_problems),
    Section("nvidia", NvidiaConfig, "where the host's NVIDIA driver files are found"),
    Section("daemon", DaemonConfig, "the daemon's pace, state folder and restarts"),
    NOTIFY,
    Section("policy", PolicyConfig, "who may book for whom, how much, reminders, no-shows and idle GPUs"),
    SFTP,
    Section("images", ImagesConfig, "template images prepared ahead of their bookings"),
    WEB,
    BACKEND,
)
BY_NAME: Mapping[str, Section] = {section.name: section for section in SECTIONS}


# -- the host's facts that defaults name -----------------------------------------------------------


def system_timezone() -> str:
    """The host's IANA time zone, as tzlocal finds it ($TZ first, then /etc/timezone and /etc/localtime);
    "UTC" where it finds none a config could name."""
    try:
        name = tzlocal.get_localzone_name()
    except (LookupError, OSError, ValueError):  # tzlocal's ZoneInfoNotFoundError is a KeyError
        return "UTC"
    return name if name and not timezone_problem(name) else "UTC"


FACTS: Mapping[str, Callable[[], Any]] = {"host name": lambda: os.uname().nodename, "time zone": system_timezone}


# -- the sections with logic of their own ---------------------------------------------------------


def _gpu_indices(reader: Reader, where: str, value: Any) -> tuple[int, ...] | None:
    if value == "all":
        return None
    if isinstance(value, list) and value and all(
        isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in value
    ):
        if len(set(value)) != len(value):
            reader.error(where, f"lists a GPU twice: {value!r}")
        return tuple(sorted(set(value)))
    reader.error(where, f'must be "all" or a non-empty list of GPU indices such as [0, 1], not {value!r}')
    return None


def _source_keys(table: Mapping[str, Any]) -> tuple[str, ...]:
    """The keys the calendar's source kind declares (the built-in default for a broken kind)."""
    kind, url = table.get("kind"), table.get("url")
    if not isinstance(kind, str):
        kind = implied_kind(https_url(url)) if isinstance(url, str) else "caldav"
    if sources.REGISTRY.problem(kind) is not None:
        return BaseSource.calendar_keys
    return source_class(kind).calendar_keys


def _calendar(reader: Reader, where: str, table: Mapping[str, Any]) -> CalendarConfig | None:
    source_keys = _source_keys(table)
    reader.unknown(table, where, ["url", *source_keys, "gpus", "kind", "user"])
    url = reader.get(table, where, "url", str)
    kind = None
    if isinstance(url, str):
        url = https_url(url)
        if not re.match(r"^https?://[^\s/]+", url):
            reader.error(join(where, "url"), f"must be an http:// or https:// URL, not {redact_url(url)!r}")
        kind = implied_kind(url)
    kind = reader.get(table, where, "kind", str, default=kind, check=sources.REGISTRY.problem)
    settings = reader.settings(table, where, CalendarConfig, only=[*source_keys, "user"])
    gpus = _gpu_indices(reader, join(where, "gpus"), table.get("gpus", "all"))
    if url is None or kind is None:
        return None
    return CalendarConfig(url=url, gpus=gpus, kind=kind, **settings)


def calendars(reader: Reader, data: Mapping[str, Any], name: str) -> tuple[CalendarConfig, ...]:
    found: list[CalendarConfig] = []
    raw_calendars = data.get(name)
    if raw_calendars is None:
        reader.error(name, "at least one [[calendar]] is required")
    elif not isinstance(raw_calendars, list):
        reader.error(name, "must be written [[calendar]] (a list of tables)")
    else:
        for position, table in enumerate(raw_calendars):
            if not isinstance(table, Mapping):
                reader.error(f"{name}[{position}]", "must be a table")
            elif (calendar := _calendar(reader, f"{name}[{position}]", table)) is not None:
                found.append(calendar)
        urls = [c.url for c in found]
        for url in sorted({u for u in urls if urls.count(u) > 1}):
            reader.error(name, f"{redact_url(url)} is configured more than once")
    return tuple(found)


def _user(reader: Reader, name: str, table: Any, *, directory: bool = False) -> UserConfig | None:
    where = f"users.{name}"
    if problem := checks.user_name(name):
        reader.error(where, problem)
        return None
    if not isinstance(table, Mapping):
        reader.error(where, f"must be a table ([users.{name}]), not {kind_of(table)}")
        return None
    # With a directory, a table may only set a directory user's limits: its uid is the directory's (0 until then).
    given = {"name": name, "uid": 0} if directory and "uid" not in table else {"name": name}
    settings = reader.settings(table, where, UserConfig, given=given)
    return UserConfig(**settings) if settings["uid"] is not None else None


def users(reader: Reader, data: Mapping[str, Any], name: str) -> dict[str, UserConfig]:
    """The [users.NAME] tables; with [directory] source = "ldap" or "host", those without a uid too (uid 0)."""
    found: dict[str, UserConfig] = {}
    directory = data.get("directory")
    from_directory = isinstance(directory, Mapping) and directory.get("source") in DIRECTORY_SOURCES
    for user_name, table in reader.table(data, name, name).items():
        if (user := _user(reader, user_name, table, directory=from_directory)) is not None:
            found[user_name] = user
    seen_emails: dict[str, str] = {}
    for user in found.values():
        for address in user.email:
            other = seen_emails.setdefault(address.lower(), user.name)
            if other != user.name:
                reader.error(f"users.{user.name}.email", f"{address} also belongs to users.{other}")
    return found


def groups(reader: Reader, data: Mapping[str, Any], name: str) -> dict[str, GroupConfig]:
    """The [groups.NAME] tables, in the file's order."""
    found: dict[str, GroupConfig] = {}
    for group_name, table in reader.table(data, name, name).items():
        where = f"{name}.{group_name}"
        if problem := checks.group_name(group_name):
            reader.error(where, problem)
        elif not isinstance(table, Mapping):
            reader.error(where, f"must be a table ([{name}.{group_name}]), not {kind_of(table)}")
        else:
            found[group_name] = GroupConfig(**reader.settings(table, where, GroupConfig, given={"name": group_name}))
    return found


def group_problems(reader: Reader, users: Mapping[str, UserConfig], known: Mapping[str, GroupConfig]) -> None:
    """Each user's `groups` must name [groups.NAME] tables, each once."""
    for user in users.values():
        for position, group in enumerate(user.groups):
            where = f"users.{user.name}.groups[{position}]"
            if group in user.groups[:position]:
                reader.error(where, f"names the group {group!r} twice")
            elif group not in known:
                close = difflib.get_close_matches(group, list(known), n=1)
                hint = f"; did you mean {close[0]!r}?" if close else \
                    (f" (the groups: {', '.join(known)})" if known else " (there is no [groups.NAME] table)")
                reader.error(where, f"{group!r} is not a [groups.NAME] table{hint}")


SPECIAL: Mapping[str, Callable[[Reader, Mapping[str, Any], str], Any]] = {"calendar": calendars, "users": users,
                                                                                 "groups": groups}


def read_section(reader: Reader, data: Mapping[str, Any], section: Section) -> Any:
    special = SPECIAL.get(section.name)
    return special(reader, data, section.name) if special else reader.section(data, section)
