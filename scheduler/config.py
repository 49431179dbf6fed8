"""The daemon's configuration: one TOML file, validated as a whole.

Every problem is collected and reported together as `FILE: section.key: what is wrong`, with
"did you mean" for unknown keys. Defaults live beside each key below, with their unit.
Secrets (calendar passwords) are read here and never shown again: they are kept out of repr().
"""

from __future__ import annotations

import difflib
import os
import re
import socket
import stat
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from runtime.engines import EngineSettings as EngineConfig
from runtime.errors import ConfigError
from runtime.names import template_name_problem as _template_name_problem
from runtime.names import user_name_problem as _user_name_problem

PASSWORD_ENV = "GPUBOOK_CALENDAR_PASSWORD"  # noqa: S105 - the variable's name, not a secret
_REQUIRED = object()


@dataclass(frozen=True)
class HostConfig:
    name: str  # shown in ssh lines; default: this machine's host name
    timezone: str  # IANA name; floating calendar times are read in it; default: the system's


@dataclass(frozen=True)
class CalendarConfig:
    url: str  # a CalDAV collection, or an http(s) .ics feed
    gpus: tuple[int, ...] | None  # None = "all" GPUs of the host
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    kind: str = "caldav"  # "caldav" or "ics"; an URL ending in .ics (or webcal://) is a feed


@dataclass(frozen=True)
class Defaults:
    template: str = "debian-ssh"
    gpus: int = 1  # GPUs a booking gets when it names none
    max_hours: float = 72.0  # longest booking accepted, in hours
    warn_minutes: float = 15.0  # warning before the end, in minutes


@dataclass(frozen=True)
class UserConfig:
    name: str
    uid: int
    gid: int
    email: tuple[str, ...] = ()
    ssh_keys: tuple[str, ...] = ()
    max_gpus: int | None = None  # None: no per-user limit beyond the calendar's GPUs
    templates: tuple[str, ...] = ("*",)  # fnmatch patterns of allowed templates


@dataclass(frozen=True)
class StorageConfig:
    data_root: Path | None = None  # <root>/<user>/{input,output[,home]}
    persistent_home: bool = False


@dataclass(frozen=True)
class SshConfig:
    port_min: int = 2200  # each running booking gets its own port in [port_min, port_max]
    port_max: int = 2299


@dataclass(frozen=True)
class NvidiaConfig:
    driver_roots: tuple[Path, ...] = ()  # extra folders to search for driver files


@dataclass(frozen=True)
class DaemonConfig:
    poll_seconds: float = 60.0
    state_dir: Path | None = None  # default: $XDG_STATE_HOME/gpubook
    stale_after_minutes: float = 30.0  # nothing starts from calendar data older than this
    notice_seconds: float = 300.0  # end moved earlier / event deleted while running: warning → stop
    restart_limit: int = 3  # restarts of a container that died during its booking
    restart_backoff_seconds: float = 10.0  # wait before the first restart; doubled each time


NOTICE_KINDS = ("accepted", "rejected", "running", "warning", "ended")


@dataclass(frozen=True)
class EmailConfig:
    """[notify.email]: notices mailed to the booker's `email` addresses (off unless enabled)."""

    host: str = "localhost"
    port: int = 25
    security: str = "none"  # "none", "starttls" or "tls" (SMTPS)
    sender: str = "gpubook@localhost"
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    timeout_seconds: float = 10.0
    events: tuple[str, ...] = ("warning", "ended")


@dataclass(frozen=True)
class WebhookConfig:
    """[notify.webhook]: one JSON POST per notice (off unless enabled)."""

    url: str
    token: str | None = field(default=None, repr=False)  # sent as "Authorization: Bearer <token>"
    timeout_seconds: float = 10.0
    events: tuple[str, ...] = ("warning", "ended")


@dataclass(frozen=True)
class NotifyConfig:
    email: EmailConfig | None = None  # None: off
    webhook: WebhookConfig | None = None  # None: off


@dataclass(frozen=True)
class Config:
    path: Path
    host: HostConfig
    calendars: tuple[CalendarConfig, ...]
    defaults: Defaults
    users: Mapping[str, UserConfig]
    gpu_count: int | None  # [gpus] count: the static inventory where NVML cannot be read
    templates_dir: Path | None
    engine: EngineConfig
    storage: StorageConfig
    ssh: SshConfig
    nvidia: NvidiaConfig
    daemon: DaemonConfig
    notify: NotifyConfig = field(default_factory=NotifyConfig)

    def user_by_email(self, email: str) -> UserConfig | None:
        wanted = email.strip().lower().removeprefix("mailto:")
        for user in self.users.values():
            if wanted in (address.lower() for address in user.email):
                return user
        return None


class _Reader:
    """Reads typed values out of TOML tables, collecting every error instead of stopping."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.errors: list[str] = []

    def error(self, where: str, message: str) -> None:
        self.errors.append(f"{self.path}: {where}: {message}")

    def table(self, data: Mapping[str, Any], key: str, where: str) -> Mapping[str, Any]:
        value = data.get(key, {})
        if not isinstance(value, Mapping):
            self.error(where, f"must be a table ([{key}]), not {_kind(value)}")
            return {}
        return value

    def unknown(self, table: Mapping[str, Any], where: str, known: list[str]) -> None:
        for key in table:
            if key not in known:
                close = difflib.get_close_matches(key, known, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else f"; known keys: {', '.join(known)}"
                self.error(_join(where, key), f"unknown key{hint}")

    def get(
        self,
        table: Mapping[str, Any],
        where: str,
        key: str,
        kind: type | tuple[type, ...],
        default: Any = _REQUIRED,
        check: Callable[[Any], str | None] | None = None,
    ) -> Any:
        place = _join(where, key)
        if key not in table:
            if default is _REQUIRED:
                self.error(place, "is required")
            return None if default is _REQUIRED else default
        value = table[key]
        kinds = kind if isinstance(kind, tuple) else (kind,)
        # TOML booleans are ints in Python; never accept one where a number is meant.
        if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
            names = " or ".join(_type_name(k) for k in kinds)
            self.error(place, f"must be {names}, not {_kind(value)} {value!r}")
            return None if default is _REQUIRED else default
        if check is not None:
            problem = check(value)
            if problem:
                self.error(place, problem)
                return None if default is _REQUIRED else default
        return value

    def strings(self, table: Mapping[str, Any], where: str, key: str, default: tuple[str, ...],
                check: Callable[[str], str | None] | None = None) -> tuple[str, ...]:
        value = self.get(table, where, key, (list, str), default=list(default))
        items = [value] if isinstance(value, str) else list(value)
        result = []
        for position, item in enumerate(items):
            if not isinstance(item, str):
                self.error(f"{_join(where, key)}[{position}]", f"must be a string, not {_kind(item)}")
            elif check is not None and (problem := check(item)):
                self.error(f"{_join(where, key)}[{position}]", problem)
            else:
                result.append(item)
        return tuple(result)


def _join(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key


def _type_name(kind: type) -> str:
    return {str: "a string", int: "an integer", float: "a number", bool: "true or false",
            list: "a list", dict: "a table"}.get(kind, kind.__name__)


def _kind(value: Any) -> str:
    return {str: "a string", int: "an integer", float: "a number", bool: "a boolean",
            list: "a list", dict: "a table"}.get(type(value), type(value).__name__)


def _positive(value: float) -> str | None:
    return None if value > 0 else "must be greater than 0"


def _port(value: int) -> str | None:
    return None if 1024 <= value <= 65535 else "must be a port between 1024 and 65535"


def _email_problem(address: str) -> str | None:
    return None if re.match(r"^[^@\s]+@[^@\s]+$", address) else "is not an e-mail address"


def _ssh_key_problem(line: str) -> str | None:
    if re.match(r"^(ssh-|ecdsa-|sk-)\S+ [A-Za-z0-9+/=]+( [^\n]*)?$", line):
        return None
    return "is not an SSH public key line (such as 'ssh-ed25519 AAAA... alice@laptop')"


def _timezone_problem(name: str) -> str | None:
    try:
        ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError):
        return f"unknown time zone {name!r} (use an IANA name such as 'Europe/Paris')"
    return None


def _system_timezone() -> str:
    try:
        name = Path("/etc/timezone").read_text().strip()
        if name and not _timezone_problem(name):
            return name
    except OSError:
        pass
    try:
        target = os.readlink("/etc/localtime")
        name = target.split("zoneinfo/", 1)[1]
        if not _timezone_problem(name):
            return name
    except (OSError, IndexError):
        pass
    return "UTC"


def _gpu_indices(reader: _Reader, where: str, value: Any) -> tuple[int, ...] | None:
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


def _read_password(reader: _Reader, where: str, base: Path, password_file: str | None) -> str | None:
    if password_file is None:
        return os.environ.get(PASSWORD_ENV)
    return _read_secret(reader, where, base, password_file)


def _read_secret(reader: _Reader, where: str, base: Path, secret_file: str) -> str | None:
    """A secret file's content; it must be readable by its owner only."""
    path = (base / secret_file).expanduser()
    try:
        info = path.stat()
        if stat.S_IMODE(info.st_mode) & 0o077:
            reader.error(where, f"{path} must be readable by its owner only (chmod 600 {path})")
            return None
        return path.read_text().strip()
    except OSError as error:
        reader.error(where, f"cannot read {path}: {error.strerror}")
        return None


def _calendar(reader: _Reader, where: str, table: Mapping[str, Any], base: Path) -> CalendarConfig | None:
    known = ["url", "username", "password_file", "gpus", "kind"]
    reader.unknown(table, where, known)
    url = reader.get(table, where, "url", str)
    kind = None
    if isinstance(url, str):
        if url.startswith("webcal://"):
            url = "https://" + url.removeprefix("webcal://")
        if not re.match(r"^https?://[^\s/]+", url):
            reader.error(_join(where, "url"), f"must be an http:// or https:// URL, not {url!r}")
        kind = "ics" if url.split("?", 1)[0].lower().endswith(".ics") else "caldav"
    kind = reader.get(table, where, "kind", str, default=kind,
                      check=lambda k: None if k in ("caldav", "ics") else 'must be "caldav" or "ics"')
    username = reader.get(table, where, "username", str, default=None)
    password_file = reader.get(table, where, "password_file", str, default=None)
    password = _read_password(reader, _join(where, "password_file"), base, password_file)
    gpus = _gpu_indices(reader, _join(where, "gpus"), table.get("gpus", "all"))
    if url is None or kind is None:
        return None
    return CalendarConfig(url=url, gpus=gpus, username=username, password=password, kind=kind)


def _user(reader: _Reader, name: str, table: Any) -> UserConfig | None:
    where = f"users.{name}"
    if problem := _user_name_problem(name):
        reader.error(where, problem)
        return None
    if not isinstance(table, Mapping):
        reader.error(where, f"must be a table ([users.{name}]), not {_kind(table)}")
        return None
    reader.unknown(table, where, ["email", "uid", "gid", "ssh_keys", "max_gpus", "templates"])

    def uid_check(value: int) -> str | None:
        return None if 1 <= value < 2**31 else "must be a uid between 1 and 2147483647 (not root)"

    uid = reader.get(table, where, "uid", int, check=uid_check)
    gid = reader.get(table, where, "gid", int, default=uid, check=uid_check)
    email = reader.strings(table, where, "email", (), check=_email_problem)
    keys = reader.strings(table, where, "ssh_keys", (), check=_ssh_key_problem)
    max_gpus = reader.get(table, where, "max_gpus", int, default=None,
                          check=lambda v: None if v >= 1 else "must be at least 1")
    templates = reader.strings(table, where, "templates", ("*",))
    if uid is None:
        return None
    return UserConfig(name=name, uid=uid, gid=gid if gid is not None else uid, email=email,
                      ssh_keys=keys, max_gpus=max_gpus, templates=templates)


def _events(reader: _Reader, table: Mapping[str, Any], where: str) -> tuple[str, ...]:
    def known(kind: str) -> str | None:
        return None if kind in NOTICE_KINDS else f"is not a notice ({', '.join(NOTICE_KINDS)})"

    return reader.strings(table, where, "events", ("warning", "ended"), check=known)


def _notify(reader: _Reader, table: Mapping[str, Any], base: Path) -> NotifyConfig:
    reader.unknown(table, "notify", ["email", "webhook"])
    mail_table = reader.table(table, "email", "notify.email")
    hook_table = reader.table(table, "webhook", "notify.webhook")
    where = "notify.email"
    reader.unknown(mail_table, where, ["enabled", "host", "port", "security", "sender", "username",
                                       "password_file", "timeout_seconds", "events"])
    email = None
    if reader.get(mail_table, where, "enabled", bool, default=False):
        password_file = reader.get(mail_table, where, "password_file", str, default=None)
        email = EmailConfig(
            host=reader.get(mail_table, where, "host", str, default="localhost"),
            port=reader.get(mail_table, where, "port", int, default=25,
                            check=lambda v: None if 1 <= v <= 65535 else "must be a port number"),
            security=reader.get(mail_table, where, "security", str, default="none",
                                check=lambda v: None if v in ("none", "starttls", "tls")
                                else 'must be "none", "starttls" or "tls"'),
            sender=reader.get(mail_table, where, "sender", str, default="gpubook@localhost", check=_email_problem),
            username=reader.get(mail_table, where, "username", str, default=None),
            password=_read_secret(reader, f"{where}.password_file", base, password_file) if password_file else None,
            timeout_seconds=float(reader.get(mail_table, where, "timeout_seconds", (int, float), default=10.0,
                                             check=_positive)),
            events=_events(reader, mail_table, where),
        )
    where = "notify.webhook"
    reader.unknown(hook_table, where, ["enabled", "url", "token_file", "timeout_seconds", "events"])
    webhook = None
    if reader.get(hook_table, where, "enabled", bool, default=False):
        url = reader.get(hook_table, where, "url", str,
                         check=lambda u: None if re.match(r"^https?://[^\s/]+", u) else "must be an http(s):// URL")
        token_file = reader.get(hook_table, where, "token_file", str, default=None)
        webhook = WebhookConfig(
            url=url or "",
            token=_read_secret(reader, f"{where}.token_file", base, token_file) if token_file else None,
            timeout_seconds=float(reader.get(hook_table, where, "timeout_seconds", (int, float), default=10.0,
                                             check=_positive)),
            events=_events(reader, hook_table, where),
        )
    return NotifyConfig(email=email, webhook=webhook)


def parse(data: Mapping[str, Any], path: Path) -> Config:
    """Validate parsed TOML; raise ConfigError listing every problem."""
    reader = _Reader(path)
    base = path.parent
    sections = ["host", "calendar", "defaults", "users", "gpus", "templates", "engine", "storage",
                "ssh", "nvidia", "daemon", "notify"]
    reader.unknown(data, "", sections)

    host_table = reader.table(data, "host", "host")
    reader.unknown(host_table, "host", ["name", "timezone"])
    host = HostConfig(
        name=reader.get(host_table, "host", "name", str, default=socket.gethostname(),
                        check=lambda n: None if re.match(r"^[A-Za-z0-9.-]{1,253}$", n) else "is not a host name"),
        timezone=reader.get(host_table, "host", "timezone", str, default=_system_timezone(),
                            check=_timezone_problem),
    )

    calendars: list[CalendarConfig] = []
    raw_calendars = data.get("calendar")
    if raw_calendars is None:
        reader.error("calendar", "at least one [[calendar]] is required")
    elif not isinstance(raw_calendars, list):
        reader.error("calendar", "must be written [[calendar]] (a list of tables)")
    else:
        for position, table in enumerate(raw_calendars):
            if not isinstance(table, Mapping):
                reader.error(f"calendar[{position}]", "must be a table")
            elif (calendar := _calendar(reader, f"calendar[{position}]", table, base)) is not None:
                calendars.append(calendar)
        urls = [c.url for c in calendars]
        for url in sorted({u for u in urls if urls.count(u) > 1}):
            reader.error("calendar", f"{url} is configured more than once")

    d = reader.table(data, "defaults", "defaults")
    reader.unknown(d, "defaults", ["template", "gpus", "max_hours", "warn_minutes"])
    defaults = Defaults(
        template=reader.get(d, "defaults", "template", str, default=Defaults.template,
                            check=_template_name_problem),
        gpus=reader.get(d, "defaults", "gpus", int, default=Defaults.gpus, check=_positive),
        max_hours=float(reader.get(d, "defaults", "max_hours", (int, float), default=Defaults.max_hours,
                                   check=_positive)),
        warn_minutes=float(reader.get(d, "defaults", "warn_minutes", (int, float),
                                      default=Defaults.warn_minutes,
                                      check=lambda v: None if v >= 0 else "must be 0 or more")),
    )

    users: dict[str, UserConfig] = {}
    for name, table in reader.table(data, "users", "users").items():
        if (user := _user(reader, name, table)) is not None:
            users[name] = user
    seen_emails: dict[str, str] = {}
    for user in users.values():
        for address in user.email:
            other = seen_emails.setdefault(address.lower(), user.name)
            if other != user.name:
                reader.error(f"users.{user.name}.email", f"{address} also belongs to users.{other}")

    g = reader.table(data, "gpus", "gpus")
    reader.unknown(g, "gpus", ["count"])
    gpu_count = reader.get(g, "gpus", "count", int, default=None,
                           check=lambda v: None if 0 <= v <= 64 else "must be between 0 and 64")

    t = reader.table(data, "templates", "templates")
    reader.unknown(t, "templates", ["dir"])
    templates_dir = reader.get(t, "templates", "dir", str, default=None)

    e = reader.table(data, "engine", "engine")
    reader.unknown(e, "engine", ["name", "binary", "runtime", "storage_driver", "network", "ulimits",
                                 "stop_grace_seconds"])
    engine = EngineConfig(
        name=reader.get(e, "engine", "name", str, default="podman",
                        check=lambda v: None if v in ("podman", "docker") else 'must be "podman" or "docker"'),
        binary=reader.get(e, "engine", "binary", str, default=None),
        runtime=reader.get(e, "engine", "runtime", str, default=None),
        storage_driver=reader.get(e, "engine", "storage_driver", str, default="overlay"),
        network=reader.get(e, "engine", "network", str, default="host",
                           check=lambda v: None if v in ("host", "private") else 'must be "host" or "private"'),
        ulimits=reader.strings(e, "engine", "ulimits", ()),
        stop_grace_seconds=float(reader.get(e, "engine", "stop_grace_seconds", (int, float), default=10.0,
                                            check=lambda v: None if v >= 0 else "must be 0 or more")),
    )

    s = reader.table(data, "storage", "storage")
    reader.unknown(s, "storage", ["data_root", "persistent_home"])
    data_root = reader.get(s, "storage", "data_root", str, default=None)
    storage = StorageConfig(
        data_root=(base / data_root).expanduser() if data_root else None,
        persistent_home=reader.get(s, "storage", "persistent_home", bool, default=False),
    )

    h = reader.table(data, "ssh", "ssh")
    reader.unknown(h, "ssh", ["port_min", "port_max"])
    ssh = SshConfig(port_min=reader.get(h, "ssh", "port_min", int, default=2200, check=_port),
                    port_max=reader.get(h, "ssh", "port_max", int, default=2299, check=_port))
    if ssh.port_min > ssh.port_max:
        reader.error("ssh.port_max", f"must not be below ssh.port_min ({ssh.port_min})")

    n = reader.table(data, "nvidia", "nvidia")
    reader.unknown(n, "nvidia", ["driver_roots"])
    nvidia = NvidiaConfig(driver_roots=tuple(Path(p) for p in reader.strings(n, "nvidia", "driver_roots", ())))

    dm = reader.table(data, "daemon", "daemon")
    reader.unknown(dm, "daemon", ["poll_seconds", "state_dir", "stale_after_minutes", "notice_seconds",
                                  "restart_limit", "restart_backoff_seconds"])
    state_dir = reader.get(dm, "daemon", "state_dir", str, default=None)
    daemon = DaemonConfig(
        poll_seconds=float(reader.get(dm, "daemon", "poll_seconds", (int, float), default=60.0, check=_positive)),
        state_dir=(base / state_dir).expanduser() if state_dir else None,
        stale_after_minutes=float(reader.get(dm, "daemon", "stale_after_minutes", (int, float), default=30.0,
                                             check=_positive)),
        notice_seconds=float(reader.get(dm, "daemon", "notice_seconds", (int, float), default=300.0,
                                        check=lambda v: None if v >= 0 else "must be 0 or more")),
        restart_limit=reader.get(dm, "daemon", "restart_limit", int, default=3,
                                 check=lambda v: None if v >= 0 else "must be 0 or more"),
        restart_backoff_seconds=float(reader.get(dm, "daemon", "restart_backoff_seconds", (int, float),
                                                 default=10.0,
                                                 check=lambda v: None if v >= 0 else "must be 0 or more")),
    )

    notify = _notify(reader, reader.table(data, "notify", "notify"), base)

    if reader.errors:
        raise ConfigError("\n".join(reader.errors))
    return Config(
        path=path, host=host, calendars=tuple(calendars), defaults=defaults, users=users,
        gpu_count=gpu_count, templates_dir=(base / templates_dir).expanduser() if templates_dir else None,
        engine=engine, storage=storage, ssh=ssh, nvidia=nvidia, daemon=daemon, notify=notify,
    )


def load(path: str | os.PathLike[str]) -> Config:
    """Read and validate a config file; ConfigError says what is wrong, all at once."""
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
    return parse(data, path.resolve())
