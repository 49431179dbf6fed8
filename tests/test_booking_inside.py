"""The booking as the booker sees it inside its container, with the real daemon, Radicale and
rootless podman: /run/gpubook/booking.json, GPUBOOK_BOOKING/END/GPUS in the SSH session and the
`gpubook-booking` command say the booking's end and GPUs; once the booker moves the end later in
the calendar, booking.json and gpubook-booking say the new end (and the stop, once it is moved
earlier); the booker, root inside through
sudo, cannot change the file gpubook keeps on the host. `gpubook status` names the booking by
its (hostile) title, escaped, and --json keeps the title and the UID."""

from __future__ import annotations

import json
import shlex
from datetime import UTC, datetime, timedelta
from pathlib import Path

from gpubook.runtime import private
from gpubook.runtime.booking import booking_json
from gpubook.runtime.engines import container_name
from gpubook.scheduler.outbox.timeline import short_title
from tests.kits.daemon_kit import (
    DAEMON_MODULE,
    DaemonProcess,
    book,
    cli,
    edit,
    event_text,
    run,
    running_container,
    try_login,
    wait_for,
    write_config,
)

pytestmark = DAEMON_MODULE

UID = "inside@test"
NOTICE_SECONDS = 120  # the notice before a stop when the end moves earlier: time to read booking.json
TITLE = 'Fine-tune "llama" </script><script>alert(1)</script> for the whole afternoon, then evaluate'


def seconds_to(moment: datetime) -> float:
    """The most whole seconds `gpubook-booking --left` may say of `moment` if run from now on: it counts
    from the container's clock in whole seconds, so up to one more than the exact time left."""
    return (moment - datetime.now(UTC)).total_seconds() + 1


def iso(moment: datetime) -> str:
    return moment.astimezone(UTC).isoformat(timespec="seconds")


def test_the_booking_inside_its_container_follows_a_later_end_and_the_booker_cannot_change_it(
        tmp_path: Path, radicale, engine, keys, cleanup, daemons) -> None:
    calendar = radicale.new_calendar()
    config = write_config(tmp_path, str(calendar.url), keys=keys, poll_seconds=1, gpus=8,
                          notice_seconds=NOTICE_SECONDS)
    start = datetime.now(UTC).replace(microsecond=0) - timedelta(minutes=5)  # booked for right now
    end = start + timedelta(minutes=30)
    book(calendar, UID, user="alice", start=start, end=end, gpus="6,7", summary=TITLE)
    cleanup.append(UID)
    host_file = booking_json.card_folder(private.default_cache_dir(), container_name(UID)) / booking_json.CARD_FILE
    daemon = DaemonProcess(config).start()
    daemons.append(daemon)
    try:
        info = wait_for("alice's container", lambda: running_container(engine, UID), timeout=90, daemon=daemon)
        client = wait_for("alice's login", lambda: try_login(info.port, "alice", keys["alice"]), timeout=60,
                          daemon=daemon)

        def inside() -> dict:
            status, text = run(client, "cat /run/gpubook/booking.json")
            assert status == 0, text
            return json.loads(text)

        card = inside()
        made = card.pop("provenance")  # what its start knew: tests/test_provenance_daemon.py reads it
        assert made["template"]["name"] == "debian-ssh" and made["end"] is None
        assert card == {"booking": UID, "uid": UID, "title": TITLE, "user": "alice", "start": iso(start),
                        "end": iso(end), "end_epoch": int(end.timestamp()), "gpus": [6, 7],
                        "template": "debian-ssh", "host": "127.0.0.1", "port": info.port}
        card["provenance"] = made
        status, text = run(client, 'printf "%s|%s|%s" "$GPUBOOK_BOOKING" "$GPUBOOK_END" "$GPUBOOK_GPUS"')
        assert (status, text) == (0, f"{UID}|{iso(end)}|6,7")
        status, text = run(client, "bash -lc 'echo $GPUBOOK_END'")  # a login shell: /etc/profile.d
        assert (status, text.strip()) == (0, iso(end))
        status, text = run(client, "gpubook-booking")
        assert status == 0, text
        assert f"booking:  {UID}" in text and "GPUs:     6,7" in text and f"ends:     {iso(end)} (" in text
        most = seconds_to(end)  # taken before the command: a later reading is smaller than what it said
        status, text = run(client, "gpubook-booking --left")
        assert status == 0 and 0 < int(text) <= most, text
        status, text = run(client, "gpubook-booking --json")
        assert status == 0 and json.loads(text) == card

        # Root inside (sudo) can neither write, replace nor remount the file gpubook keeps.
        kept = host_file.read_bytes()
        for attempt in ("echo '{}' > /run/gpubook/booking.json", "echo '{}' > /.gpubook-booking/booking.json",
                        "rm -f /.gpubook-booking/booking.json", "touch /.gpubook-booking/planted",
                        "mount -o remount,rw /.gpubook-booking"):
            status, text = run(client, f"sudo sh -c {shlex.quote(attempt)}")
            assert status != 0, f"root inside could: {attempt}"
        assert host_file.read_bytes() == kept
        assert sorted(p.name for p in host_file.parent.iterdir()) == [booking_json.CARD_FILE]

        # The booker moves the end an hour later in their calendar: the daemon agrees, and says so inside.
        later = end + timedelta(hours=1)
        moved = event_text(UID, user="alice", start=start, end=later, gpus="6,7", summary=TITLE)
        wait_for("the event moved (retried while gpubook writes back)", lambda: edit(calendar, UID, moved),
                 timeout=30, daemon=daemon)
        wait_for("booking.json's later end", lambda: inside()["end"] == iso(later) or None, timeout=60,
                 interval=0.5, daemon=daemon)
        assert inside() == {**card, "end": iso(later), "end_epoch": int(later.timestamp())}
        status, text = run(client, "gpubook-booking")
        assert status == 0 and f"ends:     {iso(later)} (" in text, text
        most = seconds_to(later)
        status, text = run(client, "gpubook-booking --left")
        assert status == 0 and seconds_to(end) < int(text) <= most, text
        status, text = run(client, 'printf %s "$GPUBOOK_END"')  # the end at the container's start, as documented
        assert (status, text) == (0, iso(end))

        # Then earlier, long past its warning time: warned at once, the container stops after
        # notice_seconds, and booking.json says that stop.
        sooner = start + timedelta(minutes=1)
        moved = event_text(UID, user="alice", start=start, end=sooner, gpus="6,7", summary=TITLE)
        asked = datetime.now(UTC).replace(microsecond=0)
        wait_for("the event moved earlier", lambda: edit(calendar, UID, moved), timeout=30, daemon=daemon)
        stop_at = wait_for("booking.json's sooner end", lambda: inside()["end_epoch"] < later.timestamp() and
                           datetime.fromisoformat(inside()["end"]), timeout=60, interval=0.5, daemon=daemon)
        assert asked <= stop_at <= datetime.now(UTC) + timedelta(seconds=NOTICE_SECONDS)
        client.close()

        shown = cli(config, "status")
        assert short_title(TITLE) in shown.stdout, shown.stdout + shown.stderr
        as_json = cli(config, "status", "--json")
        (running,) = json.loads(as_json.stdout)["running"]
        assert (running["booking"], running["title"]) == (UID, TITLE)
    finally:
        booking_json.forget_card(private.default_cache_dir(), container_name(UID))
