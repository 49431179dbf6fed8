"""The Slurm backend against a real Slurm 22.05 cluster (tests/kits/slurm_kit.py): two slurmd nodes in
their own network namespaces, slurmctld run as the unprivileged account the daemon uses."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from gpubook.scheduler.config import parse as parse_config
from gpubook.scheduler.hosts import backend as backends
from gpubook.scheduler.hosts.slurm import Scontrol, SlurmCluster, SlurmError, SlurmUnreachable, parse
from tests.kits import slurm_kit
from tests.kits.slurm_jobs_kit import accepted, booking

pytestmark = [pytest.mark.slurm, pytest.mark.skipif(slurm_kit.available() is not None,
                                                    reason=str(slurm_kit.available()))]
PREFIX = "gpubook-"
BASE = {"calendar": [{"url": "http://127.0.0.1:5232/lab/", "gpus": "all"}]}  # a config's calendar, never read


class ScontrolAs(Scontrol):
    """scontrol run as one account (the daemon's, never root), as the daemon would run it."""

    def __init__(self, user: str, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.user = user

    def argv(self, args: Sequence[str]) -> list[str]:
        return ["runuser", "-u", self.user, "--", *super().argv(args)]


def backend(cluster: slurm_kit.Cluster, user: str | None = None) -> SlurmCluster:
    account = user or cluster.user
    return SlurmCluster(scontrol=ScontrolAs(account, conf=cluster.conf), prefix=PREFIX, users=[cluster.user])


def held(cluster: slurm_kit.Cluster) -> dict[str, parse.Reservation]:
    text = subprocess.run(["scontrol", "show", "reservation", "--oneliner"], env={**cluster.env, "TZ": "UTC"},
                          capture_output=True, text=True, check=True).stdout
    return {r.name: r for r in parse.reservations(text)}


def now() -> datetime:
    return datetime.now(UTC).replace(microsecond=0)


def test_the_inventory_is_the_usable_gpu_nodes(cluster: slurm_kit.Cluster) -> None:
    slurm = backend(cluster)
    assert slurm.inventory() == {"node1": (0, 1, 2, 3), "node2": (0, 1, 2, 3)}
    cluster.scontrol("update", "NodeName=node2", "State=DRAIN", "Reason=disk")
    assert slurm.inventory() == {"node1": (0, 1, 2, 3)}


def test_a_booking_becomes_a_reservation_on_its_node_and_a_second_sync_issues_nothing(
        cluster: slurm_kit.Cluster) -> None:
    slurm = backend(cluster)
    item = accepted(booking("alice-1", start=now() + timedelta(hours=1)), host="node2")
    done = slurm.sync([item], now=now())
    assert [c.kind for c in done.changes] == ["create"] and not done.refused
    (reservation,) = held(cluster).values()
    assert reservation.nodes == ("node2",) and reservation.users == (cluster.user,)
    assert reservation.start == item.booking.start and "OVERLAP" in reservation.flags
    calls = slurm.scontrol.calls
    again = slurm.sync([item], now=now())
    assert again.changes == () and slurm.scontrol.calls == calls + 1  # the one listing, nothing else


def test_an_edit_moves_the_reservation_and_a_cancel_deletes_it(cluster: slurm_kit.Cluster) -> None:
    slurm = backend(cluster)
    start = now() + timedelta(hours=2)
    slurm.sync([accepted(booking("b1", start=start), host="node1")], now=now())
    moved = accepted(booking("b1", start=start + timedelta(hours=1), hours=2), host="node2")
    done = slurm.sync([moved], now=now())
    assert [c.kind for c in done.changes] == ["update"] and not done.refused
    (reservation,) = held(cluster).values()
    assert reservation.nodes == ("node2",)
    assert (reservation.start, reservation.end) == (moved.booking.start, moved.booking.end)
    assert [c.kind for c in slurm.sync([], now=now()).changes] == ["delete"]
    assert held(cluster) == {}


def test_a_restarted_daemon_adopts_its_reservations_and_removes_orphans_only(cluster: slurm_kit.Cluster) -> None:
    start = now() + timedelta(hours=1)
    kept = [accepted(booking("b1", start=start)), accepted(booking("b2", start=start), host="node1")]
    backend(cluster).sync(kept, now=now())
    cluster.scontrol("create", "reservation", "ReservationName=gpubook-orphan", "StartTime=now+3600",
                     "Duration=60", "Nodes=node2", f"Users={cluster.user}", "Flags=OVERLAP")
    cluster.scontrol("create", "reservation", "ReservationName=maintenance", "StartTime=now+7200",
                     "Duration=60", "Nodes=node2", f"Users={cluster.user}")
    fresh = backend(cluster)  # a new daemon: nothing in memory
    done = fresh.sync(kept, now=now())
    assert [(c.kind, c.name) for c in done.changes] == [("delete", "gpubook-orphan")]
    names = set(held(cluster))
    assert "maintenance" in names and len(names) == 3  # both bookings' once each, the admin's own


def test_bookings_sharing_a_node_each_get_their_reservation(cluster: slurm_kit.Cluster) -> None:
    start = now() + timedelta(hours=1)
    both = [accepted(booking("b1", start=start, gpus=2)), accepted(booking("b2", start=start, gpus=2))]
    done = backend(cluster).sync(both, now=now())
    assert not done.refused and len(held(cluster)) == 2


def test_a_refused_reservation_is_that_bookings_problem_alone(cluster: slurm_kit.Cluster) -> None:
    start = now() + timedelta(hours=1)
    done = backend(cluster).sync([accepted(booking("gone", start=start), host="node9"),
                                  accepted(booking("fine", start=start), host="node1")], now=now())
    assert set(done.refused) == {"gone"}
    assert done.refused["gone"].startswith("Slurm refused to create reservation gpubook-gone-")
    assert len(held(cluster)) == 1


def test_only_an_account_slurm_lets_manage_reservations_can_sync(cluster: slurm_kit.Cluster) -> None:
    """The daemon needs no root, and Slurm, not gpubook, decides who may reserve: `nobody` is refused."""
    item = accepted(booking("b1", start=now() + timedelta(hours=1)))
    done = backend(cluster, user="nobody").sync([item], now=now())
    assert "b1" in done.refused and held(cluster) == {}
    assert not backend(cluster).sync([item], now=now()).refused


def test_a_stopped_controller_is_temporary_and_reservations_survive_its_restart(cluster: slurm_kit.Cluster) -> None:
    slurm = backend(cluster)
    item = accepted(booking("b1", start=now() + timedelta(hours=1)))
    slurm.sync([item], now=now())
    cluster.stop_slurmctld()  # SIGTERM: slurmctld saves its state (a kill -9 may lose the last seconds' changes)
    slurm.scontrol.timeout = 5
    with pytest.raises(SlurmUnreachable) as raised:
        slurm.sync([item], now=now())
    assert raised.value.temporary
    cluster.start_slurmctld()
    assert slurm.sync([item], now=now()).changes == ()  # adopted from slurmctld's saved state
    cluster.stop_slurmctld(kill=True)
    cluster.start_slurmctld()
    slurm.sync([item], now=now())  # whatever a kill -9 lost is made again, never twice
    assert len(held(cluster)) == 1


def test_slurm_confines_a_job_in_the_reservation_to_the_gpus_it_asks_for(cluster: slurm_kit.Cluster) -> None:
    """The enforcement the plan relies on: a job in a booking's reservation gets exactly its GPU count."""
    slurm = backend(cluster)
    slurm.sync([accepted(booking("b1", start=now() - timedelta(minutes=1)), host="node2")], now=now())
    (name,) = held(cluster)
    out = cluster.root / "job.out"
    out.touch()
    subprocess.run(["chown", cluster.user, str(out)], check=True)
    submit = ["runuser", "-u", cluster.user, "--", "sbatch", "--parsable", f"--reservation={name}",
              "--gres=gpu:2", f"--output={out}", "--chdir=/tmp",
              "--wrap", "echo node=$SLURMD_NODENAME gpus=$CUDA_VISIBLE_DEVICES"]
    subprocess.run(submit, env=cluster.env, check=True, capture_output=True, text=True)
    deadline = time.monotonic() + 30
    while "gpus=" not in out.read_text() and time.monotonic() < deadline:
        time.sleep(0.3)
    assert out.read_text().split() == ["node=node2", "gpus=0,1"]
    too_many = [*submit[:7], "--gres=gpu:5", *submit[8:]]
    refused = subprocess.run(too_many, env=cluster.env, capture_output=True, text=True)
    assert refused.returncode != 0 and "Requested node configuration is not available" in refused.stderr


def test_the_backend_says_what_is_missing_when_scontrol_is_not_installed() -> None:
    with pytest.raises(SlurmError, match="not installed"):
        Scontrol(program="/nonexistent/scontrol")("ping")


def test_doctor_asks_the_slurm_backend_for_its_rows(cluster: slurm_kit.Cluster, tmp_path: Path) -> None:
    """`gpubook doctor`'s backend rows come from the backend itself: the shared folder, then the
    controller and its usable GPU nodes."""
    slurm = {"kind": "slurm", "slurm_conf": str(cluster.conf), "command_seconds": 5}
    shared = tmp_path / "shared"
    config = parse_config({**BASE, "backend": {**slurm, "shared_dir": str(shared)}}, tmp_path / "gpubook.toml")
    rows = {check.name: check for check in backends.preflight(config)}
    assert rows["slurm shared_dir"].ok and rows["slurm controller"].ok, rows
    assert rows["slurm controller"].detail == "2 of 2 GPU node(s) usable"
    cluster.scontrol("update", "NodeName=node1,node2", "State=DRAIN", "Reason=disk")
    assert backends.preflight(config)[1].detail == "0 of 2 GPU node(s) usable"
    assert not backends.preflight(config)[1].ok
    cluster.stop_slurmctld()
    silent = backends.preflight(config)[1]
    assert (silent.name, silent.ok) == ("slurm controller", False) and "did not answer" in silent.detail, silent
    unset = parse_config({**BASE, "backend": slurm}, tmp_path / "gpubook.toml")
    assert [(c.name, c.ok) for c in backends.preflight(unset)] == [("slurm shared_dir", False)]
    nowhere = parse_config({**BASE, "backend": {**slurm, "shared_dir": "/nowhere/at/all"}}, tmp_path / "gpubook.toml")
    assert not backends.preflight(nowhere)[0].ok
