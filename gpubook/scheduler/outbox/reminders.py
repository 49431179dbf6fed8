"""Reminder notices: an e-mail or webhook `remind_minutes` before an accepted booking's start.

The alarm in the booker's event (gpubook/scheduler/sources/alarm.py) reminds them in their own calendar
program; this is the same reminder for those who read mail, or for a chat webhook. A pass decides
the reminders due (gpubook/scheduler/core/upkeep.py, `Remind`) and tells the daemon when the next
one is due, so that a boundary wake-up comes exactly then; its handler queues each here (`queue`:
the notice in State's outbox, delivered after the pass like every notice, and the REMINDED note).
Each occurrence is reminded once: the note keeps the start it was reminded of (a booking moved to
another start is reminded again of the new one). A reminder whose start already came is not sent.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from zoneinfo import ZoneInfo

from gpubook.scheduler.core import upkeep
from gpubook.scheduler.settings import Config
from gpubook.scheduler.sources.block import one_line
from gpubook.scheduler.state import State, notes

KIND = "reminder"


def wanted(config: Config) -> bool:
    """Whether any notice channel sends reminders (`events` of [notify.email] or [notify.webhook])."""
    channels = (config.notify.email, config.notify.webhook)
    return any(channel is not None and KIND in channel.events for channel in channels)


def minutes_of(config: Config) -> Callable[[str], float]:
    """A booker's reminder minutes before the start, for `upkeep.reminders` (0: none, also while no
    channel sends reminders)."""
    if not wanted(config):
        return lambda user: 0.0
    return lambda user: config.policy_for(user).remind_minutes


def queue(state: State, action: upkeep.Remind, *, config: Config, now: datetime) -> None:
    """The reminder's notice in the outbox, and the note that it was queued (a StateError is the caller's)."""
    accepted = action.accepted
    booking = accepted.booking
    when = booking.start.astimezone(ZoneInfo(config.host.timezone)).strftime("%Y-%m-%d %H:%M %z")
    name = one_line(booking.summary) or booking.id
    host = config.host.name
    text = (f'gpubook: your booking "{name}" ({len(accepted.gpus)} GPU(s): '
            f"{', '.join(map(str, accepted.gpus))}) starts at {when} on {host}. At the start the event shows "
            f"the ssh line (ssh -p PORT {booking.user}@{host}).")
    state.queue_notice(kind=KIND, booking_id=booking.id, user=booking.user,
                       subject=f'gpubook: "{name}" starts at {when}', text=text,
                       fields={"start": booking.start.isoformat(), "gpus": list(accepted.gpus), "host": host},
                       at=now)
    notes.REMINDED.write(state, booking.id, booking.start, at=now)
