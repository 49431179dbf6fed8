#!/usr/bin/env python3
"""Makes docs/images/report-example.png (the README's "Reports"): a month of made-up bookings on 4 GPUs,
written through State's accounting methods as the daemon writes them (samples every 10 min here,
not 30 s, to keep the file small), then `gpubook report`'s own plot of it.

    python3 docs/report_example.py [OUT.png]
"""

from __future__ import annotations

import random
import sys
import tempfile
from datetime import UTC, datetime, timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpubook.scheduler.outbox import report, report_plots  # noqa: E402
from gpubook.scheduler.state import BookedRow, RejectedRow, Sample, State  # noqa: E402

START, END = datetime(2026, 11, 1, tzinfo=UTC), datetime(2026, 12, 1, tzinfo=UTC)
USERS = {"alice": 0.85, "bob": 0.35, "carol": 0.6, "dave": 0.1, "erin": 0.7}  # how busy each keeps a GPU
STEP = timedelta(minutes=10)


def month(state: State, rng: random.Random) -> None:
    booked = []
    for day in range(30):
        for gpu in range(4):
            if rng.random() < 0.35:
                continue
            user = rng.choice(list(USERS))
            begin = START + timedelta(days=day, hours=rng.randrange(7, 14))
            end = begin + timedelta(hours=rng.randrange(2, 10))
            template = rng.choice(["pytorch", "jax"])
            booked.append(BookedRow(booking_id=f"{day}-{gpu}-{user}", user=user, template=template,
                                    host="devbox1", gpus=(gpu,), start=begin, end=end))
    refused = [RejectedRow(booking_id=f"r{n}", user=rng.choice(list(USERS)), start=START + timedelta(days=n * 3),
                           end=START + timedelta(days=n * 3, hours=4), reason=reason)
               for n, reason in enumerate(["the GPUs asked for are taken: GPU 1 by booking x"] * 5
                                          + ["'frank' is not a known user of devbox1"] * 2)]
    state.record_bookings(accepted=booked, rejected=refused, now=START, complete=False)
    for booking in booked:
        if booking.user != "dave" and rng.random() < 0.9:  # dave never comes; now and then nor do others
            state.record_login(booking.booking_id, user=booking.user, at=booking.start + timedelta(minutes=3))
    owner = {(b.gpus[0], b.start + STEP * n): b for b in booked for n in range(int((b.end - b.start) / STEP))}
    moment = START
    while moment < END:
        rows = []
        for gpu in range(4):
            booking = owner.get((gpu, moment))
            busy = 0.0
            if booking is not None and not booking.booking_id.endswith("dave"):
                busy = min(100.0, max(0.0, rng.gauss(USERS[booking.user] * 100, 15)))
            rows.append(Sample(at=moment, host="devbox1", gpu=gpu, booking_id=booking.booking_id if booking else None,
                               utilisation=busy, memory_used_mib=int(busy * 700), memory_total_mib=81920,
                               seconds=STEP.total_seconds()))
        state.record_samples(rows)
        moment += STEP


def main() -> None:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent / "images" / "report-example.png"
    with tempfile.TemporaryDirectory() as folder, State(Path(folder) / "state.sqlite") as state:
        month(state, random.Random(12))  # noqa: S311 - made-up figures, repeatable
        made = report.build(state, start=START, end=END, now=END, by="user")
    out.write_bytes(report_plots.png(made))
    print("\n".join(report.table(made)))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
