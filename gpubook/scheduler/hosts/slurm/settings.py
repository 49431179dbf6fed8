"""[backend]: where bookings run, declared beside the Slurm backend that reads most of it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from gpubook.scheduler.settings import Check, Section, checks, setting


def _kind_problem(kind: str) -> str | None:
    """The backend registry's word on `kind` (imported when a config is read: it loads a named class)."""
    from gpubook.scheduler.hosts.backend import kind_problem

    return kind_problem(kind)


@dataclass(frozen=True)
class BackendConfig:
    """[backend]: where bookings run: this machine ("local") or a Slurm cluster ("slurm", gpubook/scheduler/hosts/slurm:
    inventory and reservations so far; README "Running on a Slurm cluster")."""

    kind: str = setting("local", '"local" (this machine), "slurm" (a Slurm cluster), or a backend of one\'s own '
                        'as "package.module:Class"',
                        check=Check('"local", "slurm", another registered backend or "package.module:Class"',
                                    _kind_problem))
    slurm_conf: Path | None = setting(None, "the cluster's slurm.conf for scontrol (SLURM_CONF); unset: Slurm's own",
                                      sample="/etc/slurm/slurm.conf")
    partition: str = setting("", "the partition whose GPU nodes gpubook books; empty: every node",
                             check=checks.matches(r"[A-Za-z0-9_.-]{0,64}", "a Slurm partition name (up to 64 "
                                                  "letters, digits, '_', '.' or '-')", "is not a Slurm partition name"))
    reservation_prefix: str = setting("gpubook-", "the start of every reservation name gpubook makes (and may "
                                      "delete); one per gpubook instance",
                                      check=checks.matches(r"[A-Za-z0-9_-]{1,32}", "1-32 letters, digits, '_' or '-'",
                                                           "must be 1-32 letters, digits, '_' or '-'"))
    command_seconds: float = setting(20.0, "seconds an scontrol command may take before slurmctld counts as "
                                     "unreachable", check=checks.positive)
    shared_dir: Path | None = setting(None, "a folder every node and the daemon see at the same path (shared "
                                      "storage): each booking's job request, script, log and SSH result",
                                      sample="/shared/gpubook")


SECTION = Section("backend", BackendConfig, "where bookings run: this machine, or a Slurm cluster")
