"""Round 3, M4, the parts that need no cluster: which job a /proc/PID/cgroup text names, and the
Prolog leaving every job but the account's alone (tests/test_slurm_pause.py has the cluster)."""

from __future__ import annotations

import pytest

from gpubook.runtime.slurm import pause as slurm_pause
from gpubook.runtime.slurm.pause import job_of, prolog

V1 = "12:freezer:/slurm/uid_1010/job_42/step_0\n11:memory:/user.slice\n0::/user.slice/session-3.scope\n"
V2 = "0::/system.slice/slurmstepd.scope/job_7/step_0/user/task_0\n"


@pytest.mark.parametrize(("text", "job"), [(V1, "42"), (V2, "7"), ("0::/system.slice/slurmd.service\n", None),
                                           ("0::/user.slice/job_seeker/x\n", None), ("", None)])
def test_the_job_a_cgroup_text_names(text: str, job: str | None) -> None:
    assert job_of(text) == job


def test_the_prolog_leaves_other_accounts_jobs_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("the Prolog ran a command for another account's job")

    monkeypatch.setattr(slurm_pause.subprocess, "run", never)
    assert prolog("gpubook", environ={"SLURM_JOB_USER": "alice"}) == "job of alice: nothing to do"
    assert prolog("gpubook", environ={}) == "job of nobody: nothing to do"


def test_outside_a_job_cgroup_nothing_is_checked() -> None:
    """This test's own process is in no Slurm job: the step's check has nothing to fear."""
    assert slurm_pause.check_outside_jobs(job="42", node="node1") is None
    assert slurm_pause.check_outside_jobs(job=None, node="node1") is None
