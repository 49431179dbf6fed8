"""The handlers of no-shows and idle GPUs (gpubook/scheduler/core/reclaim.py judges; these act and record).

A release is recorded in State before its container stops: should the stop fail, the next pass
plans the booking as ended at its release and stops the container (decide's `Memory.released`);
it is never started again. Before releasing, the booker's login is looked for once more in the
container's log (the sampler looks only every few minutes): one who logged in just now keeps
their booking. An idle notice is remembered per idle stretch (a State note), so the booker is told
once per stretch, in the container's terminals and by mail or webhook where configured.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime, timedelta
from zoneinfo import ZoneInfo

from gpubook.runtime.engines import ContainerInfo
from gpubook.runtime.errors import GpubookError
from gpubook.scheduler.apply.handlers import NOTHING, Change, finish_provenance, note_ended, record_stop, tell_terminals
from gpubook.scheduler.apply.memory import Journal
from gpubook.scheduler.core import reclaim
from gpubook.scheduler.core.plan import Plan
from gpubook.scheduler.hosts import Host
from gpubook.scheduler.outbox.metrics import Metrics
from gpubook.scheduler.settings import Config
from gpubook.scheduler.state import ContainerRecord, State, StateError, notes

log = logging.getLogger(__name__)

def read_releases(state: State, *, after: datetime) -> dict[str, reclaim.Released]:
    """The releases of bookings whose time ends after `after` (a StateError is the pass's)."""
    return {row.booking_id: reclaim.Released(row.booking_id, row.start, row.end, row.at, row.reason)
            for row in state.releases(ending_after=after).values()}


# A GPU's busy samples in the first seconds of a booking are not its booker's use: the previous booking's
# processes may still be going (seen on an H100: GPU 0 at 99 % and 1 GiB used 1.6 s after the next
# booking's start on it, at 0 % two seconds later), and one such sample made a no-show look used.
# At most a quarter of the no-show time, so that a booker who starts at once is still seen in time.
SETTLE = timedelta(seconds=15)


def judge_running(config: Config, state: State, *, plan: Plan, running: Mapping[str, ContainerInfo],
                  records: Mapping[str, Sequence[ContainerRecord]], now: datetime) -> dict[str, reclaim.Verdict]:
    """The judge's verdict on each booking that runs in its time, from State's logins and samples
    (read once per pass, and only where a rule is on); none while State cannot be read."""
    if not reclaim.any_rules(config):
        return {}
    bookings = {a.booking.id: a.booking for a in plan.accepted}
    candidates = {}
    for booking_id, info in running.items():
        booking = bookings.get(booking_id)
        opened = [r for r in records.get(booking_id, ()) if r.stopped_at is None]
        # Only a start that was recorded (its SSH answered): an armed container is nobody's time yet.
        if booking is not None and opened and booking.start <= now < booking.end:
            candidates[booking_id] = (info, booking, max(booking.start, opened[-1].started_at))
    verdicts: dict[str, reclaim.Verdict] = {}
    try:
        logins = state.logins(list(candidates)) if candidates else {}
        for booking_id, (info, booking, since) in candidates.items():
            rules = reclaim.rules(config, booking.user)
            if not rules.active:
                continue
            settle = SETTLE if rules.no_show is None else min(SETTLE, rules.no_show / 4)
            samples = state.gpu_samples_of(booking_id, info.gpus, since=since, busy_since=since + settle,
                                           busy_percent=rules.idle_percent)
            use = {s.gpu: reclaim.GpuUse(first=s.first, last=s.last, last_busy=s.last_busy) for s in samples}
            evidence = reclaim.Evidence(since=since, gpus=info.gpus, logged_in=logins.get(booking_id), use=use)
            verdicts[booking_id] = reclaim.judge(evidence, rules, now=now)
    except StateError as error:
        log.warning("no-shows and idle GPUs are not judged this pass: %s", error)
        return {}
    return verdicts


def event_lines(verdicts: Mapping[str, reclaim.Verdict], releases: Mapping[str, reclaim.Released], *,
                config: Config) -> dict[str, str]:
    """booking id → the line its event shows: its release, or its idle GPUs while they stay idle."""
    zone = ZoneInfo(config.host.timezone)
    lines = {booking_id: reclaim.idle_line(verdict.idle, percent=config.policy.idle_percent, zone=zone)
             for booking_id, verdict in verdicts.items() if verdict.idle is not None}
    lines.update({booking_id: reclaim.release_sentence(released, zone=zone)
                  for booking_id, released in releases.items()})
    return lines


class ReleaseHandler:
    def __init__(self, *, hosts: Mapping[str, Host], state: State, journal: Journal, timezone: str,
                 logged_in: Callable[[ContainerInfo], bool] | None = None, metrics: Metrics | None = None) -> None:
        """`logged_in`: the last look at a container's log for its booker's login (None: State's alone)."""
        self.hosts, self.state, self.journal, self.metrics = hosts, state, journal, metrics
        self.zone = ZoneInfo(timezone)
        self.logged_in = logged_in

    def __call__(self, action: reclaim.Release, *, now: datetime) -> Change:
        if self._came(action, now=now):
            return NOTHING
        self.state.record_release(action.booking_id, start=action.start, end=action.end, at=now, reason=action.reason)
        sentence = reclaim.release_sentence(
            reclaim.Released(action.booking_id, action.start, action.end, now, action.reason), zone=self.zone)
        self.hosts[action.host].stop(action.name, action.grace)
        record = record_stop(self.state, name=action.name, booking_id=action.booking_id, reason=sentence, now=now)
        ended = finish_provenance(self.state, self.hosts[action.host], action.booking_id, now=now,
                                  timezone=str(self.zone), journal=self.journal)
        self.state.release_port(action.booking_id)
        notes.clear_history(self.state, action.booking_id)
        note_ended(self.state, action.booking_id, ended, now=now, journal=self.journal)
        self.journal.say(action.booking_id, f"{sentence}; its container stopped, /data/output is kept", now=now)
        if self.metrics is not None:
            self.metrics.released()
        self.state.queue_notice(
            kind="released", booking_id=action.booking_id, user=action.user,
            subject="gpubook: your booking was released",
            text=f"gpubook: booking {action.booking_id} was {sentence}. Files in /data/output are kept.",
            fields={"reason": action.reason, "until": action.end.isoformat()}, at=now)
        return Change(gone=action.name, records=(record,), ended=ended)

    def _came(self, action: reclaim.Release, *, now: datetime) -> bool:
        """Whether the last look finds the booker logged in (recorded: the next pass judges again)."""
        if self.logged_in is None:
            return False
        info = self.hosts[action.host].inspect(action.name)
        try:
            came = info is not None and self.logged_in(info)
        except GpubookError as error:  # State's logins decide, as the sampler left them
            self.journal.log.warning("booking %s: its log cannot be read for a login before its release: %s",
                                     action.booking_id, error)
            came = False
        if not came:
            return False
        self.state.record_login(action.booking_id, user=action.user, at=now)
        self.journal.say(action.booking_id, f"not released: {action.user} logged in", now=now)
        return True


class IdleHandler:
    def __init__(self, *, hosts: Mapping[str, Host], state: State, journal: Journal) -> None:
        self.hosts, self.state, self.journal = hosts, state, journal

    def __call__(self, action: reclaim.IdleNotice, *, now: datetime) -> Change:
        text = (f"gpubook: {action.line}. If you no longer need the GPUs, end the booking in the calendar so "
                f"that others can use them.")
        notes.IDLE_TOLD.write(self.state, action.booking_id, frozenset(action.stretches), at=now)
        self.journal.say(action.booking_id, f"told its booker: {action.line}", now=now)
        tell_terminals(self.hosts[action.host], action.name, text, booking_id=action.booking_id,
                       journal=self.journal, what="idle notice")
        self.state.queue_notice(kind="idle", booking_id=action.booking_id, user=action.user,
                                subject="gpubook: your GPUs are idle", text=text,
                                fields={"gpus": ",".join(str(gpu) for gpu, _ in action.stretches)}, at=now)
        return NOTHING
