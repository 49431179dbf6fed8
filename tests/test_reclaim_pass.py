"""A no-show through a real Pass and State, the host a tiny class meeting the Host protocol
(tests/test_pass_bounded.py's Machine): the release's last look at the container's log, and a
released booking's GPU given to the next booking, also by a new Pass (a restarted daemon)."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

from gpubook.runtime.engines import ContainerInfo
from gpubook.scheduler import config as config_module
from gpubook.scheduler.apply.passes import Pass
from gpubook.scheduler.state import State
from tests.kits.pass_kit import NOW, Machine, bookings, event, make_pass

CONFIG = ('[host]\nname = "devbox1"\ntimezone = "UTC"\n[[calendar]]\nurl = "http://127.0.0.1:9/lab/devbox1/"\n'
          '[engine]\nname = "podman"\n[gpus]\ncount = 1\n[defaults]\ntemplate = "debian-ssh"\ngpus = 1\n'
          '[users.alice]\nuid = 2001\n[users.bob]\nuid = 2002\n[policy]\nno_show_minutes = 30\n')


def made(tmp_path: Path, machine: Machine, state: State, *, logged_in: Callable[[ContainerInfo], bool] | None) -> Pass:
    path = tmp_path / "gpubook.toml"
    path.write_text(CONFIG)
    passes = make_pass(config_module.load(path), machine, state)
    passes.handlers.update(Pass(passes.config, backend=passes.backend, state=state, templates=passes.templates,
                                logged_in=logged_in).handlers)
    return passes


def test_a_booker_seen_in_the_log_at_the_last_look_keeps_the_booking(tmp_path: Path) -> None:
    """The sampler looks at a log only every few minutes: a booker who logged in just before the
    no-show time is found by the release's own look, recorded, and not released."""
    machine = Machine(gpus=(0,))
    machine.release_exec.set()
    looked: list[str] = []

    def came(info: ContainerInfo) -> bool:
        looked.append(info.booking_id)
        return True

    with State(tmp_path / "state.sqlite") as state:
        passes = made(tmp_path, machine, state, logged_in=came)
        alice = event("a", NOW, NOW + timedelta(hours=4))
        try:
            passes.run(bookings(passes.config, alice), now=NOW, write_back=False)
            later = NOW + timedelta(minutes=31)
            passes.run(bookings(passes.config, alice, now=later), now=later, write_back=False)
            passes.run(bookings(passes.config, alice, now=later), now=later + timedelta(seconds=1), write_back=False)
        finally:
            passes.close()
        assert state.releases() == {} and set(state.logins()) == {"a"}
        assert [c.booking_id for c in machine.containers.values()] == ["a"]
        assert looked == ["a"]  # once: the login recorded, the next pass has no no-show to judge


def test_a_released_booking_gives_its_gpu_to_the_next_and_never_starts_again(tmp_path: Path) -> None:
    machine = Machine(gpus=(0,))
    machine.release_exec.set()
    with State(tmp_path / "state.sqlite") as state:
        passes = made(tmp_path, machine, state, logged_in=lambda info: False)
        alice = event("a", NOW, NOW + timedelta(hours=4))
        bob = event("b", NOW + timedelta(minutes=40), NOW + timedelta(hours=4), user="bob")
        try:
            passes.run(bookings(passes.config, alice), now=NOW, write_back=False)
            before = NOW + timedelta(minutes=20)
            result = passes.run(bookings(passes.config, alice, bob, now=before), now=before, write_back=False)
            assert [r.id for r in result.plan.rejected] == ["b"]  # alice's slot, until she is a no-show
            released = NOW + timedelta(minutes=30)
            passes.run(bookings(passes.config, alice, bob, now=released), now=released, write_back=False)
            assert set(state.releases()) == {"a"} and machine.containers == {}
        finally:
            passes.close()
        restarted = made(tmp_path, machine, state, logged_in=lambda info: False)
        try:
            now = NOW + timedelta(minutes=40)
            result = restarted.run(bookings(restarted.config, alice, bob, now=now), now=now, write_back=False)
        finally:
            restarted.close()
        ends = {a.booking.id: a.booking.end for a in result.plan.accepted}
        assert ends == {"a": released, "b": NOW + timedelta(hours=4)}
        assert any(e.message.startswith("released: nobody logged in and no use of GPU 0 was seen for 30 min")
                   for e in state.events(booking_id="a"))
    assert [c.booking_id for c in machine.containers.values()] == ["b"]
    assert machine.steps.count(("start", "a")) == 1
