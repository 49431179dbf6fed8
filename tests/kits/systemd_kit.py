"""A Debian 12 container booted with systemd as PID 1, for tests of gpubook's user unit.

No systemd runs as PID 1 on the test machine, so a user manager (`systemd --user`, started by
logind for a lingering account) can only run inside such a container. The image is made here with
mmdebstrap, its tarball cached under ~/.cache/gpubook/systemd keyed by the package list, and imported
by rootful podman (runc: crun fails on this machine). gpubook goes in from wheels built on the host
from this tree (no network inside); `gpubook setup` installs it for the account.
"""

from __future__ import annotations

import hashlib
import os
import resource
import secrets
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from gpubook.runtime.templates import overlay_image
from gpubook.runtime.templates.catalog import get_template

ROOT = Path(__file__).resolve().parents[2]
CACHE = Path.home() / ".cache" / "gpubook" / "systemd"
SUITE = "bookworm"
PACKAGES = ("systemd", "systemd-sysv", "dbus", "dbus-user-session", "libpam-systemd", "python3", "python3-venv",
            "podman", "uidmap", "slirp4netns", "runc", "fuse-overlayfs", "procps", "iproute2",
            "mmdebstrap")  # gpubook setup wants it for its image step (it then finds the tarball cached)
# podman's own system units: its API service fails on socket activation in a container (accept4 on
# a datagram socket), which would leave the boot "degraded"; nothing here uses them.
MASKED = ("podman.service", "podman.socket", "podman-restart.service", "podman-auto-update.service",
          "podman-auto-update.timer")
ACCOUNT = "gpubook"
DATA_ROOT = "/srv/gpubook"
WHEELS = "/wheels"
VENV = "/opt/gpubook/venv"  # where docs/guides/install.md puts it; setup points the unit's ExecStart at it
GPUBOOK = f"{VENV}/bin/gpubook"
ROOTFS = "/rootfs"  # the booking image's tarball, bound read-only
FEED_DIR = "/srv/feed"
FEED_PORT = 8765
LABEL = "gpubook-test=systemd"


def _run(argv: Sequence[str], *, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, check=False,
                          stdin=subprocess.DEVNULL)
    if check and done.returncode != 0:
        said = (done.stderr or done.stdout).strip()[-3000:]
        raise RuntimeError(f"{shlex.join(argv)} exited {done.returncode}: {said}")
    return done


def wait_for(what: str, probe: Callable[[], object], *, timeout: float, every: float = 0.5) -> object:
    """Poll `probe` until it gives something true; bounded, and the failure names what was awaited."""
    deadline = time.monotonic() + timeout
    while True:
        found = probe()
        if found:
            return found
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {timeout:g} s for {what}; last: {found!r}")
        time.sleep(every)


# -- the image ------------------------------------------------------------------------------------

def image_key() -> str:
    text = f"{SUITE} minbase {','.join(sorted(PACKAGES))} mask {','.join(MASKED)}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def image() -> str:
    """The systemd image's tag, made (mmdebstrap, about half a minute) and imported when missing."""
    tag = f"localhost/gpubook/test-systemd:{image_key()}"
    if _run(["podman", "image", "exists", tag], check=False).returncode == 0:
        return tag
    tarball = CACHE / f"{image_key()}.tar"
    if not tarball.is_file():
        CACHE.mkdir(parents=True, exist_ok=True)
        partial = tarball.with_suffix(".partial.tar")
        mask = " ".join(MASKED)
        _run(["mmdebstrap", "--mode=root", "--variant=minbase", "--quiet", "--include=" + ",".join(PACKAGES),
              f"--customize-hook=chroot \"$1\" systemctl mask {mask}", SUITE, str(partial)])
        partial.replace(tarball)
    _run(["podman", "import", "--change", 'CMD ["/sbin/init"]', str(tarball), tag])
    _forget_other_images(tag)
    return tag


def _forget_other_images(tag: str) -> None:
    """Images and tarballs of an earlier package list: one of each is kept, never more."""
    repository = tag.rsplit(":", 1)[0]
    listed = _run(["podman", "images", "--format", "{{.Repository}}:{{.Tag}}", "--filter", f"reference={repository}"])
    for other in set(listed.stdout.split()) - {tag}:
        _run(["podman", "rmi", other], check=False)
    for old in CACHE.glob("*.tar"):
        if old.name != f"{image_key()}.tar":
            old.unlink()


def booking_rootfs() -> Path:
    """The debian-ssh template's root file system tarball, where `gpubook templates build` caches it
    (~/.cache/gpubook/rootfs, named by its recipe), made here with mmdebstrap when missing: the
    booted container has no network, so its account gets this file in its own cache and
    `gpubook templates build debian-ssh` only imports it."""
    return overlay_image.rootfs_tarball(get_template("debian-ssh"), cache_dir=Path.home() / ".cache" / "gpubook")


def wheelhouse(folder: Path) -> Path:
    """gpubook's wheel built from this tree, with the wheels of everything it depends on."""
    constraints = ROOT / "constraints.txt"
    argv = [sys.executable, "-m", "pip", "wheel", "--quiet", "--wheel-dir", str(folder), str(ROOT)]
    if constraints.is_file():
        argv += ["--constraint", str(constraints)]
    _run(argv)
    folder.chmod(0o755)  # the account inside reads it through the bind mount
    for wheel in folder.iterdir():
        wheel.chmod(0o644)
    return folder


# -- the booted container -------------------------------------------------------------------------

def ulimits() -> list[str]:
    """Limits this machine lets runc set. It withholds CAP_SYS_RESOURCE, so podman's defaults
    (nofile 1048576, nproc 4194304) are refused ("error setting rlimit type 7: operation not
    permitted"); nproc above 32768 was refused as well (32768 is this kernel's pid_max; whether that
    is why was not found out)."""
    nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    nproc = resource.getrlimit(resource.RLIMIT_NPROC)[1]
    nofile = 65536 if nofile == resource.RLIM_INFINITY else min(nofile, 65536)
    nproc = 32768 if nproc == resource.RLIM_INFINITY else min(nproc, 32768)
    return ["--ulimit", f"nofile={nofile}:{nofile}", "--ulimit", f"nproc={nproc}:{nproc}"]


# What rootless podman inside the booted container (the daemon's bookings) needs of it:
NESTED = (
    # newuidmap is setuid root, and the kernel lets a process write another account's uid_map only
    # with CAP_SYS_ADMIN over it (map_write); without it: "newuidmap: write to uid_map failed".
    "--cap-add", "SYS_ADMIN",
    # A new /proc can be mounted only where no part of /proc is masked or read-only ("error mounting
    # proc ... operation not permitted").
    "--security-opt", "unmask=ALL",
    # Without a cgroup namespace the container sees its cgroup by the host's path, which runc then
    # cannot find under its own /sys/fs/cgroup ("stat /sys/fs/cgroup/systemd/...podman-N.scope").
    "--cgroupns=private",
    "--device", "/dev/net/tun",  # slirp4netns, the bookings' private network
)


@dataclass(frozen=True)
class Booted:
    """A running container whose PID 1 is systemd."""

    name: str

    def sh(self, script: str, *, user: str | None = None, timeout: float = 300,
           check: bool = True) -> subprocess.CompletedProcess[str]:
        if user:  # the account's podman uses the runtime folder its user manager has (logind made it)
            script = f"export XDG_RUNTIME_DIR=/run/user/$(id -u); {script}"
        argv = ["podman", "exec", *(["--user", user, "--workdir", f"/home/{user}"] if user else []), self.name,
                "bash", "-c", script]
        return _run(argv, timeout=timeout, check=check)

    def user_systemctl(self, *args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        """systemctl of the account's user manager, from root, as an admin would reach it."""
        return _run(["podman", "exec", self.name, "systemctl", "--user", f"--machine={ACCOUNT}@.host", *args],
                    timeout=timeout, check=check)

    def unit(self, *properties: str) -> dict[str, str]:
        shown = self.user_systemctl("show", "gpubook.service", *(f"--property={p}" for p in properties))
        return dict(line.split("=", 1) for line in shown.stdout.splitlines() if "=" in line)

    def journal(self) -> str:
        """The user unit's journal lines (root reads the account's user journal)."""
        return self.sh(f"journalctl --no-pager -o cat _SYSTEMD_USER_UNIT=gpubook.service _UID=$(id -u {ACCOUNT})",
                       check=False).stdout


@dataclass(frozen=True)
class Timing:
    boot_seconds: float  # podman run until `systemctl is-system-running` says running


@contextmanager
def booted(*, wheels: Path, extra: Sequence[str] = ()) -> Iterator[tuple[Booted, Timing]]:
    """Boot the image; the container is removed (forcibly, at once) however the test ends."""
    name = f"gpubook-systemd-{secrets.token_hex(4)}"
    rootfs = booking_rootfs()
    # /home on the host's file system: the account's rootless podman keeps its overlay store there,
    # and an overlay upper layer cannot sit on the container's own overlay root.
    homes = Path(tempfile.mkdtemp(prefix="gpubook-systemd-home-", dir="/var/tmp"))
    homes.chmod(0o755)
    argv = ["podman", "run", "--detach", "--runtime", "runc", "--systemd=always", "--name", name,
            "--label", LABEL, *ulimits(), *NESTED,
            "--volume", f"{wheels}:{WHEELS}:ro", "--volume", f"{rootfs}:{ROOTFS}/{rootfs.name}:ro",
            "--volume", f"{homes}:/home",
            *extra, image(), "/sbin/init"]
    started = time.monotonic()
    _run(argv, timeout=120)
    try:
        machine = Booted(name)
        # Until systemd listens, systemctl says nothing at all; then --wait waits for the boot's end.
        state = wait_for("systemd in the container to answer", lambda: machine.sh(
            "timeout 120 systemctl is-system-running --wait", check=False, timeout=150).stdout.strip(), timeout=150)
        if state != "running":
            failed = machine.sh("systemctl --failed --no-pager; journalctl -b -p warning --no-pager | tail -30",
                                check=False).stdout
            raise AssertionError(f"the container booted to {state!r}, not 'running':\n{failed}")
        yield machine, Timing(boot_seconds=time.monotonic() - started)
    finally:
        _run(["podman", "rm", "--force", "--time", "0", name], check=False, timeout=120)
        shutil.rmtree(homes, ignore_errors=True)


# -- the install: the admin's steps, then `gpubook setup` ---------------------------------------------

def create_account(machine: Booted) -> None:
    """The account before setup (setup finds it and says "already"): its cache must get the booking
    image's tarball before setup's image step, which then imports it instead of running mmdebstrap
    (the container has no network)."""
    machine.sh(f"useradd --create-home --shell /bin/bash {ACCOUNT}")
    tarball = booking_rootfs().name
    machine.sh(f"mkdir -p ~/.cache/gpubook/rootfs && cp {ROOTFS}/{tarball} ~/.cache/gpubook/rootfs/", user=ACCOUNT)


def install_venv(machine: Booted) -> None:
    """The wheel into /opt/gpubook/venv as root, from the bound wheels only (no index)."""
    machine.sh(f"python3 -m venv {VENV} && {VENV}/bin/pip install --quiet --no-index --find-links {WHEELS} gpubook")


def setup(machine: Booted, config: str) -> str:
    """`gpubook setup` as root, with `config` as the account's new config; its output."""
    subprocess.run(["podman", "exec", "--interactive", machine.name, "tee", "/root/gpubook.toml"],
                   input=config, capture_output=True, text=True, check=True, timeout=60)
    done = machine.sh(f"{GPUBOOK} setup --user {ACCOUNT} --data-root {DATA_ROOT} --config-from /root/gpubook.toml",
                      check=False, timeout=900)
    if done.returncode != 0:
        raise AssertionError(f"gpubook setup exited {done.returncode}:\n{done.stdout}{done.stderr}")
    return done.stdout


def install_dropin(machine: Booted, name: str, text: str) -> None:
    _write(machine, f".config/systemd/user/gpubook.service.d/{name}", text)
    machine.user_systemctl("daemon-reload")


def write_config(machine: Booted, text: str) -> None:
    _write(machine, ".config/gpubook/gpubook.toml", text)


def _write(machine: Booted, relative: str, text: str) -> None:
    """A file in the account's home, written by the account (its own folders, its own modes)."""
    path = f"/home/{ACCOUNT}/{relative}"
    _run(["podman", "exec", "--user", ACCOUNT, machine.name, "mkdir", "-p", os.path.dirname(path)])
    subprocess.run(["podman", "exec", "--interactive", "--user", ACCOUNT, machine.name, "tee", path],
                   input=text, capture_output=True, text=True, check=True, timeout=60)


def publish(machine: Booted, ics: str) -> None:
    """The feed's content, replaced."""
    _run(["podman", "exec", machine.name, "mkdir", "-p", FEED_DIR])
    subprocess.run(["podman", "exec", "--interactive", machine.name, "tee", f"{FEED_DIR}/lab.ics"],
                   input=ics, capture_output=True, text=True, check=True, timeout=60)


def serve_feed(machine: Booted, ics: str) -> str:
    """An ICS feed file served by Python's http.server (a transient system unit); its URL."""
    publish(machine, ics)
    machine.sh(f"systemd-run --unit=feed --property=WorkingDirectory={FEED_DIR} "
               f"python3 -m http.server {FEED_PORT} --bind 127.0.0.1")
    url = f"http://127.0.0.1:{FEED_PORT}/lab.ics"
    wait_for("the feed server", lambda: machine.sh(
        f"python3 -c 'import urllib.request; urllib.request.urlopen(\"{url}\", timeout=5)'",
        check=False).returncode == 0, timeout=60)
    return url


def leftovers() -> list[str]:
    """Containers of these tests still there (none may be, after a test)."""
    return _run(["podman", "ps", "--all", "--filter", f"label={LABEL}", "--format", "{{.Names}}"]).stdout.split()
