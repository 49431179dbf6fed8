"""The daemon prepares a booking's image ahead: the template's image is only in a registry (Debian's
docker-registry, TLS and htpasswd), the booking is accepted well under a minute before its start,
and the image is pulled before the start (the event says "image: ready" then), so the booking
starts at its start with no pull in its way. Real Radicale, rootless podman, `gpubook run`."""

from __future__ import annotations

import json
import secrets
import shutil
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from gpubook.runtime.templates import default_templates_dir
from tests.kits import daemon_kit, registry_kit
from tests.kits.daemon_kit import (
    DAEMON_MODULE,
    DaemonProcess,
    book,
    description,
    run,
    running_container,
    soon,
    try_login,
    wait_for,
)
from tests.kits.registry_kit import Registry

pytestmark = [
    *DAEMON_MODULE,
    pytest.mark.skipif(shutil.which("docker-registry") is None, reason="docker-registry is not installed"),
]


@pytest.fixture(scope="module")
def registry() -> Iterator[Registry]:
    with registry_kit.running() as running:
        yield running


@pytest.fixture
def registry_only_image(engine, registry: Registry) -> Iterator[str]:  # type: ignore[no-untyped-def]
    """debian-ssh plus a file of its own, pushed to the registry and absent from podman's storage."""
    local = registry_kit.tiny_image(engine, f"localhost/gpubook-test/lab-ssh:{secrets.token_hex(4)}",
                                    base="localhost/gpubook/debian-ssh:12")
    name = f"lab/ssh:{secrets.token_hex(4)}"
    registry_kit.push(engine, registry, local, name)
    registry_kit.untag(engine, local)
    remote = f"{registry.address}/{name}"
    assert not engine.image_exists(remote) and not engine.image_exists(local)
    yield remote
    registry_kit.untag(engine, remote)


def test_an_image_only_in_a_registry_is_pulled_before_a_booking_accepted_minutes_ahead(
        tmp_path: Path, radicale, engine, keys, cleanup, daemons, registry: Registry,  # type: ignore[no-untyped-def]
        registry_only_image: str) -> None:
    templates = tmp_path / "templates"
    templates.mkdir()
    shutil.copy(default_templates_dir() / "debian-ssh.toml", templates)
    (templates / "lab-ssh.toml").write_text(f'image = "{registry_only_image}"\ncuda = "none"\nhas_sshd = true\n')
    calendar = radicale.new_calendar()
    config = daemon_kit.write_config(tmp_path, str(calendar.url), keys=keys, poll_seconds=5)
    with config.open("a") as appended:
        appended.write(f'\n[templates]\ndir = "{templates}"\n\n[images]\nauth_file = "{registry.auth_file}"\n')
    daemon = DaemonProcess(config).start()
    daemons.append(daemon)
    wait_for("the daemon's first pass", lambda: (tmp_path / "state" / "daemon-status.json").exists(),
             timeout=60, daemon=daemon)

    start = soon(40)  # accepted at the next poll, well under a minute before its start
    book(calendar, "pulled@test", user="alice", start=start, end=start + timedelta(minutes=2),
         description="template: lab-ssh\n")
    cleanup.append("pulled@test")
    ready = wait_for("image: ready in the event", lambda: "image: ready" in description(calendar, "pulled@test"),
                     timeout=60, interval=0.2, daemon=daemon)
    ready_at = datetime.now(UTC)
    assert ready and ready_at < start, (ready_at, start)  # pulled before the start, not at it
    assert engine.image_exists(registry_only_image)
    status = json.loads((tmp_path / "state" / "daemon-status.json").read_text())
    (row,) = [r for r in status["images"]["preparations"] if r["template"] == "lab-ssh"]
    assert row["state"] == "ready" and row["detail"] == f"pulled from {registry_only_image}"
    assert row["bookings"] == ["pulled@test"]
    early = running_container(engine, "pulled@test")
    assert early is None or early.start == start  # not before its start, or armed for it (SSH closed until then)
    listing = daemon_kit.cli(config, "images")  # what is prepared for which booking
    assert listing.returncode == 0, listing.stderr
    assert f"{registry_only_image}" in listing.stdout and "[ready]  for pulled@test" in listing.stdout
    print(listing.stdout)

    while datetime.now(UTC) < start:
        time.sleep(0.02)
    info = wait_for("the container", lambda: running_container(engine, "pulled@test"), timeout=30,
                    interval=0.02, daemon=daemon)
    client = wait_for("SSH login as the booker", lambda: try_login(info.port, "alice", keys["alice"]),
                      timeout=30, interval=0.02, daemon=daemon)
    print(f"booker logged in {(datetime.now(UTC) - start).total_seconds():.2f} s after the start "
          f"(image ready {(start - ready_at).total_seconds():.1f} s before it)")
    try:
        assert run(client, "test -s /gpubook-token && echo pulled-image")[1] == "pulled-image\n"
    finally:
        client.close()
    started = registry_kit.podman(engine, "inspect", "--format", "{{.State.StartedAt}}", info.name)
    log = daemon.log.read_text()
    armed = "booking pulled@test: its container runs ahead of its start" in log
    # run at its start, or armed ahead of it with SSH closed until then (tests/test_daemon_armed.py)
    assert armed or datetime.strptime(started[:19], "%Y-%m-%d %H:%M:%S").replace(tzinfo=UTC) >= start
    # The preparer's own line for each pull ("not armed yet: … pulling" only echoes its state).
    pulls = [line for line in log.splitlines() if f"template lab-ssh: pulling {registry_only_image}" in line]
    assert len(pulls) == 1  # one pull, ahead; the start pulled nothing
