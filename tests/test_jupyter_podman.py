"""JupyterLab in a real booking: reached by the booker through their SSH, by nobody else.

Rootless podman on the host network (the worst case: the container's loopback is the host's), a
Debian image with sshd and a real JupyterLab (made here: the debian-ssh image, then JupyterLab's wheels
installed offline from a wheelhouse that `pip download` fills once; both cached), started through
the host start path (booking.booking_spec + booking.start_booking). The booker forwards the socket with
OpenSSH's own `ssh -L` and asks JupyterLab's API with and without the token. Hostile: root in another
booking's container, on the same network, looks for a Jupyter server on every listening port and at
the socket's path; a host user's `ps` must not show the token; no TCP port listens as the booker.
"""

from __future__ import annotations

import secrets
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest
import requests

from gpubook.runtime.booking import jupyter
from gpubook.runtime.engines import Engine, container_name, engine_from
from gpubook.runtime.errors import EngineError
from gpubook.runtime.templates.catalog import Template, get_template
from gpubook.runtime.templates.overlay_image import build_rootfs_image
from gpubook.scheduler.commands.embedded import free_port
from tests.kits import safe_data
from tests.kits.daemon_kit import DaemonProcess, book, description, soon, try_login, wait_for, write_config
from tests.kits.engine_suite import BOOKER, BOOKER_UID, CACHE_DIR, PODMAN, Booking, Bookings, connect, run

pytestmark = [
    pytest.mark.podman,
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("podman") is None, reason="podman is not installed"),
]

LAB_VERSION = "4.2.5"
LAB_IMAGE = f"localhost/gpubook/test-jupyterlab:{LAB_VERSION}-on-debian-ssh"
PATH = "/opt/jupyter/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

# Run by root inside another booking's container (same host network): every listening TCP port is
# asked for Jupyter's API, and the socket's path is tried. Prints what it found, or "nothing".
SCAN = r"""
import socket, sys
found = []
ports = set()
for table in ("/proc/net/tcp", "/proc/net/tcp6"):
    for line in open(table).read().splitlines()[1:]:
        fields = line.split()
        if fields[3] == "0A":
            ports.add(int(fields[1].rsplit(":", 1)[1], 16))
for port in sorted(ports):
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
            s.settimeout(3)
            s.sendall(b"GET /api/status HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
            reply = s.recv(4096).decode("latin-1").lower()
    except OSError:
        continue
    if "tornado" in reply or "jupyter" in reply or '"started"' in reply:
        found.append(f"tcp {port}")
try:
    s = socket.socket(socket.AF_UNIX)
    s.connect(sys.argv[1])
    found.append("socket " + sys.argv[1])
except OSError:
    pass
print(" ".join(found) or "nothing")
"""


@pytest.fixture(scope="module")
def engine() -> Engine:
    return engine_from(**PODMAN, network="host")


def _present(engine: Engine, image: str) -> bool:
    try:
        engine.ensure_image(image)
    except EngineError:
        return False
    return True


def wheelhouse() -> Path:
    """JupyterLab's wheels for this Python (Debian 12's, as in the image), and pip's own (the image has
    no python3-venv, so no pip: pip runs from its wheel), downloaded once."""
    folder = CACHE_DIR / "wheels" / f"jupyterlab-{LAB_VERSION}-and-pip"
    if not (folder / ".complete").exists():
        partial = folder.with_name(folder.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--only-binary=:all:", "-d", str(partial),
                        f"jupyterlab=={LAB_VERSION}", "pip"], check=True, timeout=600)
        (partial / ".complete").touch()
        shutil.rmtree(folder, ignore_errors=True)
        partial.replace(folder)
    return folder


@pytest.fixture(scope="module")
def lab_image(engine: Engine, ssh_image: str) -> str:
    """Debian 12 with sshd, sudo and JupyterLab in /opt/jupyter (on PATH, as NGC's images have it): the
    debian-ssh image (its root file system made once for the whole run) with a venv made without pip
    and JupyterLab installed into it by pip run from its wheel, offline."""
    if _present(engine, LAB_IMAGE):
        return LAB_IMAGE
    wheels = wheelhouse()
    name = f"gpubook-test-jupyter-build-{secrets.token_hex(4)}"
    podman = engine.global_argv()
    install = ("python3 -m venv --without-pip /opt/jupyter && set -- /wheels/pip-*.whl && /opt/jupyter/bin/python "
               f"\"$1/pip\" install -q --no-index --find-links /wheels jupyterlab=={LAB_VERSION}")
    try:
        subprocess.run([*podman, "run", "--name", name, "--network", "none", "--volume", f"{wheels}:/wheels:ro",
                        ssh_image, "sh", "-c", install], check=True, timeout=900)
        subprocess.run([*podman, "commit", "-q", "--change", f"ENV PATH={PATH}", name, LAB_IMAGE], check=True,
                       timeout=300)
    finally:
        subprocess.run([*podman, "rm", "-f", name], capture_output=True, check=False)
    return LAB_IMAGE


@pytest.fixture(scope="module")
def ssh_image(engine: Engine) -> str:
    """The debian-ssh image (no JupyterLab), built once with mmdebstrap like the other suites'."""
    return build_rootfs_image(engine, get_template("debian-ssh"), cache_dir=CACHE_DIR)


@pytest.fixture
def data_root() -> Iterator[Path]:
    with safe_data.data_root() as root:
        yield root


def lab_template(image: str) -> Template:
    return replace(get_template("debian-ssh"), image=image, jupyter=True, build=None)


def wait_for_server(booking: Booking) -> None:
    """Until JupyterLab says it runs (both server generations log "is running at"), wherever it listens."""
    with connect(booking.spec.port, BOOKER, booking.key) as client:
        deadline = time.monotonic() + 180
        while run(client, f"grep -q 'is running at' {jupyter.FOLDER}/log")[0] != 0:
            if time.monotonic() > deadline:
                log = run(client, f"cat {jupyter.FOLDER}/log")[1]
                raise AssertionError(f"JupyterLab never said it runs; its log:\n{log}")
            time.sleep(0.5)


def listening_as(uid: int) -> list[str]:
    """TCP sockets listening on this (the host's) network and owned by host uid `uid`."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and int(fields[7]) == uid:
                found.append(fields[1])
    return found


def every_argv() -> str:
    """What `ps -ef` shows any host user: every process's argv."""
    seen = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                seen.append((entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
            except OSError:
                continue
    return "\n".join(seen)


def forward(booking: Booking, folder: Path) -> tuple[subprocess.Popen[bytes], int]:
    """The booker's `ssh -N -L PORT:SOCKET` with OpenSSH, trusting only the booking's host key."""
    key_file, known_hosts = folder / "alice.key", folder / "known_hosts"
    booking.key.write_private_key_file(str(key_file))
    key_file.chmod(0o600)
    known_hosts.write_text(f"[127.0.0.1]:{booking.spec.port} {booking.ready.host_key}\n")
    local = free_port()
    process = subprocess.Popen(
        ["ssh", "-N", "-L", f"127.0.0.1:{local}:{jupyter.SOCKET}", "-p", str(booking.spec.port), "-i", str(key_file),
         "-o", "IdentitiesOnly=yes", "-o", "BatchMode=yes", "-o", f"UserKnownHostsFile={known_hosts}",
         "-o", "StrictHostKeyChecking=yes", "-o", "ExitOnForwardFailure=yes", f"{BOOKER}@127.0.0.1"],
        stdin=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", local), timeout=1).close()
            return process, local
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                raise AssertionError(f"ssh -L failed: {process.communicate()[1].decode()}") from None
            time.sleep(0.1)


def test_jupyterlab_answers_the_bookers_ssh_and_nobody_else(engine: Engine, lab_image: str, ssh_image: str,
                                                            data_root: Path, tmp_path: Path) -> None:
    bookings = Bookings(engine, data_root, lab_template(lab_image))
    others = Bookings(engine, data_root, get_template("debian-ssh"))
    try:
        booking = bookings.start()
        assert jupyter.availability(engine, booking.spec.name) == jupyter.Availability(True)
        wait_for_server(booking)
        with connect(booking.spec.port, BOOKER, booking.key) as client:
            url = run(client, f"cat {jupyter.URL_FILE}")[1].strip()
            modes = run(client, f"stat -c '%a %U' {jupyter.FOLDER} {jupyter.SOCKET} {jupyter.URL_FILE}")[1]
        token = parse_qs(urlsplit(url).query)["token"][0]
        assert len(token) == 48

        # Hostile. Nothing listens on TCP as the booker: on this network any host user could reach it.
        assert listening_as(engine.host_owner(BOOKER_UID, BOOKER_UID)[0]) == []
        # Root in another booking's container, on the same (host) network, finds no Jupyter server.
        other = others.start()
        scan = engine.exec(other.spec.name, ["python3", "-c", SCAN, jupyter.SOCKET], timeout=120)
        assert scan.returncode == 0 and scan.stdout.strip() == "nothing", scan.stdout + scan.stderr
        # A host user: the socket's path means nothing outside the container, and `ps` shows no token.
        with socket.socket(socket.AF_UNIX) as probe, pytest.raises(FileNotFoundError):
            probe.connect(jupyter.SOCKET)
        assert token not in every_argv()
        assert token not in engine.logs(booking.spec.name, tail=200)  # logs end up in errors and notes

        # The booker: their socket and URL file are theirs alone, and their `ssh -L` reaches the API.
        assert modes.split("\n")[:3] == [f"700 {BOOKER}", f"600 {BOOKER}", f"600 {BOOKER}"]
        process, local = forward(booking, tmp_path)
        try:
            api = f"http://127.0.0.1:{local}/api/status"
            answer = requests.get(api, headers={"Authorization": f"token {token}"}, timeout=30)
            assert answer.status_code == 200 and "started" in answer.json()
            assert requests.get(api, timeout=30).status_code == 403
            assert requests.get(api, headers={"Authorization": "token " + "0" * 48}, timeout=30).status_code == 403
            assert requests.get(f"http://127.0.0.1:{local}/lab?token={token}", timeout=60).status_code == 200
        finally:
            process.terminate()
            process.wait(timeout=10)
    finally:
        others.cleanup()
        bookings.cleanup()


def test_an_image_without_jupyterlab_still_starts_and_says_so(engine: Engine, ssh_image: str,
                                                              data_root: Path) -> None:
    bookings = Bookings(engine, data_root, lab_template(ssh_image))
    try:
        booking = bookings.start()
        said = jupyter.availability(engine, booking.spec.name)
        assert said == jupyter.Availability(False, "not available in this image (no jupyter-lab on its PATH)")
        with connect(booking.spec.port, BOOKER, booking.key) as client:
            assert run(client, "id -un")[1] == f"{BOOKER}\n"
    finally:
        bookings.cleanup()


@pytest.mark.daemon
@pytest.mark.caldav
def test_the_daemon_writes_back_how_to_reach_jupyterlab(engine: Engine, lab_image: str, ssh_image: str,
                                                        radicale, keys, tmp_path: Path) -> None:  # noqa: ANN001
    """The real daemon and Radicale: the running block gets the `ssh -L` line, and never the token."""
    templates = tmp_path / "templates"
    templates.mkdir()
    shutil.copy(get_template("debian-ssh").path, templates / "debian-ssh.toml")
    (templates / "lab.toml").write_text(f'image = "{lab_image}"\ncuda = "none"\nhas_sshd = true\njupyter = true\n')
    calendar = radicale.new_calendar()
    config = write_config(tmp_path, str(calendar.url), keys=keys)
    config.write_text(config.read_text() + f'\n[templates]\ndir = "{templates}"\n')
    start = soon(8)
    book(calendar, "lab@test", user="alice", start=start, end=start + timedelta(minutes=2),
         description="template: lab\n")
    daemon = DaemonProcess(config).start()
    try:
        line = wait_for("the jupyter line in the event",
                        lambda: next((x for x in description(calendar, "lab@test").splitlines()
                                      if x.startswith("jupyter: ")), None), timeout=90, daemon=daemon)
        info = engine.inspect(container_name("lab@test"))
        assert info is not None and info.port is not None
        assert line == f"jupyter: {jupyter.forward_line(port=info.port, user='alice', host='127.0.0.1')}"
        text = description(calendar, "lab@test")
        assert f"cat {jupyter.URL_FILE}" in text and "token=" not in text
        client = wait_for("SSH as the booker", lambda: try_login(info.port, "alice", keys["alice"]), timeout=30,
                          daemon=daemon)
        try:
            assert run(client, f"cat {jupyter.URL_FILE}")[1].startswith("http://127.0.0.1:8888/lab?token=")
        finally:
            client.close()
    finally:
        daemon.stop()
        engine.stop(container_name("lab@test"), 0)
