"""What groups as projects cost the plan: 1,000 users in 50 groups, the same calendar planned without
groups and with group quotas (prints figures, asserts nothing).

    PYTHONPATH=. python bench/plan_groups.py [EVENTS] [GPUS]

EVENTS calendar objects (default 2,000: 80 % single bookings, 20 % daily series of 30) by 1,000
users, user N in group N mod 50, every tenth user in a second group too and naming it (`project:`) in
half their bookings; read by the booking reader over the window the daemon reads with a week quota
(two weeks and the longest booking back, a week ahead) on GPUS GPUs (default 100). Planned with each
user's `week_gpu_hours = 40` in both runs; "no groups" has no [groups.NAME] (today's config: bookings
have no project), "50 groups" gives each group `week_gpu_hours = 400`, `max_gpus = 16` and
`max_future_bookings = 200`. CPU time of `plan()` alone, best of 5, and what each quota refused. Run
with PYTHONPATH naming another tree (one without groups, such as main before them), it plans "no
groups" only: today's plan on the same input.
"""

from __future__ import annotations

import os
import platform
import random
import sys
from collections import Counter
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from bench.quota import best
from gpubook.scheduler.config import Config, parse
from gpubook.scheduler.core import policy
from gpubook.scheduler.core.bookings import BookingReader
from gpubook.scheduler.core.plan import Plan, plan, seen_key
from gpubook.scheduler.settings import Config as Settings
from gpubook.scheduler.sources import RawObject

CALENDAR = "http://127.0.0.1:5232/lab/devbox1/"
TEMPLATES = frozenset({"debian-ssh", "pytorch"})
USERS, GROUPS = 1000, 50
NOW = datetime(2026, 11, 26, tzinfo=UTC)
HAS_GROUPS = "groups" in Settings.__dataclass_fields__


def groups_of(user: int) -> list[str]:
    first = f"group{user % GROUPS}"
    return [first, f"group{(user * 7 + 3) % GROUPS}"] if user % 10 == 0 and (user * 7 + 3) % GROUPS != user % GROUPS \
        else [first]


def config(*, with_groups: bool) -> Config:
    users: dict[str, dict[str, Any]] = {f"user{n}": {"uid": 2000 + n} for n in range(USERS)}
    table: dict[str, Any] = {
        "host": {"name": "bench", "timezone": "Europe/Paris"},
        "calendar": [{"url": CALENDAR, "gpus": "all"}],
        "users": users,
        "policy": {"week_gpu_hours": 40},
    }
    if with_groups:
        for n in range(USERS):
            users[f"user{n}"]["groups"] = groups_of(n)
        table["groups"] = {f"group{n}": {"week_gpu_hours": 400, "max_gpus": 16, "max_future_bookings": 200}
                           for n in range(GROUPS)}
    return parse(table, Path("bench.toml"))


def event(number: int, rng: random.Random, gpus: int) -> str:
    start = NOW - timedelta(days=10) + timedelta(minutes=30 * rng.randrange(17 * 48))
    end = start + timedelta(hours=rng.choice([1, 2, 4, 8, 24]))
    user = rng.randrange(USERS)
    named = groups_of(user)
    project = f"\\nproject: {named[1]}" if len(named) > 1 and rng.random() < 0.5 else ""
    lines = ["BEGIN:VCALENDAR", "VERSION:2.0", "PRODID:-//gpubook bench//EN", "BEGIN:VEVENT",
             f"UID:bench-{number}@gpubook", "DTSTAMP:20261101T000000Z",
             f"CREATED:20261101T{number // 3600 % 24:02d}{number // 60 % 60:02d}{number % 60:02d}Z",
             f"DTSTART:{start:%Y%m%dT%H%M%SZ}", f"DTEND:{end:%Y%m%dT%H%M%SZ}", f"SUMMARY:user{user} run {number}",
             f"DESCRIPTION:gpus: {rng.choice([1, 1, 2, 4])}{project if HAS_GROUPS else ''}"]
    if number % 5 == 0:
        lines.append("RRULE:FREQ=DAILY;COUNT=30")
    lines += ["END:VEVENT", "END:VCALENDAR", ""]
    return "\r\n".join(lines)


def kinds(result: Plan) -> dict[str, int]:
    """How many refusals each limit made ("user week", "group at once", ...; "other": GPUs taken)."""
    def kind(reason: str) -> str:
        who = "group" if reason.startswith("group ") else "user"
        if "GPU-hours in the week" in reason:
            return f"{who} week"
        if "at once" in reason or "may book at most" in reason:
            return f"{who} at once"
        return f"{who} future" if "have not started" in reason else "other"
    return dict(sorted(Counter(kind(r.reason) for r in result.rejected).items()))


def main() -> None:
    events = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
    gpus = int(sys.argv[2]) if len(sys.argv) > 2 else 100
    rng = random.Random(38)
    objects = [RawObject(href=f"{CALENDAR}{n}.ics", etag=f'"{n}"', ical=event(n, rng, gpus), calendar_url=CALENDAR)
               for n in range(events)]
    runs = [("no groups", config(with_groups=False))]
    if HAS_GROUPS:
        runs.append((f"{GROUPS} groups", config(with_groups=True)))
    print(f"machine: {platform.platform()}, {os.cpu_count()} CPUs, Python {platform.python_version()}")
    for name, cfg in runs:
        window = (NOW - policy.reach_back(cfg), NOW + policy.reach_ahead(cfg))
        read = BookingReader().read(objects, config=cfg, calendar=cfg.calendars[0], templates=TEMPLATES,
                                    window_start=window[0], window_end=window[1]).occurrences
        first_seen = {seen_key(o): o.start - timedelta(days=1) for o in read}
        projects = Counter(getattr(o, "project", None) is not None for o in read)
        wall, cpu, result = best(5, lambda cfg=cfg, read=read, first_seen=first_seen: plan(
            read, inventory=range(gpus), config=cfg, templates=TEMPLATES, now=NOW, first_seen=first_seen))
        print(f"{name:9s}: {events} objects -> {len(read)} occurrences ({projects[True]} with a project), "
              f"{gpus} GPUs, {USERS} users; plan {wall * 1000:7.1f} ms wall {cpu * 1000:7.1f} ms CPU (best of 5); "
              f"{len(result.accepted)} accepted, rejected: {kinds(result)}")


if __name__ == "__main__":
    main()
