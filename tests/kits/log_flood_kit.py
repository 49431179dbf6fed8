"""A booking that floods its container log, and the daemon's login sampler reading it meanwhile.

The sampler runs in a process of its own (this file run as a script, with gpubook from whichever
tree PYTHONPATH names), so that its peak RSS is the sampler's and not pytest's: the daemon's
`usage.Sampler` with the engine's `logs`, forced to look at the booking's log every round (its
backoff skipped), until the flood is over and twice more. It prints one JSON line: its peak RSS
(VmHWM), its RSS before the first round, the rounds, its RSS after each, the longest log text it
was given, the reads that failed.
Used by tests/test_log_flood.py and bench/log_flood.py.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

KIT = Path(__file__).resolve()
FLOOD_LINE = "gpubook-log-flood"  # 18 bytes a line with its newline


def flood_command(total_bytes: int, marker: str) -> tuple[str, ...]:
    """The template command: write `total_bytes` to stdout (the container's log), touch `marker`,
    then stay up."""
    return ("/bin/sh", "-c", f"yes {FLOOD_LINE} | head -c {total_bytes}; touch {marker}; exec sleep 3600")


def peak_rss_kib(pid: int | str = "self") -> int:
    """VmHWM of a process, in KiB: the most resident memory it ever had."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmHWM in /proc/{pid}/status")


def rss_kib(pid: int | str = "self") -> int:
    """VmRSS of a process, in KiB: its resident memory now."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS in /proc/{pid}/status")


def run_sampler(name: str, marker: Path, *, code: Path, timeout: float, memory: int | None = None) -> dict:
    """The sampler process against container `name` until `marker` exists; its JSON line. `memory`:
    its address space at most, in bytes (a read past it fails with MemoryError)."""
    env = dict(os.environ, PYTHONPATH=str(code))

    def limit() -> None:
        if memory is not None:
            resource.setrlimit(resource.RLIMIT_AS, (memory, memory))

    done = subprocess.run([sys.executable, str(KIT), name, str(marker), str(timeout)], env=env,
                          capture_output=True, text=True, timeout=timeout + 120, check=False, preexec_fn=limit)
    if done.returncode != 0:
        raise RuntimeError(f"the sampler process failed ({done.returncode}): {done.stderr[-2000:]}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def _sampler_main(name: str, marker: Path, timeout: float) -> None:
    from gpubook.runtime.engines import engine_from
    from gpubook.scheduler.hosts.usage import LOGIN_CHECK_MAX, Sampler
    from gpubook.scheduler.state import State

    engine = engine_from(name="podman", runtime="runc", storage_driver="overlay")
    info = engine.inspect(name)
    if info is None:
        raise SystemExit(f"no container {name}")
    longest = 0
    errors: list[str] = []

    def logs(container: str) -> str:
        nonlocal longest
        try:
            text = engine.logs(container)
        except Exception as error:  # what the sampler would log and skip; counted here
            errors.append(str(error)[:200])
            raise
        longest = max(longest, len(text))
        return text

    with tempfile.TemporaryDirectory() as folder:
        state = State(Path(folder) / "state.sqlite")
        sampler = Sampler(state=state, host="flood", interval=1.0, running=lambda: [info], logs=logs,
                          probe_fingerprint="SHA256:none", read=lambda: None)  # type: ignore[arg-type,return-value]
        now, rounds, after, series = datetime.now(UTC), 0, 0, []
        baseline = peak_rss_kib()  # gpubook imported, the engine and the state made
        deadline = time.monotonic() + timeout
        while after < 2 and time.monotonic() < deadline:
            done = marker.exists()
            now += LOGIN_CHECK_MAX + timedelta(seconds=1)  # every round looks (no backoff)
            sampler.watch_logins([info], now=now)
            rounds += 1
            series.append(rss_kib())
            after += done
            time.sleep(0.5)
    print(json.dumps({"peak_rss_kib": peak_rss_kib(), "baseline_rss_kib": baseline, "rounds": rounds,
                      "longest_log_chars": longest, "flood_done": marker.exists(),
                      "rss_series_kib": series, "errors": errors}))


if __name__ == "__main__":
    _sampler_main(sys.argv[1], Path(sys.argv[2]), float(sys.argv[3]))
