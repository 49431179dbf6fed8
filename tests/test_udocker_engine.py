"""The engine behaviour against udocker (R1: the host's runc in an unprivileged user namespace), run
as the tests' unprivileged user, with what differs said test by test: one id (the booker's, the
daemon's own on the host), so no root and no sudo inside, and the host's network."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from dataclasses import replace
from pathlib import Path

import pytest

from gpubook.runtime.engines import EngineOptions, engine_from, udocker
from gpubook.runtime.errors import EngineError
from gpubook.scheduler.apply.handlers import notice_argv
from tests.kits.engine_suite import (
    BOOKER,
    Bookings,
    EngineBehaviour,
    _put,
    connect,
    finished_spare,
    lane_port,
    new_key,
    run,
)
from tests.kits.oci_policy import isolation_problems

pytestmark = [pytest.mark.udocker, pytest.mark.skipif(os.geteuid() == 0, reason="udocker runs as a user")]


@pytest.fixture(scope="session")
def engine_args() -> dict:
    return {"name": "udocker", "network": "host"}


@pytest.fixture
def expected_owner():
    # One id: every file a booking writes is the daemon's user's on the host.
    return lambda uid: os.getuid()


class TestUdocker(EngineBehaviour):
    root_inside = False


def test_the_booker_cannot_make_the_input_writable(bookings: Bookings) -> None:
    """The input is a read-only bind made in the container's mount namespace, which belongs to the
    container's user namespace: root there (the daemon's uid) keeps no SYS_ADMIN, and a namespace
    the booker makes for itself gets the bind locked read-only."""
    booking = bookings.start()
    _put(booking.folders.input / "dataset.txt", "numbers\n")
    with connect(booking.spec.port, BOOKER, booking.key) as client:
        status, _, error = run(client, "mount -o remount,rw /data/input")
        assert status != 0, "remounted the input read-write"
        attempt = "unshare -Urm sh -c 'mount -o remount,rw /data/input && echo changed > /data/input/dataset.txt'"
        status, _, error = run(client, attempt)
        assert status != 0, f"a namespace of the booker's own made the input writable: {error}"
    assert (booking.folders.input / "dataset.txt").read_text() == "numbers\n"


def test_files_planted_in_the_containers_root_are_not_trusted(bookings: Bookings, engine_args: dict) -> None:
    """The container's root lies inside udocker's container folder, where the engine keeps its own
    files (labels, runc id) and runc its state: the booker owns that root and plants look-alikes
    there. The engine reads only its own files beside it, never runc's listing of that folder."""
    booking = bookings.start()
    fake = json.dumps({"name": "gpubook-fake", "image": "x", "uid": 0, "gid": 0,
                       "labels": {**booking.spec.labels(), "gpubook.booking": "fake@gpubook"}})
    with connect(booking.spec.port, BOOKER, booking.key) as client:
        plant = (f"printf '%s' '{fake}' > /gpubook.json && echo ROOT > /gpubook-runc-id && "
                 "printf '{\"id\":\"ROOT\",\"init_process_pid\":1,\"config\":{}}' > /state.json")
        assert run(client, plant)[0] == 0
    fresh = engine_from(**engine_args)
    found = fresh.list()
    assert [info.booking_id for info in found if info.name == booking.spec.name] == [booking.spec.booking_id]
    assert not [info for info in found if info.booking_id == "fake@gpubook" or info.name == "gpubook-fake"]
    assert fresh.inspect(booking.spec.name).running


def test_a_bookers_output_never_fills_the_disk(bookings: Bookings) -> None:
    """What the booking's processes write to the container's output is kept in two files of half
    the bound each: 30 MB written, at most LOG_MAX kept."""
    command = ("/bin/sh", "-c", "head -c 30000000 /dev/zero | tr '\\0' x; touch /data/output/written; sleep 600")
    booking = bookings.start(command=command)
    written = booking.folders.output / "written"
    for _ in range(1200):
        if written.exists():
            break
        time.sleep(0.1)
    assert written.exists(), "the writer never finished"
    folder = bookings.engine._folder(booking.spec.name)
    kept = sum(path.stat().st_size for path in folder.glob(f"{udocker.LOG_FILE}*"))
    assert 0 < kept <= udocker.LOG_MAX, f"{kept} bytes of the container's output kept"
    assert len(bookings.engine.logs(booking.spec.name)) <= udocker.LOG_READ_LIMIT


def test_the_warning_reaches_the_bookers_terminal(bookings: Bookings) -> None:
    """The end's warning is an exec as the container's root writing to the booker's terminals: with
    one id, root inside and the booker are the same host id, so the booker's pty takes it."""
    booking = bookings.start()
    with connect(booking.spec.port, BOOKER, booking.key) as client:
        channel = client.invoke_shell()
        channel.settimeout(30)
        channel.send(b"echo shell-is-up\n")
        seen = b""
        while b"shell-is-up\r\n" not in seen:
            seen += channel.recv(4096)
        done = bookings.engine.exec(booking.spec.name, notice_argv("gpubook: this booking ends in 10 minutes"))
        assert done.returncode == 0, done.stderr
        while b"ends in 10 minutes" not in seen:
            seen += channel.recv(4096)
    notice = bookings.engine.exec(booking.spec.name, ["cat", "/run/gpubook/notice"])
    assert "ends in 10 minutes" in notice.stdout


def test_a_container_still_starting_is_never_taken_for_dead(bookings: Bookings, engine_args: dict) -> None:
    """Between `udocker create` and runc's container there are seconds (the labels are written, runc
    has no state yet). A pass that looked then saw "exited", and the stop that followed removed the
    folder under the starting entrypoint (seen: a booking whose /etc vanished as it ran). Now a
    container whose `udocker run` still runs is running, and a stop ends that run first."""
    spec, _ = bookings.spec(key=new_key())
    engine = bookings.engine
    created = engine._udocker(["create", f"--name={spec.name}", spec.image])
    folder = engine.top / "containers" / created.stdout.strip().splitlines()[-1]
    (folder / udocker.LABELS_FILE).write_text(json.dumps(
        {"name": spec.name, "image": spec.image, "uid": spec.uid, "gid": spec.gid, "labels": spec.labels()}))
    run = subprocess.Popen(["sleep", "600"], start_new_session=True)  # stands for the `udocker run` starting it
    try:
        (folder / udocker.RUN_FILE).write_text(f"{run.pid} {udocker._start_time(run.pid)}")
        seen = engine_from(**engine_args).inspect(spec.name)
        assert seen is not None and seen.running, "a starting container was taken for dead"
        engine.stop(spec.name, 5)
        assert run.wait(timeout=30) == -9  # the start's session was ended first
        assert engine.inspect(spec.name) is None and not folder.exists()
    finally:
        run.kill()
        run.wait()


def test_dev_shm_has_the_templates_size(bookings: Bookings) -> None:
    """udocker's spec makes /dev/shm 2 GiB whatever the template says (2097152 KiB seen before the
    policy's shm_size): the template's size wins."""
    bookings.template = replace(bookings.template, shm_size="300m")
    booking = bookings.start()
    said = bookings.engine.exec(booking.spec.name, ["df", "-k", "/dev/shm"])
    assert said.returncode == 0, said
    size_kib = int(said.stdout.splitlines()[-1].split()[1])
    assert size_kib == 300 * 1024, said.stdout


def test_a_booker_can_neither_plant_a_set_uid_file_for_host_logins_nor_reach_its_cgroup_tree(
        bookings: Bookings) -> None:
    """Round 3, H1: udocker's FileBind folder, in /tmp (0755, the daemon's) and bound read-write at
    /.bind_host_files, took the booker's set-uid copy of a binary, which any host login then ran as
    the daemon's account. H2: udocker removes runc's read-only /sys/fs/cgroup, and the host's cgroup
    tree was writable below /sys (under a systemd user unit its files are the daemon's: freeze or
    kill the daemon). The spec runc received is checked against the policy, then each from inside."""
    booking = bookings.start()
    folder = bookings.engine._folder(booking.spec.name)
    received = json.loads((folder / "config.json").read_text())  # the bundle's spec, as the wrapper left it
    policy = json.loads((folder / udocker.POLICY_FILE).read_text())
    writable = {m["target"] for m in policy["mounts"] if not m["read_only"]} | {"/.bind_host_files"}
    assert "/data/output" in writable and "/data/input" not in writable
    assert isolation_problems(received, writable=writable) == []
    with connect(booking.spec.port, BOOKER, booking.key) as client:
        status, _, error = run(client, "cp /bin/true /.bind_host_files/planted && chmod 4755 /.bind_host_files/planted")
        assert status == 0, error  # the booker is the daemon's id: the entrypoint writes /etc/passwd there
        status, listed, _ = run(client, "ls -A /sys/fs/cgroup")
        assert status == 0 and listed.strip() == "", f"the host's cgroup tree is visible: {listed}"
        status, _, _ = run(client, "mkdir /sys/fs/cgroup/x")
        assert status != 0
    planted = [p for p in bookings.engine.top.rglob("planted") if "BIND_FILES" in str(p)]
    assert len(planted) == 1 and planted[0].stat().st_mode & 0o4000  # set-uid, the daemon's ...
    closed = [p for p in planted[0].parents if p.stat().st_mode & 0o001 == 0]
    assert closed, f"{planted[0]}: every account can reach it"  # ... but no other account can run it
    mine = [p for p in Path("/tmp").glob("udocker-*-BIND_FILES") if p.stat().st_uid == os.getuid()]  # noqa: S108
    assert mine == [], "udocker's FileBind folder is in /tmp, where every account reaches it"


def test_a_spare_made_ahead_is_the_next_bookings_container_and_is_made_again(bookings: Bookings) -> None:
    """Issue 42, part 4: `udocker create` (the image's copy, 9 s for debian-ssh on ext4) paid ahead by the
    image preparer's `warm`, so that a booking for now starts without it; the spare taken is made again
    in the background, and a spare of an image since replaced is never used."""
    engine = bookings.engine
    assert isinstance(engine, udocker.UdockerEngine)
    image = bookings.spec(key=new_key())[0].image
    link = engine.top / "containers" / udocker.spare_name(image)

    def spare() -> Path | None:
        return finished_spare(engine, image)

    engine.warm(image)
    made = spare()
    assert made is not None and not (made / udocker.LABELS_FILE).exists()
    assert all(info.name != link.name for info in engine.list())  # never taken for a booking's
    booking = bookings.start()
    mine = engine.top / "containers" / booking.spec.name
    assert (mine.parent / os.readlink(mine)).resolve() == made  # the spare, renamed
    assert not (made / udocker.SPARE_FILE).exists()
    with connect(booking.spec.port, BOOKER, booking.key) as client:
        assert run(client, "id -un")[1].strip() == BOOKER
    deadline = time.monotonic() + 180
    while (again := spare()) is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert again is not None and again != made, "no new spare after the first was taken"
    # A spare of the image as it was before a new pull (its layers recorded otherwise) is removed, not used.
    (again / udocker.SPARE_FILE).write_text(json.dumps({"image": image, "layers": "an older pull"}))
    second = bookings.start()
    theirs = engine.top / "containers" / second.spec.name
    assert (theirs.parent / os.readlink(theirs)).resolve() != again
    assert not again.exists()
    bookings.cleanup()
    deadline = time.monotonic() + 180
    while spare() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert spare() is not None
    # One a killed daemon left half-made (its `udocker create` ended after the daemon: no spare's file) is
    # made again by the next warm; so is one whose folder is gone (a name udocker's `rm` cannot remove).
    half = spare()
    assert half is not None
    (half / udocker.SPARE_FILE).unlink()
    engine.warm(image)
    assert spare() not in (None, half) and not half.exists()
    gone = spare()
    assert gone is not None
    subprocess.run(["chmod", "-R", "u+rwX", str(gone)], check=True)  # udocker's copy has folders without w
    shutil.rmtree(gone)
    assert link.is_symlink() and not link.exists()
    engine.warm(image)
    assert spare() is not None, "a spare name left without its folder blocked every spare after it"
    # A racing daemon that saw no container by a running booking's name never takes that name for the spare.
    class Racing(udocker.UdockerEngine):
        def inspect(self, name: str) -> None:  # type: ignore[override]
            return None

    taken = bookings.start()
    racer = Racing(engine.settings, EngineOptions(global_args=engine.global_args))
    with pytest.raises(EngineError):
        racer.start(replace(taken.spec, port=lane_port()))
    assert engine.inspect(taken.spec.name).id == taken.ready.info.id  # type: ignore[union-attr]
    assert spare() is not None  # the spare stays one
    engine._remove(link.name)  # the other tests start without one
