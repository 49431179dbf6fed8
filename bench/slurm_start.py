"""Start-to-SSH of a booking through Slurm against the same step run without Slurm: prints figures.

    sudo PYTHONPATH=. python bench/slurm_start.py [ROUNDS]

Needs root (tests/kits/slurm_kit.py makes a real Slurm 22.05 cluster: slurmctld, two slurmd in their
own network namespaces) and the account gpubook-test with rootless podman and the debian-ssh test
image (built once, as in tests/test_slurm_jobs.py). Each round, one booking:

- through Slurm: its reservation made (not timed), then `SlurmHost.start`: sbatch into the
  reservation, Slurm starts the job, srun runs `runtime.slurm.step` on node2, which starts the
  container and logs in over SSH with its probe key, then writes its result; timed until
  `start` returns (it polls the shared folder every 0.5 s, so figures carry up to 0.5 s of that).
- without Slurm: `python -m gpubook.runtime.slurm.step` run directly as the account (same engine code,
  same container, same probe), timed until its result file appears (polled every 0.05 s).

Each line also gives the step's own engine-start-to-SSH time (`seconds_to_ssh` in the result).
"""

from __future__ import annotations

import json
import os
import platform
import pwd
import signal
import statistics
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

from gpubook.runtime.engines import container_name
from gpubook.runtime.slurm.step import StepRequest
from gpubook.runtime.templates.catalog import get_template
from gpubook.scheduler.hosts import Booker, StartRequest
from gpubook.scheduler.hosts.slurm import SlurmCluster
from gpubook.scheduler.hosts.slurm.host import SlurmHost
from tests.kits import slurm_kit
from tests.kits.engine_suite import key_line, new_key
from tests.kits.slurm_jobs_kit import ENGINE, PREFIX, REPO, AsAccount, JobsOfAccount, accepted, booking
from tests.kits.slurm_kit import podman_as


def through_slurm(cluster: slurm_kit.Cluster, jobs: JobsOfAccount, scontrol: AsAccount, booking_id: str,
                  port: int) -> tuple[float, float]:
    now = datetime.now(UTC).replace(microsecond=0)
    item = accepted(booking(booking_id, start=now - timedelta(minutes=1), gpus=2), host="node2")
    SlurmCluster(scontrol=scontrol, prefix=PREFIX, users=[cluster.user]).sync([item], now=now)
    host = SlurmHost(name="node2", gpus=range(4), jobs=jobs, engine=ENGINE, start_timeout=120)
    request = StartRequest(booking_id=booking_id, booker=Booker(name="alice", uid=2001, gid=2001,
                                                                ssh_keys=(key_line(new_key()),)),
                           template=get_template("debian-ssh"), gpus=(0, 1), port=port, end=item.booking.end)
    began = time.monotonic()
    started = host.start(request)
    seconds = time.monotonic() - began
    inner = jobs.results(booking_id)["node2"].seconds_to_ssh
    host.stop(started.info.name, 10)
    while jobs.name(booking_id) in jobs.jobs():
        time.sleep(0.3)
    return seconds, inner


def without_slurm(folder: Path, user: str, booking_id: str, port: int) -> tuple[float, float]:
    folder.mkdir()
    account = pwd.getpwnam(user)
    os.chown(folder, account.pw_uid, account.pw_gid)
    step = StepRequest(booking_id=booking_id, user="alice", uid=2001, gid=2001, ssh_keys=(key_line(new_key()),),
                       template="debian-ssh", templates_dir=None, port=port,
                       end=datetime.now(UTC) + timedelta(hours=1), engine=ENGINE, data_root=None,
                       multi_node=False)
    step.write(folder / "request.json")
    env = [f"HOME={account.pw_dir}", f"XDG_RUNTIME_DIR=/run/user/{account.pw_uid}", f"PYTHONPATH={REPO}",
           "PATH=/usr/local/bin:/usr/bin:/bin", "SLURMD_NODENAME=local", "CUDA_VISIBLE_DEVICES=0,1"]
    began = time.monotonic()
    process = subprocess.Popen(["runuser", "-u", user, "--", "env", *env, sys.executable, "-m",
                                "gpubook.runtime.slurm.step", str(folder / "request.json")], cwd="/tmp")
    result = folder / "result-local.json"
    while not result.exists():
        if process.poll() is not None:
            raise SystemExit(f"the step ended with status {process.returncode} before its result")
        time.sleep(0.05)
    seconds = time.monotonic() - began
    inner = float(json.loads(result.read_text())["seconds_to_ssh"])
    os.kill(process.pid, signal.SIGTERM)  # runuser passes it on to the step, which stops its container
    process.wait(timeout=60)
    return seconds, inner


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    with slurm_kit.running() as cluster:
        shared = cluster.root / "shared"
        shared.mkdir()
        account = pwd.getpwnam(cluster.user)
        os.chown(shared, account.pw_uid, account.pw_gid)
        scontrol = AsAccount(cluster.user, conf=cluster.conf)
        jobs = JobsOfAccount(scontrol=scontrol, prefix=PREFIX, shared_dir=shared, user=cluster.user,
                             python=sys.executable)
        slurm, local = [], []
        try:
            for index in range(rounds):
                slurm.append(through_slurm(cluster, jobs, scontrol, f"bench-s{index}", 24100 + index))
                local.append(without_slurm(cluster.root / f"local{index}", cluster.user, f"bench-l{index}",
                                           24200 + index))
                print(f"round {index + 1}: through Slurm {slurm[-1][0]:.2f} s (step's own {slurm[-1][1]:.2f} s), "
                      f"without Slurm {local[-1][0]:.2f} s (step's own {local[-1][1]:.2f} s)", flush=True)
        finally:
            for index in range(rounds):
                for name in (f"bench-s{index}", f"bench-l{index}", f"bench-s{index}@node2", f"bench-l{index}@node2"):
                    podman_as(cluster.user, "rm", "--force", "--time=0", container_name(name))
    print(f"median start-to-SSH: through Slurm {statistics.median(s for s, _ in slurm):.2f} s, "
          f"without Slurm {statistics.median(s for s, _ in local):.2f} s ({rounds} rounds)")
    print(f"machine: {platform.platform()}, {os.cpu_count()} CPUs, rootless podman as {cluster.user}, "
          f"load {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
