"""A real Slurm cluster made by the tests: munge, slurmctld and two slurmd "nodes" on this machine.

Debian 12's slurm-wlm 22.05 and munge, started by hand under a private folder (no systemd unit,
no /etc/slurm change). Each slurmd runs in its own network namespace (ip netns + a veth pair to
the root namespace) with its own NodeName and NodeAddr, as on a cluster of separate machines;
it is entered with `nsenter --net` rather than `ip netns exec`, which mounts a fresh /sys and
so hides /sys/fs/cgroup (slurmd 22.05 will not start without it). slurmctld listens in the root
namespace on an address of a link of its own (a veth pair: this kernel has no dummy module) that
every node routes to. GPUs are GRES on placeholder device files (null devices; Slurm drops a
GPU without a File, and AutoDetect is off): no GPU is needed, Slurm still counts, reserves and
hands out gres/gpu (CUDA_VISIBLE_DEVICES in a job). Process tracking is proctrack/linuxproc
with task/none: this machine has hybrid cgroups, and confinement to GPUs needs no cgroup here.
Without slurmdbd gres/gpu cannot be an accounting TRES (slurmctld refuses to start).

SlurmUser is the unprivileged account the daemon runs as (`slurm_user`): slurmctld runs as that
account, so it may create, update and delete reservations without root. slurmd runs as root (it
starts jobs as their owners). Making it needs root (namespaces, slurmd); CI runs as root.
Everything is undone by `stop()`: daemons ended by their process ids, namespaces and links
deleted, the folder removed.

Real-GPU mode (`make(real_gpus=N)`, tests/gpu/test_slurm_gpu.py on the GPU host): one node, the
host itself (NodeAddr 127.0.0.1, no network namespace: that host has no `ip`), whose GRES gpu are
the host's REAL device files `/dev/nvidia[0-N-1]` (AutoDetect still off: gres.conf names them),
so Slurm hands out the host's GPUs by their minor numbers.
"""

from __future__ import annotations

import fcntl
import os
import pwd
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

SBIN = Path("/usr/sbin")
CGROUP_V2 = Path("/sys/fs/cgroup/cgroup.controllers")  # exists where /sys/fs/cgroup is cgroup v2 alone
# Seconds a node may leave slurmctld's pings unanswered before it is DOWN and its jobs are killed
# (NODE_FAIL, no output): 30 (the old value) can pass on a loaded machine's first run; no test waits
# for a node to time out (a failed node is set DOWN with scontrol).
SLURMD_TIMEOUT = 300
# The account the clusters' SlurmUser (and so the daemon and its jobs) runs as: each test run its own,
# so that runs side by side (a CI run, a helper's) never share a podman store or a data folder.
DEFAULT_USER = os.environ.get("GPUBOOK_SLURM_TEST_USER", "gpubook-test")
# Held while a cluster picks its network and ports, so that two clusters made at once on this machine
# (a CI run's and another's) never pick the same subnet, link names or ports.
LOCK = Path("/run/gpubook-slurm-kit.lock")


def available(*, real_gpus: bool = False) -> str | None:
    """Why no test cluster can be made here (None: it can); `real_gpus`: the one-node GPU-host mode,
    which needs no `ip`."""
    if os.geteuid() != 0:
        return "making a Slurm test cluster needs root (network namespaces, slurmd)"
    for program in ("slurmctld", "slurmd", "munged", "scontrol", *(() if real_gpus else ("ip",))):
        if shutil.which(program, path=f"{SBIN}:/usr/bin:/bin") is None:
            return f"{program} is not installed (apt-get install slurmctld slurmd slurm-client munge)"
    return None


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@contextmanager
def _machine_lock() -> Iterator[None]:
    with LOCK.open("a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(held, fcntl.LOCK_UN)


def _unused_network() -> tuple[str, int]:
    """A tag (link and namespace names) and a 10.OCTET.0.0/16 subnet no other cluster here uses: an
    address taken twice would route one cluster's nodes to another's slurmctld."""
    addresses = subprocess.run(["ip", "-o", "addr", "show"], capture_output=True, text=True, check=False).stdout
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=False).stdout
    namespaces = {p.name for p in Path("/run/netns").iterdir()} if Path("/run/netns").is_dir() else set()
    for _ in range(200):
        tag, octet = secrets.token_hex(2), 100 + secrets.randbelow(150)
        if (f" 10.{octet}." not in addresses and f"gbs{tag}" not in links
                and not any(n.startswith(f"gbs{tag}") for n in namespaces)):
            return tag, octet
    raise RuntimeError("no free 10.x subnet for a test cluster: 200 tries found each taken")


def _run(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True, text=True, timeout=30)


@dataclass(frozen=True)
class Node:
    name: str
    address: str  # its address inside its namespace
    netns: str  # "": the host's own network (real-GPU mode)
    gpus: int


@dataclass
class Cluster:
    """One running test cluster: its folder, config file and nodes."""

    root: Path
    conf: Path
    user: str
    nodes: tuple[Node, ...]
    partition: str
    gpu_type: str
    gpu_files: str = ""  # real-GPU mode: the host's device files ("/dev/nvidia[0-1]"); "": placeholders
    proctrack: str = "linuxproc"  # "cgroup": each job a cgroup whose processes end with it (the usual setting)
    prolog: str = ""  # slurm.conf's Prolog, run by slurmd as root before a job's first step ("": none)
    _processes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    _links: list[str] = field(default_factory=list)
    _namespaces: list[str] = field(default_factory=list)

    @property
    def env(self) -> dict[str, str]:
        """What a Slurm client (scontrol, sbatch) needs to find this cluster."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def scontrol(self, *args: str, as_user: bool = True) -> str:
        """scontrol run as the Slurm user (as the daemon would), its output; raises on failure."""
        argv = ["scontrol", *args]
        if as_user and os.geteuid() == 0:
            argv = ["runuser", "-u", self.user, "--", *argv]
        done = subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=30, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(args)}: {done.stderr.strip() or done.stdout.strip()}")
        return done.stdout

    def log(self, name: str) -> str:
        path = self.root / "log" / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    # -- the daemons -------------------------------------------------------------------------

    def start_slurmctld(self) -> None:
        self._processes["slurmctld"] = subprocess.Popen(
            [str(SBIN / "slurmctld"), "-D", "-i", "-f", str(self.conf)], user=self.user, group=self.user,
            extra_groups=[],
            env=self.env, stdout=subprocess.DEVNULL, stderr=(self.root / "log" / "slurmctld.out").open("wb"))
        self._wait(lambda: self._answers(), "slurmctld answering `scontrol ping`", "slurmctld")

    def stop_slurmctld(self, *, kill: bool = False) -> None:
        self._end("slurmctld", kill=kill)

    def start_slurmd(self, node: Node) -> None:
        key = f"slurmd-{node.name}"
        enter = ["nsenter", f"--net=/run/netns/{node.netns}"] if node.netns else []
        self._processes[key] = subprocess.Popen(
            [*enter, str(SBIN / "slurmd"), "-D", "-N", node.name, "-f", str(self.conf)],
            env=self.env, stdout=subprocess.DEVNULL, stderr=(self.root / "log" / f"{key}.out").open("wb"))

    def wait_nodes_idle(self, timeout: float = 30) -> None:
        def idle() -> bool:
            out = self.scontrol("show", "node", "--oneliner")
            return all(f"NodeName={n.name} " in out for n in self.nodes) and out.count("State=IDLE") >= len(
                self.nodes)
        self._wait(idle, "every node IDLE", "slurmctld", timeout)

    def _answers(self) -> bool:
        try:
            return "UP" in self.scontrol("ping")
        except RuntimeError:
            return False

    def _wait(self, check: object, what: str, log: str, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if callable(check) and check():
                return
            if any(p.poll() is not None for p in self._processes.values()):
                dead = [k for k, p in self._processes.items() if p.poll() is not None]
                said = "".join(f"\n{k} log:\n{self.log(k)[-2000:]}{self._stderr(k)}" for k in dead if k != log)
                raise RuntimeError(f"{', '.join(dead)} ended while waiting for {what}; "
                                   f"{log} log:\n{self.log(log)[-3000:]}{said}")
            time.sleep(0.2)
        raise RuntimeError(f"the test cluster did not reach {what} in {timeout:.0f} s; "
                           f"{log} log:\n{self.log(log)[-3000:]}")

    def _stderr(self, key: str) -> str:
        path = self.root / "log" / f"{key}.out"
        text = path.read_text(errors="replace")[-1500:] if path.exists() else ""
        return f"\n{key} stderr:\n{text}" if text else ""

    def _end(self, key: str, *, kill: bool = False) -> None:
        process = self._processes.pop(key, None)
        if process is None or process.poll() is not None:
            return
        if kill:
            process.kill()
        else:
            process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=5)

    def stop(self) -> None:
        """Everything undone, even after a half-made start."""
        self._end_jobs()
        for key in sorted(self._processes, key=lambda k: k == "munged"):  # munge last
            self._end(key)
        for netns in self._namespaces:
            subprocess.run(["ip", "netns", "delete", netns], capture_output=True, check=False)
        for link in self._links:
            subprocess.run(["ip", "link", "delete", link], capture_output=True, check=False)
        shutil.rmtree(self.root, ignore_errors=True)


    def _end_jobs(self) -> None:
        """The jobs' processes (slurmstepd, srun, the gpubook steps): they outlive slurmd by design,
        so a test's cluster would leave them running (and a step's container) for the next tests.
        Podman's own processes started from a step are spared, as Slurm's process tracking
        (proctrack/linuxproc) spares them: the account's pause process holds the namespaces of all
        its containers (killed, every later podman command of the account fails), and a conmon is
        ended with its container (`podman rm`), never alone (its container would run on, unlisted)."""
        containers: set[str] = set()
        for _ in range(2):  # a step killed while slurmstepd starts another: look twice
            for pid, container in _pids_of(self):
                if container is not None:
                    containers.add(container)
                    continue
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.2)
        containers.update(c for _, c in _pids_of(self) if c is not None)
        if containers:
            podman_as(self.user, "rm", "--force", "--time=0", *sorted(containers))


def podman_as(user: str, *args: str) -> int:
    """podman run as `user` (root's tests), its exit status."""
    account = pwd.getpwnam(user)
    return subprocess.run(["runuser", "-u", user, "--", "env", f"HOME={account.pw_dir}",
                           f"XDG_RUNTIME_DIR=/run/user/{account.pw_uid}", "podman", *args],
                          cwd="/tmp", capture_output=True, timeout=60).returncode


# Podman's processes that a step may start and that outlive it: they are podman's, not the job's.
PODMAN_OWN = frozenset({"catatonit", "conmon", "slirp4netns", "rootlessport", "rootlessport-child"})


def _pids_of(cluster: Cluster) -> list[tuple[int, str | None]]:
    """Processes whose environment names this cluster's slurm.conf, or whose command line its folder:
    (pid, None) for each of the job's own, (pid, container id) for a conmon; podman's pause
    process and the other processes of podman's (PODMAN_OWN) are left out."""
    marker, found = f"SLURM_CONF={cluster.conf}".encode(), []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
            command = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if marker not in environ and str(cluster.root).encode() not in command:
            continue
        argv = command.decode(errors="replace").split("\0")
        if b"_PODMAN_PAUSE=1" in environ or Path(argv[0]).name in PODMAN_OWN:
            if Path(argv[0]).name == "conmon" and "-c" in argv[:-1]:
                found.append((int(entry.name), argv[argv.index("-c") + 1]))
            continue
        found.append((int(entry.name), None))
    return found


def _slurm_conf(cluster: Cluster, *, host: str, ctl_address: str, ctl_port: int, slurmd_port: int) -> str:
    log = cluster.root / "log"
    prolog = f"\nProlog={cluster.prolog}" if cluster.prolog else ""
    nodes = "\n".join(
        f"NodeName={n.name} NodeAddr={n.address} CPUs=2 RealMemory=1000 Gres=gpu:{cluster.gpu_type}:{n.gpus} "
        "State=UNKNOWN" for n in cluster.nodes)
    names = ",".join(n.name for n in cluster.nodes)
    return f"""\
ClusterName=gpubooktest
SlurmctldHost={host}({ctl_address})
SlurmctldPort={ctl_port}
SlurmdPort={slurmd_port}
SlurmUser={cluster.user}
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={cluster.root}/munge/munge.socket
StateSaveLocation={cluster.root}/state
SlurmdSpoolDir={cluster.root}/spool/%n
SlurmctldPidFile={cluster.root}/run/slurmctld.pid
SlurmdPidFile={cluster.root}/run/slurmd-%n.pid
SlurmctldLogFile={log}/slurmctld.log
SlurmdLogFile={log}/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/{cluster.proctrack}
TaskPlugin=task/none{prolog}
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
MpiDefault=none
SwitchType=switch/none
ReturnToService=2
GresTypes=gpu
PlugStackConfig={cluster.root}/plugstack.conf
SlurmctldTimeout=30
SlurmdTimeout={SLURMD_TIMEOUT}
InactiveLimit=0
MailProg=/bin/true
MinJobAge=60
KillWait=5
{nodes}
PartitionName={cluster.partition} Nodes={names} Default=YES MaxTime=INFINITE State=UP
"""


def _gres_conf(cluster: Cluster) -> str:
    lines = ["AutoDetect=off"]
    lines += [f"NodeName={n.name} Name=gpu Type={cluster.gpu_type} "
              f"File={cluster.gpu_files or f'{cluster.root}/dev/{n.name}/nvidia[0-{n.gpus - 1}]'}"
              for n in cluster.nodes]
    return "\n".join(lines) + "\n"


def make(*, user: str | None = None, nodes: int = 2, gpus: int = 4, gpu_type: str = "a100",
         real_gpus: int = 0, proctrack: str = "linuxproc", prolog: str = "") -> Cluster:
    """A started cluster (call `stop()`); raises with the daemons' logs when it does not come up.
    `real_gpus`: one node, this host, with its GPUs /dev/nvidia0 ... (the GPU host's mode); `user`:
    the SlurmUser (default: GPUBOOK_SLURM_TEST_USER, else gpubook-test); `proctrack`: "cgroup" for
    jobs tracked by cgroup (on this machine's cgroup v1 freezer); `prolog`: slurm.conf's Prolog."""
    user = user or DEFAULT_USER
    tag, octet = secrets.token_hex(2), 100 + secrets.randbelow(150)
    root = Path(tempfile.mkdtemp(prefix=f"gpubook-slurm-{tag}-"))
    root.chmod(0o755)
    if real_gpus:
        node_list: tuple[Node, ...] = (Node(name="node1", address="127.0.0.1", netns="", gpus=real_gpus),)
        gpu_files = "/dev/nvidia0" if real_gpus == 1 else f"/dev/nvidia[0-{real_gpus - 1}]"
    else:
        node_list = tuple(Node(name=f"node{i}", address=f"10.{octet}.{i}.2", netns=f"gbs{tag}n{i}", gpus=gpus)
                          for i in range(1, nodes + 1))
        gpu_files = ""
    cluster = Cluster(root=root, conf=root / "slurm.conf", user=user, nodes=node_list, partition="gpu",
                      gpu_type=gpu_type, gpu_files=gpu_files, proctrack=proctrack, prolog=prolog)
    try:
        with _machine_lock():  # released once its addresses and ports are taken (its daemons answer)
            if not real_gpus:
                tag, octet = _unused_network()
                cluster.nodes = tuple(Node(name=n.name, address=f"10.{octet}.{i}.2", netns=f"gbs{tag}n{i}",
                                           gpus=n.gpus) for i, n in enumerate(cluster.nodes, start=1))
            _make(cluster, tag=tag, octet=octet)
    except BaseException:
        cluster.stop()
        raise
    return cluster


def _make(cluster: Cluster, *, tag: str, octet: int) -> None:
    account = pwd.getpwnam(cluster.user)
    root = cluster.root
    for sub in ("state", "log", "run", "spool", "munge"):
        (root / sub).mkdir()
    for sub in ("state", "log", "run"):
        os.chown(root / sub, account.pw_uid, account.pw_gid)
    (root / "munge").chmod(0o755)
    key = root / "munge" / "munge.key"
    key.write_bytes(secrets.token_bytes(1024))
    key.chmod(0o400)
    (root / "plugstack.conf").write_text("")
    for node in () if cluster.gpu_files else cluster.nodes:  # Slurm drops a GPU without a device file:
        (root / "dev" / node.name).mkdir(parents=True)  # placeholders (null devices)
        for index in range(node.gpus):
            os.mknod(root / "dev" / node.name / f"nvidia{index}", 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    if cluster.gpu_files:  # one node, this host, its own network
        ctl_address = "127.0.0.1"
    else:
        ctl_address = _make_network(cluster, tag=tag, octet=octet)
    _configure_and_start(cluster, ctl_address=ctl_address, key=key)


def _make_network(cluster: Cluster, *, tag: str, octet: int) -> str:
    """A link carrying slurmctld's address (returned), one namespace + veth per node."""
    ctl_address = f"10.{octet}.0.1"
    dummy = f"gbs{tag}c"
    _run("ip", "link", "add", dummy, "type", "veth", "peer", "name", f"gbs{tag}d")  # no dummy module here
    cluster._links.append(dummy)
    _run("ip", "addr", "add", f"{ctl_address}/32", "dev", dummy)
    _run("ip", "link", "set", dummy, "up")
    _run("ip", "link", "set", f"gbs{tag}d", "up")
    forward = Path("/proc/sys/net/ipv4/ip_forward")
    if forward.read_text().strip() != "1":  # each node has a subnet of its own: they reach each other through here
        forward.write_text("1\n")  # (a fresh Debian 12 has it off; Docker's daemon turns it on for good too)
    for i, node in enumerate(cluster.nodes, start=1):
        outside, inside = f"gbs{tag}v{i}", f"gbs{tag}p{i}"
        _run("ip", "netns", "add", node.netns)
        cluster._namespaces.append(node.netns)
        _run("ip", "link", "add", outside, "type", "veth", "peer", "name", inside)
        cluster._links.append(outside)
        _run("ip", "link", "set", inside, "netns", node.netns)
        _run("ip", "addr", "add", f"10.{octet}.{i}.1/24", "dev", outside)
        _run("ip", "link", "set", outside, "up")
        ns = ("ip", "netns", "exec", node.netns)
        _run(*ns, "ip", "addr", "add", f"{node.address}/24", "dev", inside)
        _run(*ns, "ip", "link", "set", inside, "up")
        _run(*ns, "ip", "link", "set", "lo", "up")
        _run(*ns, "ip", "route", "add", "default", "via", f"10.{octet}.{i}.1")
    return ctl_address


def _configure_and_start(cluster: Cluster, *, ctl_address: str, key: Path) -> None:
    root = cluster.root
    _write_conf(cluster, ctl_address=ctl_address)
    (root / "gres.conf").write_text(_gres_conf(cluster))
    if cluster.proctrack == "cgroup" and not CGROUP_V2.exists():
        (root / "cgroup.conf").write_text("CgroupPlugin=cgroup/v1\nCgroupAutomount=yes\n")
    elif CGROUP_V2.exists():  # slurmd 22.05 always starts its cgroup plugin; without systemd (the GPU host)
        # v2 needs IgnoreSystemd (plain mkdir instead of a scope asked of systemd over dbus) and system.slice
        (root / "cgroup.conf").write_text("CgroupPlugin=autodetect\nIgnoreSystemd=yes\n")
        (CGROUP_V2.parent / "system.slice").mkdir(exist_ok=True)
    for path in (cluster.conf, root / "gres.conf", root / "plugstack.conf", root / "cgroup.conf"):
        if path.exists():
            path.chmod(0o644)
    cluster._processes["munged"] = subprocess.Popen(
        ["munged", "-F", "--force", f"--socket={root}/munge/munge.socket", f"--key-file={key}",
         f"--pid-file={root}/munge/munged.pid", f"--log-file={root}/log/munged.log",
         f"--seed-file={root}/munge/munged.seed"],
        stdout=subprocess.DEVNULL, stderr=(root / "log" / "munged.out").open("wb"))
    cluster._wait(lambda: (root / "munge" / "munge.socket").exists(), "munge's socket", "munged", 10)
    for attempt in range(3):  # a port free when picked may be taken before slurmctld binds it (by another run)
        try:
            cluster.start_slurmctld()
            break
        except RuntimeError:
            if attempt == 2 or "Address already in use" not in cluster.log("slurmctld") + cluster._stderr("slurmctld"):
                raise
            cluster._processes.pop("slurmctld", None)
            (root / "log" / "slurmctld.log").unlink(missing_ok=True)
            _write_conf(cluster, ctl_address=ctl_address)
    for node in cluster.nodes:
        (root / "spool" / node.name).mkdir()
        cluster.start_slurmd(node)
    cluster.wait_nodes_idle()


def _write_conf(cluster: Cluster, *, ctl_address: str) -> None:
    cluster.conf.write_text(_slurm_conf(cluster, host=socket.gethostname().split(".")[0], ctl_address=ctl_address,
                                        ctl_port=_free_port(), slurmd_port=_free_port()))
    cluster.conf.chmod(0o644)


@contextmanager
def running(**kwargs: object) -> Iterator[Cluster]:
    cluster = make(**kwargs)  # type: ignore[arg-type]
    try:
        yield cluster
    finally:
        cluster.stop()
