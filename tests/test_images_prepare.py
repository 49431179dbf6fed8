"""The image preparer with the pass, without a registry: what a pass hands it (bookings within
prepare_hours, never a calendar's image name), that the pass never waits for a pull, the backoff of
a failed pull, the event block's line, and the argv a pull becomes (never an option from a name).

The engines are the real PodmanEngine and DockerEngine with only `_process` replaced by a recorder
(the argv they would run, and the answers a registry would give)."""

from __future__ import annotations

import threading
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from zoneinfo import ZoneInfo

import pytest

from gpubook.runtime.errors import Preparing, TemplateError
from gpubook.runtime.templates import images
from gpubook.runtime.templates.catalog import load_template
from gpubook.scheduler.hosts.images import (
    EVENT_REFRESH,
    FAILED,
    PULLING,
    READY,
    WARMING,
    ImagePreparer,
    Preparation,
)
from gpubook.scheduler.outbox.writeback import Remarks, WriteBack
from gpubook.scheduler.state import State
from tests.kits.booking_kit import vevent
from tests.kits.images_kit import RecordingDocker, lab_preparer, recording
from tests.kits.pass_kit import HOLD, NOW, Machine, bookings, event, make_config, make_pass


class PreparingMachine(Machine):
    def __init__(self, preparer: ImagePreparer) -> None:
        super().__init__()
        self.images = preparer


def test_a_pass_queues_the_bookings_within_prepare_hours_and_never_waits_for_the_pull(
        tmp_path: Path, state: State) -> None:
    config = make_config(tmp_path)
    engine = recording()
    engine.answers.release.clear()  # the pull hangs until the test lets it go
    done = threading.Event()
    preparer = ImagePreparer(engine=engine, ledger=images.Ledger(tmp_path / "images.json"), on_done=done.set)
    passes = make_pass(config, PreparingMachine(preparer), state)
    soon = vevent("soon", f"DTSTART:{NOW + timedelta(hours=2):%Y%m%dT%H%M%SZ}",
                  f"DTEND:{NOW + timedelta(hours=3):%Y%m%dT%H%M%SZ}", "SUMMARY:alice tensorflow-cuda9")
    later = event("later", NOW + timedelta(hours=30), NOW + timedelta(hours=31), user="bob")
    try:
        passes.run(bookings(config, soon, later), now=NOW, write_back=False)  # returns with the pull held
        assert not done.is_set()
        (row,) = preparer.snapshot()["preparations"]
        assert (row["template"], row["bookings"]) == ("tensorflow-cuda9", ["soon"])
        assert row["state"] in ("queued", "pulling")  # the worker holds the pull; the pass went on
        engine.answers.release.set()
        assert done.wait(HOLD)
    finally:
        engine.answers.release.set()
        passes.close()
        preparer.close()
    pulls = [a for a in engine.answers.argv if "pull" in a]
    assert pulls == [["pull", "--", "tensorflow/tensorflow:1.12.0-gpu-py3"]]  # debian-ssh (30 h away): not yet
    assert any(a[0] == "build" for a in engine.answers.argv)  # its sshd overlay, in the background too
    assert preparer.lines() == {"soon": "image: ready"}


def test_a_booking_never_names_an_image_nor_a_flag(tmp_path: Path, state: State) -> None:
    """Whatever an event says, only images of admins' templates are pulled."""
    config = make_config(tmp_path)
    engine = recording()
    preparer = ImagePreparer(engine=engine, ledger=images.Ledger(tmp_path / "images.json"))
    passes = make_pass(config, PreparingMachine(preparer), state)
    start, end = NOW + timedelta(hours=1), NOW + timedelta(hours=2)
    crafted = [
        vevent("a", f"DTSTART:{start:%Y%m%dT%H%M%SZ}", f"DTEND:{end:%Y%m%dT%H%M%SZ}",
               "SUMMARY:alice evil.example:5000/x:1"),
        event("b", start, end, extra=("DESCRIPTION:template: --authfile=/etc/shadow",)),
        event("c", start, end, extra=("DESCRIPTION:template: evil.example/x\\nimage: evil.example/x:1",)),
        event("d", start, end, extra=("DESCRIPTION:image: -v\\nmirror: evil.example",)),
    ]
    try:
        passes.run(bookings(config, *crafted), now=NOW, write_back=False)
    finally:
        passes.close()
        preparer.close()
    named = " ".join(" ".join(argv) for argv in engine.answers.argv)
    assert "evil" not in named and "shadow" not in named and " -v" not in named
    # The default template's image is made here (never pulled): no pull at all.
    assert [a for a in engine.answers.argv if "pull" in a] == []
    assert {row["template"] for row in preparer.snapshot()["preparations"]} <= {"debian-ssh"}


def test_a_pull_is_argv_with_the_name_after_double_dash_and_never_an_option(tmp_path: Path) -> None:
    auth = tmp_path / "auth.json"
    auth.write_text('{"auths": {"registry.example": {"auth": "bGFiOnNlY3JldA=="}}}')
    podman = recording()
    for hostile in ("--authfile=/etc/shadow", "-v", "registry.example/x --tls-verify=false", "a/--b:1",
                    "registry.example/x:1@sha256:short"):
        with pytest.raises(TemplateError):
            podman.pull(hostile, auth_file=auth)
    assert podman.answers.argv == []  # refused before any engine ran
    podman.pull("registry.example/lab/x:1", auth_file=auth)
    assert podman.answers.argv[-1] == ["pull", "--authfile", str(auth), "--", "registry.example/lab/x:1"]
    docker = recording(RecordingDocker)
    docker.pull("registry.example/lab/x:1", auth_file=auth)
    argv = docker.answers.argv[-1]
    assert argv[0] == "--config" and argv[2:] == ["pull", "--", "registry.example/lab/x:1"]
    assert docker.answers.auth_seen == [auth.read_text()]
    assert not Path(argv[1]).exists()  # the credentials' copy is gone with the pull


@pytest.mark.parametrize("line", ['image = "-v"', 'image = "--authfile=/etc/shadow"',
                                  'image = "x"\nmirror = "--tls-verify=false"', 'image = "x"\nmirror = "evil"'])
def test_a_template_cannot_make_an_option_of_its_image_or_mirror(tmp_path: Path, line: str) -> None:
    path = tmp_path / "lab.toml"
    path.write_text(f'{line}\ncuda = "none"\n')
    with pytest.raises(TemplateError):
        load_template(path)


def test_a_failed_pull_is_tried_again_after_a_growing_delay_not_in_a_loop(tmp_path: Path) -> None:
    engine = recording()
    engine.answers.pull_fails = ("Error: initializing source docker://registry.example/lab/x:1: reading manifest 1 "
                                 "in registry.example/lab/x: unauthorized: authentication required")
    template, done, preparer = lab_preparer(tmp_path, engine)
    try:
        now = datetime.now(UTC)
        preparer.want({"b": template}, now=now)
        assert done.acquire(timeout=HOLD)
        for seconds in range(0, 60, 5):  # passes in the first minute: no new pull
            preparer.want({"b": template}, now=now + timedelta(seconds=seconds))
        (row,) = preparer.snapshot()["preparations"]
        assert (row["state"], row["why"], row["attempts"]) == (FAILED, images.REFUSED, 1)
        preparer.want({"b": template}, now=now + timedelta(seconds=61))
        assert done.acquire(timeout=HOLD)
        (row,) = preparer.snapshot()["preparations"]
        assert row["attempts"] == 2
        assert datetime.fromisoformat(row["retry_at"]) - datetime.fromisoformat(row["since"]) >= timedelta(seconds=119)
    finally:
        preparer.close()
    assert sum("pull" in a for a in engine.answers.argv) == 2
    assert preparer.lines() == {"b": "image: not ready: registry refused (registry.example/lab/x:1); gpubook "
                                      "tries again"}


def test_the_event_block_says_whether_the_image_is_ready(tmp_path: Path, state: State) -> None:
    config = make_config(tmp_path)
    (booking,) = bookings(config, event("x", NOW + timedelta(hours=3), NOW + timedelta(hours=4)))
    plan = make_pass(config, Machine(), state).plan([booking], [], now=NOW)
    line = "image: not ready: not found (registry.example/lab/x:1); gpubook tries again"
    remarks = Remarks(refused={}, failures={}, notes={}, images={"x": line})
    outcome = WriteBack(config, state).outcome(plan.accepted[0], None, None, remarks=remarks, now=NOW)
    assert outcome is not None and outcome.lines[-1] == line


@pytest.fixture
def state(tmp_path: Path):  # type: ignore[no-untyped-def]
    with State(tmp_path / "state.sqlite", busy_timeout=0.2) as opened:
        yield opened


def test_an_image_removed_after_it_was_prepared_is_prepared_again_not_failed_forever(tmp_path: Path) -> None:
    """An admin removes a prepared image: the next start's failure finds it gone and queues a new
    pull (LocalHost.start then holds the booking with Preparing), instead of every start failing."""
    engine = recording()
    template, done, preparer = lab_preparer(tmp_path, engine)
    try:
        now = datetime.now(UTC)
        preparer.want({"b": template}, now=now)
        assert done.acquire(timeout=HOLD)
        assert preparer.ready(template, now=now) == "registry.example/lab/x:1"
        assert preparer.recheck(template, now=now)  # still there: the start's failure was something else
        engine.answers.present.clear()  # `podman rmi` by an admin
        assert not preparer.recheck(template, now=now)
        assert done.acquire(timeout=HOLD)
        assert preparer.ready(template, now=now) == "registry.example/lab/x:1"
    finally:
        preparer.close()
    assert sum("pull" in a for a in engine.answers.argv) == 2



def test_the_sentence_of_an_image_on_its_way_and_when_it_should_be_ready(tmp_path: Path) -> None:
    """Issue 27: "preparing image pytorch: 4.1 of 9.3 GB, ready about 10:42" in the bookers' zone;
    MB under a GB; the estimate is the rate so far for what is left, plus the last preparation's
    pace after the download; events see a new sentence at most every EVENT_REFRESH."""
    zone = ZoneInfo("Europe/Paris")
    began = datetime(2026, 11, 24, 9, 30, tzinfo=UTC)
    pulling = Preparation("pytorch", "lab/pytorch:1", "lab/pytorch:1", PULLING, began, total=9_300_000_000,
                          done=4_100_000_000, began=began, ready_about=datetime(2026, 11, 24, 9, 42, tzinfo=UTC))
    assert pulling.sentence(zone) == "preparing image pytorch: 4.1 of 9.3 GB, ready about 10:42"
    assert pulling.line(zone) == pulling.sentence(zone)  # the event's line while it is made
    small = replace(pulling, total=15_000_000, done=6_000_000, ready_about=None)
    assert small.sentence() == "preparing image pytorch: 6 of 15 MB"
    assert replace(pulling, state=WARMING).sentence(UTC).startswith(
        "preparing image pytorch: downloaded, making its first start ready, ready about 09:42")
    assert replace(pulling, total=None, done=2_500_000_000, ready_about=None).sentence() == \
        "preparing image pytorch: 2.5 GB downloaded"

    preparer = ImagePreparer(engine=recording(), ledger=images.Ledger(tmp_path / "images.json"), zone=zone)
    try:
        preparer.after_download = 0.0
        assert preparer._estimate(1000, 0, began, now=began + timedelta(seconds=10)) is None  # no rate yet
        halfway = preparer._estimate(1000, 500, began, now=began + timedelta(minutes=5))
        assert halfway == began + timedelta(minutes=10)  # as long again for the other half
        preparer.after_download = 0.01
        came = began + timedelta(minutes=5)  # the last byte: unpacking, then the copy, at the learned pace
        assert preparer._estimate(1000, 1000, began, now=came + timedelta(seconds=7), downloaded=came) == \
            came + timedelta(seconds=10)
        assert replace(pulling, done=pulling.total).sentence(zone) == \
            "preparing image pytorch: 9.3 GB downloaded, unpacking, ready about 10:42"
        first = preparer._shown_line(pulling, now=began)
        later = replace(pulling, done=4_600_000_000)
        assert preparer._shown_line(later, now=began + EVENT_REFRESH / 2) == first  # not rewritten yet
        assert preparer._shown_line(later, now=began + EVENT_REFRESH) == later.sentence(zone)
        warming = replace(later, state=WARMING)
        assert preparer._shown_line(warming, now=began + EVENT_REFRESH * 1.1) == warming.sentence(zone)  # a new step
        assert preparer._shown_line(replace(later, state=READY), now=began + EVENT_REFRESH) == "image: ready"
    finally:
        preparer.close()


def test_a_booking_waits_for_the_warm_up_of_an_image_pulled_a_moment_ago(tmp_path: Path) -> None:
    """Pulled, present, and its first start's copy being made: a start waits for that copy (it would
    pay it anyway, beside the preparer's) and is told so; the moment the image is ready it may go.
    An image that was there before its preparation was queued starts at once."""
    engine = recording()
    engine.answers.warm.clear()  # the warm-up's `podman create` holds
    engine.answers.release.clear()  # and the pull, once podman has named the image
    engine.answers.tagged_early = True
    template, done, preparer = lab_preparer(tmp_path, engine)
    try:
        preparer.want({"b": template}, now=NOW)
        while not engine.image_exists(template.image):
            threading.Event().wait(0.01)
        with pytest.raises(Preparing, match="^preparing image lab: "):  # present, not yet pulled to the end
            preparer.ready(template)
        engine.answers.release.set()
        wait_until = datetime.now(UTC) + timedelta(seconds=HOLD)
        while preparer.snapshot()["preparations"][0]["state"] != WARMING:
            assert datetime.now(UTC) < wait_until, preparer.snapshot()
            threading.Event().wait(0.01)
        assert engine.image_exists(template.image)  # pulled
        with pytest.raises(Preparing, match="^preparing image lab: downloaded, making its first start ready"):
            preparer.ready(template)
        engine.answers.warm.set()
        assert done.acquire(timeout=HOLD)
        assert preparer.ready(template) == template.image
        warm = [a for a in engine.answers.argv if a[0] == "create"]
        assert len(warm) == 1 and engine._map_args()[0] in warm[0] and warm[0][-2:] == [template.image, "true"]
    finally:
        engine.answers.warm.set()
        preparer.close()


def test_a_booking_that_starts_on_a_queued_image_makes_its_first_start_alone(tmp_path: Path) -> None:
    """An image present before its preparation came round (a booking saved after its start): the
    booking starts at once and makes the first chowned copy itself; the preparation leaves its
    warm-up out, and a second booking waits for the preparation: no two first starts of an image
    at once (suspected in a CI run where every start failed with "permission denied" mounting
    /etc/hosts right after the warm-up's `create` and a booking's `run` overlapped)."""
    engine = recording()
    engine.answers.release.clear()  # the other template's pull holds the only worker
    other = tmp_path / "other.toml"
    other.write_text('image = "registry.example/lab/other:1"\ncuda = "none"\nhas_sshd = true\n')
    template, _, _ = lab_preparer(tmp_path, engine)
    engine.answers.present.add(template.image)
    done = threading.Semaphore(0)
    preparer = ImagePreparer(engine=engine, ledger=images.Ledger(tmp_path / "ledger.json"), workers=1,
                             on_done=done.release)
    try:
        preparer.want({"a": load_template(other), "b": template, "c": template}, now=NOW)
        assert preparer.ready(template) == template.image  # queued, present: the booking goes
        with pytest.raises(Preparing, match="^preparing image lab: queued"):
            preparer.ready(template)  # one first start at a time: the next waits for the preparation
        engine.answers.release.set()
        assert done.acquire(timeout=HOLD) and done.acquire(timeout=HOLD)
        assert preparer.ready(template) == template.image
        warmed = [a[-2] for a in engine.answers.argv if a[0] == "create"]
        assert warmed == ["registry.example/lab/other:1"]  # the booking's own start made lab's copy
    finally:
        engine.answers.release.set()
        preparer.close()
