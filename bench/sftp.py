"""gpubook's SFTP service against the floor (OpenSSH's own sftp-server, no container), in one run.

    python bench/sftp.py                                  # as the daemon user: 1 GiB, 10,000 x 4 KiB, 3 repeats
    python bench/sftp.py --repeats 1 --size-mib 256 --network private host
    python bench/sftp.py --data-root /srv/disk/bench      # a real disk's folder (nosuid,nodev, as gpubook asks)

Every transfer is OpenSSH's `sftp -b` (batch; the client's key, known_hosts, StrictHostKeyChecking
=yes), timed from its start to its exit (connection set-up included, about 0.1 s): `put` and `get`
of one file of random bytes, `put -r` and `get -r` of one folder of small files. The sources, the
uploads and the downloads all lie on the same data root (default the tests' nosuid,nodev tmpfs).

The floor is a private `sshd` (/usr/sbin/sshd, run as this user on a free port, its own host key,
`Subsystem sftp /usr/lib/openssh/sftp-server`) on the same host and data root; the ratios and
the targets are against it. A second floor, the same sshd with `internal-sftp` (the SFTP server
inside the session's own process, as in gpubook's service; --no-internal-floor leaves it out),
tells the container's cost apart from that of sftp-server's own process. gpubook's service
is SftpService as the daemon starts it, measured per network: "private" is gpubook's default
(rootless podman: slirp4netns, rootlesskit port handler), "private-slirp" slirp4netns's own port
handler, "host" the host's network ([engine] network = "host"). Repeats interleave the targets,
their order rotated, so that the machine's load falls on each alike; medians are reported. A first
round (--warmup) is not counted: in this VM, memory touched for the first time is slow.

Then the service's footprint: RSS of the container's processes (`podman top NAME hpid`, VmRSS in
/proc/PID/status) idle and with one sftp session open, and CPU seconds (utime+stime in
/proc/PID/stat; this host has cgroup v1, so no per-container cpu.stat) over an idle interval;
podman's helpers (conmon, slirp4netns, rootlessport) are shown beside them.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.container_start import podman_engine  # noqa: E402
from gpubook.runtime import private  # noqa: E402
from gpubook.runtime.booking import ssh
from gpubook.runtime.data import sftp, storage
from gpubook.runtime.engines import Engine  # noqa: E402
from gpubook.runtime.templates.catalog import get_template  # noqa: E402
from gpubook.scheduler.hosts.sftp import SftpService, SftpSettings  # noqa: E402
from tests.kits import safe_data  # noqa: E402

MIB = 1 << 20
SSHD = Path("/usr/sbin/sshd")
SFTP_SERVER = Path("/usr/lib/openssh/sftp-server")
USER = "alice"
TARGETS = {"big": 1.10, "small": 1.25}  # service / floor time, at most


@dataclass(frozen=True)
class Target:
    """Where `sftp` logs in, and the remote folder the uploads go to."""

    label: str
    port: int
    user: str
    remote: str  # remote folder of the uploads
    local: Path  # the same folder seen from this host (to remove the uploads)
    known_hosts: Path
    unshare: bool  # uploads belong to subordinate ids: removed through `podman unshare`


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def run_sftp(target: Target, key: Path, commands: str, *, timeout: float = 1800) -> float:
    """Seconds one `sftp -b -` took to run `commands`; raises SystemExit when it failed."""
    argv = ["sftp", "-P", str(target.port), "-i", str(key), "-o", "IdentitiesOnly=yes", "-o", "BatchMode=yes",
            "-o", f"UserKnownHostsFile={target.known_hosts}", "-o", "StrictHostKeyChecking=yes",
            "-o", "ConnectTimeout=10", "-b", "-", f"{target.user}@127.0.0.1"]
    began = time.monotonic()
    done = subprocess.run(argv, input=commands, capture_output=True, text=True, timeout=timeout, check=False)
    took = time.monotonic() - began
    if done.returncode != 0:
        raise SystemExit(f"sftp to {target.label} failed ({done.returncode}) on {commands.strip()!r}: "
                         f"{done.stderr.strip()[-1000:]}")
    return took


def wait_ready(target: Target, key: Path) -> None:
    deadline = time.monotonic() + 30
    while True:
        try:
            run_sftp(target, key, "pwd\n", timeout=15)
            return
        except SystemExit:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.3)


def make_sources(folder: Path, *, size_mib: int, files: int, file_kib: int) -> tuple[Path, Path]:
    """One file of `size_mib` MiB and one folder of `files` files, random (incompressible) bytes."""
    big = folder / "big"
    with big.open("wb") as handle:
        chunk = os.urandom(MIB)
        for _ in range(size_mib):
            handle.write(chunk)
    small = folder / "small"
    small.mkdir()
    payload = os.urandom(file_kib * 1024)
    for number in range(files):
        (small / f"f{number:05d}").write_bytes(payload)
    return big, small


@contextmanager
def floor_sshd(folder: Path, *, public_key: str, remote: Path, subsystem: str) -> Iterator[Target]:
    """OpenSSH's sshd as this user on a free port, no container: the floor. `subsystem`:
    sftp-server (a process of its own beside the session, the issue's floor) or internal-sftp
    (in the session's own process, as in gpubook's service)."""
    if not SSHD.exists() or not SFTP_SERVER.exists():
        raise SystemExit(f"{SSHD} or {SFTP_SERVER} is missing: install them as root with "
                         "`apt-get install -y openssh-server openssh-sftp-server` (the floor needs them)")
    folder.mkdir()
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(folder / "host_key")], check=True)
    (folder / "authorized_keys").write_text(public_key + "\n")
    port = free_port()
    config = folder / "sshd_config"
    config.write_text("\n".join([
        f"Port {port}", "ListenAddress 127.0.0.1", f"HostKey {folder / 'host_key'}",
        f"AuthorizedKeysFile {folder / 'authorized_keys'}", f"PidFile {folder / 'sshd.pid'}",
        "AuthenticationMethods publickey", "PasswordAuthentication no", "KbdInteractiveAuthentication no",
        "UsePAM no", "StrictModes no", "DisableForwarding yes", "PermitTTY no", "LogLevel ERROR",
        f"Subsystem sftp {subsystem}", ""]))
    known_hosts = folder / "known_hosts"
    known_hosts.write_text(f"[127.0.0.1]:{port} {(folder / 'host_key.pub').read_text().strip()}\n")
    remote.mkdir()
    daemon = subprocess.Popen([str(SSHD), "-D", "-e", "-f", str(config)], stdin=subprocess.DEVNULL,
                              stdout=subprocess.DEVNULL, stderr=(folder / "sshd.log").open("wb"))
    try:
        label = "floor" if subsystem == str(SFTP_SERVER) else f"floor {subsystem}"
        yield Target(label=label, port=port, user=os.environ.get("USER") or os.getlogin(), remote=str(remote),
                     local=remote, known_hosts=known_hosts, unshare=False)
    finally:
        daemon.terminate()
        daemon.wait(timeout=10)


@contextmanager
def service(network: str, folder: Path, *, image: str, public_key: str) -> Iterator[tuple[Target, SftpService]]:
    """gpubook's SFTP service on `network`, as the daemon starts it, with one user."""
    engine: Engine = podman_engine(network)
    folder.mkdir()
    (folder / "etc").mkdir()
    data_root = folder / "data"
    data_root.mkdir(mode=0o755)
    port = free_port()
    settings = SftpSettings(port=port, listen="127.0.0.1", data_root=data_root, host_network=network == "host",
                            users=(sftp.SftpUser(USER, 2001, 2001, (public_key,)),))
    made = SftpService(engine=engine, settings=settings, etc_dir=folder / "etc", image=lambda: image,
                       name=f"gpubook-sftp-bench-{network}")
    try:
        status = made.check()
        if not status.running or status.problem is not None:
            raise SystemExit(f"the SFTP service on {network} did not start: {status.problem}")
        known_hosts = folder / "known_hosts"
        known_hosts.write_text(f"[127.0.0.1]:{port} {status.host_key}\n")
        yield Target(label=f"service {network}", port=port, user=USER, remote="input",
                     local=data_root / USER / "input", known_hosts=known_hosts, unshare=True), made
    finally:
        made.stop(grace=1)


def remove(path: Path, *, unshare: bool) -> None:
    if unshare:
        subprocess.run(["podman", "unshare", "rm", "-rf", "--", str(path)], capture_output=True, check=False)
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=unshare)
    else:
        path.unlink(missing_ok=True)


def transfer(target: Target, key: Path, kind: str, source: Path, downloads: Path, number: int) -> tuple[float, float]:
    """Upload then download `source` ("big": one file, "small": a folder): (up s, down s)."""
    remote = f"{target.remote}/{kind}-{number}"
    local = downloads / f"{kind}-{number}"
    recursive = "-r " if kind == "small" else ""
    up = run_sftp(target, key, f"put {recursive}{source} {remote}\n")
    os.sync()
    down = run_sftp(target, key, f"get {recursive}{remote} {local}\n")
    os.sync()
    if kind == "big" and local.stat().st_size != source.stat().st_size:
        raise SystemExit(f"{target.label}: the downloaded file has {local.stat().st_size} bytes")
    if kind == "small" and len(os.listdir(local)) != len(os.listdir(source)):
        raise SystemExit(f"{target.label}: {len(os.listdir(local))} files came back")
    remove(local, unshare=False)
    remove(target.local / f"{kind}-{number}", unshare=target.unshare)
    return up, down


def container_pids(name: str) -> list[int]:
    done = subprocess.run(["podman", "top", name, "hpid"], capture_output=True, text=True, check=True)
    return [int(line) for line in done.stdout.split()[1:]]


def helper_pids(name: str, port: int) -> list[int]:
    """podman's processes beside the container: conmon, slirp4netns, the port handler and its child."""
    done = subprocess.run(["podman", "inspect", "--format", "{{.State.ConmonPid}} {{.State.Pid}}", name],
                          capture_output=True, text=True, check=True)
    conmon, init = done.stdout.split()
    found = {int(conmon)}
    listeners = subprocess.run(["ss", "-Hltnp", f"sport = :{port}"], capture_output=True, text=True, check=False)
    for field in listeners.stdout.replace(",", " ").split():
        if field.startswith("pid="):
            found.add(int(field[4:]))
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if (argv[0].endswith(b"slirp4netns") and init.encode() in argv) or parent in found - {int(conmon)}:
            found.add(int(entry.name))
    return sorted(found - set(container_pids(name)))


def rss_kib(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total


def cpu_seconds(pids: list[int]) -> float:
    ticks = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            ticks += int(fields[11]) + int(fields[12])  # utime, stime
        except (OSError, ValueError, IndexError):
            pass
    return ticks / os.sysconf("SC_CLK_TCK")


@contextmanager
def open_session(target: Target, key: Path) -> Iterator[None]:
    """One sftp session logged in and idle until the block ends."""
    argv = ["sftp", "-P", str(target.port), "-i", str(key), "-o", "IdentitiesOnly=yes", "-o", "BatchMode=yes",
            "-o", f"UserKnownHostsFile={target.known_hosts}", "-o", "StrictHostKeyChecking=yes",
            "-b", "-", f"{target.user}@127.0.0.1"]
    client = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                              text=True)
    assert client.stdin is not None and client.stdout is not None
    try:
        client.stdin.write("pwd\n")
        client.stdin.flush()
        while "Remote working directory" not in client.stdout.readline():
            if client.poll() is not None:
                raise SystemExit(f"sftp to {target.label} ended before its session was open")
        time.sleep(0.5)  # sshd's session process settles
        yield
    finally:
        client.stdin.close()
        client.wait(timeout=10)


def footprint(services: dict[str, tuple[Target, SftpService]], key: Path, idle_seconds: float) -> list[str]:
    """RSS idle and with a session, and idle CPU over `idle_seconds` (all services at once)."""
    lines, before = [], {}
    pids = {network: (container_pids(made.name), helper_pids(made.name, target.port))
            for network, (target, made) in services.items()}
    time.sleep(2)
    for network, (inside, helpers) in pids.items():
        before[network] = (cpu_seconds(inside), cpu_seconds(helpers))
    time.sleep(idle_seconds)
    for network, (inside, helpers) in pids.items():
        used = (cpu_seconds(inside) - before[network][0], cpu_seconds(helpers) - before[network][1])
        target, made = services[network]
        idle = (rss_kib(inside), rss_kib(helpers))
        with open_session(target, key):
            now = container_pids(made.name)
            session = (rss_kib(now), rss_kib(helper_pids(made.name, target.port)))
        lines.append(f"service {network}: container RSS idle {idle[0] / 1024:.1f} MiB ({len(inside)} processes), "
                     f"one session open {session[0] / 1024:.1f} MiB ({len(now)} processes); idle CPU "
                     f"{used[0]:.2f} s over {idle_seconds:.0f} s; podman's helpers ({len(helpers)} processes) RSS "
                     f"{idle[1] / 1024:.1f} MiB idle, {session[1] / 1024:.1f} MiB with the session, "
                     f"idle CPU {used[1]:.2f} s")
    return lines


def median_line(label: str, values: list[float], size_mib: float) -> str:
    middle = statistics.median(values)
    return (f"{label}: median {middle:.2f} s ({size_mib / middle:.0f} MiB/s) over {len(values)}; each: "
            + ", ".join(f"{value:.2f}" for value in values))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=1024, help="size of the large file")
    parser.add_argument("--files", type=int, default=10_000, help="number of small files")
    parser.add_argument("--file-kib", type=int, default=4, help="size of each small file")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1,
                        help="rounds first run and not counted (a VM's fresh memory is slow at first touch)")
    parser.add_argument("--no-internal-floor", dest="internal_floor", action="store_false",
                        help="leave out the second floor: sshd with internal-sftp, no container")
    parser.add_argument("--idle-seconds", type=float, default=30)
    parser.add_argument("--network", nargs="+", default=["private", "private-slirp", "host"],
                        choices=["private", "private-slirp", "host"])
    parser.add_argument("--data-root", type=Path, default=safe_data.MOUNT,
                        help="folder (on a nosuid,nodev mount) under which everything is written")
    args = parser.parse_args()
    problem = storage.mount_problem(args.data_root)
    if problem is not None:
        raise SystemExit(f"--data-root {args.data_root}: {problem}")
    cache = private.default_cache_dir()
    image = ssh.build_rootfs_image(podman_engine("private"), get_template("debian-ssh"), cache_dir=cache)
    print(f"machine: Debian 12 VM, 2 cores, 24 GiB; {datetime.now(UTC):%Y-%m-%d %H:%M} UTC; "
          f"load before: {' '.join(f'{v:.2f}' for v in os.getloadavg())}", flush=True)
    base = Path(tempfile.mkdtemp(prefix="bench-sftp-", dir=args.data_root))
    base.chmod(0o755)
    times: dict[tuple[str, str, str], list[float]] = {}
    try:
        with ExitStack() as stack:
            work = base / "client"
            work.mkdir()
            key = work / "key"
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
            public_key = (work / "key.pub").read_text().strip()
            big, small = make_sources(work, size_mib=args.size_mib, files=args.files, file_kib=args.file_kib)
            downloads = work / "downloads"
            downloads.mkdir()
            floors = [str(SFTP_SERVER)] + (["internal-sftp"] if args.internal_floor else [])
            targets = [stack.enter_context(floor_sshd(base / f"floor-{number}", public_key=public_key,
                                                      remote=base / f"floor-data-{number}", subsystem=subsystem))
                       for number, subsystem in enumerate(floors)]
            services = {network: stack.enter_context(service(network, base / f"service-{network}", image=image,
                                                             public_key=public_key)) for network in args.network}
            targets += [target for target, _ in services.values()]
            for target in targets:
                wait_ready(target, key)
            sources = {"big": big, "small": small}
            for number in range(-args.warmup, args.repeats):  # rounds below 0 warm up, not counted
                for shift in range(len(targets)):
                    target = targets[(number + shift) % len(targets)]
                    login = run_sftp(target, key, "pwd\n")
                    if number >= 0:
                        times.setdefault((target.label, "login", "pwd"), []).append(login)
                for kind, source in sources.items():
                    for shift in range(len(targets)):
                        target = targets[(number + shift) % len(targets)]
                        up, down = transfer(target, key, kind, source, downloads, number)
                        if number < 0:
                            print(f"raw: warm-up {target.label} {kind} upload {up:.3f} s download {down:.3f} s",
                                  flush=True)
                            continue
                        times.setdefault((target.label, kind, "upload"), []).append(up)
                        times.setdefault((target.label, kind, "download"), []).append(down)
                        print(f"raw: repeat {number} {target.label} {kind} upload {up:.3f} s download {down:.3f} s",
                              flush=True)
            report(times, args, [target.label for target in targets])
            for line in footprint(services, key, args.idle_seconds):
                print(line)
    finally:
        remove(base, unshare=True)
    print(f"load after: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")


def report(times: dict[tuple[str, str, str], list[float]], args: argparse.Namespace, labels: list[str]) -> None:
    sizes = {"big": float(args.size_mib), "small": args.files * args.file_kib / 1024}
    names = {"big": f"1 file of {args.size_mib} MiB", "small": f"{args.files} files of {args.file_kib} KiB"}
    for label in labels:
        logins = times[(label, "login", "pwd")]
        print(f"login and pwd alone (in every figure below), {label}: median {statistics.median(logins):.2f} s; "
              "each: " + ", ".join(f"{value:.2f}" for value in logins))
    for kind in ("big", "small"):
        for way in ("upload", "download"):
            for label in labels:
                print(median_line(f"{way} {names[kind]}, {label}", times[(label, kind, way)], sizes[kind]))
    def median(label: str, kind: str, way: str) -> float:
        return statistics.median(times[(label, kind, way)])

    for label in (label for label in labels if label.startswith("service")):
        for kind in ("big", "small"):
            for way in ("upload", "download"):
                ratio = median(label, kind, way) / median("floor", kind, way)
                verdict = "met" if ratio <= TARGETS[kind] else "NOT met"
                other = "".join(f"; / {floor}: {median(label, kind, way) / median(floor, kind, way):.2f}"
                                for floor in labels if floor.startswith("floor "))
                print(f"{label} / floor, {way} {names[kind]}: {ratio:.2f} (target <= {TARGETS[kind]:.2f}: {verdict})"
                      + other)


if __name__ == "__main__":
    main()
