"""The sampler on a real GPU (the GPU test host): NVML's utilisation and memory land in State, a row
per GPU, the booked one carrying its booking (tests/test_usage_sampler.py covers the rest without a GPU)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from gpubook.runtime.engines import ContainerInfo
from gpubook.scheduler.hosts.usage import Sampler
from gpubook.scheduler.state import BookedRow, State

pytestmark = pytest.mark.gpu


def test_a_round_reads_every_gpu_from_nvml(tmp_path: Path, host_gpus) -> None:  # type: ignore[no-untyped-def]
    now = datetime.now(UTC)
    first = host_gpus[0].index
    booked = ContainerInfo(name="gpubook-gpu-sample", id="x", state="running", image="x", booking_id="gpu-sample",
                           user="alice", gpus=(first,), end=now + timedelta(hours=1), spec_hash="x", port=2200,
                           template="debian-ssh")
    with State(tmp_path / "state.sqlite") as state:
        row = BookedRow(booking_id="gpu-sample", user="alice", template="debian-ssh", host="local", gpus=(first,),
                        start=now, end=now + timedelta(hours=1))
        state.record_bookings(accepted=[row], rejected=[], now=now, complete=True)
        sampler = Sampler(state=state, host="local", interval=30.0, running=lambda: [booked],
                          logs=lambda name: "", probe_fingerprint="SHA256:none")
        assert sampler(now=now).samples == len(host_gpus)
        sums = state.sample_sums(now - timedelta(seconds=1), now + timedelta(seconds=1), bucket_seconds=60)
        rows = state._query("SELECT gpu, booking_id, utilisation, memory_used_mib, memory_total_mib FROM gpu_samples")
    assert sorted(r[0] for r in rows) == sorted(g.index for g in host_gpus)
    assert all(r[2] is not None and 0 <= r[2] <= 100 and r[4] > 0 and 0 <= r[3] <= r[4] for r in rows), rows
    assert {(s.gpu, s.booking_id) for s in sums if s.booking_id} == {(first, "gpu-sample")}
