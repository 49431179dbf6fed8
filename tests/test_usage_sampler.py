"""The sampler and the passes' accounting on a real State: a row per GPU with the booking on it, the
booker's first login told from the daemon's probe login, nothing recorded (and that said once)
without a GPU, and a state database that fails costing a warning, never a pass or a round.

There is no GPU here: the reader handed to the sampler returns NVML's view type (NvmlView, Gpu)
with made-up values; the GPU host's run reads the real NVML (tests/gpu).
"""

from __future__ import annotations

import logging
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from gpubook.runtime.engines import ContainerInfo
from gpubook.runtime.nvidia.model import Gpu
from gpubook.runtime.nvidia.nvml import NvmlView
from gpubook.scheduler.apply.accounting import Accounting
from gpubook.scheduler.core.plan import Plan
from gpubook.scheduler.hosts.usage import Sampler, booker_logged_in
from gpubook.scheduler.state import BookedRow, Sample, State, StateUnavailable

NOW = datetime(2026, 11, 20, 10, tzinfo=UTC)
PROBE = "SHA256:pr0beFingerprintOfTheDaemonsKey0000000000000"
ALICE = "SHA256:aliceKeyFingerprint000000000000000000000000000"
PROBE_LINE = f"Accepted publickey for alice from 127.0.0.1 port 50312 ssh2: ECDSA {PROBE}\n"
ALICE_LINE = f"Accepted publickey for alice from 10.0.0.7 port 40022 ssh2: ED25519 {ALICE}\n"


def info(booking_id: str, *, user: str, gpus: tuple[int, ...], start: datetime | None = None) -> ContainerInfo:
    return ContainerInfo(name=f"gpubook-{booking_id}", id=booking_id, state="running", image="debian",
                         booking_id=booking_id, user=user, gpus=gpus, end=NOW + timedelta(hours=1), spec_hash="x",
                         port=2200, template="debian-ssh", start=start)


def two_gpus() -> NvmlView:
    return NvmlView("550.54.15", (Gpu(index=0, utilisation_percent=40, memory_used_mib=2048, memory_total_mib=81920),
                                  Gpu(index=1, utilisation_percent=None, memory_used_mib=0, memory_total_mib=81920)))


def make_sampler(state: State, containers: list[ContainerInfo], logs: dict[str, str], *,
                 read=two_gpus) -> Sampler:  # type: ignore[no-untyped-def]
    return Sampler(state=state, host="devbox1", interval=30.0, running=lambda: containers,
                   logs=lambda name: logs.get(name, ""), probe_fingerprint=PROBE, read=read)


def test_a_round_writes_a_row_per_gpu_with_the_booking_on_it(tmp_path: Path) -> None:
    armed = info("later", user="bob", gpus=(1,), start=NOW + timedelta(minutes=5))  # nobody's time yet
    with State(tmp_path / "state.sqlite") as state:
        state.record_bookings(accepted=[BookedRow(booking_id="now", user="alice", template="debian-ssh", host="devbox1",
                                                  gpus=(0,), start=NOW, end=NOW + timedelta(hours=1))],
                              rejected=[], now=NOW, complete=True)
        sampler = make_sampler(state, [info("now", user="alice", gpus=(0,)), armed], {})
        assert sampler(now=NOW).samples == 2
        assert sampler(now=NOW + timedelta(seconds=30)).samples == 2
        sums = state.sample_sums(NOW, NOW + timedelta(hours=1), bucket_seconds=3600)
        assert state.gpu_hours_used_by_user() == {"alice": pytest.approx(2 * 30 * 0.4 / 3600)}
    by_gpu = {(s.gpu, s.booking_id): s for s in sums}
    assert set(by_gpu) == {(0, "now"), (1, None)}
    assert by_gpu[(0, "now")].busy_percent_hours / by_gpu[(0, "now")].sampled_hours == pytest.approx(40)
    assert by_gpu[(1, None)].sampled_hours == 0  # NVML said nothing of its utilisation


def test_only_the_bookers_own_login_counts(tmp_path: Path) -> None:
    """The probe logs in as the booker at every start: its line must not make a booking "logged in"."""
    assert not booker_logged_in(PROBE_LINE * 3, user="alice", probe_fingerprint=PROBE)
    assert not booker_logged_in(ALICE_LINE, user="bob", probe_fingerprint=PROBE)
    assert booker_logged_in(PROBE_LINE + "sshd: some other line\n" + ALICE_LINE, user="alice",
                            probe_fingerprint=PROBE)
    logs = {"gpubook-probed": PROBE_LINE, "gpubook-used": PROBE_LINE + ALICE_LINE}
    read = {"count": 0}

    def counted(name: str) -> str:
        read["count"] += 1
        return logs.get(name, "")

    with State(tmp_path / "state.sqlite") as state:
        sampler = make_sampler(state, [info("probed", user="alice", gpus=(0,)), info("used", user="alice", gpus=(1,))],
                               logs, read=lambda: NvmlView(None, problem="no driver"))
        sampler.logs = counted
        assert sampler(now=NOW).logins == ("used",)
        assert sampler(now=NOW + timedelta(minutes=1)).logins == ()
        assert state.logins() == {"used": NOW}
    assert read["count"] == 3  # "used" is not read again once seen logged in


def test_without_a_gpu_nothing_is_recorded_and_that_is_said_once(tmp_path: Path,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="gpubook.scheduler.hosts.usage")
    with State(tmp_path / "state.sqlite") as state:
        sampler = make_sampler(state, [], {}, read=lambda: NvmlView(None, problem="NVML cannot be read (no driver)"))
        assert [sampler(now=NOW + timedelta(seconds=30 * n)).samples for n in range(3)] == [0, 0, 0]
        assert state.samples_count() == 0
    said = [r.getMessage() for r in caplog.records if r.name == "gpubook.scheduler.hosts.usage"]
    assert said == ["no GPU to sample (NVML cannot be read (no driver)): GPU utilisation is not recorded; "
                    "logins still are"]


class Unwritable(State):
    """A state database whose writes fail (a full disk): the real State, its writes refused."""

    def record_samples(self, samples: object) -> None:
        raise StateUnavailable("the state database could not be used: database or disk is full")

    def record_bookings(self, **kwargs: object) -> None:  # type: ignore[override]
        raise StateUnavailable("the state database could not be used: database or disk is full")


def test_a_failing_state_costs_a_warning_never_the_round_or_the_pass(tmp_path: Path,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    with Unwritable(tmp_path / "state.sqlite") as state:
        assert make_sampler(state, [], {})(now=NOW).samples == 0
        accounting = Accounting(state)
        accounting.record(Plan(accepted=(), rejected=(), next_wakeup=None), now=NOW, complete=True)
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "this round's GPU samples are lost" in said and "the accounting misses this pass's bookings" in said


def test_a_plan_recorded_once_is_not_written_again(tmp_path: Path) -> None:
    writes: list[int] = []

    class Counted(State):
        def record_bookings(self, **kwargs):  # type: ignore[no-untyped-def, override]
            writes.append(len(kwargs["accepted"]))
            return super().record_bookings(**kwargs)

    with Counted(tmp_path / "state.sqlite") as state:
        accounting = Accounting(state)
        empty = Plan(accepted=(), rejected=(), next_wakeup=None)
        for _ in range(3):
            accounting.record(empty, now=NOW, complete=True)
        accounting.record(empty, now=NOW, complete=False)  # an incomplete reading: written, never a forgetting
    assert writes == [0, 0]


def test_old_databases_migrate_and_keep_their_rows(tmp_path: Path) -> None:
    import sqlite3

    from gpubook.scheduler.state import schema

    path = tmp_path / "state.sqlite"
    old = sqlite3.connect(path)
    for number, script in enumerate(schema.MIGRATIONS[:4]):
        old.executescript(script)
        old.execute(f"PRAGMA user_version = {number + 1}")
    old.execute("INSERT INTO ports (booking_id, port, allocated_at) VALUES ('b', 2201, 0)")
    old.commit()
    old.close()
    with State(path) as state:
        assert state.schema_version == len(schema.MIGRATIONS) >= 6
        assert state.ports() == {"b": 2201}
        state.record_samples([Sample(at=NOW, host="h", gpu=0, booking_id=None, utilisation=1.0, memory_used_mib=1,
                                     memory_total_mib=2, seconds=30)])
        assert state.samples_count() == 1


def test_a_log_is_read_less_often_over_time_and_every_round_near_the_end(tmp_path: Path) -> None:
    """Reading a container's log costs an engine call: a booking nobody logs into is looked at
    after 0, 30, 90, 210, 450 s (the gaps doubling, at most 5 min), and every round in its last 5 min."""
    reads: list[str] = []
    far = info("far", user="alice", gpus=(0,))  # ends in an hour
    near = replace(info("near", user="bob", gpus=(1,)), end=NOW + timedelta(minutes=4))
    with State(tmp_path / "state.sqlite") as state:
        sampler = make_sampler(state, [far, near], {}, read=lambda: NvmlView(None, problem="no driver"))
        sampler.logs = lambda name: reads.append(name) or ""  # type: ignore[func-returns-value]
        for n in range(20):
            sampler(now=NOW + timedelta(seconds=30 * n))
    assert reads.count("gpubook-far") == 5
    assert reads.count("gpubook-near") == 20  # every round: its end is near (and past, while it is still listed)
