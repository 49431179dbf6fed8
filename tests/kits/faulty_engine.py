"""An engine binary that hangs or is killed midway on demand: the engine faults of the fault harness
(issue 26), by `[engine] binary` pointing to a wrapper around the real podman (or docker).

`FaultyEngine(folder)` writes into `folder` an executable wrapper (`.path`) and a control file that
`.arm()` and `.lift()` write. Unarmed, the wrapper is a shell script that execs the real binary
(no control file: one `test -e` more than podman itself). Armed, it execs this very file (copied
into `folder`, run by Debian's python with -S -I: the standard library only), which takes one of
the `count` faults under a lock when the command's verb is armed:

- "hang": the command waits until `.lift()`, then runs the real command (a stuck engine that
  recovers; the caller's own timeout may kill it before, and then nothing ran);
- "kill": the real command runs and is killed by SIGKILL after a random 0 to `kill_within` s
  (seeded where `seed` is given), and the wrapper exits 137; where the command had ended before,
  its exit status is replaced by 137 all the same (killed just after its work was done).

The verb is podman's subcommand: the first argument that is neither an option nor a global option's
value (gpubook puts --runtime, --storage-driver, ... before it); `container X` counts as X.
`.hits()`: every faulted command's (time.monotonic(), verb, outcome), outcome one of "hung",
"released" (a hung one let go by lift), "killed", "killed-after-exit".

What podman 4.3 leaves when killed midway (see tests/test_faulty_engine.py): a `stop` or `rm --force`
killed while the container stops leaves it "Stopping"; a later `rm --force` then answers 0 and
forgets it while its processes run on (its conmon, its command, its published port held): a
container podman no longer lists. `orphans()` finds those, for the harness's invariants.
"""

from __future__ import annotations

import fcntl
import json
import os
import random
import shlex
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gpubook.runtime.engines.conmon import Monitor

KINDS = ("hang", "kill")
KILL_WITHIN = 1.5  # seconds: a killed command is killed at a random moment of its first 1.5 s
HOLD_POLL = 0.05  # seconds between a hung command's looks at whether it was lifted
# Global options of podman and docker that take a value as the next argument.
VALUE_OPTIONS = frozenset({
    "--cgroup-manager", "--cni-config-dir", "--config", "--conmon", "--connection", "--context",
    "--db-backend", "--events-backend", "--hooks-dir", "--host", "--identity", "--imagestore",
    "--log-level", "--module", "--network-cmd-path", "--network-config-dir", "--out", "--root",
    "--runroot", "--runtime", "--runtime-flag", "--ssh", "--storage-driver", "--storage-opt",
    "--tlscacert", "--tlscert", "--tlskey", "--tmpdir", "--url", "--volumepath", "-H", "-c", "-l",
})
GROUPS = frozenset({"container"})  # `podman container inspect` is `podman inspect`
CONTROL = "control.json"
HITS = "hits.jsonl"


@dataclass(frozen=True)
class Hit:
    time: float  # time.monotonic() of the fault (CLOCK_MONOTONIC: one clock for every process here)
    verb: str
    outcome: str
    pid: int  # the wrapper's process


class FaultyEngine:
    """The wrapper and its control file in `folder` (which the engine's account can read)."""

    def __init__(self, folder: Path, real: str = "podman", *, python: str | None = None) -> None:
        found = shutil.which(real)
        if found is None:
            raise ValueError(f"faulty engine: {real} is not installed or not on PATH")
        self.folder = Path(folder)
        self.real = os.path.realpath(found)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.path = self.folder / Path(found).name  # named like the real one: its messages read the same
        helper = self.folder / "faulty_engine.py"
        helper.write_text(Path(__file__).read_text())
        python = python or ("/usr/bin/python3" if os.access("/usr/bin/python3", os.X_OK) else sys.executable)
        control, real_q = shlex.quote(str(self.folder / CONTROL)), shlex.quote(self.real)
        self.path.write_text(
            "#!/bin/sh\n"
            f"# FaultyEngine's wrapper (tests/kits/faulty_engine.py): {self.real} itself unless armed.\n"
            f'[ -e {control} ] || exec {real_q} "$@"\n'
            f'exec {shlex.quote(python)} -S -I {shlex.quote(str(helper))} {real_q} "$@"\n')
        self.path.chmod(0o755)

    def arm(self, kind: str, verbs: Sequence[str] | None = None, count: int | None = 1, *,
            seed: int | None = None, kill_within: float = KILL_WITHIN) -> None:
        """Fault the next `count` commands (every one, with None) whose verb is in `verbs` (any
        verb, with None), until lift(). A new arm replaces the one before (hung commands stay hung)."""
        if kind not in KINDS:
            raise ValueError(f"engine fault {kind!r} is not one of {', '.join(KINDS)}")
        if count is not None and count < 1:
            raise ValueError(f"engine fault count must be 1 or more (or None for every command), not {count}")
        if isinstance(verbs, str):
            raise ValueError(f"engine fault verbs must be a list of verbs, not the string {verbs!r}")
        arm_id = uuid.uuid4().hex
        if kind == "hang":
            (self.folder / f"hold-{arm_id}").touch()
        state = {"id": arm_id, "kind": kind, "verbs": None if verbs is None else list(verbs), "count": count,
                 "taken": 0, "seed": seed, "kill_within": kill_within}
        staged = self.folder / f".{CONTROL}.{arm_id}"
        staged.write_text(json.dumps(state))
        staged.replace(self.folder / CONTROL)

    def lift(self) -> None:
        """Disarm; every hung command goes on to run the real command."""
        (self.folder / CONTROL).unlink(missing_ok=True)
        for hold in self.folder.glob("hold-*"):
            hold.unlink(missing_ok=True)

    def orphans(self, global_args: Sequence[str] = (), *, settle: float = 1.0) -> list[Monitor]:
        """Containers of this account whose conmon runs while podman (with `global_args`, the
        store the engine uses) lists no such container; seen twice `settle` seconds apart (a
        container being removed has its conmon a moment longer)."""
        first = _unlisted(self.real, global_args)
        if not first:
            return []
        time.sleep(settle)
        return [o for o in _unlisted(self.real, global_args) if o in first]

    def hits(self) -> list[Hit]:
        try:
            lines = (self.folder / HITS).read_text().splitlines()
        except FileNotFoundError:
            return []
        return [Hit(*json.loads(line)) for line in lines if line.strip()]


def end_orphan(orphan: Monitor) -> None:
    """SIGKILL an orphan's command and its conmon (gpubook's own, conmon.end)."""
    from gpubook.runtime.engines import conmon  # not at the top: the wrapper runs this file alone

    conmon.end(orphan)


def _unlisted(real: str, global_args: Sequence[str]) -> list[Monitor]:
    from gpubook.runtime.engines import conmon

    found = conmon.monitors()
    listed = subprocess.run([real, *global_args, "ps", "--all", "--no-trunc", "--format", "{{.ID}}"],
                            capture_output=True, text=True, timeout=120, check=True).stdout.split()
    return [o for o in found if o.id not in listed]


def verb_of(args: Sequence[str]) -> str:
    """The engine subcommand of an argv (without the binary): "" for none (`podman --version`)."""
    words: list[str] = []
    skip = False
    for arg in args:
        if skip:
            skip = False
        elif arg.startswith("-"):
            skip = arg in VALUE_OPTIONS
        else:
            words.append(arg)
            if words[0] not in GROUPS or len(words) == 2:
                break
    return words[-1] if words else ""


def _take(folder: Path, verb: str) -> dict[str, object] | None:
    """The arm this command takes one fault of, or None (unarmed, another verb, none left)."""
    for _ in range(10):  # the control file replaced by a new arm under us: read the new one
        try:
            fd = os.open(folder / CONTROL, os.O_RDWR)
        except FileNotFoundError:
            return None
        with os.fdopen(fd, "r+") as control:
            fcntl.flock(control, fcntl.LOCK_EX)
            if os.fstat(fd).st_nlink == 0:
                continue
            arm = json.loads(control.read())
            if (arm["verbs"] is not None and verb not in arm["verbs"]) or arm["count"] == 0:
                return None
            arm["taken"] += 1
            if arm["count"] is not None:
                arm["count"] -= 1
            if arm["count"] == 0:
                os.unlink(folder / CONTROL)  # the last one: the fast path again
            control.seek(0)
            control.truncate()
            control.write(json.dumps(arm))
            return arm
    return None


def _record(folder: Path, verb: str, outcome: str) -> None:
    line = json.dumps([time.monotonic(), verb, outcome, os.getpid()]) + "\n"
    fd = os.open(folder / HITS, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def _die_with_parent() -> None:
    """In the real command's child: SIGKILL it if the wrapper is killed (the caller's timeout)."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _hang(folder: Path, arm: dict[str, object], verb: str, argv: list[str]) -> None:
    _record(folder, verb, "hung")
    hold = folder / f"hold-{arm['id']}"
    while hold.exists():
        time.sleep(HOLD_POLL)
    _record(folder, verb, "released")
    os.execv(argv[0], argv)  # noqa: S606 - the engine's own argv, as the caller gave it


def _kill(folder: Path, arm: dict[str, object], verb: str, argv: list[str]) -> int:
    within = float(arm["kill_within"])  # type: ignore[arg-type]
    draw = random.Random(f"{arm['seed']}:{arm['taken']}") if arm["seed"] is not None else random.Random()
    child = subprocess.Popen(argv, preexec_fn=_die_with_parent)  # a prctl only: no lock taken
    try:
        child.wait(timeout=draw.uniform(0, within))
        outcome = "killed-after-exit"
    except subprocess.TimeoutExpired:
        child.send_signal(signal.SIGKILL)
        child.wait()
        outcome = "killed"
    _record(folder, verb, outcome)
    return 137


def main(argv: list[str]) -> int:
    """The armed wrapper: argv is the real binary and its arguments."""
    folder = Path(__file__).resolve().parent
    verb = verb_of(argv[1:])
    arm = _take(folder, verb)
    if arm is None:
        os.execv(argv[0], argv)  # noqa: S606 - the engine's own argv, as the caller gave it
    if arm["kind"] == "hang":
        _hang(folder, arm, verb, argv)
    return _kill(folder, arm, verb, argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
