"""The soak's short form (bench/soak.py, issue 42): 100 bookings through one real daemon on rootless podman
and Radicale, in the daemon's told time, sampled every 25. Nothing may grow per booking beyond the
soak's limit, no start may be missed, nothing may be left behind, and every ended booking's block has
the same length whatever its history (cancelled, moved, extended, refused, logged into or not)."""

from __future__ import annotations

from pathlib import Path

from bench.soak import judge, soak, table
from tests.kits.daemon_kit import daemon_test


@daemon_test
def test_a_hundred_bookings_leave_nothing_growing_and_nothing_behind(tmp_path: Path) -> None:
    result = soak(100, folder=tmp_path, seed=42, sample_every=25)
    print("\n" + table(result))
    assert len(result.samples) == 4 and result.samples[-1].done == 100, table(result)  # a sample each 25 or so
    assert judge(result) == [], table(result)
