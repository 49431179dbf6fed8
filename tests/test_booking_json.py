"""booking.json on the host (gpubook/runtime/booking/booking_json.py), hostile to what may be planted where
it is written: the daemon writes through a fresh file and a rename, never through a symlink, and
refuses a folder that is not its own."""

from __future__ import annotations

import json
import os
import threading
from datetime import UTC, datetime, timedelta
from pathlib import Path
from zoneinfo import ZoneInfo

import pytest

from gpubook.runtime.booking import booking_json
from gpubook.runtime.booking.booking_json import Card, CardError

START = datetime(2026, 11, 26, 9, 0, tzinfo=UTC)
CARD = Card(booking="b@test", uid="b@test", title='Run "x"\x1b[31m\u00e9', user="alice", start=START,
            end=START + timedelta(hours=8), gpus=(0, 1), template="debian-ssh", host="devbox1", port=2201)


def test_the_file_is_one_key_a_line_ascii_json_in_the_hosts_zone_and_readable_by_all(tmp_path: Path) -> None:
    folder = booking_json.write_card(tmp_path, "gpubook-b", CARD, zone=ZoneInfo("Europe/Paris"))
    path = folder / booking_json.CARD_FILE
    raw = path.read_bytes()
    raw.decode("ascii")  # the ESC and the é are JSON escapes, never raw bytes for a terminal
    data = json.loads(raw)
    assert (data["start"], data["end"], data["end_epoch"]) == (
        "2026-11-26T10:00:00+01:00", "2026-11-26T18:00:00+01:00", int(CARD.end.timestamp()))
    assert data["title"] == CARD.title and data["gpus"] == [0, 1]
    assert all(line.startswith(('  "', "{", "}")) for line in raw.decode().splitlines())
    assert (os.stat(path).st_mode & 0o777, os.stat(folder).st_mode & 0o777) == (0o644, 0o755)


def test_a_later_end_is_written_through_a_new_file_never_through_a_planted_symlink(tmp_path: Path) -> None:
    folder = booking_json.write_card(tmp_path, "gpubook-b", CARD, zone=UTC)
    victim = tmp_path / "victim"
    victim.write_text("keep")
    for name in os.listdir(folder):
        assert not name.startswith(".")  # no temporary file left
    planted = [folder / f".{booking_json.CARD_FILE}.{os.getpid()}.{n}" for n in range(3)]
    later = CARD.end + timedelta(hours=2)
    planted.append(folder / f".{booking_json.CARD_FILE}.{os.getpid()}.{threading.get_ident()}")
    for path in planted:
        path.symlink_to(victim)
    assert booking_json.move_end(tmp_path, "gpubook-b", later, zone=UTC)
    assert victim.read_text() == "keep"
    assert json.loads((folder / booking_json.CARD_FILE).read_text())["end"] == "2026-11-26T19:00:00+00:00"
    assert not booking_json.move_end(tmp_path, "gpubook-other", later, zone=UTC)  # none here: nothing made
    assert not booking_json.card_folder(tmp_path, "gpubook-other").exists()


def test_a_booking_json_that_is_a_symlink_is_not_followed_and_a_foreign_folder_is_refused(tmp_path: Path) -> None:
    folder = booking_json.write_card(tmp_path, "gpubook-b", CARD, zone=UTC)
    secret = tmp_path / "secret.json"
    secret.write_text('{"end": "x"}')
    (folder / booking_json.CARD_FILE).unlink()
    (folder / booking_json.CARD_FILE).symlink_to(secret)
    with pytest.raises(OSError):
        booking_json.move_end(tmp_path, "gpubook-b", CARD.end, zone=UTC)
    assert secret.read_text() == '{"end": "x"}'
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    booking_json.card_folder(tmp_path, "gpubook-c").symlink_to(elsewhere)
    with pytest.raises(CardError, match="not a folder of this daemon's own"):
        booking_json.write_card(tmp_path, "gpubook-c", CARD, zone=UTC)
    assert list(elsewhere.iterdir()) == []
    booking_json.forget_card(tmp_path, "gpubook-b")
    assert not folder.exists()
