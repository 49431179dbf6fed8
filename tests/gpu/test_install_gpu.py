"""gpubook installed from its wheel on the GPU host and run rootless: issue 21's proof on Ubuntu.

tests/gpu/rootless_install.sh (as root, before this test) brought rootless podman (Debian's stack
from the bundle, setuid newuidmap/newgidmap, slirp4netns), installed the wheel and its dependencies
alone into /opt/gpubook/venv and ran `gpubook setup` (the account, its subordinate ids, data_root,
storage.conf, /dev/net/tun, the delegated cgroup v2 subtree). This test (as root) runs the daemon
AS THAT ACCOUNT from that venv (`gpubook run`: no checkout, no PYTHONPATH),
in the subtree's leaf /gpubook/daemon, with `[engine] network` left at its default (private:
slirp4netns, the booking's port published) and `[engine] memory` set. A Radicale on 127.0.0.1
holds the bookings.

Each booker reads the `running: ssh -p PORT` and `known_hosts:` lines written back into its event,
logs in with paramiko rejecting any other host key, runs a CUDA kernel (tests/gpu/cudacheck.c),
lists the GPUs, and must see exactly its booked GPU. Inside, memory.max and pids.max must be the
configured limits. A memory hog (`tail /dev/zero`) in one booking must be OOM-killed while the
other booking (on a host with two GPUs; else a second session of the same booking), the daemon
and the host go on. At the end each container is stopped and the event says "ended".

On the GPU host, as root, from a folder holding BUNDLE and the source tree's tests/ (no gpubook/
there: the test imports the installed wheel):

    tests/gpu/rootless_install.sh BUNDLE gpubook
    PYTHONPATH=.:/opt/gpubook/venv/lib/python3.12/site-packages:BUNDLE/testsite \\
      GPUBOOK_BUNDLE=BUNDLE python3 -m pytest tests/gpu/test_install_gpu.py -m gpu -v -s --confcutdir=tests/gpu

GPUBOOK_GPU_RESULTS names a folder for the figures (install-gpu-figures.json) and the logs.
"""

from __future__ import annotations

import json
import lzma
import os
import platform
import pwd
import re
import shutil
import subprocess
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path

import paramiko
import pytest

import gpubook
from gpubook.runtime.data import storage
from gpubook.runtime.engines import Engine, container_name, engine_from
from gpubook.runtime.nvidia.model import Gpu
from tests.kits import booker, hostroot, servers
from tests.kits.daemon_kit import book, description, wait_for, write_config

pytestmark = [pytest.mark.gpu, pytest.mark.caldav, pytest.mark.slow]

ACCOUNT = os.environ.get("GPUBOOK_ACCOUNT", "gpubook")
CGROUP = Path("/sys/fs/cgroup/gpubook")
DAEMON_LEAF = CGROUP / "daemon"
DATA_MOUNT = Path("/srv/gpubook-data")
MEMORY, MEMORY_BYTES = "1g", 1 << 30
PIDS = 4096  # [engine] pids_limit's default
LENGTH_SECONDS = 75
RUNNING_LINE = re.compile(r"running: ssh -p (\d+) (\S+)@")
KNOWN_HOSTS = re.compile(r"known_hosts: (\[127\.0\.0\.1\]:\d+ ssh-ed25519 \S+)")
LIMITS = "cat /sys/fs/cgroup/memory.max /sys/fs/cgroup/pids.max"
HOG = ("grep oom_kill /sys/fs/cgroup/memory.events; timeout 120 tail /dev/zero; echo \"hog exit $?\"; "
       "grep oom_kill /sys/fs/cgroup/memory.events")


@dataclass(frozen=True)
class Account:
    name: str
    uid: int
    gid: int
    home: Path
    venv: Path

    def env(self) -> dict[str, str]:
        return {"HOME": str(self.home), "USER": self.name, "LOGNAME": self.name, "LANG": "C.UTF-8",
                "XDG_RUNTIME_DIR": f"/run/user/{self.uid}", "PATH": "/usr/local/bin:/usr/bin:/bin"}

    def argv(self, *command: str) -> list[str]:
        """`command` as the account itself (setpriv execs: no wrapper process stays)."""
        return ["setpriv", f"--reuid={self.uid}", f"--regid={self.gid}", "--clear-groups", "--",
                "env", "-i", *(f"{k}={v}" for k, v in self.env().items()), *command]


@dataclass(frozen=True)
class Booker:
    booking_id: str
    user: str
    key: paramiko.PKey
    hog: bool  # this booking runs the memory hog


@dataclass(frozen=True)
class Figure:
    booking: str
    user: str
    gpus: tuple[int, ...]
    line_after_start_s: float
    login_after_start_s: float
    smi: tuple[str, ...]
    kernel: str
    memory_max: int
    pids_max: int
    container_cgroup: str
    network_mode: str
    hog: dict[str, object] = field(default_factory=dict)


@pytest.fixture(scope="module")
def account() -> Account:
    try:
        entry = pwd.getpwnam(ACCOUNT)
    except KeyError:
        pytest.skip(f"no account {ACCOUNT}: run tests/gpu/rootless_install.sh BUNDLE {ACCOUNT} as root first")
    venv = Path(os.environ.get("GPUBOOK_VENV", "/opt/gpubook/venv"))
    if not (venv / "bin" / "gpubook").exists() or os.geteuid() != 0:
        pytest.skip(f"needs root and {venv}/bin/gpubook (tests/gpu/rootless_install.sh)")
    return Account(ACCOUNT, entry.pw_uid, entry.pw_gid, Path(entry.pw_dir), venv)


@pytest.fixture(scope="module")
def engine(account: Account, tmp_path_factory: pytest.TempPathFactory) -> Engine:
    """gpubook's engine as the account (its rootless store), the sshd image imported there."""
    wrapper = tmp_path_factory.mktemp("bin") / "podman-as-account"
    wrapper.write_text("#!/bin/sh\nexec " + " ".join(account.argv("podman")) + ' "$@"\n')
    wrapper.chmod(0o755)
    wrapper.parent.chmod(0o755)
    made = engine_from("podman", binary=str(wrapper), runtime="runc", storage_driver="overlay",
                       ulimits=hostroot.ULIMITS)
    if not made.image_exists(hostroot.SSHD_IMAGE):
        tarball = Path("/tmp/gpu-sshd.tar")  # noqa: S108 - readable by the account
        with lzma.open(hostroot.BUNDLE / "gpu-sshd.tar.xz") as packed, tarball.open("wb") as plain:
            shutil.copyfileobj(packed, plain, 1 << 20)
        tarball.chmod(0o644)
        made.import_rootfs(tarball, hostroot.SSHD_IMAGE)
        tarball.unlink()
    return made


@pytest.fixture(scope="module")
def data_mount(account: Account) -> Path:
    """The nosuid,nodev data_root rootless_install.sh mounted before the account's first podman call."""
    problem = storage.mount_problem(DATA_MOUNT)
    if problem is not None or DATA_MOUNT.stat().st_uid != account.uid:
        why = problem or f"not owned by {account.name}"
        pytest.skip(f"{DATA_MOUNT}: {why} (tests/gpu/rootless_install.sh mounts it)")
    return DATA_MOUNT


@pytest.fixture(scope="module")
def radicale() -> Iterator[servers.CalendarServer]:
    with servers.running(servers.radicale) as server:
        yield server


def test_the_installed_wheel_runs_a_rootless_gpu_booking(account: Account, data_mount: Path, engine: Engine,
                                                         radicale: servers.CalendarServer,
                                                         host_gpus: tuple[Gpu, ...]) -> None:
    results = Path(os.environ.get("GPUBOOK_GPU_RESULTS", "/tmp/install-gpu-results"))  # noqa: S108
    results.mkdir(parents=True, exist_ok=True)
    folder = Path(account.home) / f"install-test-{int(time.time())}"
    folder.mkdir()
    cudacheck = (hostroot.BUNDLE / "cudacheck").read_bytes()
    two = len(host_gpus) >= 2
    users = ["alice", "bob"] if two else ["alice"]
    keys = {user: paramiko.ECDSAKey.generate(bits=256) for user in users}
    calendar = radicale.new_calendar()
    templates = folder / "templates"
    templates.mkdir()
    (templates / f"{hostroot.SSHD_TEMPLATE}.toml").write_text(hostroot.SSHD_TEMPLATE_TOML)
    data = data_mount / folder.name
    data.mkdir()
    (folder / "data").symlink_to(data)
    config = write_config(folder, str(calendar.url), keys=keys, gpus=len(host_gpus), poll_seconds=60,
                          warn_minutes=0.1, template=hostroot.SSHD_TEMPLATE, templates_dir=templates,
                          engine_lines=(f"ulimits = {json.dumps(list(hostroot.ULIMITS))}", f'memory = "{MEMORY}"'))
    assert "network" not in config.read_text(), "the default network must be under test"
    subprocess.run(["chown", "-R", f"{account.uid}:{account.gid}", str(folder), str(data)], check=True)
    start = (datetime.now(UTC) + timedelta(seconds=21)).replace(microsecond=0)
    bookers = [Booker("gpu-a@install", "alice", keys["alice"], hog=not two)]
    if two:
        bookers.append(Booker("gpu-b@install", "bob", keys["bob"], hog=True))
    for one in bookers:
        book(calendar, one.booking_id, user=one.user, start=start, end=start + timedelta(seconds=LENGTH_SECONDS),
             gpus="1", description=f"template: {hostroot.SSHD_TEMPLATE}\n")
    log = folder / "daemon.log"
    with log.open("ab") as out:  # root moves the shell into the leaf, then it becomes the account
        daemon = subprocess.Popen(
            ["sh", "-c", f'echo $$ > {DAEMON_LEAF}/cgroup.procs && exec "$@"', "sh",
             *account.argv(str(account.venv / "bin" / "gpubook"), "run", "--config", str(config))],
            stdout=out, stderr=out, stdin=subprocess.DEVNULL, cwd=account.home)
    figures: list[Figure] = []
    facts: dict[str, object] = {"gpubook": gpubook.__version__, "gpubook_from": str(Path(gpubook.__file__).parent)}
    try:
        facts |= daemon_facts(daemon.pid, account)
        with ThreadPoolExecutor(len(bookers)) as pool:
            served = list(pool.map(lambda one: serve(one, radicale, calendar.url, engine, start, cudacheck,
                                                     host_gpus, results, log), bookers))
        figures = [figure for figure, _ in served]
        # Issue 41, items 2-3: the admin's views from root's shell (outside the daemon's leaf) while both run.
        views = admin_views(account, config, [one.booking_id for one in bookers])
        facts["admin_views"] = views
        quiet = next((client for (_, client), one in zip(served, bookers, strict=True) if not one.hog), None)
        hogged = [figure for figure in figures if figure.hog]
        assert len(hogged) == 1
        facts["after_hog"] = survivors(quiet, [c for (_, c), one in zip(served, bookers, strict=True) if one.hog][0],
                                       daemon)
        for _, client in served:
            client.close()
        end = start + timedelta(seconds=LENGTH_SECONDS)
        for one in bookers:
            wait_for(f"{one.booking_id}: the stop at the end",
                     lambda one=one: engine.inspect(container_name(one.booking_id)) is None,
                     timeout=max(0.0, (end - datetime.now(UTC)).total_seconds()) + 45)
            assert datetime.now(UTC) >= end
            text = wait_for(f"{one.booking_id}: ended in the event",
                            lambda one=one: ended_text(description(calendar, one.booking_id)), timeout=30)
            facts[f"{one.booking_id} event at the end"] = text
        facts["stopped_at_end"] = True
        assert daemon.poll() is None, log.read_text()[-3000:]
        check_admin_views(views, account.name, [one.booking_id for one in bookers])
    finally:
        daemon.terminate()
        try:
            daemon.wait(timeout=30)
        except subprocess.TimeoutExpired:
            daemon.kill()
        for one in bookers:
            engine.stop(container_name(one.booking_id), 0)
        report(figures, facts, host_gpus, results, log)


def admin_views(account: Account, config: Path, booking_ids: list[str]) -> dict[str, object]:
    """`gpubook doctor` and `gpubook status` as install.md's step 12 runs them (as the account, from
    root's shell: this test's cgroup, not the daemon's leaf), and `status` as root itself."""
    gpubook_binary = str(account.venv / "bin" / "gpubook")
    seen: dict[str, object] = {"cgroup_of_the_shell": Path("/proc/self/cgroup").read_text().strip()}
    for name, argv in (("doctor", account.argv(gpubook_binary, "doctor", "--config", str(config))),
                       ("status_as_account", account.argv(gpubook_binary, "status", "--config", str(config))),
                       ("status_as_root", [gpubook_binary, "status", "--config", str(config)])):
        done = subprocess.run(argv, capture_output=True, text=True, timeout=180, check=False, cwd="/")
        seen[name] = {"exit": done.returncode, "stdout": done.stdout, "stderr": done.stderr[-2000:]}
    return seen


def check_admin_views(views: dict[str, object], account_name: str, booking_ids: list[str]) -> None:
    """Doctor exits 0 with the limits enforced; neither status shows a limits problem; root's status
    says whose engine it is and lists the bookings as the daemon's last pass saw them."""
    assert "/gpubook/daemon" not in str(views["cgroup_of_the_shell"]), views["cgroup_of_the_shell"]
    doctor, mine, roots = (views[name] for name in ("doctor", "status_as_account", "status_as_root"))
    assert isinstance(doctor, dict) and isinstance(mine, dict) and isinstance(roots, dict)
    lines = doctor["stdout"].splitlines()
    assert doctor["exit"] == 0 and not [line for line in lines if line.startswith("FAIL")], doctor
    limits = [line for line in lines if line.startswith(("ok    engine limits", "WARN  engine limits"))]
    assert len(limits) == 1 and limits[0].startswith("ok") and "NOT enforced" not in limits[0], doctor
    for shown in (mine, roots):
        assert shown["exit"] == 0, shown
        assert "resource limits:" not in shown["stdout"] and "NOT enforced" not in shown["stdout"], shown
        assert all(booking in shown["stdout"] for booking in booking_ids), shown
    assert f"of {account_name}, the daemon's account" in roots["stdout"], roots


def ended_text(text: str) -> str | None:
    return text if "ended:" in text else None


def daemon_facts(pid: int, account: Account) -> dict[str, object]:
    """Who the daemon runs as and where: read from /proc once it has exec'd gpubook."""
    def exec_done() -> bool:  # sh, setpriv and env exec in turn; then python runs the venv's gpubook
        try:
            first = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0]
        except OSError:
            return False
        return b"python" in first
    wait_for("the daemon's exec of gpubook", exec_done, timeout=20, interval=0.02)
    status = Path(f"/proc/{pid}/status").read_text()
    uid = int(re.search(r"^Uid:\s+(\d+)", status, re.MULTILINE).group(1))  # type: ignore[union-attr]
    assert uid == account.uid, status
    cgroup = Path(f"/proc/{pid}/cgroup").read_text().strip()
    assert cgroup == "0::/gpubook/daemon", cgroup
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    return {"daemon_uid": uid, "daemon_cgroup": cgroup, "daemon_argv": [a.decode() for a in argv if a]}


def serve(one: Booker, server: servers.CalendarServer, calendar_url: object, engine: Engine, start: datetime,
          cudacheck: bytes, every: Sequence[Gpu], results: Path, log: Path) -> tuple[Figure, paramiko.SSHClient]:
    calendar = server.client().calendar(url=calendar_url)
    while datetime.now(UTC) < start:
        time.sleep(0.01)
    line = wait_for(f"{one.booking_id}: the ssh line in the event",
                    lambda: RUNNING_LINE.search(description(calendar, one.booking_id)), timeout=90, interval=0.05)
    line_after = (datetime.now(UTC) - start).total_seconds()
    text = description(calendar, one.booking_id)
    pinned = KNOWN_HOSTS.search(text)
    assert pinned, f"no known_hosts line in the event:\n{text}"
    known_hosts = log.with_name(f"known_hosts-{one.user}")
    known_hosts.write_text(pinned.group(1) + "\n")
    port = int(line.group(1))
    client = wait_for(f"{one.booking_id}: SSH login as {one.user} with the event's known_hosts",
                      lambda: login(port, one.user, one.key, known_hosts), timeout=30, interval=0.02)
    login_after = (datetime.now(UTC) - start).total_seconds()
    info = engine.inspect(container_name(one.booking_id))
    assert info is not None and info.running and info.port == port, info
    assert len(info.gpus) == 1, info.gpus
    mine = [gpu for gpu in every if gpu.index in info.gpus]
    seen = booker.look(client, cudacheck=cudacheck, every=every)
    booker.assert_exactly(seen, mine=mine, every=every, booking_id=one.booking_id)
    status, limits = booker.run(client, LIMITS)
    assert status == 0, limits
    memory_max, pids_max = (int(word) for word in limits.split())
    assert (memory_max, pids_max) == (MEMORY_BYTES, PIDS), limits
    inspected = json.loads(subprocess.run([engine.binary, "inspect", container_name(one.booking_id)],  # type: ignore[attr-defined]
                                          capture_output=True, text=True, check=True).stdout)[0]
    host_pid = inspected["State"]["Pid"]
    container_cgroup = Path(f"/proc/{host_pid}/cgroup").read_text().strip()
    assert container_cgroup.startswith("0::/gpubook/"), container_cgroup  # in the delegated subtree
    network_mode = inspected["HostConfig"]["NetworkMode"]
    assert network_mode.startswith("slirp4netns"), network_mode
    hog: dict[str, object] = {}
    if one.hog:
        status, said = booker.run(client, HOG, timeout=180)
        kills = [int(n) for n in re.findall(r"oom_kill (\d+)", said)]
        hog = {"output": said, "oom_kill_before": kills[0] if kills else None,
               "oom_kill_after": kills[-1] if kills else None}
        assert "hog exit 137" in said, said  # SIGKILL from the cgroup's OOM killer
        assert len(kills) == 2 and kills[1] > kills[0], said
    figure = Figure(one.booking_id, one.user, tuple(info.gpus), round(line_after, 3), round(login_after, 3),
                    tuple(sorted(seen.smi_uuids)), seen.kernel_output.strip(), memory_max, pids_max,
                    container_cgroup, network_mode, hog)
    print(f"{one.booking_id}: ssh line {line_after:.3f} s after the start, login {login_after:.3f} s; "
          f"memory.max {memory_max}, pids.max {pids_max}, cgroup {container_cgroup}", flush=True)
    return figure, client


def login(port: int, user: str, key: paramiko.PKey, known_hosts: Path) -> paramiko.SSHClient | None:
    """The booker's login: only the host key the event pinned is accepted."""
    client = paramiko.SSHClient()
    client.load_host_keys(str(known_hosts))
    client.set_missing_host_key_policy(paramiko.RejectPolicy())
    try:
        client.connect("127.0.0.1", port=port, username=user, pkey=key, look_for_keys=False, allow_agent=False,
                       timeout=3, banner_timeout=3, auth_timeout=3)
    except (OSError, paramiko.SSHException, EOFError):
        client.close()
        return None
    return client


def survivors(quiet: paramiko.SSHClient | None, hogged: paramiko.SSHClient,
              daemon: subprocess.Popen[bytes]) -> dict[str, object]:
    """After the hog's kill: the other booking (or the hog's own session), the daemon, the host."""
    seen: dict[str, object] = {}
    if quiet is not None:
        status, said = booker.run(quiet, f"echo alive; cat {booker.OUTPUT}")
        assert status == 0 and "alive" in said and "kernel ok" in said, said
        seen["other_booking"] = said
    status, said = booker.run(hogged, "echo alive; grep -E '^(oom|oom_kill) ' /sys/fs/cgroup/memory.events")
    seen["hog_booking_session"] = said if status == 0 else f"exit {status}: {said}"
    if quiet is None:
        assert status == 0 and "alive" in said, said
    assert daemon.poll() is None, "the daemon died with the hog"
    seen["host_meminfo"] = " ".join(Path("/proc/meminfo").read_text().splitlines()[:3])
    return seen


def report(figures: Sequence[Figure], facts: dict[str, object], every: Sequence[Gpu], results: Path,
           log: Path) -> None:
    machine = (f"{len(every)} x {every[0].name or 'NVIDIA GPU'}, {platform.platform()}, {os.cpu_count()} cores, "
               f"rootless podman (runc, slirp4netns) as {ACCOUNT}, gpubook from its wheel")
    for figure in figures:
        print(f"figure: {json.dumps(asdict(figure))}")
    (results / "install-gpu-figures.json").write_text(json.dumps(
        {"machine": machine, "date": datetime.now(UTC).isoformat(timespec="seconds"),
         "figures": [asdict(f) for f in figures], "facts": facts}, indent=2, default=str))
    if log.exists():
        shutil.copy(log, results / "daemon.log")
