"""The department's short form (bench/department.py, issue 42, part 3): five real daemons, each with its own
calendar on one Radicale holding 500 events, their containers SSH servers in the daemon's process
(tests/kits/department_kit.py). Bookings for now saved while all five run start and let the probe in;
Radicale restarted under that load and then taken away: the bookings known before the outage start on time
without it, every daemon says the outage once and its end once, recovers by itself, and starts what is
booked after it."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.department import judge, run, table

pytestmark = [pytest.mark.caldav, pytest.mark.slow, pytest.mark.daemon]  # five `gpubook run` processes


def test_five_servers_on_one_calendar_server_miss_nothing_and_ride_out_an_outage(tmp_path: Path) -> None:
    result = run(daemons=5, events=500, bookings=10, idle=10, outage=30, seed=42, folder=tmp_path)
    print("\n" + table(result))
    assert judge(result) == [], table(result)
    phases = {phase.name: phase for phase in result.phases}
    assert set(phases) == {"idle", "bookings", "restart", "outage"}
    assert len(phases["bookings"].to_running) == 10 and len(phases["restart"].to_running) == 5
    assert len(phases["outage"].to_running) == 10  # five known before it, five booked after it
    assert len(phases["idle"].checks_per_second) == 5 and min(phases["idle"].checks_per_second) > 0
    assert result.said and all(said == [1, 1] for said in result.said.values())
