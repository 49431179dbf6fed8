"""Accounting with the real daemon, Radicale and rootless podman: two bookings start, the booker of
one logs in over SSH (paramiko), the other never does; after their end the report counts the
second as a no-show and not the first. The daemon's readiness probe logs into both as their
booker: its login must not count (hostile to a sampler that only looks for sshd's "Accepted").
Without a GPU here the sampler records no GPU rows, and says so once."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from gpubook.scheduler.outbox import report
from gpubook.scheduler.state import State
from tests.kits.daemon_kit import (
    DAEMON_MODULE,
    DaemonProcess,
    book,
    run,
    running_container,
    soon,
    try_login,
    wait_for,
    write_config,
)

pytestmark = DAEMON_MODULE


def test_a_booking_logged_into_is_no_no_show_and_one_never_logged_into_is(tmp_path: Path, radicale, engine, keys,
                                                                           cleanup, daemons) -> None:
    calendar = radicale.new_calendar()
    config = write_config(tmp_path, str(calendar.url), keys=keys, poll_seconds=1, gpus=8)
    config.write_text(config.read_text().replace("[daemon]\n", "[daemon]\nsample_seconds = 1\n"))
    start = soon(6)
    end = start + timedelta(seconds=25)
    book(calendar, "used@test", user="alice", start=start, end=end, gpus="4,")  # GPUs no other test holds
    book(calendar, "idle@test", user="bob", start=start, end=end, gpus="5,")
    cleanup.extend(["used@test", "idle@test"])
    daemon = DaemonProcess(config).start()
    daemons.append(daemon)
    used = wait_for("alice's container", lambda: running_container(engine, "used@test"), timeout=60, daemon=daemon)
    wait_for("bob's container", lambda: running_container(engine, "idle@test"), timeout=60, daemon=daemon)
    assert used.port is not None
    client = wait_for("alice's login", lambda: try_login(used.port, "alice", keys["alice"]), timeout=30,
                      daemon=daemon)
    assert run(client, "true")[0] == 0
    client.close()
    database = tmp_path / "state" / "state.sqlite"

    def logins() -> dict[str, datetime]:
        with State(database) as state:
            return state.logins()

    wait_for("alice's login recorded", lambda: "used@test" in logins(), timeout=15, daemon=daemon)
    wait_for("both containers gone after the end", lambda: datetime.now(UTC) > end and not any(
        running_container(engine, b) for b in ("used@test", "idle@test")), timeout=60, daemon=daemon)
    daemon.stop()
    assert set(logins()) == {"used@test"}  # bob's container was probed as bob, and nobody else came
    with State(database) as state:
        result = report.build(state, start=start - timedelta(hours=1), end=end + timedelta(hours=1),
                              now=datetime.now(UTC), by="user")
        assert state.samples_count() == 0  # no GPU on this machine
        booked = state.gpu_hours_booked_by_user()  # what the Prometheus counters read
    by = {row.key: row for row in result.rows}
    assert (by["alice"].bookings, by["alice"].no_shows) == (1, 0)
    assert (by["bob"].bookings, by["bob"].no_shows) == (1, 1)
    assert by["bob"].booked_hours == pytest.approx(25 / 3600)
    assert booked == {"alice": pytest.approx(25 / 3600), "bob": pytest.approx(25 / 3600)}
    assert daemon.log.read_text().count("no GPU to sample") == 1
