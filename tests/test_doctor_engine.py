"""Doctor against real engines: podman's network backend as root (and made unfindable), each
allowed template's image in a rootless store, and `gpubook status` with a real daemon holding the
state folder's lock, then without it (exit 3)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from gpubook.runtime import network
from gpubook.runtime.engines import EngineSettings, engine_from, podman_network
from gpubook.scheduler import config as config_module
from gpubook.scheduler.commands import doctor as doctor_module
from tests.kits.daemon_kit import DaemonProcess, cli, wait_for, write_config

ROOT = Path(__file__).resolve().parents[1]
needs_podman = pytest.mark.skipif(shutil.which("podman") is None, reason="podman is not installed")
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="rootful podman: run as root")
CNI_LOCK = Path("/etc/cni/net.d/cni.lock")


@pytest.fixture
def containers_conf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """Write a containers.conf that podman reads instead of the host's (CONTAINERS_CONF)."""
    made_lock = not CNI_LOCK.exists()

    def write(text: str) -> Path:
        path = tmp_path / "containers.conf"
        path.write_text(text)
        monkeypatch.setenv("CONTAINERS_CONF", str(path))
        return path

    yield write
    if made_lock:  # podman's CNI backend leaves its lock file; this machine did not have one
        CNI_LOCK.unlink(missing_ok=True)


@pytest.mark.rootful
@needs_podman
@as_root
def test_doctor_as_root_names_a_missing_network_backend(tmp_path: Path, containers_conf) -> None:  # type: ignore[no-untyped-def]
    """The GPU host (2026-11-25) had neither netavark nor iptables, and doctor said `ok engine
    network: private`; every booking's start then failed inside podman."""
    settings = EngineSettings(runtime="runc")
    here = podman_network.backend_check(settings)
    assert here.ok, here
    assert here.detail.split(",")[0] in ("netavark", "cni")
    assert [c.name for c in network.checks(settings)] == ["engine network", "engine network backend"]

    no_firewall = podman_network.backend_check(settings, firewall_path=str(tmp_path))
    assert not no_firewall.ok and "needs iptables (or nft)" in no_firewall.detail
    assert no_firewall.fix == "install iptables (Debian/Ubuntu: apt install iptables)"

    empty = tmp_path / "empty"
    empty.mkdir()
    containers_conf(f'[engine]\nhelper_binaries_dir = ["{empty}"]\n[network]\nnetwork_backend = "netavark"\n')
    missing = podman_network.backend_check(settings)
    assert missing.level == "fail"
    assert missing.detail.startswith("podman's network backend is netavark, but podman cannot find it")
    assert missing.fix is not None and "apt install netavark iptables" in missing.fix

    containers_conf(f'[network]\nnetwork_backend = "cni"\ncni_plugin_dirs = ["{empty}"]\n')
    no_plugins = podman_network.backend_check(settings)
    assert no_plugins.level == "fail" and "CNI and its plugins are missing (bridge" in no_plugins.detail

    config = tmp_path / "gpubook.toml"
    config.write_text('[[calendar]]\nurl = "http://127.0.0.1:9/cal/"\n[gpus]\ncount = 1\n[engine]\nruntime = "runc"\n')
    done = subprocess.run([sys.executable, "-m", "gpubook", "doctor", "--json", "--config", str(config)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT, check=False,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    found = {c["name"]: c for c in json.loads(done.stdout)}
    assert found["engine network backend"]["level"] == "fail", found
    assert done.returncode == 1


@pytest.mark.podman
@needs_podman
def test_rootless_podman_keeps_its_slirp4netns_and_tun_checks() -> None:
    if os.geteuid() == 0:
        pytest.skip("rootless podman: run as the test account")
    assert [c.name for c in network.checks(EngineSettings())] == ["engine network", "slirp4netns", "tun device"]


@pytest.mark.podman
@needs_podman
def test_doctor_checks_each_allowed_templates_image(tmp_path: Path, engine) -> None:  # type: ignore[no-untyped-def]
    """Built here and missing: FAIL (nothing will pull it); from a registry and missing: WARN (the
    daemon pulls it ahead of its bookings); present: ok. The engine fixture built debian-ssh."""
    store = engine_from("podman", runtime="runc", storage_driver="overlay")
    folder = tmp_path / "templates"
    folder.mkdir()
    shutil.copy(ROOT / "gpubook" / "templates" / "debian-ssh.toml", folder)
    (folder / "made-here.toml").write_text('image = "localhost/gpubook-test/made-here:1"\ncuda = "none"\n'
                                           'has_sshd = true\n[build]\ninclude = ["openssh-server"]\n')
    (folder / "pulled.toml").write_text('image = "registry.invalid:5000/lab/pulled:1"\ncuda = "none"\n'
                                        'mirror = "127.0.0.1:5999/mirror"\n')
    (folder / "present.toml").write_text('image = "localhost/gpubook-test/present:1"\ncuda = "none"\nhas_sshd = true\n')
    (folder / "other.toml").write_text('image = "localhost/gpubook-test/other:1"\ncuda = "none"\nhas_sshd = true\n')
    empty = tmp_path / "empty.tar"
    with tarfile.open(empty, "w"):
        pass
    store.import_rootfs(empty, "localhost/gpubook-test/present:1")
    try:
        config = tmp_path / "gpubook.toml"
        config.write_text('[[calendar]]\nurl = "http://127.0.0.1:9/cal/"\n[defaults]\ntemplate = "made-here"\n'
                          f'[templates]\ndir = "{folder}"\n[engine]\nruntime = "runc"\nstorage_driver = "overlay"\n'
                          '[users.alice]\nuid = 2001\ntemplates = ["p*", "debian-ssh"]\n')
        checks = doctor_module.image_checks(config_module.load(config))
        by_name = {c.name: c for c in checks}
        assert list(by_name) == ["image store", "image progress", "image made-here", "image debian-ssh",
                                 "image present", "image pulled"]  # not other
        assert by_name["image progress"].level == ("ok" if shutil.which("skopeo") else "warn")
        shown = by_name["image store"]  # issue 27: the store's size and free space
        assert shown.level == "ok" and shown.detail.startswith(f"{store.storage_path()}: "), shown
        assert re.search(r": \d+ images, \d+\.\d GB; \d+\.\d GB free of \d+ GB$", shown.detail), shown.detail
        made = by_name["image made-here"]
        assert made.level == "fail" and made.fix.startswith("gpubook templates build made-here; or, made on another ")
        assert made.fix.endswith("gpubook templates import made-here made-here.tar"), made.fix
        assert made.detail.startswith("localhost/gpubook-test/made-here:1 is not in the engine's store and is made "
                                      "on this machine")
        assert by_name["image debian-ssh"].level == "ok"
        assert by_name["image present"].level == "ok"
        pulled = by_name["image pulled"]
        assert pulled.level == "warn"
        assert "pulls it from the mirror 127.0.0.1:5999/mirror, then registry.invalid:5000" in pulled.detail
        assert pulled.fix == "to have it now, as the daemon's user: podman pull registry.invalid:5000/lab/pulled:1"
        with config.open("a") as appended:  # a floor the disk is under: doctor says so
            appended.write("[images]\nmin_free_gb = 100000\n")
        floor = doctor_module.image_checks(config_module.load(config))[0]
        assert floor.name == "image store" and floor.level == "fail", floor
        assert "(gpubook removes its unused images under 100000 GB free): under the floor now" in floor.detail
        config.write_text(config.read_text().replace('template = "made-here"', 'template = "gone"'))
        [_store, _progress, gone, *_] = doctor_module.image_checks(config_module.load(config))
        assert gone.name == "image gone" and gone.level == "fail" and "does not exist" in gone.detail
    finally:
        store.remove_image("localhost/gpubook-test/present:1")


@pytest.mark.daemon
@pytest.mark.podman
@pytest.mark.caldav
@pytest.mark.slow
@needs_podman
def test_status_exits_3_when_no_daemon_holds_the_state_folder(  # type: ignore[no-untyped-def]
        tmp_path: Path, radicale, engine, keys, daemons) -> None:
    calendar = radicale.new_calendar()
    config = write_config(tmp_path, str(calendar.url), keys=keys, poll_seconds=60)
    state = tmp_path / "state"
    daemon = DaemonProcess(config).start()
    daemons.append(daemon)
    wait_for("the daemon's first pass", lambda: (state / "daemon-status.json").exists(), timeout=60, daemon=daemon)

    done = cli(config, "status", "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert daemon.process is not None
    assert report["daemon"] == {"running": True, "pid": daemon.process.pid, "state_dir": str(state)}
    text = cli(config, "status")
    assert text.returncode == 0 and "no gpubook daemon" not in text.stdout

    assert daemon.stop() is not None
    done = cli(config, "status", "--json")
    assert done.returncode == 3, done.stderr
    report = json.loads(done.stdout)
    assert report["daemon"] == {"running": False, "pid": None, "state_dir": str(state)}
    text = cli(config, "status")
    assert text.returncode == 3
    first, *rest = text.stdout.splitlines()
    assert first == f"no gpubook daemon is running for {state} (last status written at {report['updated']})"
    assert rest and rest[0].startswith("GPUs: 2 (config")  # the last status it has, still shown
