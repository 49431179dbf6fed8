"""Podman's pause process outside every Slurm job (round 3, M4).

Rootless podman keeps one pause process per account and node; it holds the user namespace of all
the account's containers there, and when it ends, every one of them loses its namespaces (gpubook
then restarts those bookings; their work inside is lost). It is started by the first podman command
that finds none. On a node whose jobs are tracked by cgroup (proctrack/cgroup, the usual setting),
that command would be a booking's step, inside its job's cgroup: the end of that job (its booker
deletes the event, or it simply ends) would kill the pause process and take every other booking on
the node with it, which a booker can do at will.

So, before its first podman command, a step whose job has a cgroup of its own (`/job_<id>/` in
/proc/self/cgroup) makes sure the pause process runs, and outside every job's cgroup; if it does not,
the step refuses to start, with a sentence naming the fix. The fix is Slurm's Prolog, which slurmd
runs as root, outside the job, before it: `python -m gpubook.runtime.slurm.pause ACCOUNT` starts the
account's pause process there (`podman unshare true` as the account) when the job is the account's,
and does nothing for anyone else's. On nodes whose tracking has no cgroup per job
(proctrack/linuxproc, proctrack/pgid) podman's pause process, re-parented once its podman exits, is
no process of the job and outlives it: nothing is checked there.
"""

from __future__ import annotations

import os
import pwd
import re
import shutil
import subprocess
import sys
from pathlib import Path

from gpubook.runtime.engines.podman import pause_pid
from gpubook.runtime.errors import GpubookError

_ANY_JOB = re.compile(r"/job_(\d+)(?:/|$)")
PROLOG_DOC = "docs/guides/slurm.md#the-prolog"


class PauseInJob(GpubookError):
    """Podman's pause process would live, or lives, in a Slurm job's cgroup."""


def job_of(cgroup_text: str) -> str | None:
    """The Slurm job whose cgroup a /proc/PID/cgroup text names ("…/job_<id>/…"), or None."""
    for line in cgroup_text.splitlines():
        found = _ANY_JOB.search(line.split(":", 2)[-1])
        if found:
            return found.group(1)
    return None


def _cgroup_of(pid: int | str) -> str:
    try:
        return Path(f"/proc/{pid}/cgroup").read_text()
    except OSError:
        return ""


def check_outside_jobs(*, job: str | None, node: str) -> str | None:
    """Before a step's first podman command: None where its job has no cgroup of its own (nothing to
    fear), else the sentence saying where the pause process runs; `PauseInJob` when it runs in a job's
    cgroup or not at all (the step's podman would start it in its own)."""
    if os.geteuid() == 0 or not job or job_of(_cgroup_of("self")) != job:
        return None
    pid = pause_pid()
    if pid is None:
        raise PauseInJob(
            f"podman's pause process of this account does not run on {node}, and this step runs in the cgroup of "
            f"job {job}: its first podman command would start it there, and the end of this job would end it, "
            f"with every other booking's containers on {node}; start it outside the jobs with Slurm's Prolog "
            f"(python -m gpubook.runtime.slurm.pause {_account()}; {PROLOG_DOC})")
    holder = job_of(_cgroup_of(pid))
    if holder is not None:
        raise PauseInJob(
            f"podman's pause process of this account on {node} (pid {pid}) runs in the cgroup of job {holder}: "
            f"the end of that job would end it, with every booking's containers on {node}; start it outside the "
            f"jobs with Slurm's Prolog (python -m gpubook.runtime.slurm.pause {_account()}; {PROLOG_DOC})")
    return f"podman's pause process (pid {pid}) runs outside every job"


def _account() -> str:
    try:
        return pwd.getpwuid(os.getuid()).pw_name
    except KeyError:
        return str(os.getuid())


def prolog(account: str, *, environ: dict[str, str] | None = None) -> str:
    """What Slurm's Prolog does (as root, outside the job): for a job of `account`, its pause process
    started if none runs; any other job is left alone. The sentence says what was done."""
    env = os.environ if environ is None else environ
    user = env.get("SLURM_JOB_USER", "")
    if user != account:
        return f"job of {user or 'nobody'}: nothing to do"
    entry = pwd.getpwnam(account)
    runtime = Path(f"/run/user/{entry.pw_uid}")
    if not runtime.is_dir():  # no login manager on the node: made as pam_systemd would
        runtime.mkdir(mode=0o700, parents=True)
        os.chown(runtime, entry.pw_uid, entry.pw_gid)
    system_path = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"  # slurmd gives a Prolog no PATH
    runuser = shutil.which("runuser", path=system_path) or "runuser"
    done = subprocess.run(
        [runuser, "-u", account, "--", "/usr/bin/env", "-i", f"HOME={entry.pw_dir}", f"USER={account}",
         f"LOGNAME={account}", f"XDG_RUNTIME_DIR={runtime}", "PATH=/usr/local/bin:/usr/bin:/bin",
         "podman", "unshare", "true"],
        cwd="/", capture_output=True, text=True, timeout=120, check=False, stdin=subprocess.DEVNULL,
        env={"PATH": system_path, "LANG": "C.UTF-8"})
    if done.returncode != 0:
        return f"podman unshare as {account} failed: {(done.stderr or done.stdout).strip()[-500:]}"
    return f"{account}'s podman pause process runs outside the job"


def main(argv: list[str] | None = None) -> int:
    """Slurm's Prolog: `python -m gpubook.runtime.slurm.pause ACCOUNT`. It always exits 0: a failing
    Prolog drains the node for every job; a step that still finds no pause process says why."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m gpubook.runtime.slurm.pause ACCOUNT (in Slurm's Prolog, as root)", file=sys.stderr)
        return 0
    try:
        print(f"gpubook prolog: {prolog(args[0])}", file=sys.stderr)
    except (OSError, KeyError, subprocess.SubprocessError) as error:
        print(f"gpubook prolog: {error}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
