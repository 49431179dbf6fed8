"""The provenance card with the real daemon, Radicale and rootless podman, on the CPU path (no GPU):
booking.json says the image id and the template at the start; at the end the ended block has the
two provenance lines and /data/output/.gpubook/provenance.json has the image, the template, the
start and the end. A booker who planted `.gpubook` as a symlink gets nothing written where it
points, and their booking still ends; one who planted `provenance.json` as a symlink to a file gets
the link replaced, the file untouched."""

from __future__ import annotations

import json
import shlex
from datetime import UTC, datetime, timedelta
from pathlib import Path

from gpubook.runtime.booking import provenance
from gpubook.runtime.engines import container_name
from tests.kits.daemon_kit import (
    DAEMON_MODULE,
    DaemonProcess,
    book,
    description,
    run,
    running_container,
    try_login,
    wait_for,
    write_config,
)

pytestmark = DAEMON_MODULE

IMAGE = "localhost/gpubook/debian-ssh:12"


def _ended(text: str) -> str | None:
    """The event's description once its block says "ended" and has its provenance lines."""
    return text if "ended:" in text and "provenance: ran from" in text else None


def test_the_card_at_the_start_and_at_the_end(tmp_path: Path, radicale, engine, keys, cleanup, daemons) -> None:
    calendar = radicale.new_calendar()
    config = write_config(tmp_path, str(calendar.url), keys=keys, poll_seconds=2, gpus=2)
    start = datetime.now(UTC).replace(microsecond=0) - timedelta(minutes=1)  # booked for right now
    end = datetime.now(UTC).replace(microsecond=0) + timedelta(seconds=100)
    book(calendar, "card-a@test", user="alice", start=start, end=end, gpus="1")
    book(calendar, "card-b@test", user="bob", start=start, end=end, gpus="1")
    cleanup.extend(["card-a@test", "card-b@test"])
    facts = engine.image_facts(IMAGE)
    assert facts is not None and facts.id
    image_id = facts.id if ":" in facts.id else f"sha256:{facts.id}"
    digest = provenance.repo_digest(facts.digests)  # podman may give an imported image a manifest digest too
    shown = digest or image_id  # what the block's line names
    elsewhere = tmp_path / "elsewhere"  # where bob's planted link points: the daemon's user may write here
    elsewhere.mkdir()
    victim = tmp_path / "victim.txt"  # where alice's planted provenance.json points
    victim.write_text("not the booker's\n")
    daemon = DaemonProcess(config).start()
    daemons.append(daemon)
    began = datetime.now(UTC).replace(microsecond=0)
    for uid, user in (("card-a@test", "alice"), ("card-b@test", "bob")):
        info = wait_for(f"{user}'s container", lambda uid=uid: running_container(engine, uid), timeout=90,
                        daemon=daemon)
        client = wait_for(f"{user}'s login", lambda port=info.port, user=user: try_login(port, user, keys[user]),
                          timeout=60, daemon=daemon)
        try:
            status, text = run(client, "cat /run/gpubook/booking.json")
            assert status == 0, text
            card = json.loads(text)["provenance"]
            assert card["image"]["id"] == image_id and card["image"]["reference"] == IMAGE
            assert card["image"]["digest"] == digest
            assert card["template"]["name"] == "debian-ssh" and len(card["template"]["sha256"]) == 64
            assert card["image"]["cuda"] is None and card["image"]["cudnn"] is None  # debian-ssh declares none
            assert card["gpus"] == [] and card["host"] == {"driver": None, "cuda": None}  # no GPU here: null
            assert card["end"] is None and began - timedelta(seconds=5) <= datetime.fromisoformat(card["start"])
            if user == "alice":  # a real .gpubook of hers, and its provenance.json a link to a host file
                planted = f"mkdir -p /data/output/.gpubook && ln -s {victim} /data/output/.gpubook/provenance.json"
            else:  # root inside plants .gpubook itself as a link to a host folder
                planted = f"sudo ln -s {elsewhere} /data/output/.gpubook"
            status, text = run(client, f"sh -c {shlex.quote(planted)}")
            assert status == 0, text
        finally:
            client.close()

    for uid in ("card-a@test", "card-b@test"):
        wait_for(f"the stop of {uid}", lambda uid=uid: engine.inspect(container_name(uid)) is None,
                 timeout=max(0.0, (end - datetime.now(UTC)).total_seconds()) + 60, daemon=daemon)
        text = wait_for(f"ended in {uid}'s event", lambda uid=uid: _ended(description(calendar, uid)),
                        timeout=30, daemon=daemon)
        lines = [line.strip() for line in text.splitlines() if line.strip().startswith("provenance:")]
        assert len(lines) == 2, text
        assert lines[0] == f"provenance: image {shown[:19]}… (debian-ssh); no GPU", lines
        assert lines[1].startswith("provenance: ran from "), lines
        assert ("/data/output/.gpubook/provenance.json" in lines[1]) == (uid == "card-a@test"), lines

    card_file = tmp_path / "data" / "alice" / "output" / ".gpubook" / "provenance.json"
    assert not card_file.is_symlink()
    card = json.loads(card_file.read_text())
    assert card["image"]["id"] == image_id and card["template"]["name"] == "debian-ssh"
    started, ended = datetime.fromisoformat(card["start"]), datetime.fromisoformat(card["end"])
    assert began - timedelta(seconds=5) <= started < ended and end <= ended <= datetime.now(UTC)
    assert victim.read_text() == "not the booker's\n"
    assert list(elsewhere.iterdir()) == []  # bob's link was not followed
    assert (tmp_path / "data" / "bob" / "output" / ".gpubook").is_symlink()
    assert "its provenance.json is not written" in daemon.log.read_text()
