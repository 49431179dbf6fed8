"""Reminder notices: an e-mail or webhook `remind_minutes` before an accepted booking's start.

The alarm in the booker's event (gpubook/scheduler/sources/alarm.py) reminds them in their own calendar
program; this is the same reminder for those who read mail, or for a chat webhook. A pass queues
each due reminder in State's outbox (delivered after the pass like every notice) and tells the
daemon when the next one is due, so that a boundary wake-up comes exactly then. Each occurrence
is reminded once: a State note keeps the start it was reminded of (a booking moved to another
start is reminded again of the new one). A reminder whose start already came is not sent.
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta
from zoneinfo import ZoneInfo

from gpubook.scheduler.core.plan import Plan
from gpubook.scheduler.settings import Config
from gpubook.scheduler.sources.block import one_line
from gpubook.scheduler.state import State, StateError

log = logging.getLogger(__name__)
REMINDED = "reminded"  # State note: the start (ISO) a reminder notice was queued for
KIND = "reminder"


def wanted(config: Config) -> bool:
    """Whether any notice channel sends reminders (`events` of [notify.email] or [notify.webhook])."""
    channels = (config.notify.email, config.notify.webhook)
    return any(channel is not None and KIND in channel.events for channel in channels)


def queue_due(plan: Plan, *, config: Config, state: State, now: datetime) -> datetime | None:
    """Queue the reminders due now; return when the next one is due (None: none ahead)."""
    if not wanted(config):
        return None
    try:
        sent = state.notes(REMINDED)
    except StateError as error:
        log.warning("reminder notices wait for a later pass: %s", error)
        return None
    ahead: list[datetime] = []
    for accepted in plan.accepted:
        booking = accepted.booking
        minutes = config.policy_for(booking.user).remind_minutes
        if minutes <= 0 or now >= booking.start or sent.get(booking.id) == booking.start.isoformat():
            continue
        due = booking.start - timedelta(minutes=minutes)
        if due > now:
            ahead.append(due)
            continue
        when = booking.start.astimezone(ZoneInfo(config.host.timezone)).strftime("%Y-%m-%d %H:%M %z")
        name = one_line(booking.summary) or booking.id
        host = config.host.name
        text = (f'gpubook: your booking "{name}" ({len(accepted.gpus)} GPU(s): '
                f"{', '.join(map(str, accepted.gpus))}) starts at {when} on {host}. At the start the event shows "
                f"the ssh line (ssh -p PORT {booking.user}@{host}).")
        try:
            state.queue_notice(kind=KIND, booking_id=booking.id, user=booking.user,
                               subject=f'gpubook: "{name}" starts at {when}', text=text,
                               fields={"start": booking.start.isoformat(), "gpus": list(accepted.gpus),
                                       "host": host},
                               at=now)
            state.set_note(booking.id, REMINDED, booking.start.isoformat(), at=now)
        except StateError as error:
            log.warning("booking %s: its reminder waits for a later pass: %s", booking.id, error)
    return min(ahead, default=None)
