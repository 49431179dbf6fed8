"""A Slurm cluster as gpubook sees it: its GPU nodes (the plan's inventory) and gpubook's advance
reservations there, kept in step with the plan by `sync`.

Every Slurm call is `scontrol` with an argv list, run with TZ=UTC (so times read and written are
UTC) and SLURM_CONF when the config names the cluster's file. The daemon needs no root: Slurm
lets its SlurmUser (or an Operator, where slurmdbd is used) create, update and delete
reservations. A controller that does not answer is a temporary error (the whole sync waits for
the next pass, nothing half-decided is acted on); a command Slurm refuses is that booking's
problem alone, reported in `Synced.refused` with Slurm's own sentence.
"""

from __future__ import annotations

import copy
import os
import pwd
import subprocess
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from gpubook.runtime.errors import GpubookError
from gpubook.scheduler.core.plan import Accepted
from gpubook.scheduler.hosts.slurm import parse, sync
from gpubook.scheduler.hosts.slurm.settings import BackendConfig

# scontrol's words when it cannot reach slurmctld (22.05): a temporary state, never the booking's fault.
_UNREACHABLE = ("Unable to contact slurm controller", "Socket timed out", "Connection refused",
                "Zero Bytes were transmitted", "Communication connection failure")


class SlurmError(GpubookError):
    """Slurm refused a command; carries Slurm's own message."""


class SlurmUnreachable(SlurmError):
    """slurmctld did not answer (down, restarting, network); retried on the next pass."""

    temporary = True


@dataclass(frozen=True)
class Synced:
    changes: tuple[sync.Change, ...]  # the commands issued, in order
    refused: Mapping[str, str] = field(default_factory=dict)  # booking id → Slurm's reason


class Scontrol:
    """scontrol, run with an argv list, a time limit and UTC."""

    def __init__(self, *, conf: Path | None = None, timeout: float = 20.0, program: str = "scontrol") -> None:
        self.conf, self.timeout, self.program = conf, timeout, program
        self.calls = 0  # how many commands were run (the no-change sync's check counts these)

    def __call__(self, *args: str) -> str:
        env = {**os.environ, "TZ": "UTC"}
        if self.conf is not None:
            env["SLURM_CONF"] = str(self.conf)
        self.calls += 1
        try:
            done = subprocess.run(self.argv(args), env=env, capture_output=True, text=True,
                                  timeout=self.timeout, check=False)
        except subprocess.TimeoutExpired:
            raise SlurmUnreachable(f"{Path(self.program).name} {args[0]} did not answer within {self.timeout:g} s"
                                   ) from None
        except FileNotFoundError:
            raise SlurmError(f"{self.program} is not installed (Debian: apt-get install slurm-client)") from None
        if done.returncode != 0:
            message = (done.stderr.strip() or done.stdout.strip() or f"exit status {done.returncode}")
            message = message.removeprefix(f"{Path(self.program).name}: ").replace("\n", "; ")
            if any(words in message for words in _UNREACHABLE):
                raise SlurmUnreachable(f"slurmctld did not answer: {message}")
            raise SlurmError(message)
        return done.stdout

    def argv(self, args: Sequence[str]) -> list[str]:
        return [self.program, *args]

    def tool(self, program: str) -> Scontrol:
        """The same runner (its config, time limit, account) for another Slurm client: sbatch,
        squeue, scancel."""
        other = copy.copy(self)
        other.program = program
        return other


class SlurmCluster:
    """The cluster's GPU nodes and gpubook's reservations on them."""

    def __init__(self, *, scontrol: Scontrol, prefix: str, users: Sequence[str], partition: str = "") -> None:
        if not sync.PREFIX_PATTERN.fullmatch(prefix):
            raise SlurmError(f"reservation prefix {prefix!r} is not 1-32 letters, digits, '_' or '-'")
        self.scontrol, self.prefix, self.users, self.partition = scontrol, prefix, tuple(users), partition

    @classmethod
    def from_config(cls, backend: BackendConfig) -> SlurmCluster:
        """The cluster of a `[backend] kind = "slurm"` config; reservations are for the daemon's own
        account (it submits the bookings' jobs into them)."""
        account = pwd.getpwuid(os.geteuid()).pw_name
        return cls(scontrol=Scontrol(conf=backend.slurm_conf, timeout=backend.command_seconds),
                   prefix=backend.reservation_prefix, users=[account], partition=backend.partition)

    def nodes(self) -> tuple[parse.Node, ...]:
        return parse.nodes(self.scontrol("show", "node", "--oneliner"))

    def gpu_nodes(self) -> tuple[parse.Node, ...]:
        """The nodes with GPUs in the configured partition, whatever their state, in Slurm's order."""
        return tuple(node for node in self.nodes()
                     if node.gpus > 0 and (not self.partition or self.partition in node.partitions))

    def inventory(self) -> dict[str, tuple[int, ...]]:
        """Each usable node with GPUs (in the configured partition) → its GPU indices, in Slurm's order.
        A down, drained or failed node is left out: the plan places nothing new there."""
        return {node.name: tuple(range(node.gpus)) for node in self.gpu_nodes() if node.usable}

    def reservations(self) -> tuple[parse.Reservation, ...]:
        """gpubook's reservations (its prefix), as Slurm holds them now."""
        listed = parse.reservations(self.scontrol("show", "reservation", "--oneliner"))
        return tuple(r for r in listed if r.name.startswith(self.prefix))

    def sync(self, accepted: Iterable[Accepted], *, now: datetime,
             nodes_of: dict[str, tuple[str, ...]] | None = None, keep: Collection[str] = ()) -> Synced:
        """Make gpubook's reservations match the plan: one listing, then only the changes (`keep`:
        reservations not deleted yet, their jobs still running)."""
        want = sync.wanted(accepted, prefix=self.prefix, users=self.users, nodes_of=nodes_of)
        changes = sync.diff(want, self.reservations(), prefix=self.prefix, now=now, keep=keep)
        refused: dict[str, str] = {}
        for change in changes:
            try:
                self.scontrol(*change.argv)
            except SlurmUnreachable:
                raise
            except SlurmError as error:
                if change.booking_id:
                    refused[change.booking_id] = f"Slurm refused to {change.kind} reservation {change.name}: {error}"
        return Synced(tuple(changes), refused)
