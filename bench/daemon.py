"""The daemon's figures: start-to-login latency, idle RSS and CPU, plan+reconcile time. Prints them.

    PYTHONPATH=. python bench/daemon.py latency [--bookings 20]      # real Radicale + rootless podman
    PYTHONPATH=. python bench/daemon.py idle [--seconds 300] [--web] # `gpubook run`, poll every 30 s
    PYTHONPATH=. python bench/daemon.py plan [--bookings 1000 --gpus 100]
    PYTHONPATH=. python bench/daemon.py adopt [--bookings 8 --rounds 20]   # real Radicale + rootless podman
    PYTHONPATH=. python bench/daemon.py lost [--bookings 8 --rounds 20]    # real Radicale + rootless podman

latency: bookings made through CalDAV, one after the other; `gpubook run` as a real process; for
each, the time from the booking's start time to the first successful SSH login of the booker's
key (paramiko), measured by this script. The booking's port is read from the state database as
soon as the daemon allocates it. Targets: p95 <= 1.5 s.
idle: `gpubook run` with poll_seconds = 30 and one booking a day ahead; RSS (VmRSS, max) and CPU
(utime + stime of the process over the run, as a share of one core). Targets: 80 MB, 1 %.
plan: 1,000 accepted-or-rejected bookings on 100 GPUs over a week, 100 of them running now:
pin_running + plan_with_extensions (the real plan) + decide with the running containers' infos.
Target: 200 ms.
adopt: `gpubook run` with 8 bookings running (8 fake GPUs, tests/kits/fake_gpus.py), then 20 rounds of
kill -9 and a restart, each timed from the new process's spawn to the end of its first complete pass
(daemon-status.json written with the new pid: the daemon writes it after the pass), then checked: the
same container per booking, running, one each; in State one open run per booking and the same ports.
Where the time goes: the spawn to the "daemon started" event (imports, config, parts), from there to
the pass's start (the calendars read), the pass; the heaviest imports (python -X importtime, one
unmeasured start); the events the restarted daemons wrote (the calendar behind a counting front).
gpubook's bytecode is compiled by the first start and read by the next ones, as from an installed
package (--from-source: compiled at each start, as a source tree under PYTHONDONTWRITEBYTECODE is).
Target: p95 <= 2 s.
lost: `gpubook run` with 8 bookings running, then rounds of podman's namespaces lost under them, in
turn "netns" (each container's network namespace no mount in podman's mount namespace, as a new
pause process leaves it: every `podman ps` fails) and "pause" (podman's pause process and every
conmon SIGKILLed: podman refuses every command), each timed from the fault to every booking running
in a new container (read with podman itself) and to every booker's SSH login answered (on the
port the booking has then: a start that finds its old port still held takes another). The daemon
polls every 60 s and restarts a dead container after 1 s, doubled at each death: the rounds run in
pairs, one of each way, in a world of their own (the first of a pair meets a 1 s back-off, the
second 2 s; the order alternates).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import paramiko  # noqa: E402
import requests  # noqa: E402

from gpubook.runtime.engines import ContainerInfo, container_name  # noqa: E402
from gpubook.scheduler.config import parse  # noqa: E402
from gpubook.scheduler.core.bookings import Booking  # noqa: E402
from gpubook.scheduler.core.decide import Memory, decide, pin_running, plan_with_extensions  # noqa: E402
from gpubook.scheduler.core.plan import plan  # noqa: E402
from gpubook.scheduler.state import State  # noqa: E402


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(fraction * (len(ordered) - 1)))]


def machine() -> str:
    cores = os.cpu_count()
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{platform.platform()}, {cores} cores, {memory:.0f} GiB, Python {platform.python_version()}"


# -- latency -----------------------------------------------------------------------------------


def latency(count: int) -> None:
    from gpubook.runtime.engines import engine_from
    from gpubook.runtime.templates import overlay_image
    from gpubook.runtime.templates.catalog import get_template
    from tests.kits import servers
    from tests.kits.daemon_kit import DaemonProcess, book, soon, try_login, write_config
    from tests.kits.engine_suite import CACHE_DIR

    engine = engine_from("podman", runtime="runc", storage_driver="overlay")
    overlay_image.build_rootfs_image(engine, get_template("debian-ssh"), cache_dir=CACHE_DIR)
    key = paramiko.ECDSAKey.generate(bits=256)
    figures: list[float] = []
    with tempfile.TemporaryDirectory(prefix="gpubook-bench-") as folder, \
            servers.running(servers.radicale) as radicale:
        calendar = radicale.new_calendar()
        config = write_config(Path(folder), str(calendar.url), keys={"alice": key}, poll_seconds=30,
                              warn_minutes=0.02)
        spacing, length = 6, 4
        first = soon(12)
        ids = [f"bench-{n}@gpubook" for n in range(count)]
        for n, booking_id in enumerate(ids):
            start = first + timedelta(seconds=spacing * n)
            book(calendar, booking_id, user="alice", start=start, end=start + timedelta(seconds=length))
        daemon = DaemonProcess(config).start()
        try:
            state_path = Path(folder) / "state" / "state.sqlite"
            while not state_path.exists():
                time.sleep(0.1)
            with State(state_path) as state:
                for n, booking_id in enumerate(ids):
                    start = first + timedelta(seconds=spacing * n)
                    while datetime.now(UTC) < start:
                        time.sleep(0.005)
                    port = None
                    client = None
                    while client is None:
                        port = port or state.ports().get(booking_id)
                        client = try_login(port, "alice", key, timeout=2) if port else None
                        if client is None:
                            time.sleep(0.01)
                        if (datetime.now(UTC) - start).total_seconds() > 60:
                            raise SystemExit(f"{booking_id}: no login within 60 s\n{daemon.tail()}")
                    seconds = (datetime.now(UTC) - start).total_seconds()
                    client.close()
                    figures.append(seconds)
                    print(f"  {booking_id}: logged in {seconds:.3f} s after its start", flush=True)
        finally:
            daemon.stop()
            for booking_id in ids:
                engine.stop(container_name(booking_id), 0)
    print(f"start time → booker's SSH login, {count} bookings: median {statistics.median(figures):.3f} s, "
          f"p95 {percentile(figures, 0.95):.3f} s, max {max(figures):.3f} s (target p95 <= 1.5 s)")


# -- idle --------------------------------------------------------------------------------------


def idle(seconds: float, *, web: bool = False, check_seconds: float | None = None) -> None:
    from tests.kits import servers
    from tests.kits.daemon_kit import DaemonProcess, book, write_config

    key = paramiko.ECDSAKey.generate(bits=256)
    ticks = os.sysconf("SC_CLK_TCK")
    with tempfile.TemporaryDirectory(prefix="gpubook-bench-") as folder, \
            servers.running(servers.radicale) as radicale:
        calendar = radicale.new_calendar()
        config = write_config(Path(folder), str(calendar.url), keys={"alice": key}, poll_seconds=30)
        if check_seconds is not None:  # the change check's pace (0: none, polls only, as v0.2.0 did)
            config.write_text(config.read_text().replace("[daemon]\n", f"[daemon]\ncheck_seconds = {check_seconds}\n"))
        if web:  # the status page served by the daemon, asked for once a second meanwhile (a browser's tab)
            config.write_text(config.read_text() + '\n[web]\nenabled = true\nlisten = "127.0.0.1:0"\n')
        tomorrow = (datetime.now(UTC) + timedelta(days=1)).replace(microsecond=0)
        book(calendar, "tomorrow@gpubook", user="alice", start=tomorrow, end=tomorrow + timedelta(hours=2))
        daemon = DaemonProcess(config).start()
        assert daemon.process is not None
        pid = daemon.process.pid
        try:
            time.sleep(15)  # the start and the first pass are not "idle"

            def cpu() -> tuple[float, float]:
                """(the daemon's own CPU seconds, those of its finished children: podman list)."""
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                return (int(fields[11]) + int(fields[12])) / ticks, (int(fields[13]) + int(fields[14])) / ticks

            def rss_mb() -> float:
                for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                    if line.startswith("VmRSS:"):
                        return int(line.split()[1]) / 1024
                return 0.0

            began, cpu_before = time.monotonic(), cpu()
            peak = rss_mb()
            page = _page_url(daemon) if web else None
            while time.monotonic() - began < seconds:
                time.sleep(1)
                if page is not None and int(time.monotonic() - began) % 15 == 0:
                    requests.get(page, timeout=10).raise_for_status()
                peak = max(peak, rss_mb())
            wall = time.monotonic() - began
            own, children = (after - before for after, before in zip(cpu(), cpu_before, strict=True))
            if daemon.process.poll() is not None:  # a dead daemon's /proc entry reads as 0 MB and 0 s
                raise SystemExit(f"the daemon exited during the idle run (exit {daemon.process.returncode}):\n"
                                 f"{daemon.tail()}")
        finally:
            daemon.stop()
    print(f"idle daemon{' serving the status page (asked every 15 s)' if web else ''} over {wall:.0f} s, "
          f"poll every 30 s: RSS max {peak:.1f} MB (target <= 80 MB), "
          f"CPU {own:.2f} s = {100 * own / wall:.2f} % of one core, with the podman commands it ran "
          f"{own + children:.2f} s = {100 * (own + children) / wall:.2f} % (target <= 1 %)")


def _page_url(daemon) -> str:  # type: ignore[no-untyped-def]
    """The page's address, as the daemon logs it (port 0: one it chose)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        found = re.search(r"status page on (http://\S+/)", daemon.tail())
        if found:
            return found[1]
        time.sleep(0.5)
    raise RuntimeError(f"the daemon did not serve its page:\n{daemon.tail()}")


# -- adoption after kill -9 -------------------------------------------------------------------


@contextmanager
def _booked(count: int) -> Iterator[SimpleNamespace]:
    """`count` bookings running now on as many fake GPUs, in a real Radicale (behind a counting front), the
    debian-ssh image in rootless podman, a config polling every 60 s; the containers removed after."""
    from gpubook.runtime.engines import engine_from
    from gpubook.runtime.templates import overlay_image
    from gpubook.runtime.templates.catalog import get_template
    from tests.kits import fake_gpus, servers
    from tests.kits.daemon_kit import book, soon, write_config
    from tests.kits.engine_suite import CACHE_DIR
    from tests.kits.front import CountingFront

    engine = engine_from("podman", runtime="runc", storage_driver="overlay")
    overlay_image.build_rootfs_image(engine, get_template("debian-ssh"), cache_dir=CACHE_DIR)
    key = paramiko.ECDSAKey.generate(bits=256)
    ids = [f"adopt-{n}@gpubook" for n in range(count)]
    with tempfile.TemporaryDirectory(prefix="gpubook-bench-") as name, \
            servers.running(servers.radicale) as radicale:
        folder = Path(name)
        calendar = radicale.new_calendar()
        front = CountingFront(radicale.base_url).start()  # counts the daemon's requests
        gpus = folder / "gpus.json"
        fake_gpus.write(gpus, [{"utilisation": 0} for _ in range(count)])
        config = write_config(folder, front.base_url + calendar.url.path, keys={"alice": key}, poll_seconds=60,
                              gpus=count, gpu_lines=['monitor = "tests.kits.fake_gpus:read"'])
        start, end = soon(0) - timedelta(seconds=1), soon(3600)
        for n, booking_id in enumerate(ids):
            book(calendar, booking_id, user="alice", start=start, end=end, gpus=f"{n},")
        try:
            yield SimpleNamespace(engine=engine, key=key, ids=ids, folder=folder, calendar=calendar, front=front,
                                  config=config, env={fake_gpus.ENV: str(gpus)})
        finally:
            front.stop()
            for booking_id in ids:
                engine.stop(container_name(booking_id), 0)


def adopt(count: int, rounds: int, *, from_source: bool = False) -> None:
    from tests.kits.daemon_kit import DaemonProcess

    writes = 0  # the calendar's events written by the restarted daemons (their write-back runs after the pass)
    figures: list[float] = []
    phases: list[tuple[float, float, float]] = []
    with _booked(count) as world:
        engine, ids, folder, calendar, front, config = (world.engine, world.ids, world.folder, world.calendar,
                                                         world.front, world.config)
        env = dict(world.env)
        if not from_source:  # as installed: bytecode compiled once (by the first start here, unmeasured), then read
            env |= {"PYTHONDONTWRITEBYTECODE": "", "PYTHONPYCACHEPREFIX": str(folder / "pycache")}
        status_path = folder / "state" / "daemon-status.json"
        daemon = DaemonProcess(config, env=env).start()
        try:
            first = _wait_all_running(engine, ids, daemon)
            print(f"  {count} bookings running: {', '.join(sorted(first))}", flush=True)
            _wait_pass(status_path, daemon, began=time.monotonic())
            # Its write-back done too: a restart then has nothing left to write (writes counts what it writes).
            _wait_written(calendar, ids, daemon)
            for number in range(rounds + 1):
                daemon.kill()
                profiled = number == rounds  # one start more, unmeasured: where its imports' time goes
                spawned_wall = time.time()
                spawned = time.monotonic()
                daemon = DaemonProcess(config, env=env | ({"PYTHONPROFILEIMPORTTIME": "1"} if profiled else {}))
                daemon.log.write_text("")
                daemon.start()
                status = _wait_pass(status_path, daemon, began=spawned)
                seconds = time.monotonic() - spawned
                _check_adopted(engine, first, folder / "state" / "state.sqlite", round_number=number, daemon=daemon)
                written = len(front.requests(since=spawned, method="PUT"))
                writes += written
                if profiled:
                    _print_imports(daemon.log.read_text(errors="replace"))
                    continue
                started = _started_at(folder, daemon.process.pid)  # type: ignore[union-attr]
                passed = datetime.fromisoformat(status["updated"]).timestamp()
                phases.append((started - spawned_wall, passed - started, spawned_wall + seconds - passed))
                figures.append(seconds)
                print(f"  round {number}: first complete pass {seconds:.3f} s after the spawn (start "
                      f"{phases[-1][0]:.3f} s, to the pass {phases[-1][1]:.3f} s, pass {phases[-1][2]:.3f} s); "
                      f"the same {count} containers; {written} events written", flush=True)
            time.sleep(2)  # the last daemon's write-back, if any
            writes += len(front.requests(since=spawned, method="PUT"))
        finally:
            daemon.stop()
    print(f"adoption after kill -9, {count} running bookings, {rounds} rounds, "
          f"{'every module compiled at each start' if from_source else 'bytecode cached'}: spawn → first complete pass "
          f"median {statistics.median(figures):.3f} s, p95 {percentile(figures, 0.95):.3f} s, "
          f"max {max(figures):.3f} s (target p95 <= 2 s)")
    for label, index in (("spawn → \"daemon started\" (imports, config, parts)", 0),
                         ("→ the pass's start (scheduler, calendars read)", 1), ("the pass, status written", 2)):
        values = [p[index] for p in phases]
        print(f"  {label}: median {statistics.median(values):.3f} s, max {max(values):.3f} s")
    print(f"  events written to the calendar by the restarted daemons: {writes}")


def lost(count: int, rounds: int) -> None:
    """Rounds of podman's namespaces lost under `count` running bookings, one way and the other in
    turn: "netns", every booking's network namespace unmounted in podman's mount namespace (the state
    a new pause process leaves: no `podman ps` works); "pause", podman's pause process and every
    conmon of the account SIGKILLed (podman refuses every command until `podman system migrate`).
    Each timed from the fault to every booking running in a new container, and to every booker's
    SSH login answered on the booking's own port."""
    from tests.kits.daemon_kit import DaemonProcess, try_login

    figures: dict[str, list[tuple[float, float]]] = {"netns": [], "pause": []}
    ports = {"netns": 0, "pause": 0}  # bookings started again on another port (their old one still held)
    for pair in range(max(1, rounds // 2)):  # a world each: a booking's restart back-off doubles at each death
        order = ("netns", "pause") if pair % 2 == 0 else ("pause", "netns")
        with _booked(count) as world:
            engine = world.engine
            daemon = DaemonProcess(world.config, env=world.env).start()
            try:
                before = _wait_all_running(engine, world.ids, daemon)
                print(f"  world {pair}: {count} bookings running", flush=True)
                for step, way in enumerate(order):
                    number = 2 * pair + step
                    hit = time.monotonic()
                    if way == "netns":
                        _unmount_netns(engine, list(before.values()))
                    else:
                        _end_pause_and_conmons()
                    _wait_replaced(engine, {info.id for info in before.values()}, len(world.ids), daemon)
                    running = time.monotonic() - hit
                    after = _wait_all_running(engine, world.ids, daemon)  # mended by now: gpubook's engine reads it
                    for info in after.values():  # on the port the booking has now (its event says it)
                        while (client := try_login(info.port, "alice", world.key)) is None:
                            if time.monotonic() - hit > 180:
                                listening = subprocess.run(["ss", "-Htlnp", f"sport = :{info.port}"],
                                                           capture_output=True, text=True, check=False).stdout
                                raise SystemExit(f"round {number}: no SSH on {info.port} within 180 s; listening "
                                                 f"there: {listening.strip() or 'nothing'}\n{daemon.tail()}")
                            time.sleep(0.1)
                        client.close()
                    ssh = time.monotonic() - hit
                    moved = sum(before[b].port != after[b].port for b in before)
                    figures[way].append((running, ssh))
                    ports[way] += moved
                    print(f"  round {number} ({way}, back-off {2 ** step} s): every booking running again "
                          f"{running:.2f} s after the fault, every login answered {ssh:.2f} s after it; "
                          f"{moved} on another port", flush=True)
                    before = after
            finally:
                daemon.stop()
    for way, label in (("netns", "network namespaces lost"), ("pause", "pause process and conmons killed")):
        if figures[way]:
            running, ssh = [f[0] for f in figures[way]], [f[1] for f in figures[way]]
            print(f"podman's namespaces lost under {count} running bookings ({label}), {len(running)} rounds: "
                  f"all running again median {statistics.median(running):.2f} s, max {max(running):.2f} s; all "
                  f"logins answered median {statistics.median(ssh):.2f} s, max {max(ssh):.2f} s; "
                  f"{ports[way]} of {count * len(running)} restarts on another port")


def _wait_replaced(engine, old: set[str], count: int, daemon) -> None:  # type: ignore[no-untyped-def]
    """Until `count` booking containers run, none of them one of `old`. Read with podman itself (it
    fails until the daemon mends podman's state), never through gpubook's engine (which would)."""
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        done = subprocess.run([*engine.global_argv(), "ps", "--filter", "label=gpubook.booking", "--format", "json"],
                              capture_output=True, text=True, check=False)
        listed = json.loads(done.stdout or "[]") if done.returncode == 0 else []
        if len([c for c in listed if c.get("State") == "running" and c.get("Id") not in old]) == count:
            return
        time.sleep(0.1)
    raise SystemExit(f"the bookings were not running again within 180 s\n{daemon.tail()}")


def _unmount_netns(engine, infos: list[ContainerInfo]) -> None:  # type: ignore[no-untyped-def]
    """What a new pause process leaves: the containers' network namespaces are no mounts in podman's."""
    podman = engine.global_argv()
    paths = [subprocess.run([*podman, "inspect", "--format", "{{.NetworkSettings.SandboxKey}}", info.id],
                            capture_output=True, text=True, check=True).stdout.strip() for info in infos]
    subprocess.run([*podman, "unshare", "umount", *paths], capture_output=True, check=True)


def _end_pause_and_conmons() -> None:
    """SIGKILL podman's pause process and every conmon of this account, and wait for their end."""
    from gpubook.runtime.engines.conmon import monitors
    from tests.kits.daemon_kit import alive

    runtime = Path(os.environ.get("XDG_RUNTIME_DIR") or f"/run/user/{os.getuid()}")
    pids = [int((runtime / "libpod" / "tmp" / "pause.pid").read_text()), *(monitor.pid for monitor in monitors())]
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)


def _wait_all_running(engine, ids: list[str], daemon) -> dict[str, ContainerInfo]:  # type: ignore[no-untyped-def]
    """Booking id → its container, once every booking's container runs."""
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        running = {c.booking_id: c for c in engine.list() if c.running and c.booking_id in ids}
        if len(running) == len(ids):
            return running
        time.sleep(0.5)
    raise SystemExit(f"not every booking ran within 180 s\n{daemon.tail()}")


def _wait_written(calendar, ids: list[str], daemon) -> None:  # type: ignore[no-untyped-def]
    """Until every booking's event says it runs (the daemon's write-back of its start)."""
    from tests.kits.daemon_kit import description

    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if all("running: ssh" in description(calendar, booking_id) for booking_id in ids):
            return
        time.sleep(0.5)
    raise SystemExit(f"not every event said \"running\" within 120 s\n{daemon.tail()}")


def _wait_pass(path: Path, daemon, *, began: float) -> dict:  # type: ignore[no-untyped-def, type-arg]
    """daemon-status.json once the daemon's first pass wrote it (its pid); polled every 10 ms."""
    pid = daemon.process.pid
    while time.monotonic() - began < 120:
        try:
            status = json.loads(path.read_text())
        except (OSError, ValueError):  # not there yet, or caught mid-write
            status = {}
        if status.get("pid") == pid:
            return status
        if daemon.process.poll() is not None:
            raise SystemExit(f"the daemon exited ({daemon.process.returncode}) before its first pass\n{daemon.tail()}")
        time.sleep(0.01)
    raise SystemExit(f"no complete pass within 120 s of the spawn\n{daemon.tail()}")


def _check_adopted(engine, first: dict[str, ContainerInfo], state_path: Path, *,  # type: ignore[no-untyped-def]
                   round_number: int, daemon) -> None:
    """The same container per booking, running, and one each (none started again, none stopped); in
    State one run per booking, still open, and the same ports."""
    mine = [c for c in engine.list() if c.booking_id in first]
    found = sorted((c.booking_id, c.id, c.state) for c in mine)
    wanted = sorted((booking_id, info.id, "running") for booking_id, info in first.items())
    with State(state_path) as state:
        runs = sorted((r.booking_id, r.stopped_at is None) for r in state.containers() if r.booking_id in first)
        ports = {booking_id: port for booking_id, port in state.ports().items() if booking_id in first}
    problems = [f"containers {found}, wanted {wanted}" if found != wanted else "",
                f"runs in State {runs}" if runs != sorted((booking_id, True) for booking_id in first) else "",
                f"ports in State {ports}" if ports != {b: info.port for b, info in first.items()} else ""]
    if any(problems):
        raise SystemExit(f"round {round_number}, after the restart: {'; '.join(p for p in problems if p)}\n"
                         f"{daemon.tail()}")


def _started_at(folder: Path, pid: int) -> float:
    """When the daemon with `pid` logged "daemon started" (a Unix time)."""
    with State(folder / "state" / "state.sqlite") as state:
        for entry in reversed(state.events()):
            if entry.message.startswith(f"daemon started (pid {pid})"):
                return entry.at.timestamp()
    raise SystemExit(f"no \"daemon started\" event of pid {pid}")


def _print_imports(log: str, top: int = 12) -> None:
    """Where one start's imports go (python -X importtime lines: self, cumulative, name indented by
    depth): their total, the heaviest packages by their modules' own time, and the heaviest imports
    made by gpubook's modules (a cumulative time: what importing there costs, the rest included)."""
    rows = []
    for line in log.splitlines():
        found = re.match(r"import time:\s+(\d+) \|\s+(\d+) \| ( *)(\S+)", line)
        if found:
            rows.append((int(found[1]), int(found[2]), len(found[3]) // 2, found[4]))
    parents: dict[str, str] = {}
    stack: list[str] = []
    for _, _, depth, module in reversed(rows):  # a module's line comes after those of the imports it made
        del stack[depth:]
        if stack:
            parents[module] = stack[-1]
        stack.append(module)
    packages: dict[str, list[int]] = {}
    for own, _, _, module in rows:
        packages.setdefault(module.split(".")[0], []).append(own)
    total = sum(cumulative for _, cumulative, depth, _ in rows if depth == 0)
    print(f"  imports of one start (python -X importtime): {total / 1e6:.3f} s, {len(rows)} modules; by package:")
    for package, times in sorted(packages.items(), key=lambda item: -sum(item[1]))[:top]:
        print(f"    {sum(times) / 1e6:.3f} s  {package} ({len(times)} modules)")
    print("  the heaviest packages gpubook imports (cumulative), and by which module:")
    edges = [(cumulative, module, parents.get(module, "")) for _, cumulative, _, module in rows
             if not module.startswith("gpubook") and parents.get(module, "").startswith("gpubook")]
    for cumulative, module, parent in sorted(edges, reverse=True)[:top]:
        print(f"    {cumulative / 1e6:.3f} s  {module} ← {parent}")


# -- plan + reconcile --------------------------------------------------------------------------


def plan_and_reconcile(count: int, gpus: int, rounds: int = 20) -> None:
    users = {f"user{n}": {"uid": 2000 + n} for n in range(20)}
    config = parse({"host": {"name": "bench", "timezone": "UTC"},
                    "calendar": [{"url": "http://127.0.0.1/cal/", "gpus": "all"}], "users": users},
                   Path("bench.toml"))
    rng = random.Random(7)
    now = datetime(2026, 11, 24, 12, tzinfo=UTC)
    bookings = []
    for n in range(count):
        if n < 100:  # running now
            start = now - timedelta(hours=rng.choice([1, 2, 3]))
        else:
            start = now + timedelta(minutes=30 * rng.randrange(7 * 48))
        end = start + timedelta(hours=rng.choice([1, 2, 4, 8, 24]))
        indices = (n % gpus,) if n < 100 else None
        bookings.append(Booking(
            id=f"b{n}", uid=f"b{n}", user=f"user{n % 20}", template="debian-ssh",
            gpu_count=1 if indices else rng.choice([1, 1, 2, 4]), gpu_indices=indices, start=start, end=end,
            created=now - timedelta(days=30, seconds=n), dtstamp=None, calendar_url="http://127.0.0.1/cal/",
            href=f"http://127.0.0.1/cal/b{n}.ics"))
    actual = [ContainerInfo(name=container_name(b.id), id=b.id, state="running", image="i", booking_id=b.id,
                            user=b.user, gpus=b.gpu_indices or (), end=b.end, spec_hash="h", port=2200 + n,
                            template="debian-ssh") for n, b in enumerate(bookings[:100])]
    running = {i.booking_id: i.gpus for i in actual}
    memory = Memory(known=frozenset(running))
    timings = []
    for _ in range(rounds):
        began = time.perf_counter()
        pinned = pin_running(bookings, actual)
        result, _, _ = plan_with_extensions(
            pinned.occurrences, agreed_ends={i.booking_id: i.end for i in actual if i.end},
            plan=lambda items: plan(items, inventory=range(gpus), config=config,
                                    templates=frozenset({"debian-ssh"}), now=now, running=running))
        actions = decide(result, actual, now=now, memory=memory)
        timings.append(time.perf_counter() - began)
    print(f"plan + reconcile, {count} bookings on {gpus} GPUs ({len(result.accepted)} accepted, "
          f"{len(result.rejected)} rejected, 100 running, {len(actions)} actions): median "
          f"{1000 * statistics.median(timings):.1f} ms, max {1000 * max(timings):.1f} ms over {rounds} rounds "
          f"(target <= 200 ms)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["latency", "idle", "plan", "adopt", "lost", "all"])
    parser.add_argument("--bookings", type=int, help="latency: bookings (20); plan: bookings (1000); adopt: running "
                        "bookings (8)")
    parser.add_argument("--rounds", type=int, default=20, help="adopt: kill -9 and restarts (20); lost: faults (20)")
    parser.add_argument("--from-source", action="store_true", help="adopt: no bytecode written or read for gpubook "
                        "(a source tree under PYTHONDONTWRITEBYTECODE, as the tests run): every start compiles it")
    parser.add_argument("--gpus", type=int, default=100)
    parser.add_argument("--seconds", type=float, default=300.0, help="idle: how long to measure (300)")
    parser.add_argument("--web", action="store_true", help="idle: with [web] enabled, the page asked every 15 s")
    parser.add_argument("--check-seconds", type=float, default=None, help="idle: [daemon] check_seconds (default: "
                        "the config's, a change check every second; 0: none, as before issue 24)")
    args = parser.parse_args()
    print(f"machine: {machine()}")
    if args.what in ("plan", "all"):
        plan_and_reconcile(args.bookings or 1000, args.gpus)
    if args.what in ("latency", "all"):
        latency(args.bookings or 20)
    if args.what in ("idle", "all"):
        idle(args.seconds, web=args.web, check_seconds=args.check_seconds)
    if args.what in ("adopt", "all"):
        adopt(args.bookings or 8, args.rounds, from_source=args.from_source)
    if args.what == "lost":
        lost(args.bookings or 8, args.rounds)


if __name__ == "__main__":
    main()
