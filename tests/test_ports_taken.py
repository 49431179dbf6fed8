"""A host login that binds the bookings' whole port range (busy ports are skipped at a start)
stops every start: doctor and `gpubook status` name the squatted range (issue 22, finding 11).
Real sockets, the real CLI; a small configured range."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest

from gpubook.scheduler import config as config_module
from gpubook.scheduler.commands import doctor
from gpubook.scheduler.state import State, StateError, port_is_free
from tests.kits.cli_kit import gpubook, write_config

COUNT = 4


def free_range(count: int) -> int:
    """The first port of `count` consecutive ports free on both address families."""
    for low in range(41000, 49000, count):
        if all(port_is_free(port) for port in range(low, low + count)):
            return low
    raise AssertionError("no free port range")


def listen(family: socket.AddressFamily, port: int) -> socket.socket:
    squatter = socket.socket(family, socket.SOCK_STREAM)
    if family == socket.AF_INET6:
        squatter.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)  # IPv6 alone, as a squatter binds it
    squatter.bind(("::" if family == socket.AF_INET6 else "0.0.0.0", port))  # noqa: S104 - the squatter
    squatter.listen()
    return squatter


@pytest.fixture
def squatted() -> Iterator[int]:
    """A range whose every port another process listens on: half on IPv4, half on IPv6 only."""
    low = free_range(COUNT)
    with ExitStack() as stack:
        for port in range(low, low + COUNT):
            family = socket.AF_INET if port % 2 else socket.AF_INET6
            stack.enter_context(listen(family, port))
        yield low


@pytest.mark.podman  # `gpubook status` lists the engine's containers: it fails where podman is not installed
def test_a_squatted_range_is_named_by_status_and_doctor_and_no_booking_gets_a_port(
        tmp_path: Path, squatted: int) -> None:
    high = squatted + COUNT - 1
    path = write_config(tmp_path / "gpubook.toml", state_dir=tmp_path / "state",
                        extra=f"[ssh]\nport_min = {squatted}\nport_max = {high}\n")
    sentence = f"ports {squatted}–{high}: {COUNT} of {COUNT} in use by other processes"
    with State(tmp_path / "state" / "state.sqlite") as state, pytest.raises(StateError, match="no free SSH port"):
        state.port_for("b1@test", port_min=squatted, port_max=high)
    done = gpubook("status", "--json", "--config", str(path))
    problems = json.loads(done.stdout)["problems"]
    assert any(sentence in line and "bookings cannot start" in line for line in problems), problems
    check = doctor.ports_taken_check(config_module.load(str(path)))
    assert not check.ok and sentence in check.detail and "bookings cannot start" in check.detail, check


def test_one_squatted_port_is_named_and_leaves_the_rest_to_bookings(tmp_path: Path) -> None:
    low = free_range(COUNT)
    with listen(socket.AF_INET6, low + 1):
        path = write_config(tmp_path / "gpubook.toml", state_dir=tmp_path / "state",
                            extra=f"[ssh]\nport_min = {low}\nport_max = {low + COUNT - 1}\n")
        check = doctor.ports_taken_check(config_module.load(str(path)))
        assert check.ok and f"1 of {COUNT} in use by other processes ({low + 1}); {COUNT - 1} left" in check.detail
        with State(tmp_path / "state" / "state.sqlite") as state:
            assert state.port_for("b1@test", port_min=low + 1, port_max=low + 2) == low + 2  # [::] squatted: skipped
