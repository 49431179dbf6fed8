"""The daemon's configuration: one TOML file, validated as a whole.

Every problem is collected and reported together as `FILE: section.key: what is wrong`, with
"did you mean" for unknown keys. Each section is a frozen dataclass whose fields carry their
default, their help (with the unit) and their check (`setting(...)`); one generic reader turns a
TOML table into such a dataclass: the keys it knows are the fields, the types come from the
annotations. Engines declare `[engine]` themselves (runtime.engines.EngineSettings), calendar
source kinds the extra keys a `[[calendar]]` of theirs takes (scheduler.sources).
Secrets (calendar passwords) are read here and never shown again: they are kept out of repr().
"""

from __future__ import annotations

import dataclasses
import difflib
import ipaddress
import os
import re
import stat
import tomllib
import types
from collections.abc import Callable, Iterable, Mapping
from dataclasses import MISSING, dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints, overload
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from gpubook.runtime import engines
from gpubook.runtime.engines import EngineSettings as EngineConfig
from gpubook.runtime.errors import ConfigError
from gpubook.runtime.names import template_name_problem as _template_name_problem
from gpubook.runtime.names import user_name_problem as _user_name_problem
from gpubook.runtime.plugins import load_callable
from gpubook.scheduler import sources
from gpubook.scheduler.sources import BaseSource, https_url, implied_kind, source_class
from gpubook.scheduler.sources.errors import redact_url

PASSWORD_ENV = "GPUBOOK_CALENDAR_PASSWORD"  # noqa: S105 - the variable's name, not a secret
NOTICE_KINDS = ("accepted", "rejected", "running", "warning", "ended", "reminder", "released", "idle",
                "foreign")
_REQUIRED = object()
T = TypeVar("T")
Check = Callable[[Any], "str | None"]


# -- checks: None when the value is fine, else what is wrong with it ---------------------------


def _positive(value: float) -> str | None:
    return None if value > 0 else "must be greater than 0"


def _not_negative(value: float) -> str | None:
    return None if value >= 0 else "must be 0 or more"


def _port(value: int) -> str | None:
    return None if 1024 <= value <= 65535 else "must be a port between 1024 and 65535"


def _any_port(value: int) -> str | None:
    return None if 1 <= value <= 65535 else "must be a port number"


def _uid(value: int) -> str | None:
    return None if 1 <= value < 2**31 else "must be a uid between 1 and 2147483647 (not root)"


def _one_of(choices: Iterable[str]) -> Check:
    names = [f'"{choice}"' for choice in choices]
    sentence = names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"
    return lambda value: None if value in choices else f"must be {sentence}"


def _http_url(url: str) -> str | None:
    return None if re.match(r"^https?://[^\s/]+", url) else "must be an http(s):// URL"


def _host_name(name: str) -> str | None:
    return None if re.match(r"^[A-Za-z0-9.-]{1,253}$", name) else "is not a host name"


def _email_problem(address: str) -> str | None:
    return None if re.match(r"^[^@\s]+@[^@\s]+$", address) else "is not an e-mail address"


def _ssh_key_problem(line: str) -> str | None:
    if re.match(r"^(ssh-|ecdsa-|sk-)\S+ [A-Za-z0-9+/=]+( [^\n]*)?$", line):
        return None
    return "is not an SSH public key line (such as 'ssh-ed25519 AAAA... alice@laptop')"


def _notice_kind(kind: str) -> str | None:
    return None if kind in NOTICE_KINDS else f"is not a notice ({', '.join(NOTICE_KINDS)})"


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


def setting(default: Any = MISSING, help: str = "", *, check: Check | None = None,
            factory: Callable[[], Any] | None = None, key: str | None = None,
            secret: bool = False, env: str | None = None, default_from: str | None = None,
            private: bool = False) -> Any:
    """A config field: its default (or `factory`), help with its unit, and its check.

    `check` gets the TOML value (each item, for a list); `key` is the TOML key when it is not the
    field's name; `secret`: the key names a file (mode 0600) whose content is the value, else the
    variable `env`; `default_from`: the default is the value read for that other field. A `Path`
    is relative to the config file's folder; a tuple of them is taken as written; `private`: the
    Path names a file of credentials read later, which must be its owner's only (mode 0600)."""
    metadata = {"help": help, "check": check, "key": key, "secret": secret, "env": env,
                "default_from": default_from, "private": private}
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata, repr=not secret)


# -- the sections -------------------------------------------------------------------------------


@dataclass(frozen=True)
class HostConfig:
    name: str = setting(help="shown in ssh lines; default: this machine's host name",
                        factory=lambda: os.uname().nodename, check=_host_name)
    timezone: str = setting(help="IANA name; floating calendar times are read in it; default: the system's",
                            factory=_system_timezone, check=_timezone_problem)


@dataclass(frozen=True)
class CalendarConfig:
    """A `[[calendar]]`: url, gpus and kind, plus the keys its source kind declares."""

    url: str  # a CalDAV collection, or an http(s) .ics feed (webcal:// is read as https://)
    gpus: tuple[int, ...] | None  # None = "all" GPUs of the host
    username: str | None = setting(None, "user name for the calendar server")
    password: str | None = setting(None, "read from password_file (mode 0600) or $" + PASSWORD_ENV,
                                   key="password_file", secret=True, env=PASSWORD_ENV)
    kind: str = "caldav"  # a name in scheduler.sources.REGISTRY or package.module:Class
    # An identity the calendar server vouches for (issue 22, finding 7): the server's login and
    # rights decide who may write this collection, so its every event is this user's booking.
    user: str | None = setting(None, "the only user this calendar books for (a [users] name): its every event "
                               "is theirs whatever it says, and a `user:` line naming anyone else is refused; "
                               "give each user a calendar only they can write (the server's rights). None: a "
                               "shared calendar, whose events say who they are for ([policy] identity)",
                               check=_user_name_problem)


@dataclass(frozen=True)
class Defaults:
    template: str = setting("debian-ssh", "template of a booking that names none",
                            check=_template_name_problem)
    gpus: int = setting(1, "GPUs a booking gets when it names none", check=_positive)
    max_hours: float = setting(72.0, "longest booking accepted, in hours", check=_positive)
    warn_minutes: float = setting(15.0, "warning before the end, in minutes", check=_not_negative)


@dataclass(frozen=True, kw_only=True)
class UserConfig:
    name: str  # the [users.NAME] key, checked by runtime.names
    email: tuple[str, ...] = setting((), "ORGANIZER addresses that mean this user", check=_email_problem)
    uid: int = setting(help="uid inside containers", check=_uid)
    gid: int = setting(help="gid inside containers; default: the uid", check=_uid, default_from="uid")
    ssh_keys: tuple[str, ...] = setting((), "public key lines", check=_ssh_key_problem)
    max_gpus: int | None = setting(None, "GPUs at once; None: no per-user limit beyond the calendar's",
                                   check=lambda v: None if v >= 1 else "must be at least 1")
    templates: tuple[str, ...] = setting(("*",), "fnmatch patterns of allowed templates")
    # Quotas of this user; None: [policy]'s; 0: no limit for this user (gpubook/scheduler/core/policy.py).
    week_gpu_hours: float | None = setting(None, "GPU-hours in any rolling week; default: [policy]'s",
                                           check=_not_negative)
    max_days_ahead: float | None = setting(None, "days ahead a booking may be made; default: [policy]'s",
                                           check=_not_negative)
    max_future_bookings: int | None = setting(None, "bookings not started yet held at once; default: "
                                              "[policy]'s", check=_not_negative)
    remind_minutes: float | None = setting(None, "this user's [policy] remind_minutes; None: the policy's",
                                           check=_not_negative)
    # No-shows and idle GPUs of this user (gpubook/scheduler/core/reclaim.py); None: [policy]'s; 0: off for them.
    no_show_minutes: float | None = setting(None, "this user's [policy] no_show_minutes; None: the policy's",
                                            check=_not_negative)
    idle_minutes: float | None = setting(None, "this user's [policy] idle_minutes; None: the policy's",
                                         check=_not_negative)


def _monitor_problem(name: str) -> str | None:
    if name == "nvml":
        return None
    try:
        load_callable(name, what="GPU monitor")
    except ValueError as error:
        return str(error)
    return None


@dataclass(frozen=True)
class GpusSection:
    count: int | None = setting(None, "the static inventory where NVML cannot be read",
                                check=lambda v: None if 0 <= v <= 64 else "must be between 0 and 64")
    monitor: str = setting("nvml", 'what reads utilisation and GPU processes: "nvml", or "package.module:function" '
                           "returning runtime.nvidia.nvml.NvmlView (e.g. a DCGM reader)", check=_monitor_problem)
    mps: bool = setting(False, "bind the MPS pipe folder (writable: MPS clients need it) into GPU containers "
                        "while an MPS control daemon runs; any booker can then stop or reconfigure MPS for all. "
                        "Not with Docker; the folder must be on a nosuid,nodev mount")


@dataclass(frozen=True)
class TemplatesSection:
    dir: Path | None = setting(None, "folder of templates; default: the templates shipped with gpubook")


@dataclass(frozen=True)
class StorageConfig:
    data_root: Path | None = setting(None, "<root>/<user>/{input,output[,home]}; None: no data folders")
    persistent_home: bool = setting(False, "keep a home folder per user under data_root")
    quota_gb: float | None = setting(None, "space per user under data_root, in GB (10^9 bytes); over it, "
                                     "SFTP uploads are refused until they delete; None: no quota",
                                     check=lambda v: _positive(v) if v is not None else None)
    quota_files: int | None = setting(None, "files and folders (inodes) per user under data_root; over it, SFTP "
                                      "uploads are refused as over quota_gb; None: no such quota",
                                      check=lambda v: _positive(v) if v is not None else None)


def _address_problem(value: str) -> str | None:
    try:
        ipaddress.ip_address(value)
    except ValueError:
        return "must be an IP address such as 0.0.0.0 (all) or 127.0.0.1"
    return None


@dataclass(frozen=True)
class SftpConfig:
    """[sftp]: the always-on SFTP data service (needs [storage] data_root)."""

    enabled: bool = setting(False, "run the SFTP service: each user's input/, output/ (and home/) at any time")
    port: int = setting(2222, "host port of the SFTP service (bookings never get it)", check=_port)
    listen: str = setting("0.0.0.0", "host address the port is published on", check=_address_problem)  # noqa: S104
    network: str = setting("host", '"host": sshd binds listen:port on the host\'s network (no user runs code '
                           'there: no shell, no forwarding); "private": its own namespace, the port published '
                           '(slower for many small files, see BENCHMARKS.md)', check=_one_of(("host", "private")))
    template: str = setting("debian-ssh", "template whose image runs the service (it needs OpenSSH's sshd "
                            "and pkill)", check=_template_name_problem)
    check_seconds: float = setting(5.0, "seconds between checks of the service and of the quotas",
                                   check=_positive)
    measure_seconds: float = setting(20.0, "the longest one user's folder is walked to measure it; a walk that "
                                     "cannot finish counts as over quota (uploads refused until they delete)",
                                     check=_positive)


@dataclass(frozen=True)
class ImagesConfig:
    """[images]: template images prepared ahead of their bookings (gpubook/scheduler/hosts/images.py)."""

    prepare_hours: float = setting(24.0, "hours before a booking's start that its image is pulled and its sshd "
                                   "overlay built", check=_not_negative)
    auth_file: Path | None = setting(None, "registry credentials in auth.json format (podman --authfile; Docker "
                                     "gets it as config.json), mode 0600; None: anonymous pulls", private=True)
    min_free_gb: float = setting(0.0, "free space of the engine's storage, in GB (10^9 bytes), under which "
                                 "gpubook's unused images are removed oldest first; 0: never", check=_not_negative)
    workers: int = setting(2, "pulls and overlay builds at once", check=_positive)


def _listen_problem(value: str) -> str | None:
    host, _, port = value.rpartition(":")
    if not port.isdigit() or int(port) > 65535 or _address_problem(host.strip("[]")):
        return 'must be ADDRESS:PORT, such as "127.0.0.1:8380" or "[::1]:8380"'
    return None


def _network_problem(value: str) -> str | None:
    try:
        ipaddress.ip_network(value, strict=False)
    except ValueError:
        return f"{value!r} is not an IP address or network (such as 10.0.0.5 or 10.0.0.0/24)"
    return None


WEB_AUTH = ("none", "basic", "header")


@dataclass(frozen=True)
class WebConfig:
    """[web]: the read-only status page (gpubook/scheduler/outbox/web), served by the daemon or `gpubook web`."""

    enabled: bool = setting(False, "the daemon serves the page (`gpubook web` serves it on its own either way)")
    listen: str = setting("127.0.0.1:8380", "ADDRESS:PORT the page is served on (port 0: any free "
                          "one, logged); with auth none only a loopback address", check=_listen_problem)
    # Not "none" by default: every local account can reach a loopback port (issue 22, finding 10).
    auth: str = setting("basic", '"basic" (HTTP basic auth against htpasswd_file, bcrypt entries), "header" '
                        '(a reverse proxy\'s trusted_header, from trusted_proxies only) or "none" (every local '
                        'account sees every booking; loopback only, and only when written here)',
                        check=_one_of(WEB_AUTH))
    htpasswd_file: Path | None = setting(None, "user:bcrypt-hash lines (htpasswd -B) for auth basic, mode 0600",
                                         private=True)
    trusted_header: str = setting("X-Forwarded-User", "the header naming the logged-in user, set by the proxy",
                                  check=lambda v: None if re.fullmatch(r"[A-Za-z0-9-]{1,64}", v)
                                  else "must be a header name (letters, digits, -)")
    trusted_proxies: tuple[str, ...] = setting((), "addresses or networks of the reverse proxies whose "
                                               "trusted_header is believed; none by default: auth header needs "
                                               "them written (a loopback one lets every local account name "
                                               "itself anyone)", check=_network_problem)
    metrics: bool = setting(True, "serve /metrics (Prometheus) beside the page, under the same access rules")


@dataclass(frozen=True)
class BackendConfig:
    """[backend]: where bookings run: this machine ("local") or a Slurm cluster ("slurm", gpubook/scheduler/hosts/slurm:
    inventory and reservations so far; README "Running on a Slurm cluster")."""

    kind: str = setting("local", '"local" (this machine) or "slurm" (a Slurm cluster)',
                        check=_one_of(("local", "slurm")))
    slurm_conf: Path | None = setting(None, "the cluster's slurm.conf for scontrol (SLURM_CONF); None: Slurm's own")
    partition: str = setting("", "the partition whose GPU nodes gpubook books; empty: every node",
                             check=lambda v: None if re.fullmatch(r"[A-Za-z0-9_.-]{0,64}", v)
                             else "is not a Slurm partition name")
    reservation_prefix: str = setting("gpubook-", "the start of every reservation name gpubook makes (and may "
                                      "delete); one per gpubook instance",
                                      check=lambda v: None if re.fullmatch(r"[A-Za-z0-9_-]{1,32}", v)
                                      else "must be 1-32 letters, digits, '_' or '-'")
    command_seconds: float = setting(20.0, "seconds an scontrol command may take before slurmctld counts as "
                                     "unreachable", check=_positive)
    shared_dir: Path | None = setting(None, "a folder every node and the daemon see at the same path (shared "
                                      "storage): each booking's job request, script, log and SSH result")


def web_problem(web: WebConfig) -> str | None:
    """Why the page must not start with these settings (None: it may)."""
    host = web.listen.rpartition(":")[0].strip("[]")
    if web.auth == "none" and not ipaddress.ip_address(host).is_loopback:
        return (f'[web] listen = "{web.listen}" is not a loopback address, and [web] auth = "none" would show '
                f'every booking to anyone who reaches it: set auth = "basic" or "header", or listen on 127.0.0.1')
    if web.auth == "basic" and web.htpasswd_file is None:
        return ('[web] auth = "basic" (the default) needs htpasswd_file (user:bcrypt lines, made with htpasswd -B); '
                'auth = "none" shows every booking to every local account and must be written out')
    if web.auth == "header" and not web.trusted_proxies:
        return ('[web] auth = "header" needs trusted_proxies: the address of the reverse proxy that sets '
                f'{web.trusted_header} (nobody else may set it)')
    return None


@dataclass(frozen=True)
class SshConfig:
    port_min: int = setting(2200, "each running booking gets its own port in [port_min, port_max]",
                            check=_port)
    port_max: int = setting(2299, "highest port given to a booking", check=_port)


@dataclass(frozen=True)
class NvidiaConfig:
    driver_roots: tuple[Path, ...] = setting((), "extra folders to search for driver files")


@dataclass(frozen=True)
class DaemonConfig:
    poll_seconds: float = setting(60.0, "seconds between calendar polls", check=_positive)
    state_dir: Path | None = setting(None, "state.sqlite, the probe key; default: $XDG_STATE_HOME/gpubook")
    stale_after_minutes: float = setting(30.0, "minutes after which calendar data is too old to start from",
                                         check=_positive)
    notice_seconds: float = setting(300.0, "seconds from the warning to the stop when the end moved "
                                    "earlier or the event was deleted while running", check=_not_negative)
    restart_limit: int = setting(3, "restarts of a container that died during its booking",
                                 check=_not_negative)
    restart_backoff_seconds: float = setting(10.0, "seconds before the first restart; doubled each time",
                                             check=_not_negative)
    parallel_starts: int = setting(0, "bookings whose containers the engine starts at the same time (the rest "
                                   "queue for a moment); 0: the machine's number of cores", check=_not_negative)
    sample_seconds: float = setting(30.0, "seconds between samples of each GPU's utilisation and memory (and "
                                    "checks for the bookers' first logins), for `gpubook report`; 0: off",
                                    check=_not_negative)


@dataclass(frozen=True)
class EmailConfig:
    """[notify.email]: notices mailed to the booker's `email` addresses (off unless enabled)."""

    host: str = setting("localhost", "SMTP server")
    port: int = setting(25, "SMTP port", check=_any_port)
    security: str = setting("none", '"none", "starttls" or "tls" (SMTPS)',
                            check=_one_of(("none", "starttls", "tls")))
    sender: str = setting("gpubook@localhost", "From: address", check=_email_problem)
    username: str | None = setting(None, "SMTP user name")
    password: str | None = setting(None, "read from password_file (mode 0600)", key="password_file",
                                   secret=True)
    timeout_seconds: float = setting(10.0, "seconds to wait for the server", check=_positive)
    events: tuple[str, ...] = setting(("warning", "ended", "reminder", "released", "idle", "foreign"),
                                      "notices to send", check=_notice_kind)


@dataclass(frozen=True)
class WebhookConfig:
    """[notify.webhook]: one JSON POST per notice (off unless enabled)."""

    url: str = setting(help="where to POST", check=_http_url)
    token: str | None = setting(None, 'read from token_file (mode 0600); sent as "Authorization: Bearer <token>"',
                                key="token_file", secret=True)
    timeout_seconds: float = setting(10.0, "seconds to wait for the server", check=_positive)
    events: tuple[str, ...] = setting(("warning", "ended", "reminder", "released", "idle", "foreign"),
                                      "notices to send", check=_notice_kind)


@dataclass(frozen=True)
class NotifyConfig:
    email: EmailConfig | None = setting(None, "mail; None: off")
    webhook: WebhookConfig | None = setting(None, "webhook; None: off")


IDENTITIES = ("description", "organizer")
FOREIGN_ACTIONS = ("report", "stop")


@dataclass(frozen=True)
class PolicyConfig:
    """[policy]: who may book for whom, and how much."""

    identity: str = setting(
        "description", 'who a booking is for: "description" (an ORGANIZER who is a known user books '
        'only for themselves; otherwise a `user:` line or the title names the booker) or "organizer" '
        "(only a known ORGANIZER books, for themselves; no organizer or an unknown one is refused)",
        check=_one_of(IDENTITIES))
    # Quotas (gpubook/scheduler/core/policy.py), each off by default; [users.NAME] may override each.
    week_gpu_hours: float = setting(0.0, "GPU-hours (GPUs x real hours) one user may hold in any rolling week "
                                    "(the 7 days before the end of each of their bookings); 0: no limit",
                                    check=_not_negative)
    max_days_ahead: float = setting(0.0, "days between the moment gpubook first sees a booking and its start, "
                                    "at most; 0: no limit", check=_not_negative)
    max_future_bookings: int = setting(0, "bookings not started yet that one user may hold at once; 0: no limit",
                                       check=_not_negative)
    remind_minutes: float = setting(0.0, "alarm in the accepted booking's event and a reminder notice, in "
                                    "minutes before the start; 0: off", check=_not_negative)
    # No-shows and idle GPUs (gpubook/scheduler/core/reclaim.py), off by default; [users.NAME] may override the minutes.
    no_show_minutes: float = setting(0.0, "a running booking nobody logged into whose GPUs stayed under "
                                     "idle_percent this many minutes after its start is released (its GPUs go "
                                     "back to the pool for the rest of its time); 0: off", check=_not_negative)
    idle_percent: float = setting(5.0, "a GPU under this utilisation (percent) counts as idle",
                                  check=lambda v: None if 0 < v <= 100 else "must be more than 0 and at most 100")
    idle_minutes: float = setting(0.0, "a booking's GPU idle this many minutes in a row: its booker is told "
                                  "(event, terminal, notice); 0: off", check=_not_negative)
    idle_action: str = setting("notify", '"notify" (tell the booker) or "release" (also release the booking '
                               "once all its GPUs are idle, as a no-show)", check=_one_of(("notify", "release")))
    # Processes on a booked GPU that are not its booking's container's (gpubook/scheduler/hosts/foreign.py).
    foreign_processes: str = setting("report", 'processes on a booked GPU outside its booking\'s container: "report" '
                                     '(log, event, status, metrics) or "stop" (reported, then stopped after '
                                     "foreign_grace_minutes)", check=_one_of(FOREIGN_ACTIONS))
    foreign_grace_minutes: float = setting(5.0, 'minutes between the notice and the stop, with "stop"',
                                           check=_not_negative)


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
    gpu_monitor: str = "nvml"  # [gpus] monitor: the GPUs' live view (utilisation, processes)
    gpu_mps: bool = False  # [gpus] mps: bind the MPS pipe folder (shared by every booker)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    sftp: SftpConfig = field(default_factory=SftpConfig)
    images: ImagesConfig = field(default_factory=ImagesConfig)
    web: WebConfig = field(default_factory=WebConfig)
    backend: BackendConfig = field(default_factory=BackendConfig)

    def user_by_email(self, email: str) -> UserConfig | None:
        wanted = email.strip().lower().removeprefix("mailto:")
        for user in self.users.values():
            if wanted in (address.lower() for address in user.email):
                return user
        return None


def remind_minutes(config: Config, user: str) -> float:
    """Minutes before a booking's start that its booker is reminded ([users.NAME] over [policy]); 0: off."""
    own = config.users[user].remind_minutes if user in config.users else None
    return own if own is not None else config.policy.remind_minutes


# -- reading ----------------------------------------------------------------------------------


class _Reader:
    """Reads typed values out of TOML tables, collecting every error instead of stopping."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.base = path.parent  # relative paths and secret files are relative to the config
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
        check: Check | None = None,
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
                check: Check | None = None) -> tuple[str, ...]:
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

    def secret(self, where: str, secret_file: str) -> str | None:
        """A secret file's content; it must be readable by its owner only."""
        path = (self.base / secret_file).expanduser()
        if not self.owner_only(where, path):
            return None
        try:
            return path.read_text().strip()
        except OSError as error:
            self.error(where, f"cannot read {path}: {error.strerror}")
            return None

    def owner_only(self, where: str, path: Path) -> bool:
        """Whether `path` exists and is readable and writable by its owner only (else an error)."""
        try:
            info = path.stat()
        except OSError as error:
            self.error(where, f"cannot read {path}: {error.strerror}")
            return False
        if stat.S_IMODE(info.st_mode) & 0o077:
            self.error(where, f"{path} must be readable by its owner only (chmod 600 {path})")
            return False
        return True

    # -- the generic part: a TOML table into a settings dataclass ------------------------------

    def section(self, data: Mapping[str, Any], name: str, cls: type[T],
                checks: Mapping[str, Check] | None = None) -> T:
        return cls(**self.settings(self.table(data, name, name), name, cls, checks=checks))

    def settings(self, table: Mapping[str, Any], where: str, cls: type, *,
                 checks: Mapping[str, Check] | None = None, given: Mapping[str, Any] | None = None,
                 only: Iterable[str] | None = None) -> dict[str, Any]:
        """Every field of `cls` read from `table` (unknown keys reported first), as keyword arguments.

        `given` fields are not read from TOML; `only` limits reading to those TOML keys."""
        given = dict(given or {})
        fields = [f for f in dataclasses.fields(cls) if f.init and f.name not in given]
        if only is not None:
            fields = [f for f in fields if _key(f) in set(only)]
        else:
            self.unknown(table, where, [_key(f) for f in fields])
        hints = get_type_hints(cls)
        values = given
        for item in fields:
            check = item.metadata.get("check") or (checks or {}).get(item.name)
            values[item.name] = self.value(table, where, item, hints[item.name], check, values)
        return values

    def value(self, table: Mapping[str, Any], where: str, item: dataclasses.Field[Any], hint: Any,
              check: Check | None, values: Mapping[str, Any]) -> Any:
        key, meta = _key(item), item.metadata
        default: Any = _REQUIRED
        if item.default is not MISSING:
            default = item.default
        elif item.default_factory is not MISSING:
            default = item.default_factory()
        elif meta.get("default_from"):
            default = values.get(meta["default_from"])
        kind = _optional_of(hint)
        if isinstance(kind, type) and dataclasses.is_dataclass(kind):  # a sub-table, off unless `enabled`
            return self.switched(table, _join(where, key), key, kind)
        if meta.get("secret"):
            secret_file = self.get(table, where, key, str, default=None)
            if secret_file is None:
                return os.environ.get(meta["env"]) if meta.get("env") else default
            if not secret_file and not meta.get("env"):  # [notify] always took "" for no secret
                return default
            return self.secret(_join(where, key), secret_file)
        if get_origin(kind) is tuple:
            texts = self.strings(table, where, key, tuple(str(p) for p in default), check=check)
            return tuple(Path(text) for text in texts) if get_args(kind)[0] is Path else texts
        if get_origin(kind) is Literal:
            return self.get(table, where, key, str, default, check or _one_of(get_args(kind)))
        if kind is Path:
            text = self.get(table, where, key, str, default=default, check=check)
            path = (self.base / text).expanduser() if text else None
            if path is not None and meta.get("private") and not self.owner_only(_join(where, key), path):
                return None
            return path
        if kind is float:
            number = self.get(table, where, key, (int, float), default=default, check=check)
            return float(number) if number is not None else None
        if kind in (str, int, bool):
            return self.get(table, where, key, kind, default=default, check=check)
        raise TypeError(f"{where}.{key}: the config reader cannot read a {hint!r}")

    def switched(self, data: Mapping[str, Any], where: str, key: str, cls: type[Any]) -> Any:
        table = self.table(data, key, where)
        self.unknown(table, where, ["enabled", *(_key(f) for f in dataclasses.fields(cls))])
        if not self.get(table, where, "enabled", bool, default=False):
            return None
        return cls(**self.settings(table, where, cls, only=[_key(f) for f in dataclasses.fields(cls)]))


def _key(item: dataclasses.Field[Any]) -> str:
    return item.metadata.get("key") or item.name


def _optional_of(hint: Any) -> Any:
    """`X | None` -> X; anything else as it is."""
    if get_origin(hint) in (Union, types.UnionType):
        kinds = [arg for arg in get_args(hint) if arg is not type(None)]
        if len(kinds) == 1:
            return kinds[0]
    return hint


def _join(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key


def _type_name(kind: type) -> str:
    return {str: "a string", int: "an integer", float: "a number", bool: "true or false",
            list: "a list", dict: "a table"}.get(kind, kind.__name__)


def _kind(value: Any) -> str:
    return {str: "a string", int: "an integer", float: "a number", bool: "a boolean",
            list: "a list", dict: "a table"}.get(type(value), type(value).__name__)


# -- the sections with logic of their own ---------------------------------------------------------


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


def _source_keys(table: Mapping[str, Any]) -> tuple[str, ...]:
    """The keys the calendar's source kind declares (the built-in default for a broken kind)."""
    kind, url = table.get("kind"), table.get("url")
    if not isinstance(kind, str):
        kind = implied_kind(https_url(url)) if isinstance(url, str) else "caldav"
    if sources.REGISTRY.problem(kind) is not None:
        return BaseSource.calendar_keys
    return source_class(kind).calendar_keys


def _calendar(reader: _Reader, where: str, table: Mapping[str, Any]) -> CalendarConfig | None:
    source_keys = _source_keys(table)
    reader.unknown(table, where, ["url", *source_keys, "gpus", "kind", "user"])
    url = reader.get(table, where, "url", str)
    kind = None
    if isinstance(url, str):
        url = https_url(url)
        if not re.match(r"^https?://[^\s/]+", url):
            reader.error(_join(where, "url"), f"must be an http:// or https:// URL, not {redact_url(url)!r}")
        kind = implied_kind(url)
    kind = reader.get(table, where, "kind", str, default=kind, check=sources.REGISTRY.problem)
    settings = reader.settings(table, where, CalendarConfig, only=[*source_keys, "user"])
    gpus = _gpu_indices(reader, _join(where, "gpus"), table.get("gpus", "all"))
    if url is None or kind is None:
        return None
    return CalendarConfig(url=url, gpus=gpus, kind=kind, **settings)


def _calendars(reader: _Reader, data: Mapping[str, Any], name: str) -> tuple[CalendarConfig, ...]:
    calendars: list[CalendarConfig] = []
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
                calendars.append(calendar)
        urls = [c.url for c in calendars]
        for url in sorted({u for u in urls if urls.count(u) > 1}):
            reader.error(name, f"{redact_url(url)} is configured more than once")
    return tuple(calendars)


def _user(reader: _Reader, name: str, table: Any) -> UserConfig | None:
    where = f"users.{name}"
    if problem := _user_name_problem(name):
        reader.error(where, problem)
        return None
    if not isinstance(table, Mapping):
        reader.error(where, f"must be a table ([users.{name}]), not {_kind(table)}")
        return None
    settings = reader.settings(table, where, UserConfig, given={"name": name})
    return UserConfig(**settings) if settings["uid"] is not None else None


def _users(reader: _Reader, data: Mapping[str, Any], name: str) -> dict[str, UserConfig]:
    users: dict[str, UserConfig] = {}
    for user_name, table in reader.table(data, name, name).items():
        if (user := _user(reader, user_name, table)) is not None:
            users[user_name] = user
    seen_emails: dict[str, str] = {}
    for user in users.values():
        for address in user.email:
            other = seen_emails.setdefault(address.lower(), user.name)
            if other != user.name:
                reader.error(f"users.{user.name}.email", f"{address} also belongs to users.{other}")
    return users


def _ssh(reader: _Reader, data: Mapping[str, Any], name: str) -> SshConfig:
    ssh = reader.section(data, name, SshConfig)
    if ssh.port_min > ssh.port_max:
        reader.error("ssh.port_max", f"must not be below ssh.port_min ({ssh.port_min})")
    return ssh


def _notify(reader: _Reader, data: Mapping[str, Any], name: str) -> NotifyConfig:
    notify = reader.section(data, name, NotifyConfig)
    email = notify.email
    if email is not None and email.username and email.security == "none":
        # Even to a loopback host: any local user may listen on its port while the relay is down.
        reader.error(f"{name}.email.security", f'is "none", but a username is set: logging in to '
                     f'{email.host}:{email.port} would send the password in clear; set security = '
                     f'"starttls" or "tls"')
    return notify


def _plain(cls: type, checks: Mapping[str, Check] | None = None) -> Callable[[_Reader, Mapping[str, Any], str], Any]:
    return lambda reader, data, name: reader.section(data, name, cls, checks=checks)


# The top-level tables, read in this order (errors are listed in it too).
SECTIONS: dict[str, Callable[[_Reader, Mapping[str, Any], str], Any]] = {
    "host": _plain(HostConfig),
    "calendar": _calendars,
    "defaults": _plain(Defaults),
    "users": _users,
    "gpus": _plain(GpusSection),
    "templates": _plain(TemplatesSection),
    "engine": _plain(EngineConfig, engines.SETTING_CHECKS),  # the engines declare their checks
    "storage": _plain(StorageConfig),
    "ssh": _ssh,
    "nvidia": _plain(NvidiaConfig),
    "daemon": _plain(DaemonConfig),
    "notify": _notify,
    "policy": _plain(PolicyConfig),
    "sftp": _plain(SftpConfig),
    "images": _plain(ImagesConfig),
    "web": _plain(WebConfig),
    "backend": _plain(BackendConfig),
}


def _sftp_problems(reader: _Reader, read: Mapping[str, Any]) -> None:
    """[sftp] against the sections it depends on."""
    sftp, storage = read["sftp"], read["storage"]
    if not sftp.enabled:
        return
    if storage.data_root is None:
        reader.error("sftp.enabled", "needs [storage] data_root: the service serves the folders there")
    owners: dict[int, str] = {}
    for user in read["users"].values():
        other = owners.setdefault(user.uid, user.name)
        if other != user.name:
            reader.error(f"users.{user.name}.uid", f"{user.uid} is also users.{other}'s: the SFTP service "
                         f"ends a removed or over-quota user's sessions by uid")


def parse(data: Mapping[str, Any], path: Path) -> Config:
    """Validate parsed TOML; raise ConfigError listing every problem."""
    reader = _Reader(path)
    reader.unknown(data, "", list(SECTIONS))
    read = {name: read_section(reader, data, name) for name, read_section in SECTIONS.items()}
    if not reader.errors:
        _sftp_problems(reader, read)
        for position, calendar in enumerate(read["calendar"]):
            if calendar.user is not None and calendar.user not in read["users"]:
                reader.error(f"calendar[{position}].user", f"{calendar.user!r} is not a user of [users]")
        if read["web"].enabled and (problem := web_problem(read["web"])):
            reader.error("web", problem)
        if read["gpus"].mps and (problem := engines.mps_problem(read["engine"])):
            reader.error("gpus.mps", problem)  # the engine's own reason (Docker: root inside is host root)
    if reader.errors:
        raise ConfigError("\n".join(reader.errors))
    return Config(
        path=path, host=read["host"], calendars=read["calendar"], defaults=read["defaults"],
        users=read["users"], gpu_count=read["gpus"].count, templates_dir=read["templates"].dir,
        engine=read["engine"], storage=read["storage"], ssh=read["ssh"], nvidia=read["nvidia"],
        daemon=read["daemon"], notify=read["notify"], gpu_mps=read["gpus"].mps, policy=read["policy"],
        gpu_monitor=read["gpus"].monitor, sftp=read["sftp"], images=read["images"], web=read["web"],
        backend=read["backend"],
    )


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
