"""The core's sections of the config, each a frozen dataclass whose fields carry their default, their
help (with the unit) and their check. The plug-ins declare theirs beside themselves ([backend] in
hosts/slurm/settings.py, [web] in outbox/web/settings.py, [sftp] in hosts/sftp_settings.py,
[notify] in outbox/settings.py; [engine] is runtime.engines.EngineSettings)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from gpubook.scheduler.settings import checks
from gpubook.scheduler.settings.declare import Check, setting

PASSWORD_ENV = "GPUBOOK_CALENDAR_PASSWORD"  # noqa: S105 - the variable's name, not a secret
IDENTITIES = ("description", "organizer")
FOREIGN_ACTIONS = ("report", "stop")


@dataclass(frozen=True)
class HostConfig:
    name: str = setting(help="shown in ssh lines; default: this machine's host name", fact="host name",
                        check=checks.host_name, example="devbox1")
    timezone: str = setting(help="IANA name; floating calendar times are read in it; default: the system's",
                            fact="time zone", check=checks.timezone, example="Europe/Paris")


@dataclass(frozen=True)
class CalendarConfig:
    """A `[[calendar]]`: url, gpus and kind, plus the keys its source kind declares."""

    url: str = setting(help="a CalDAV collection, or an http(s) .ics feed (webcal:// is read as https://)",
                       check=checks.http_url, example="http://127.0.0.1:5232/lab/devbox1/")
    gpus: tuple[int, ...] | None = setting(None, 'the GPUs this calendar books: "all" (unset: every GPU of the '
                                           "host), or their indices, such as [0, 1]", example="all")
    username: str | None = setting(None, "user name for the calendar server (kinds caldav, ics)",
                                   sample="gpubook")
    password: str | None = setting(None, "read from password_file (mode 0600), relative to the config file, or $"
                                   + PASSWORD_ENV, key="password_file", secret=True, env=PASSWORD_ENV,
                                   sample="secret")
    kind: str = setting("caldav", '"caldav", "ics" or "package.module:Class"; default: "ics" for a URL ending '
                        'in .ics, else "caldav"')
    # An identity the calendar server vouches for (issue 22, finding 7): the server's login and
    # rights decide who may write this collection, so its every event is this user's booking.
    user: str | None = setting(None, "the only user this calendar books for (a [users] name): its every event "
                               "is theirs whatever it says, and a `user:` line naming anyone else is refused; "
                               "give each user a calendar only they can write (the server's rights). unset: a "
                               "shared calendar, whose events say who they are for ([policy] identity)",
                               check=checks.user_name, sample="alice")


@dataclass(frozen=True)
class Defaults:
    template: str = setting("debian-ssh", "template of a booking that names none", check=checks.template_name)
    gpus: int = setting(1, "GPUs a booking gets when it names none", check=checks.positive)
    max_hours: float = setting(72.0, "longest booking accepted, in hours", check=checks.positive)
    warn_minutes: float = setting(15.0, "warning before the end, in minutes", check=checks.not_negative)


@dataclass(frozen=True, kw_only=True)
class UserConfig:
    name: str  # the [users.NAME] key, checked by runtime.names
    email: tuple[str, ...] = setting((), "ORGANIZER addresses that mean this user", check=checks.email,
                                     example=("alice@lab.example",))
    uid: int = setting(help="uid inside containers", check=checks.uid, example=1000)
    gid: int = setting(help="gid inside containers; default: the uid", check=checks.uid, default_from="uid",
                   sample=1000)
    ssh_keys: tuple[str, ...] = setting((), "public key lines", check=checks.ssh_key, example=(
        "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIB6v3b9c0p7s5xXl0bN3cYk2s9mJ0b2cZc8n8kq0tq0Q alice@laptop",))
    max_gpus: int | None = setting(None, "GPUs this user's accepted bookings hold at once (at any moment); "
                                   "default: [policy]'s; 0: no limit for this user", check=checks.not_negative,
                                   example=2)
    templates: tuple[str, ...] = setting(("*",), "fnmatch patterns of allowed templates")
    # Groups as projects (gpubook/scheduler/core/policy.py): the first is the project of a booking that names none.
    groups: tuple[str, ...] = setting((), "the [groups.NAME] this user books for, their first one the project of "
                                      "a booking that names none (`project:`); with a directory, these come "
                                      "first, then the configured groups the directory lists them in",
                                      check=checks.group_name, example=("vision",))
    # Quotas of this user; None: [policy]'s; 0: no limit for this user (gpubook/scheduler/core/policy.py).
    week_gpu_hours: float | None = setting(None, "GPU-hours in any rolling week; default: [policy]'s",
                                           check=checks.not_negative, sample=80)
    max_days_ahead: float | None = setting(None, "days ahead a booking may be made; default: [policy]'s",
                                           check=checks.not_negative, sample=7)
    max_future_bookings: int | None = setting(None, "bookings not started yet held at once; default: "
                                              "[policy]'s", check=checks.not_negative, sample=3)
    remind_minutes: float | None = setting(None, "this user's [policy] remind_minutes; unset: the policy's",
                                           check=checks.not_negative, sample=30)
    # No-shows and idle GPUs of this user (gpubook/scheduler/core/reclaim.py); None: [policy]'s; 0: off for them.
    no_show_minutes: float | None = setting(None, "this user's [policy] no_show_minutes; unset: the policy's",
                                            check=checks.not_negative, sample=0)
    idle_minutes: float | None = setting(None, "this user's [policy] idle_minutes; unset: the policy's",
                                         check=checks.not_negative, sample=0)
    # Who asks `gpubook free`, `bookings` and `mine` on the server is known by their host login
    # (the socket's peer credentials, outbox/ask_socket.py): this user's bookings are theirs by name.
    account: str | None = setting(None, "the host login that is this user when they ask the daemon "
                                  "(gpubook free, bookings, mine on the server); default: the user's name",
                                  check=checks.user_name_when_set, sample="alice")

    @property
    def login(self) -> str:
        """The host login that is this user (`account`, else the user's name)."""
        return self.account or self.name


@dataclass(frozen=True)
class GpusSection:
    count: int | None = setting(None, "the static inventory where NVML cannot be read",
                                check=checks.between(0, 64, "must be between 0 and 64"), sample=4)
    # Its check loads the named function: the reader declares it (scheduler.config.sections).
    monitor: str = setting("nvml", 'what reads utilisation and GPU processes: "nvml", or "package.module:function" '
                           "returning runtime.nvidia.nvml.NvmlView (e.g. a DCGM reader)")
    mps: bool = setting(False, "bind the MPS pipe folder (writable: MPS clients need it) into GPU containers "
                        "while an MPS control daemon runs; any booker can then stop or reconfigure MPS for all. "
                        "Not with Docker; the folder must be on a nosuid,nodev mount")


@dataclass(frozen=True)
class TemplatesSection:
    dir: Path | None = setting(None, "folder of templates; default: the templates shipped with gpubook",
                               sample="templates")


@dataclass(frozen=True)
class StorageConfig:
    data_root: Path | None = setting(None, "<root>/<user>/{input,output[,home]}; unset: no data folders",
                                     sample="/srv/gpubook")
    persistent_home: bool = setting(False, "keep a home folder per user under data_root")
    quota_gb: float | None = setting(None, "space per user under data_root, in GB (10^9 bytes); over it, "
                                     "SFTP uploads are refused until they delete; unset: no quota",
                                     check=checks.positive_when_set, sample=100)
    quota_files: int | None = setting(None, "files and folders (inodes) per user under data_root; over it, SFTP "
                                      "uploads are refused as over quota_gb; unset: no such quota",
                                      check=checks.positive_when_set, sample=1000000)


@dataclass(frozen=True)
class ImagesConfig:
    """[images]: template images prepared ahead of their bookings (gpubook/scheduler/hosts/images.py)."""

    prepare_hours: float = setting(24.0, "hours before a booking's start that its image is pulled, its sshd "
                                   "overlay built and its first start's copy made (the booker never waits for "
                                   "it); such images are never removed by min_free_gb", check=checks.not_negative)
    auth_file: Path | None = setting(None, "registry credentials in auth.json format (podman --authfile; Docker "
                                     "gets it as config.json), mode 0600; unset: anonymous pulls", private=True,
                                     sample="auth.json")
    min_free_gb: float = setting(0.0, "free space of the engine's storage, in GB (10^9 bytes), under which "
                                 "gpubook's unused images (and their chowned copies) are removed oldest first, "
                                 "before and after each preparation; 0: never",
                                 check=checks.not_negative)
    workers: int = setting(2, "pulls and overlay builds at once", check=checks.positive)


@dataclass(frozen=True)
class SshConfig:
    port_min: int = setting(2200, "each running booking gets its own port in [port_min, port_max]",
                            check=checks.port)
    port_max: int = setting(2299, "highest port given to a booking", check=checks.port)


def ssh_problems(ssh: SshConfig) -> list[tuple[str, str]]:
    if ssh.port_min > ssh.port_max:
        return [("port_max", f"must not be below ssh.port_min ({ssh.port_min})")]
    return []


@dataclass(frozen=True)
class NvidiaConfig:
    driver_roots: tuple[Path, ...] = setting((), "extra folders to search for driver files")


@dataclass(frozen=True)
class DaemonConfig:
    poll_seconds: float = setting(60.0, "seconds between calendar polls", check=checks.positive)
    check_seconds: float = setting(1.0, "seconds between cheap change checks of the CalDAV calendars that can "
                                   "tell cheaply whether they changed (a sync-token or ctag request); a change "
                                   "is read and passed at once, so a booking saved for now starts within "
                                   "seconds. Never more often than 10 times the check's own request time; "
                                   "ICS feeds keep poll_seconds; 0: off", check=checks.not_negative)
    state_dir: Path | None = setting(None, "state.sqlite, the probe key; default: $XDG_STATE_HOME/gpubook",
                                     sample="~/.local/state/gpubook")
    stale_after_minutes: float = setting(30.0, "minutes after which calendar data is too old to start from",
                                         check=checks.positive)
    notice_seconds: float = setting(300.0, "seconds from the warning to the stop when the end moved "
                                    "earlier or the event was deleted while running", check=checks.not_negative)
    restart_limit: int = setting(3, "restarts of a container that died during its booking",
                                 check=checks.not_negative)
    restart_backoff_seconds: float = setting(10.0, "seconds before the first restart; doubled each time",
                                             check=checks.not_negative)
    parallel_starts: int = setting(0, "bookings whose containers the engine starts at the same time (the rest "
                                   "queue for a moment); 0: the machine's number of cores", check=checks.not_negative)
    sample_seconds: float = setting(30.0, "seconds between samples of each GPU's utilisation and memory (and "
                                    "checks for the bookers' first logins), for `gpubook report`; 0: off",
                                    check=checks.not_negative)
    keep_days: float = setting(400.0, "days the state database keeps what a booking leaves behind after its end "
                               "(its container's run, write-back, event log lines, notices, accounting and GPU "
                               "samples), pruned daily; `gpubook report` sees no further back. 0: keep everything; "
                               "else at least 30 (the event log's append-only days)", check=checks.keep_days)


@dataclass(frozen=True)
class PolicyConfig:
    """[policy]: who may book for whom, and how much."""

    identity: str = setting(
        "description", 'who a booking is for: "description" (an ORGANIZER who is a known user books '
        'only for themselves; otherwise a `user:` line or the title names the booker) or "organizer" '
        "(only a known ORGANIZER books, for themselves; no organizer or an unknown one is refused)",
        check=checks.one_of(IDENTITIES))
    # Quotas (gpubook/scheduler/core/policy.py), each off by default; [users.NAME] may override each.
    week_gpu_hours: float = setting(0.0, "GPU-hours (GPUs x real hours) one user may hold in any rolling week "
                                    "(the 7 days before the end of each of their bookings); 0: no limit",
                                    check=checks.not_negative)
    max_days_ahead: float = setting(0.0, "days between the moment gpubook first sees a booking and its start, "
                                    "at most; 0: no limit", check=checks.not_negative)
    max_future_bookings: int = setting(0, "bookings not started yet that one user may hold at once; 0: no limit",
                                       check=checks.not_negative)
    max_gpus: int = setting(0, "GPUs one user's accepted bookings may hold at once (at any moment; a single booking "
                            "asking for more is refused outright); 0: no limit", check=checks.not_negative)
    remind_minutes: float = setting(0.0, "alarm in the accepted booking's event and a reminder notice, in "
                                    "minutes before the start; 0: off", check=checks.not_negative)
    # No-shows and idle GPUs (gpubook/scheduler/core/reclaim.py), off by default; [users.NAME] may override the minutes.
    no_show_minutes: float = setting(0.0, "a running booking nobody logged into whose GPUs stayed under "
                                     "idle_percent this many minutes after its start is released (its GPUs go "
                                     "back to the pool for the rest of its time); 0: off", check=checks.not_negative)
    idle_percent: float = setting(5.0, "a GPU under this utilisation (percent) counts as idle",
                                  check=Check("more than 0 and at most 100", lambda v: None if 0 < v <= 100
                                                     else "must be more than 0 and at most 100"))
    idle_minutes: float = setting(0.0, "a booking's GPU idle this many minutes in a row: its booker is told "
                                  "(event, terminal, notice); 0: off", check=checks.not_negative)
    idle_action: str = setting("notify", '"notify" (tell the booker) or "release" (also release the booking '
                               "once all its GPUs are idle, as a no-show)", check=checks.one_of(("notify", "release")))
    # Processes on a booked GPU that are not its booking's container's (gpubook/scheduler/hosts/foreign.py).
    foreign_processes: str = setting("report", 'processes on a booked GPU outside its booking\'s container: "report" '
                                     '(log, event, status, metrics) or "stop" (reported, then stopped after '
                                     "foreign_grace_minutes)", check=checks.one_of(FOREIGN_ACTIONS))
    foreign_grace_minutes: float = setting(5.0, 'minutes between the notice and the stop, with "stop"',
                                           check=checks.not_negative)


@dataclass(frozen=True, kw_only=True)
class GroupConfig:
    """[groups.NAME]: a group of users as a project, with quotas of its own beside each member's
    (gpubook/scheduler/core/policy.py): a booking is judged against both, and the tighter wins."""

    name: str  # the [groups.NAME] key: what `project:` names
    week_gpu_hours: float = setting(0.0, "GPU-hours the group's accepted bookings may hold in any rolling week (the "
                                    "7 days before the end of each of them); 0: no limit", check=checks.not_negative,
                                    sample=400)
    max_gpus: int = setting(0, "GPUs the group's accepted bookings may hold at once (at any moment); 0: no limit",
                            check=checks.not_negative, sample=4)
    max_future_bookings: int = setting(0, "bookings not started yet that the group may hold at once; 0: no limit",
                                       check=checks.not_negative, sample=10)
    directory_group: str | None = setting(None, "with [directory] source = \"ldap\": the DN of the LDAP group "
                                          "(posixGroup memberUid, groupOfNames member, groupOfUniqueNames "
                                          "uniqueMember) whose members are in this group, default cn=NAME beside "
                                          "[directory] group (else under its base); with source = \"host\": the "
                                          "host group's name, default NAME. Unused with source = \"file\"",
                                          sample="cn=vision,ou=groups,dc=lab,dc=example")
