"""The daemon's settings as values: pure (no file read, no TOML), what the core imports.

`Config` holds every section; the TOML reader (scheduler.config) builds it. The plug-ins' sections
([engine], [backend], [web], [sftp], [notify]) are declared beside their plug-ins, above the core:
here they are named for the type checker only, so the core holds them as values it never imports.
Per-user policy ("[users.NAME] over [policy]") is resolved once, when the Config is made.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from datetime import datetime
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING

from gpubook.scheduler.settings import checks
from gpubook.scheduler.settings.declare import Check, Section, key_of, setting
from gpubook.scheduler.settings.sections import (
    PASSWORD_ENV,
    CalendarConfig,
    DaemonConfig,
    Defaults,
    GpusSection,
    GroupConfig,
    HostConfig,
    ImagesConfig,
    NvidiaConfig,
    PolicyConfig,
    SshConfig,
    StorageConfig,
    TemplatesSection,
    UserConfig,
)

if TYPE_CHECKING:
    from gpubook.runtime.engines import EngineSettings
    from gpubook.scheduler.directory.settings import DirectoryConfig
    from gpubook.scheduler.hosts.sftp_settings import SftpConfig
    from gpubook.scheduler.hosts.slurm.settings import BackendConfig
    from gpubook.scheduler.outbox.settings import NotifyConfig
    from gpubook.scheduler.outbox.web.settings import WebConfig

__all__ = [
    "PASSWORD_ENV", "CalendarConfig", "Check", "Config", "DaemonConfig", "Defaults", "GpusSection", "GroupConfig",
    "HostConfig",
    "ImagesConfig", "NvidiaConfig", "PolicyConfig", "Section", "SshConfig", "StorageConfig", "TemplatesSection",
    "UserConfig", "UserPolicy", "checks", "key_of", "setting",
]


@dataclass(frozen=True)
class UserPolicy:
    """One user's effective policy: each value their `[users.NAME]` one, else `[policy]`'s.
    Quotas: 0 means no limit; minutes: 0 means off."""

    week_gpu_hours: float = 0.0
    max_days_ahead: float = 0.0
    max_future_bookings: int = 0
    max_gpus: int = 0
    remind_minutes: float = 0.0
    no_show_minutes: float = 0.0
    idle_minutes: float = 0.0


def user_policy(policy: PolicyConfig, user: UserConfig | None) -> UserPolicy:
    """The user's setting where they have one, else the policy's (the one place this rule lives)."""
    values = {}
    for item in fields(UserPolicy):
        own = getattr(user, item.name) if user is not None else None
        values[item.name] = getattr(policy, item.name) if own is None else own
    return UserPolicy(**values)


@dataclass(frozen=True)
class Config:
    path: Path
    host: HostConfig
    calendars: tuple[CalendarConfig, ...]
    defaults: Defaults
    users: Mapping[str, UserConfig]
    gpu_count: int | None  # [gpus] count: the static inventory where NVML cannot be read
    templates_dir: Path | None
    engine: EngineSettings
    storage: StorageConfig
    ssh: SshConfig
    nvidia: NvidiaConfig
    daemon: DaemonConfig
    notify: NotifyConfig
    sftp: SftpConfig
    web: WebConfig
    backend: BackendConfig
    gpu_monitor: str = "nvml"  # [gpus] monitor: the GPUs' live view (utilisation, processes)
    gpu_mps: bool = False  # [gpus] mps: bind the MPS pipe folder (shared by every booker)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    images: ImagesConfig = field(default_factory=ImagesConfig)
    directory: DirectoryConfig | None = None  # [directory]; None: source = "file", as read by parse()
    # [directory] source = "ldap": [users.NAME] tables without a uid (their uid 0 until a directory user fills it)
    user_overrides: Mapping[str, UserConfig] = field(default_factory=dict)
    directory_users: frozenset[str] = frozenset()  # the users that came from the directory
    # Directory users who left its group, and since when: kept in `users` for [defaults] max_hours after
    # that, so that a booking of theirs that runs runs to its end; any other booking of theirs is refused.
    departed_users: Mapping[str, datetime] = field(default_factory=dict)
    file_users: Mapping[str, UserConfig] | None = None  # the [users.NAME] tables, once the directory's were merged
    # [groups.NAME], in the file's order: projects with quotas of their own (gpubook/scheduler/core/policy.py)
    groups: Mapping[str, GroupConfig] = field(default_factory=dict)
    # Derived when made (so dataclasses.replace keeps it true): each user's effective policy.
    policies: Mapping[str, UserPolicy] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        resolved = {name: user_policy(self.policy, user) for name, user in self.users.items()}
        object.__setattr__(self, "policies", MappingProxyType(resolved))

    def policy_for(self, user: str) -> UserPolicy:
        """`user`'s effective policy; [policy]'s for a name that is not in [users]."""
        return self.policies.get(user) or user_policy(self.policy, None)

    def groups_of(self, user: str) -> tuple[str, ...]:
        """The configured groups `user` is in, their first one first (the project of a booking that
        names none): a file user's `groups` as listed; a directory user's table's, then the directory's."""
        own = self.users.get(user)
        return tuple(name for name in own.groups if name in self.groups) if own is not None else ()

    def user_by_email(self, email: str) -> UserConfig | None:
        wanted = email.strip().lower().removeprefix("mailto:")
        for user in self.users.values():
            if wanted in (address.lower() for address in user.email):
                return user
        return None
