"""The engine behaviour against real rootless podman (runc, overlay), run as an ordinary user."""

from __future__ import annotations

import json
import os
import resource
import secrets
import shutil
import subprocess
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest

from gpubook.runtime.engines import engine_from
from gpubook.runtime.engines.cli_transport import message_of
from gpubook.runtime.templates.catalog import get_template
from tests.kits import engine_suite, registry_kit, safe_data
from tests.kits.engine_suite import Bookings, EngineBehaviour, owner_for_podman

pytestmark = [
    pytest.mark.podman,
    pytest.mark.skipif(shutil.which("podman") is None, reason="podman is not installed"),
]
PODMAN = engine_suite.PODMAN


@pytest.fixture(scope="session")
def engine_args() -> dict:
    return dict(PODMAN)


@pytest.fixture
def expected_owner():
    return owner_for_podman


class TestPodman(EngineBehaviour):
    pass


def test_own_user_namespace(bookings: Bookings) -> None:
    """Podman gives each container its own user namespace (Docker shares dockerd's)."""
    booking = bookings.start()
    inside = bookings.engine.exec(
        booking.spec.name, ["readlink", "/proc/self/ns/user"]
    ).stdout.strip()
    assert inside.startswith("user:[") and inside != os.readlink("/proc/self/ns/user")


def test_preflight_finds_a_store_made_with_another_driver(tmp_path: Path) -> None:
    """On the GPU host podman's store was made with another driver than the one gpubook forced,
    so every podman call failed and no booking could start; doctor must say so, with the fix."""
    runroot = tempfile.mkdtemp(prefix="gpb-run-", dir="/tmp")  # podman wants it under 50 characters
    try:
        check_store(("--root", str(tmp_path / "root"), "--runroot", runroot))
    finally:
        shutil.rmtree(runroot, ignore_errors=True)


def check_store(store: tuple[str, ...]) -> None:
    made = engine_from("podman", storage_driver="overlay", global_args=store).preflight()
    assert [c.ok for c in made[:2]] == [True, True], made
    assert made[1].detail.startswith("driver overlay")
    checks = engine_from("podman", storage_driver="vfs", global_args=store).preflight()
    storage = checks[1]
    assert storage.name == "engine storage" and not storage.ok, checks
    assert 'made with "overlay" but gpubook asks for "vfs"' in storage.detail
    assert storage.fix is not None and "remove [engine] storage_driver" in storage.fix
    assert '"overlay"' in storage.fix and "podman system reset" in storage.fix
    # The default follows the store, whatever driver made it.
    follows = engine_from("podman", global_args=store).preflight()
    assert all(c.ok for c in follows[:2]) and follows[1].detail.startswith("driver overlay"), follows


def test_preflight_refuses_a_vfs_store(tmp_path: Path) -> None:
    """Debian 12's rootless podman makes a new store with vfs when nothing asks for overlay (CI's fresh
    test user got one from the demo, the first podman command): every start copies the whole image.
    Doctor must say so, with the way out."""
    runroot = tempfile.mkdtemp(prefix="gpb-run-", dir="/tmp")
    try:
        store = ("--root", str(tmp_path / "root"), "--runroot", runroot)
        storage = engine_from("podman", storage_driver="vfs", global_args=store).preflight()[1]
    finally:
        shutil.rmtree(runroot, ignore_errors=True)
    assert storage.name == "engine storage" and not storage.ok, storage
    assert storage.detail.startswith("driver vfs") and "copies the whole image" in storage.detail
    assert storage.fix is not None and 'driver = "overlay"' in storage.fix and "storage.conf" in storage.fix


def _processes_of_this_user() -> int:
    """Tasks charged to this uid's RLIMIT_NPROC: its own and those of every user namespace it made
    (rootless containers run as its subordinate ids, and the kernel charges their creator too)."""
    own = os.getuid()
    count = 0
    for task in Path("/proc").glob("[0-9]*/task/[0-9]*"):
        try:
            uid = task.stat().st_uid
        except OSError:
            continue
        count += uid == own or 100_000 <= uid < 1_000_000_000
    return count


def test_a_fork_bomb_stops_at_its_own_limit_and_the_daemon_still_starts_bookings(
    bookings: Bookings, engine_args: dict
) -> None:
    """A booker's processes are charged to the daemon's uid (RLIMIT_NPROC counts a namespace's
    tasks for its creator too): a fork bomb without a limit of its own leaves the daemon unable to
    fork podman. With a 200-process limit the bomb stops there; the daemon, 600 tasks from its own
    limit, starts the next booking."""
    bookings.engine = engine_from(**{**engine_args, "pids_limit": 200})
    first = bookings.start()
    soft, hard = resource.getrlimit(resource.RLIMIT_NPROC)
    resource.setrlimit(resource.RLIMIT_NPROC, (_processes_of_this_user() + 600, hard))
    try:
        bomb = "i=0; while [ $i -lt 1000 ]; do sleep 600 >/dev/null 2>&1 & i=$((i+1)); done"
        with engine_suite.connect(first.spec.port, engine_suite.BOOKER, first.key) as client:
            engine_suite.run(client, bomb)  # the shell gives up when it cannot fork any more
        counted = bookings.engine.exec(first.spec.name, ["sh", "-c", "ps -u 2001 --no-headers | wc -l"])
        started = int(counted.stdout)
        assert started <= 210, f"{started} processes in the booking"
        second = bookings.start()  # podman forks as the daemon's uid
        assert bookings.engine.inspect(second.spec.name) is not None
    finally:
        resource.setrlimit(resource.RLIMIT_NPROC, (soft, hard))


def _mapped_image_layers(engine) -> set[str]:  # type: ignore[no-untyped-def]
    """The store's layers made for an id map (chowned copies), less the containers' own layers."""
    store = engine.storage_path()
    layers = json.loads((store / "overlay-layers" / "layers.json").read_text())
    containers = json.loads((store / "overlay-containers" / "containers.json").read_text() or "[]")
    own = {c.get("layer") for c in containers}
    return {layer["id"] for layer in layers if layer.get("uidmap") and layer["id"] not in own}


def test_warm_pays_the_first_starts_chowned_copy_and_a_booking_reuses_it(engine_args: dict, image: str) -> None:
    """Rootless podman has no idmapped mounts: the first container of an image with the bookings'
    id map copies its layers chowned to that map (issue 27: seconds per GB). `warm` makes that copy
    at preparation; a booking's container made after it adds no copy of its own (same map), and
    warm leaves no container behind."""
    engine = engine_from(**engine_args)
    fresh = registry_kit.tiny_image(engine, f"localhost/gpubook-test/warm:{secrets.token_hex(4)}", base=image)
    try:
        before = _mapped_image_layers(engine)
        engine.warm(fresh)  # type: ignore[attr-defined]
        made = _mapped_image_layers(engine) - before
        assert made, "warm made no chowned copy"
        names = subprocess.run([*engine.global_argv(), "ps", "--all", "--format", "{{.Names}}"],  # type: ignore[attr-defined]
                               capture_output=True, text=True, check=True).stdout.split()
        assert not [n for n in names if n.startswith("gpubook-warm-")]
        engine.warm(fresh)  # type: ignore[attr-defined]
        assert _mapped_image_layers(engine) - before == made  # made once, kept with the image
        with safe_data.data_root() as data_root:
            bookings = engine_suite.Bookings(engine, data_root, replace(get_template("debian-ssh"), image=fresh))
            try:
                bookings.start()
                assert _mapped_image_layers(engine) - before == made  # the booking's map is warm's
            finally:
                bookings.cleanup()
    finally:
        registry_kit.remove(engine, fresh)


def test_a_failed_run_is_told_by_its_error_not_by_the_warning_before_it(image: str) -> None:
    """On rootless cgroups v1 podman writes "Resource limits are not supported…" before anything
    else; a run that then fails must be reported by its "Error:" line (a CI run once showed only
    the warning, three times, for a start that failed for another reason)."""
    failed = subprocess.run(["podman", "--cgroup-manager", "cgroupfs", "run", "--rm", "--network", "host",
                             "--pids-limit", "100", image, "/no/such/program"], capture_output=True, text=True)
    assert failed.returncode != 0
    message = message_of(failed)
    assert "/no/such/program" in message and "Resource limits" not in message, (failed.stderr, message)


def test_doctor_and_status_say_when_podman_ignores_limits(engine_args: dict, image: str) -> None:
    """Rootless podman on cgroups v1 only warns, at each start, that it ignores --pids-limit and
    --memory; gpubook must say so where an admin looks (doctor's check, status's problems)."""
    engine = engine_from(**engine_args)
    warned = subprocess.run(["podman", "--cgroup-manager", "cgroupfs", "run", "--rm", "--network", "host",
                             "--pids-limit", "100", image, "true"], capture_output=True, text=True, check=True)
    ignored = "Resource limits are not supported and ignored on cgroups V1 rootless" in warned.stderr
    limits = next(check for check in engine.preflight() if check.name == "engine limits")
    problem = engine.limits_problem()  # type: ignore[attr-defined]
    assert ignored == (problem is not None) == (not limits.ok), (warned.stderr, limits)
    if ignored:
        assert "cgroups v1" in limits.detail and "cgroups v2" in (limits.fix or "")


# What a podman command does first when it starts while the store's overlay folder is no mount
# point (containers/storage's overlay Init, MakePrivate, before it waits for any store lock):
# bind-mount the folder over itself, without the mounts beneath it. This one watches (10 s at
# most, without pause: the window is milliseconds) for a layer newly mounted under the folder, as an
# image's chowned copy is while it is made (a running container's is not new), and does just that
# then, in podman's own namespaces (entered as the pause process holds them).
RACER = r"""
folder="$1"
before=$(mktemp)
trap 'rm -f "$before"' EXIT
grep -o " $folder/[0-9a-f]*/merged " /proc/self/mountinfo > "$before"  # running containers' (not a copy)
end=$(( $(date +%s) + 10 ))
while [ "$(date +%s)" -lt "$end" ]; do
  if grep -o " $folder/[0-9a-f]*/merged " /proc/self/mountinfo | grep -qvxF -f "$before"; then
    mount --bind "$folder" "$folder" && echo "bound during the copy"
    exit 0
  fi
done
echo "no layer mounted"
"""


def test_a_podman_command_started_during_a_warm_up_cannot_empty_its_chowned_copy(engine_args: dict,
                                                                                   image: str) -> None:
    """The CI failure "open …/merged/etc/hosts: permission denied" at every start of a booking: a
    podman command that started while `warm` made the image's chowned copy bind-mounted the store's
    overlay folder over the copy's mount, the copy was chowned empty and recorded complete, and every
    container of the bookings' map saw the image's files as the daemon user's (not its root's: no
    /etc/hosts could be made). Every podman command of gpubook runs under the command lock, a
    warm-up alone: the racer, run under it as gpubook runs its commands and started first, ends
    before the warm-up may begin (without the lock it bound the folder during the copy, every time)."""
    engine = engine_from(**engine_args)
    fresh = registry_kit.tiny_image(engine, f"localhost/gpubook-test/race:{secrets.token_hex(4)}", base=image)
    folder = engine.storage_path() / "overlay"  # type: ignore[attr-defined]
    subprocess.run([*engine.global_argv(), "unshare", "true"], check=True, timeout=120)  # type: ignore[attr-defined]
    runtime = os.environ.get("XDG_RUNTIME_DIR") or f"/run/user/{os.getuid()}"
    pause = (Path(runtime) / "libpod" / "tmp" / "pause.pid").read_text().strip()
    said: list[str] = []

    def race() -> None:
        with engine.command_lock(timeout=300):  # type: ignore[attr-defined]
            said.append(subprocess.run(["nsenter", "-t", pause, "-U", "-m", "--", "sh", "-c", RACER, "racer",
                                        str(folder)], capture_output=True, text=True, timeout=120).stdout.strip())

    try:
        racer = threading.Thread(target=race)
        racer.start()
        time.sleep(0.5)  # the racer watches (without the lock it would see the copy's mount at once)
        warming = threading.Thread(target=engine.warm, args=(fresh,))  # type: ignore[attr-defined]
        warming.start()
        warming.join(timeout=600)
        racer.join(timeout=600)
        assert said == ["no layer mounted"], said
        inside = subprocess.run([*engine.global_argv(), "run", "--rm", "--network", "none",  # type: ignore[attr-defined]
                                 *engine._map_args(), fresh, "stat", "-c", "%u", "/etc"],  # type: ignore[attr-defined]
                                capture_output=True, text=True, timeout=300)
        assert (inside.returncode, inside.stdout.strip()) == (0, "0"), inside.stderr
    finally:
        registry_kit.remove(engine, fresh)
