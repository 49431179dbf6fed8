"""The daemon prepares a booking's image ahead: the template's image is only in a registry (Debian's
docker-registry, TLS and htpasswd), the booking is accepted well under a minute before its start,
and the image is pulled before the start (the event says "image: ready" then), so the booking
starts at its start with no pull in its way. Real Radicale, rootless podman, `gpubook run`."""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import tempfile
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from gpubook.runtime.templates import images
from gpubook.runtime.templates.catalog import default_templates_dir
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


@pytest.fixture
def layered_image(engine, registry: Registry) -> Iterator[str]:  # type: ignore[no-untyped-def]
    """debian-ssh plus three layers of 5 MB of random bytes each (nothing to compress), pushed to
    the registry; its own layers are then removed from podman's store, so a pull downloads them."""
    local = f"localhost/gpubook-test/layered:{secrets.token_hex(4)}"
    with tempfile.TemporaryDirectory(prefix="gpubook-layered-") as context:
        for number in range(3):
            (Path(context) / f"part{number}").write_bytes(os.urandom(5_000_000))
        (Path(context) / "Containerfile").write_text(
            "FROM localhost/gpubook/debian-ssh:12\n" + "".join(f"COPY part{n} /part{n}\n" for n in range(3)))
        registry_kit.podman(engine, "build", "--quiet", "--tag", local, context)
    name = f"lab/layered:{secrets.token_hex(4)}"
    registry_kit.push(engine, registry, local, name)
    registry_kit.podman(engine, "rmi", local)  # unused, so its own layers go with it
    remote = f"{registry.address}/{name}"
    assert not engine.image_exists(remote)
    yield name
    registry_kit.remove(engine, remote)


def _status(state: Path) -> dict:
    try:
        return json.loads((state / "daemon-status.json").read_text())
    except (OSError, ValueError):
        return {}


def _held_notes(status: dict) -> list[str]:
    return [segment.get("note", "") for host in status.get("hosts", ()) for lane in host.get("timeline", ())
            for segment in lane.get("segments", ()) if segment.get("kind") == "held"]


def test_a_booking_whose_image_is_not_ready_is_held_with_its_progress_and_starts_when_it_is(
        tmp_path: Path, radicale, engine, keys, cleanup, daemons, registry: Registry,  # type: ignore[no-untyped-def]
        layered_image: str) -> None:
    """Issue 27's hold: the image comes over a slow link (0.4 MB/s: 15 MB in about 40 s) and the
    booking starts 20 s after it was made. At its start it is held, and its event and the page say
    "preparing image lab-layered: N of 15 MB, ready about HH:MM"; once the image is ready (pulled,
    its first start's copy made) the booking starts at once (a pass woken by the preparer: the
    calendar is polled every 5 minutes). With a free-space floor that is never met, cleanup runs at
    every preparation: gpubook's old image that nobody needs goes, the image of a booking in 2 hours
    stays, and so does the one being pulled."""
    with registry_kit.slowed(registry, 400_000) as slow:
        image = f"{slow.address}/{layered_image}"
        templates = tmp_path / "templates"
        templates.mkdir()
        shutil.copy(default_templates_dir() / "debian-ssh.toml", templates)
        (templates / "lab-layered.toml").write_text(f'image = "{image}"\ncuda = "none"\nhas_sshd = true\n')
        later_image = registry_kit.tiny_image(engine, f"localhost/gpubook-test/later:{secrets.token_hex(4)}",
                                              base="localhost/gpubook/debian-ssh:12")
        old_image = registry_kit.tiny_image(engine, f"localhost/gpubook-test/old:{secrets.token_hex(4)}")
        (templates / "lab-later.toml").write_text(f'image = "{later_image}"\ncuda = "none"\nhas_sshd = true\n')
        state = tmp_path / "state"
        ledger = images.Ledger(state / "images.json")  # what gpubook pulled before: both may be removed
        ledger.add(old_image, kind="pulled", now=datetime.now(UTC) - timedelta(days=3))
        ledger.add(later_image, kind="pulled", now=datetime.now(UTC) - timedelta(days=2))
        calendar = radicale.new_calendar()
        config = daemon_kit.write_config(tmp_path, str(calendar.url), keys=keys, poll_seconds=300)
        with config.open("a") as appended:
            appended.write(f'\n[templates]\ndir = "{templates}"\n\n[images]\nauth_file = "{slow.auth_file}"\n'
                           "min_free_gb = 100000\n")
        start = soon(20)
        book(calendar, "held@test", user="alice", start=start, end=start + timedelta(minutes=3),
             description="template: lab-layered\n")
        book(calendar, "later@test", user="bob", start=start + timedelta(hours=2),
             end=start + timedelta(hours=3), description="template: lab-later\n")
        cleanup.extend(["held@test", "later@test"])
        daemon = DaemonProcess(config).start()
        daemons.append(daemon)
        wait_for("the image's progress in the event before the start",
                 lambda: " of 15 MB" in description(calendar, "held@test"), timeout=60, interval=0.2, daemon=daemon)
        while datetime.now(UTC) < start + timedelta(seconds=1):
            time.sleep(0.05)
        sentence = wait_for(
            "the progress sentence in the held booking's event",
            lambda: next((line for line in description(calendar, "held@test").splitlines()
                          if "preparing image lab-layered: " in line and " of 15 MB, ready about " in line), None),
            timeout=120, interval=0.2, daemon=daemon)
        assert re.search(r"preparing image lab-layered: \d+ of 15 MB, ready about \d\d:\d\d", sentence), sentence
        assert running_container(engine, "held@test") is None  # held: its start came, its image is not ready
        on_page = wait_for("the held booking on the page, with its progress",
                           lambda: [n for n in _held_notes(_status(state)) if "preparing image lab-layered: " in n],
                           timeout=60, interval=0.2, daemon=daemon)
        assert " of 15 MB" in on_page[0], on_page
        info = wait_for("the container", lambda: running_container(engine, "held@test"), timeout=180,
                        interval=0.05, daemon=daemon)
        seen = datetime.now(UTC)
        (row,) = wait_for("the status after the start", lambda: [  # written after the pass that started it
            r for r in _status(state).get("images", {}).get("preparations", ())
            if r["template"] == "lab-layered" and r["state"] == "ready"], timeout=60, interval=0.2, daemon=daemon)
        ready = datetime.fromisoformat(row["since"])
        assert row["state"] == "ready" and 15_000_000 <= row["total"] < 15_100_000, row  # debian-ssh's layers: there
        print(f"started {(seen - ready).total_seconds():.2f} s after its image was ready "
              f"({(ready - start).total_seconds():.1f} s after its start); {sentence}")
        assert (seen - ready).total_seconds() < 25  # woken by the preparer, not the 5-minute poll
        client = wait_for("SSH login as the booker", lambda: try_login(info.port, "alice", keys["alice"]),
                          timeout=30, interval=0.05, daemon=daemon)
        try:
            assert run(client, "stat -c %s /part0 /part1 /part2")[1].split() == ["5000000"] * 3
        finally:
            client.close()
        log = daemon.log.read_text()
        warmed = log.index("template lab-layered: its first start made ready in")  # the copy paid ahead
        assert warmed < log.index("booking held@test: started on GPU"), log[-4000:]  # never before it
        assert engine.image_exists(later_image) and engine.image_exists(image)
        assert not engine.image_exists(old_image), log[-3000:]
        assert [e.image for e in ledger.entries()] == [later_image, image]
