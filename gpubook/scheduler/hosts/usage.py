"""The daemon's sampler, a job of its own every `[daemon] sample_seconds`: each GPU's utilisation and
memory from NVML, with the booking running on it, and the bookers' first logins.

- GPUs: one `nvml.read(status=True)` per round, a row per GPU; the booking on a GPU is the running
  container whose `gpus` label holds it, as the last pass saw the containers (no engine call). On a
  machine without a GPU nothing is recorded, and that is said once.
- Logins: for running bookings not yet seen logged in, the container's log is read for sshd's
  "Accepted publickey for USER" (the booking's sshd runs with -e, so its log is the container's).
  Reading a log costs an engine call (~60 ms CPU with podman, bench/sampling.py), so a booking's
  checks spread out: the interval, then twice that, ... up to LOGIN_CHECK_MAX apart, and every
  round again in the booking's last LOGIN_CHECK_MAX (its log goes with its container).
  The daemon's readiness probe logs in as the booker too; its key's fingerprint is in that line,
  and its logins are not the booker's. A booker can print that line from inside (their command's
  output is the same log): no-shows are accounting, not a security boundary.

Bookkeeping, never the daemon's business: a failure costs a warning and this round's rows.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from gpubook.runtime.engines import ContainerInfo
from gpubook.runtime.errors import GpubookError
from gpubook.runtime.nvidia import nvml
from gpubook.runtime.nvidia.nvml import NvmlView
from gpubook.scheduler import clock
from gpubook.scheduler.state import Sample, State, StateError

log = logging.getLogger(__name__)

# sshd -e: "Accepted publickey for alice from 10.88.0.1 port 50312 ssh2: ECDSA SHA256:Qx..."
LOGIN_CHECK_MAX = timedelta(minutes=5)  # the longest wait between two looks at a booking's log
LOGIN = re.compile(r"Accepted publickey for (?P<user>\S+) from \S+ port \d+ \S+: \S+ (?P<fingerprint>SHA256:\S+)")


def read_gpus() -> NvmlView:
    return nvml.read(status=True)


def booker_logged_in(log_text: str, *, user: str, probe_fingerprint: str) -> bool:
    """Whether sshd's log shows `user` let in with a key other than the daemon's probe key."""
    return any(match["user"] == user and match["fingerprint"] != probe_fingerprint
               for match in LOGIN.finditer(log_text))


@dataclass(frozen=True)
class Round:
    """What one round recorded."""

    samples: int
    logins: tuple[str, ...]  # bookings first seen logged in this round


class Sampler:
    """`sampler()` is one round; the daemon runs it every `interval` seconds."""

    def __init__(self, *, state: State, host: str, interval: float, running: Callable[[], Sequence[ContainerInfo]],
                 logs: Callable[[str], str], probe_fingerprint: str,
                 read: Callable[[], NvmlView] = read_gpus) -> None:
        """`running`: the containers as the last pass saw them; `logs`: a container's log by name;
        `read`: NVML's view of the GPUs (with utilisation and memory)."""
        self.state = state
        self.host = host
        self.interval = interval
        self.running = running
        self.logs = logs
        self.probe_fingerprint = probe_fingerprint
        self.read = read
        self._logged_in: set[str] = set()  # bookings known to be logged into
        self._checks: dict[str, tuple[datetime, int]] = {}  # booking → (next look at its log, looks so far)
        self._said_no_gpu = False

    def __call__(self, *, now: datetime | None = None) -> Round:
        now = now or clock.now()
        # Armed containers (run ahead of their start) hold GPUs but are nobody's time yet.
        containers = [info for info in self.running()
                      if info.running and info.booking_id and (info.start is None or info.start <= now)]
        return Round(samples=self.sample_gpus(containers, now=now), logins=self.watch_logins(containers, now=now))

    def sample_gpus(self, containers: Sequence[ContainerInfo], *, now: datetime) -> int:
        view = self.read()
        if view.driver_version is None:
            if not self._said_no_gpu:
                log.warning("no GPU to sample (%s): GPU utilisation is not recorded; logins still are",
                            view.problem or "NVML lists none")
                self._said_no_gpu = True
            return 0
        self._said_no_gpu = False
        on_gpu = {gpu: info.booking_id for info in containers for gpu in info.gpus}
        samples = [Sample(at=now, host=self.host, gpu=gpu.index, booking_id=on_gpu.get(gpu.index),
                          utilisation=None if gpu.utilisation_percent is None else float(gpu.utilisation_percent),
                          memory_used_mib=gpu.memory_used_mib, memory_total_mib=gpu.memory_total_mib,
                          seconds=self.interval) for gpu in view.gpus]
        try:
            self.state.record_samples(samples)
        except StateError as error:
            log.warning("this round's GPU samples are lost: %s", error)
            return 0
        return len(samples)

    def watch_logins(self, containers: Sequence[ContainerInfo], *, now: datetime) -> tuple[str, ...]:
        waiting = {info.booking_id: info for info in containers if info.booking_id not in self._logged_in}
        if not waiting:
            return ()
        new = [booking_id for booking_id in waiting if booking_id not in self._checks]
        try:
            self._logged_in |= set(self.state.logins(new)) if new else set()  # recorded by an earlier daemon
        except StateError as error:
            log.warning("logins are not checked this round: %s", error)
            return ()
        self._checks = {k: v for k, v in self._checks.items() if k in waiting}  # ended bookings go
        found = []
        for booking_id, info in waiting.items():
            due, looks = self._checks.get(booking_id, (now, 0))
            # Every round in a booking's last minutes: its log goes with its container at the end.
            ending = info.end is not None and info.end - now <= LOGIN_CHECK_MAX
            if booking_id in self._logged_in or (due > now and not ending):
                continue
            wait = min(timedelta(seconds=self.interval * 2 ** min(looks, 16)), LOGIN_CHECK_MAX)
            self._checks[booking_id] = (now + wait, looks + 1)
            try:
                text = self.logs(info.name)
            except GpubookError as error:
                log.info("booking %s: its container's log cannot be read for logins now: %s", booking_id, error)
                continue
            if not booker_logged_in(text, user=info.user, probe_fingerprint=self.probe_fingerprint):
                continue
            try:
                self.state.record_login(booking_id, user=info.user, at=now)
            except StateError as error:
                log.warning("booking %s: its first login is not recorded yet: %s", booking_id, error)
                continue
            log.info("booking %s: %s logged in for the first time", booking_id, info.user)
            self._logged_in.add(booking_id)
            found.append(booking_id)
        return tuple(found)
