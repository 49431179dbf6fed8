"""issue 9, findings 3, 8 and 9: no booking or calendar writer can hold the service.

- Ports (3): a port is held only by a running container or a start in progress; a failed start
  gives it back; a bad UID is refused before a port is taken; a port busy on the host is skipped.
- State errors (8): a locked database fails one booking's step, never the pass.
- Slow steps (9): bookings' actions run in parallel, so a notice a booker's terminal holds up, an
  image being built, or a hung calendar server never delays another booking; a start that keeps
  failing backs off.

A real State (SQLite), a real Pass, real Radicale and a real TCP server that never answers; the
host is a tiny class meeting the Host protocol whose steps the test holds up with events and
records in the order they happened. Orderings are asserted, never durations.
"""

from __future__ import annotations

import socket
import sqlite3
import threading
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest

from gpubook.runtime.engines import ContainerInfo, container_name
from gpubook.runtime.errors import EngineError
from gpubook.runtime.templates import images
from gpubook.scheduler.apply.ahead import LEAD
from gpubook.scheduler.apply.memory import START_BACKOFF, STATE_RETRY
from gpubook.scheduler.core import decide
from gpubook.scheduler.core.bookings import Booking, Rejection
from gpubook.scheduler.hosts import Ahead, Booker, Started, StartRequest
from gpubook.scheduler.hosts.images import ImagePreparer
from gpubook.scheduler.state import State, notes
from tests.kits import servers
from tests.kits.booking_kit import vcalendar, vevent
from tests.kits.daemon_kit import port_range
from tests.kits.pass_kit import HOLD, NOW, Machine, bookings, event, make_config, make_pass, running


@pytest.fixture
def state(tmp_path: Path) -> Iterator[State]:
    with State(tmp_path / "state.sqlite", busy_timeout=0.2) as state:
        yield state


# -- finding 3: ports --------------------------------------------------------------------------


def test_a_uid_with_a_tab_is_refused_before_it_takes_a_port(tmp_path: Path, state: State) -> None:
    """One HOURLY event with a TAB in its UID used to keep one more port after each occurrence."""
    config = make_config(tmp_path, ports=(2200, 2201))
    machine = Machine()
    passes = make_pass(config, machine, state)
    try:
        hourly = event("tab\tuid", NOW - timedelta(minutes=1), NOW + timedelta(minutes=30),
                       extra=("RRULE:FREQ=HOURLY;COUNT=5",))
        for hour in range(3):
            now = NOW + timedelta(hours=hour)
            passes.run(bookings(config, hourly, now=now), now=now, write_back=False)
            assert state.ports() == {}, hour
        good = event("good", NOW + timedelta(hours=3) - timedelta(minutes=1), NOW + timedelta(hours=5))
        now = NOW + timedelta(hours=3)
        passes.run(bookings(config, hourly, good, now=now), now=now, write_back=False)
    finally:
        passes.close()
    assert ("running", "good") in machine.steps
    assert not any(booking.startswith("tab") for _, booking in machine.steps)  # never reached a host
    # refused where the calendar is read (round 3, M1), with the sentence the start gave before
    refused = bookings(config, hourly, now=NOW)
    assert refused and all(isinstance(o, Rejection) and "is empty or has control characters" in o.reason
                           for o in refused)


def test_a_failed_start_gives_its_port_back(tmp_path: Path, state: State) -> None:
    with socket.socket() as probe:  # a port free on this host now: 2200 may be busy (another test's TIME-WAIT)
        probe.bind(("0.0.0.0", 0))  # noqa: S104 - as the state's own check binds
        port = probe.getsockname()[1]
    config = make_config(tmp_path, ports=(port, port))  # one port only
    machine = Machine()
    machine.failing["broken"] = EngineError("image localhost/x is not present")
    passes = make_pass(config, machine, state)
    try:
        broken = event("broken", NOW - timedelta(minutes=1), NOW + timedelta(hours=1))
        passes.run(bookings(config, broken), now=NOW, write_back=False)
        assert state.ports() == {}
        good = event("good", NOW - timedelta(minutes=1), NOW + timedelta(hours=1), user="bob")
        # Within the broken start's backoff (START_BACKOFF): at NOW + 10 min its retry ran in the
        # same pass as "good", the two raced for the one port, and "good" lost now and then.
        later = NOW + START_BACKOFF / 2
        passes.run(bookings(config, broken, good, now=later), now=later, write_back=False)
    finally:
        passes.close()
    assert ("running", "good") in machine.steps
    assert state.ports() == {"good": port}


def test_a_port_held_but_busy_on_the_host_is_skipped_after_one_failed_start(state: State) -> None:
    """A start in progress that was cut short (a crash) left its port recorded; a booker now listens
    on it. The booking is given its port again (a restart's port is busy a moment with its died
    container's forwarder, which the engine's start removes and waits for); that start fails on it
    ("already in use") and gives it back, and the next gets another port, never that one on every retry."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        low = probe.getsockname()[1]
    port = state.port_for("b1", port_min=low, port_max=low + 50, now=NOW)
    with socket.socket() as squatter:
        squatter.bind(("0.0.0.0", port))  # noqa: S104 - as a booker's server on host network would
        squatter.listen()
        assert state.port_for("b1", port_min=low, port_max=low + 50, now=NOW) == port
        state.release_port("b1")  # the start failed on it
        again = state.port_for("b1", port_min=low, port_max=low + 50, now=NOW)
    assert again != port
    assert state.ports() == {"b1": again}


def test_ports_of_bookings_with_no_running_container_are_freed_by_the_next_pass(tmp_path: Path,
                                                                               state: State) -> None:
    config = make_config(tmp_path)
    state.port_for("gone", port_min=2200, port_max=2299, now=NOW)  # a start cut short by a crash
    passes = make_pass(config, Machine(), state)
    try:
        passes.run([], now=NOW, write_back=False)
    finally:
        passes.close()
    assert state.ports() == {}


# -- finding 8: state errors -------------------------------------------------------------------


@pytest.mark.slow  # a second or more: out of the fast lane
def test_a_locked_database_fails_each_booking_alone_and_the_pass_goes_on(tmp_path: Path, state: State) -> None:
    config = make_config(tmp_path)
    machine = Machine()
    passes = make_pass(config, machine, state)
    first = event("first", NOW - timedelta(minutes=1), NOW + timedelta(hours=1))
    second = event("second", NOW - timedelta(minutes=1), NOW + timedelta(hours=1), user="bob")
    locker = sqlite3.connect(state.path, isolation_level=None)
    locker.execute("BEGIN EXCLUSIVE")  # another process holding the database
    try:
        result = passes.run(bookings(config, first, second), now=NOW, write_back=False)
    finally:
        locker.execute("ROLLBACK")
        locker.close()
    try:
        assert set(result.failures) == {"first", "second"}  # both attempted, each failed alone
        assert all("could not be used" in why for why in result.failures.values()), result.failures
        assert result.wake_at is not None and result.wake_at > NOW  # the daemon wakes again for them
        later = result.wake_at
        passes.run(bookings(config, first, second, now=later), now=later, write_back=False)
    finally:
        passes.close()
    assert {b for what, b in machine.steps if what == "running"} == {"first", "second"}


# -- finding 9: no booking waits on another's slow step ----------------------------------------


def test_a_notice_held_up_in_one_container_does_not_delay_another_start(tmp_path: Path, state: State) -> None:
    config = make_config(tmp_path)
    machine = Machine()
    ending = NOW + timedelta(minutes=5)  # within warn_minutes: the pass warns it
    machine.containers[container_name("ending")] = running("ending", (0,), end=ending)
    state.container_started("ending", container_name("ending"), user="alice", gpu_count=1, at=NOW)
    passes = make_pass(config, machine, state)
    passes.patience = 0  # the pass leaves slow work to finish alone
    try:
        occurrences = bookings(config, event("ending", NOW - timedelta(hours=1), ending),
                               event("next", NOW - timedelta(seconds=1), NOW + timedelta(hours=1), user="bob"))
        result = passes.run(occurrences, now=NOW, write_back=False)
        assert {type(a) for a in result.actions} >= {decide.Warn, decide.Start}
        assert machine.exec_began.wait(HOLD)
        started = getattr(passes, "busy", {}).get("next")
        if started is not None:
            started.result(HOLD)
        assert ("running", "next") in machine.steps
        assert ("exec returned", "ending") not in machine.steps  # the notice is still held up
        # A later pass skips the booking still at work instead of waiting for it.
        passes.run(occurrences, now=NOW + timedelta(seconds=1), write_back=False)
        assert machine.steps.count(("exec", "ending")) == 1
    finally:
        machine.release_exec.set()
        passes.close()


@pytest.mark.parametrize("port_held", [True, False])
def test_a_start_cut_before_its_record_and_then_cancelled_is_stopped_after_the_notice(
        tmp_path: Path, state: State, port_held: bool) -> None:
    """The fault harness's finding: the daemon killed between `podman run` and State's record of the
    start, and the booking cancelled before it came back. The container runs on the port State gave
    that start: gpubook's own, so it is warned and stopped after the notice like any cancelled
    booking, not left to run to the end its labels carry (it held its GPU from the next booking).
    A container State knows nothing of (no record, no port) is still left to its end."""
    config = make_config(tmp_path)
    machine = Machine()
    port, _ = port_range(1)  # free now, in this lane's block (the state probes it on this host)
    info = running("cut", (0,), end=NOW + timedelta(hours=1), port=port)
    machine.containers[info.name] = info
    machine.release_exec.set()  # the notice's exec answers at once
    if port_held:
        assert state.port_for("cut", port_min=port, port_max=port, now=NOW) == port
    passes = make_pass(config, machine, state)
    other = event("other", NOW + timedelta(hours=2), NOW + timedelta(hours=3))  # the calendar, read, without "cut"
    try:
        result = passes.run(bookings(config, other), now=NOW, write_back=False)
    finally:
        machine.release_exec.set()
        passes.close()
    warned = [a for a in result.actions if isinstance(a, decide.Warn) and a.booking_id == "cut"]
    if port_held:
        assert warned and warned[0].stop_at == NOW + timedelta(seconds=config.daemon.notice_seconds)
    else:
        assert not warned
        assert any(isinstance(a, decide.Recheck) and a.at == info.end for a in result.actions)


def test_a_start_still_at_work_is_not_adopted_by_a_later_pass(tmp_path: Path, state: State) -> None:
    """The container of a start whose SSH probe has not answered yet runs already: a later pass must
    leave it to its start, not adopt it (which wrote `running` before SSH answered and, when the
    probe then failed, recorded a death and restarted it)."""
    config = make_config(tmp_path)
    probing, give_up = threading.Event(), threading.Event()

    class Probing(Machine):
        def start(self, request: StartRequest) -> Started:
            info = running(request.booking_id, request.gpus, end=request.end, port=request.port)
            self.containers[info.name] = info  # the engine started it; the probe waits
            probing.set()
            give_up.wait(HOLD)
            self.containers.pop(info.name)  # the probe failed: the start removes its container
            raise EngineError(f"booking {request.booking_id}: SSH did not let the probe in")

    machine = Probing()
    passes = make_pass(config, machine, state)
    passes.patience = 0
    try:
        occurrences = bookings(config, event("slow", NOW - timedelta(seconds=1), NOW + timedelta(hours=1)))
        passes.run(occurrences, now=NOW, write_back=False)
        assert probing.wait(HOLD)
        passes.run(occurrences, now=NOW + timedelta(seconds=1), write_back=False)
        start = passes.busy["slow"]
        give_up.set()
        start.result(HOLD)
        assert state.containers(booking_id="slow") == []  # a failed start, never a run that died
        assert not any("adopted" in e.message for e in state.events(limit=None))
    finally:
        give_up.set()
        passes.close()


def test_a_start_waits_for_the_stop_that_frees_its_gpu(tmp_path: Path, state: State) -> None:
    """Parallel, but never two bookings on one GPU: the start on GPU 0 follows the stop of the
    booking that ended there."""
    config = make_config(tmp_path)
    machine = Machine(gpus=(0,))
    machine.containers[container_name("old")] = running("old", (0,), end=NOW)
    state.container_started("old", container_name("old"), user="alice", gpu_count=1, at=NOW - timedelta(hours=1))
    stopped = threading.Event()
    original_stop = machine.stop

    def slow_stop(name: str, grace: float) -> None:
        machine.step("stopping", "old")
        stopped.wait(0.2)  # long enough for a start that did not wait to get in first
        original_stop(name, grace)
        machine.step("stopped", "old")

    machine.stop = slow_stop  # type: ignore[method-assign]
    passes = make_pass(config, machine, state)
    try:
        occurrences = bookings(config, event("old", NOW - timedelta(hours=1), NOW),
                               event("new", NOW, NOW + timedelta(hours=1), user="bob"))
        passes.run(occurrences, now=NOW + timedelta(seconds=1), write_back=False)
    finally:
        passes.close()
    assert machine.steps.index(("stopped", "old")) < machine.steps.index(("start", "new"))


def test_a_start_waits_for_the_next_pass_when_the_stop_that_frees_its_gpu_does(tmp_path: Path,
                                                                             state: State) -> None:
    """The ended booking still at work (its warning held up in a booker's terminal) when the pass
    that stops it runs: its stop waits for the next pass, and so does the start on its GPU (CI
    once saw both bookings run on GPU 0 for a pass)."""
    config = make_config(tmp_path)
    machine = Machine(gpus=(0,))
    ending = NOW + timedelta(minutes=5)  # within warn_minutes: the first pass warns it
    machine.containers[container_name("old")] = running("old", (0,), end=ending)
    state.container_started("old", container_name("old"), user="alice", gpu_count=1, at=NOW - timedelta(hours=1))
    original_stop = machine.stop

    def stop(name: str, grace: float) -> None:
        original_stop(name, grace)
        machine.step("stopped", "old")

    machine.stop = stop  # type: ignore[method-assign]
    passes = make_pass(config, machine, state)
    passes.patience = 0
    occurrences = bookings(config, event("old", NOW - timedelta(hours=1), ending),
                           event("new", ending, ending + timedelta(hours=1), user="bob"))
    try:
        passes.run(occurrences, now=NOW, write_back=False)
        assert machine.exec_began.wait(HOLD)
        warning = passes.busy["old"]
        passes.run(occurrences, now=ending + timedelta(seconds=1), write_back=False)
        for future in [f for b, f in passes.busy.items() if b != "old"]:  # patience 0: what this pass began
            future.result(HOLD)
        assert ("start", "new") not in machine.steps, machine.steps  # GPU 0 is still old's
        machine.release_exec.set()
        warning.result(HOLD)
        passes.run(occurrences, now=ending + timedelta(seconds=2), write_back=False)
        for future in list(passes.busy.values()):
            future.result(HOLD)
    finally:
        machine.release_exec.set()
        passes.close()
    assert machine.steps.index(("stopped", "old")) < machine.steps.index(("start", "new"))


def test_a_start_waits_while_another_bookings_start_at_work_takes_its_gpu(tmp_path: Path, state: State) -> None:
    """The fault sample's finding (seed 441597265, a clean-clone run): a booking's start at work (its
    `podman run`, slow on a loaded host), then its event deleted and another booking given its GPU.
    The container of the first is not listed yet, so the plan and the world both say GPU 0 is free:
    the second started on it, and both ran on GPU 0 until the first's notice ended. The second's
    start now waits for a pass that sees the first running (and warns and stops it)."""
    config = make_config(tmp_path)
    began, finish = threading.Event(), threading.Event()

    class Slow(Machine):
        def start(self, request: StartRequest) -> Started:
            if request.booking_id == "first":
                self.step("start", "first")
                began.set()
                finish.wait(HOLD)  # `podman run` at work: nothing listed yet
                info = running("first", request.gpus, end=request.end, port=request.port)
                self.containers[info.name] = info
                self.step("running", "first")
                return Started(info=info, seconds_to_ssh=0.0)
            return super().start(request)

    machine = Slow(gpus=(0,))
    machine.release_exec.set()  # the notice to the deleted booking's container answers at once
    passes = make_pass(config, machine, state)
    passes.patience = 0
    first = event("first", NOW - timedelta(seconds=1), NOW + timedelta(hours=1))
    second = event("second", NOW - timedelta(seconds=1), NOW + timedelta(hours=1), user="bob")
    try:
        passes.run(bookings(config, first), now=NOW, write_back=False)
        assert began.wait(HOLD)
        passes.run(bookings(config, second), now=NOW + timedelta(seconds=1), write_back=False)
        for future in [f for b, f in passes.busy.items() if b != "first"]:
            future.result(HOLD)
        assert ("start", "second") not in machine.steps, machine.steps  # GPU 0 is being taken by first
        finish.set()
        passes.busy["first"].result(HOLD)
        result = passes.run(bookings(config, second), now=NOW + timedelta(seconds=2), write_back=False)
        for future in list(passes.busy.values()):
            future.result(HOLD)
        assert ("start", "second") not in machine.steps, machine.steps
        assert any(isinstance(a, decide.Hold) and a.booking_id == "second" and "still used by first" in a.reason
                   for a in result.actions), result.actions
    finally:
        finish.set()
        passes.close()


def test_a_start_that_keeps_failing_backs_off(tmp_path: Path, state: State) -> None:
    config = make_config(tmp_path)
    machine = Machine()
    machine.failing["mute"] = EngineError("booking mute: SSH on port 2200 did not let the probe in within 60 s")
    passes = make_pass(config, machine, state)
    mute = event("mute", NOW - timedelta(minutes=1), NOW + timedelta(hours=1))
    tries = []
    try:
        for seconds in range(0, 40, 2):  # a pass every 2 s, as boundaries and polls come
            now = NOW + timedelta(seconds=seconds)
            passes.run(bookings(config, mute, now=now), now=now, write_back=False)
            tries.append(machine.steps.count(("start", "mute")))
    finally:
        passes.close()
    assert tries[-1] <= 3, tries  # 0 s, then 10 s later, then 20 s after that: not 20 tries


@pytest.mark.slow  # a second or more: out of the fast lane
def test_a_start_failing_on_state_itself_is_tried_again_soon_not_backed_off(tmp_path: Path, state: State) -> None:
    """The fault harness's full-disk case: while State cannot be written (its disk full, another
    process holding it), a due booking's start fails each time. That is no fault of the booking's:
    it is tried again every STATE_RETRY, never after a doubling wait (minutes after five failures),
    so it starts within seconds of State working again."""
    config = make_config(tmp_path)
    machine = Machine()
    passes = make_pass(config, machine, state)
    due = event("due", NOW - timedelta(minutes=1), NOW + timedelta(hours=1))
    now = NOW
    locker = sqlite3.connect(state.path, isolation_level=None)
    locker.execute("BEGIN EXCLUSIVE")
    try:
        for _ in range(5):
            result = passes.run(bookings(config, due, now=now), now=now, write_back=False)
            assert "due" in result.failures, result.failures
            assert result.wake_at is not None and now < result.wake_at <= now + STATE_RETRY
            now = result.wake_at
        locker.execute("ROLLBACK")
        passes.run(bookings(config, due, now=now), now=now, write_back=False)
    finally:
        locker.close()
        passes.close()
    assert ("running", "due") in machine.steps


def test_an_image_being_built_holds_only_its_own_booking(tmp_path: Path, state: State) -> None:
    """The overlay build (apt-get, up to an hour) runs in the background: the booking is held with
    "preparing image NAME: ..." while the other booking starts."""
    build_may_end = threading.Event()

    class SlowBuildEngine:
        """Only what the image preparer uses here: no overlay yet, and a build the test holds up (the
        overlay needs an engine that is a Builder: `build` and `import_rootfs`)."""

        name = "slow-build"

        def ensure_image(self, image: str, *, pull: bool = False) -> None:
            if "overlay" in image and not build_may_end.is_set():
                raise EngineError(f"image {image} is not present")

        def build(self, tag: str, context: Path, *, containerfile: str = "Containerfile") -> None:
            machine.step("building", tag)
            build_may_end.wait(HOLD)
            machine.step("built", tag)

        def import_rootfs(self, tarball: Path, tag: str) -> None:
            raise NotImplementedError("no template here is built from a root file system")

    class BuildingMachine(Machine):
        def start(self, request: StartRequest) -> Started:
            if not request.template.has_sshd:
                builds.ready(request.template)  # as LocalHost.start does
            return super().start(request)

    config = make_config(tmp_path)
    machine = BuildingMachine()
    engine = SlowBuildEngine()
    built = threading.Event()
    builds = ImagePreparer(engine=engine, ledger=images.Ledger(tmp_path / "images.json"),  # type: ignore[arg-type]
                           on_done=built.set)
    passes = make_pass(config, machine, state)
    try:
        x = vevent("x", f"DTSTART:{NOW:%Y%m%dT%H%M%SZ}", f"DTEND:{NOW + timedelta(hours=1):%Y%m%dT%H%M%SZ}",
                   "SUMMARY:alice digits-cuda8")
        y = event("y", NOW, NOW + timedelta(hours=1), user="bob")
        occurrences = bookings(config, x, y)
        assert {o.id for o in occurrences if isinstance(o, Booking)} == {"x", "y"}
        passes.run(occurrences, now=NOW, write_back=False)
        assert ("running", "y") in machine.steps
        assert not any(what == "built" for what, _ in machine.steps)  # x's image is still being built
        assert notes.read(state).held.get("x", "").startswith("preparing image digits-cuda8: ")
        assert "x" not in passes.recall.failures
        build_may_end.set()
        assert built.wait(HOLD)
        later = NOW + timedelta(seconds=5)
        passes.run(occurrences, now=later, write_back=False)
    finally:
        build_may_end.set()
        builds.close()
        passes.close()
    assert ("running", "x") in machine.steps
    assert machine.steps.index(("running", "y")) < machine.steps.index(("running", "x"))


class SilentServer:
    """A TCP server that accepts and never answers: a hung calendar server."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen()
        self.port = self.sock.getsockname()[1]
        self.accepted = threading.Event()
        self.client_gave_up = threading.Event()
        self.connections: list[socket.socket] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                connection, _ = self.sock.accept()
            except OSError:
                return
            self.connections.append(connection)
            self.accepted.set()
            threading.Thread(target=self._drain, args=(connection,), daemon=True).start()

    def _drain(self, connection: socket.socket) -> None:
        try:
            while connection.recv(65536):
                pass
        except OSError:
            pass
        self.client_gave_up.set()

    def close(self) -> None:
        self.sock.close()
        for connection in self.connections:
            connection.close()


@pytest.mark.caldav
def test_a_hung_calendar_server_does_not_delay_another_calendars_write_back(
        tmp_path: Path, state: State, radicale_server: servers.CalendarServer) -> None:
    silent = SilentServer()
    hung_url = f"http://127.0.0.1:{silent.port}/lab/hung/"
    calendar = radicale_server.new_calendar()
    good_url = str(calendar.url)
    config = make_config(tmp_path, calendars=(hung_url, good_url))
    start, end = NOW + timedelta(days=1), NOW + timedelta(days=1, hours=1)
    calendar.save_event(vcalendar(event("good", start, end, user="bob")))
    machine = Machine()
    passes = make_pass(config, machine, state)
    try:
        occurrences = [*bookings(config, event("hung", start, end), calendar_url=hung_url),
                       *bookings(config, event("good", start, end, user="bob"), calendar_url=good_url)]
        href = str(calendar.event_by_uid("good").url)
        occurrences = [o if o.id != "good" else _with_href(o, href) for o in occurrences]
        assert [o.id for o in occurrences] == ["hung", "good"]  # the hung calendar's event comes first
        passes.run(occurrences, now=NOW, etags={})
        assert silent.accepted.wait(HOLD)
        deadline = threading.Event()
        for _ in range(int(HOLD * 20)):
            if "accepted:" in str(calendar.event_by_uid("good").icalendar_component.get("DESCRIPTION", "")):
                break
            deadline.wait(0.05)
        assert not silent.client_gave_up.is_set()  # written while the other server still hangs
        assert "accepted:" in str(calendar.event_by_uid("good").icalendar_component.get("DESCRIPTION", ""))
    finally:
        silent.close()
        passes.close()


def _with_href(item: Booking | Rejection, href: str) -> Booking | Rejection:
    from dataclasses import replace

    return replace(item, href=href)


# -- issue 11: bookings starting together ---------------------------------------------------------


def test_bookings_starting_together_start_in_parallel(tmp_path: Path, state: State) -> None:
    """Three bookings at one start: each start waits at a barrier for the other two, so they all
    run only if the three starts are under way at the same time (serial starts break the barrier)."""
    config = make_config(tmp_path)
    together = threading.Barrier(3, timeout=HOLD)

    class Together(Machine):
        def start(self, request: StartRequest) -> Started:
            self.step("start", request.booking_id)
            together.wait()
            return super().start(request)

    machine = Together(gpus=(0, 1, 2))
    passes = make_pass(config, machine, state)
    users = ("alice", "bob", "alice")
    events = [event(f"b{n}", NOW, NOW + timedelta(hours=1), user=user) for n, user in enumerate(users)]
    try:
        result = passes.run(bookings(config, *events), now=NOW, write_back=False)
    finally:
        passes.close()
    assert not together.broken
    assert result.failures == {}
    assert {b for what, b in machine.steps if what == "running"} == {"b0", "b1", "b2"}


class SlowSshd(Machine):
    """A host where one booking's start (its sshd) takes until the test lets it answer."""

    def __init__(self, slow: str) -> None:
        super().__init__()
        self.slow = slow
        self.answer = threading.Event()

    def start(self, request: StartRequest) -> Started:
        if request.booking_id == self.slow:
            self.step("waiting for sshd", request.booking_id)
            self.answer.wait(HOLD)
        return super().start(request)


@pytest.mark.caldav
def test_a_start_is_written_back_without_waiting_for_a_slow_sibling(
        tmp_path: Path, state: State, radicale_server: servers.CalendarServer) -> None:
    """Two bookings at one start, one of them with a slow sshd: the quick one's `running: ssh -p`
    line is in its event while the slow one still waits (before issue 11 every line waited for the
    pass's patience, that is for the slowest booking of the pass)."""
    calendar = radicale_server.new_calendar()
    url = str(calendar.url)
    config = make_config(tmp_path, calendars=(url,))
    texts = [event("slow", NOW, NOW + timedelta(hours=1)), event("quick", NOW, NOW + timedelta(hours=1), user="bob")]
    for text in texts:
        calendar.save_event(vcalendar(text))
    occurrences = [_with_href(o, str(calendar.event_by_uid(o.uid).url))
                   for o in bookings(config, *texts, calendar_url=url)]
    machine = SlowSshd("slow")
    passes = make_pass(config, machine, state)  # its patience outlasts the test: the pass waits for "slow"

    def line(uid: str) -> str:
        return str(calendar.event_by_uid(uid).icalendar_component.get("DESCRIPTION", ""))

    pass_thread = threading.Thread(target=passes.run, args=(occurrences,), kwargs={"now": NOW, "etags": {}})
    pass_thread.start()
    try:
        waited = threading.Event()
        for _ in range(int(HOLD * 20)):
            if "running: ssh -p" in line("quick"):
                break
            waited.wait(0.05)
        assert "running: ssh -p" in line("quick")
        assert not machine.answer.is_set() and pass_thread.is_alive()  # the slow one still waits
        assert "running:" not in line("slow")
    finally:
        machine.answer.set()
        pass_thread.join(HOLD)
        passes.writeback.settle(HOLD)
        passes.close()
    assert "running: ssh -p" in line("slow")


@pytest.mark.slow  # a second or more: out of the fast lane
def test_the_start_gate_is_not_held_while_a_booking_waits_for_its_sshd(tmp_path: Path) -> None:
    """[daemon] parallel_starts bounds the engine's start only: with one slot, a booking whose SSH
    never answers does not keep the next booking's container from starting."""
    import paramiko

    from gpubook.runtime.booking import launch
    from gpubook.runtime.engines import ContainerSpec
    from tests.kits.daemon_kit import IdleEngine

    began = {"a": threading.Event(), "b": threading.Event()}

    class NoSshd(IdleEngine):
        """Containers that start and run, whose SSH never answers; "a" is gone once "b" started."""

        def start(self, spec: ContainerSpec) -> ContainerInfo:
            began[spec.booking_id].set()
            return running(spec.booking_id, (), end=spec.end, port=spec.port)

        def inspect(self, name: str) -> ContainerInfo | None:
            if began["b"].is_set():
                return None
            return running("x", (), end=NOW, port=None)

    def spec(booking_id: str) -> ContainerSpec:
        with socket.socket() as probe:  # a port nothing listens on: the probe is refused at once
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        return ContainerSpec(booking_id=booking_id, user="alice", uid=2001, gid=2001, image="i", port=port,
                             end=NOW, host_key="ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIFakeFakeFakeFakeFakeFakeFake")

    gate, engine, key = threading.BoundedSemaphore(1), NoSshd(), paramiko.ECDSAKey.generate(bits=256)
    errors: dict[str, str] = {}

    def start(booking_id: str) -> None:
        try:
            launch.start_booking(engine, spec(booking_id), probe_key=key, timeout=HOLD, gate=gate)
        except EngineError as error:
            errors[booking_id] = str(error)

    first = threading.Thread(target=start, args=("a",))
    first.start()
    assert began["a"].wait(HOLD)
    start("b")
    first.join(HOLD)
    assert began["b"].is_set()
    # "a" ended because its container went once "b" had started, not at its SSH timeout
    assert "gone before SSH answered" in errors["a"], errors


class Preparing(Machine):
    """A host that can make a booking's folders and host key ahead; records when it is asked."""

    def prepare(self, ahead: Ahead) -> None:
        self.step("prepare", ahead.booking_id)

    def unprepare(self, booking_id: str) -> None:
        self.step("unprepare", booking_id)


def test_a_booking_is_prepared_before_its_start_and_unprepared_when_it_goes(tmp_path: Path, state: State) -> None:
    config = make_config(tmp_path)
    machine = Preparing()
    passes = make_pass(config, machine, state)
    soon_, later = NOW + timedelta(seconds=30), NOW + timedelta(hours=2)
    near, far = event("near", soon_, soon_ + timedelta(hours=1)), event("far", later, later + timedelta(hours=1))
    try:
        result = passes.run(bookings(config, near, far), now=NOW, write_back=False)
        passes.ahead.lane.submit(lambda: None).result(HOLD)
        assert machine.steps == [("prepare", "near")]
        assert result.wake_at == soon_  # the start of "near" (the wake-up to prepare "far" comes later)
        result = passes.run(bookings(config, far), now=NOW + timedelta(seconds=1), write_back=False)  # "near" gone
        passes.ahead.lane.submit(lambda: None).result(HOLD)
        assert machine.steps == [("prepare", "near"), ("unprepare", "near")]
        assert result.wake_at == later - LEAD
        passes.run(bookings(config, far), now=later - LEAD, write_back=False)
        passes.ahead.lane.submit(lambda: None).result(HOLD)
        assert machine.steps[-1] == ("prepare", "far")
    finally:
        passes.close()


def test_local_host_makes_the_host_key_ahead_and_removes_it_when_the_booking_goes(tmp_path: Path) -> None:
    """The start uses the key made ahead (the same key, no second one), and a booking gone before
    its start leaves no key behind."""
    import paramiko

    from gpubook.runtime.booking import ssh
    from gpubook.scheduler.hosts.local import LocalHost
    from tests.kits.daemon_kit import IdleEngine

    host = LocalHost(engine=IdleEngine(), gpus=(0,), driver_version=None,
                     probe_key=paramiko.ECDSAKey.generate(bits=256), cache_dir=tmp_path)
    booker = Booker(name="alice", uid=2001, gid=2001)
    host.prepare(Ahead(booking_id="b1", booker=booker))
    folder = ssh.host_key_folder(tmp_path, container_name("b1"))
    made = (folder / ssh.HOST_KEY_FILE).read_bytes()
    assert ssh.booking_host_key(tmp_path, container_name("b1")).folder == folder
    assert (folder / ssh.HOST_KEY_FILE).read_bytes() == made
    host.unprepare("b1")
    assert not folder.exists()
