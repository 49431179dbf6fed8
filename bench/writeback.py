"""Calendar write-back and state database costs; prints figures (not a timed test).

Run: PYTHONPATH=. /opt/gpubook/venv/bin/python bench/writeback.py
Measures, on a local Radicale and Xandikos: a write-back that changes the status (GET + PUT) and
one that finds the block already up to date (GET only); and State's commit rate for the event log.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpubook.scheduler.sources import EventRef, block  # noqa: E402
from gpubook.scheduler.sources.caldav_writer import CalendarWriter  # noqa: E402
from gpubook.scheduler.state import State  # noqa: E402
from tests.kits.writeback_kit import PASSWORD, USER, booker_event, calendar_on, put_event  # noqa: E402

ROUNDS = 20
START = datetime(2026, 11, 23, 8, tzinfo=UTC)


def _ms(samples: list[float]) -> str:
    ordered = sorted(samples)
    p95 = ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]
    return f"median {statistics.median(ordered) * 1000:6.1f} ms, p95 {p95 * 1000:6.1f} ms"


def bench_calendar(name: str, url: str) -> None:
    href = put_event(url, booker_event("bench@gpubook"))
    writer = CalendarWriter(url, username=USER, password=PASSWORD, timezone="Europe/Paris")
    ref = EventRef(url, href, "bench@gpubook")
    changing, unchanged = [], []
    for n in range(ROUNDS):
        outcome = block.running(port=2200 + n, user="alice", host="devbox1", end=START + timedelta(hours=8),
                                 timezone="Europe/Paris")
        began = time.perf_counter()
        assert writer.write(ref, outcome).written
        changing.append(time.perf_counter() - began)
        began = time.perf_counter()
        assert not writer.write(ref, outcome).written
        unchanged.append(time.perf_counter() - began)
    print(f"{name:9s} write-back, status changed (GET+PUT): {_ms(changing)}")
    print(f"{name:9s} write-back, already up to date (GET):  {_ms(unchanged)}")


def bench_state() -> None:
    with tempfile.TemporaryDirectory() as folder, State(Path(folder) / "state.sqlite") as db:
        count = 2000
        began = time.perf_counter()
        for n in range(count):
            db.log_event(f"event {n}", booking_id="b1")
        elapsed = time.perf_counter() - began
        print(f"state     {count} committed log entries: {count / elapsed:,.0f} commits/s "
              f"({elapsed / count * 1e6:.0f} us each)")


def main() -> None:
    for kind, label in (("radicale", "Radicale"), ("xandikos", "Xandikos")):
        for url in calendar_on(kind):
            bench_calendar(label, url)
    bench_state()


if __name__ == "__main__":
    main()
