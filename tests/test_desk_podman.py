"""`gpubook book` for now, `extend` and `end` on real rootless podman (issue 40): from a shell on
the server, the booker gets an ssh line within seconds, logs in with paramiko, moves the end, and
ends the booking; the event in the real Radicale calendar says each step, as the calendar's own
booking would. The commands run as a researcher runs them: no config, the daemon's socket."""

from __future__ import annotations

import json
import re
from datetime import datetime, timedelta
from pathlib import Path

from tests.kits import ask_kit
from tests.kits.daemon_kit import (
    DAEMON_MODULE,
    DaemonProcess,
    description,
    run,
    running_container,
    try_login,
    wait_for,
    write_config,
)

pytestmark = DAEMON_MODULE


def test_book_for_now_logs_in_over_ssh_then_extend_and_end_move_the_event(
        tmp_path: Path, radicale, engine, keys, cleanup, daemons) -> None:  # type: ignore[no-untyped-def]
    calendar = radicale.new_calendar()
    config = write_config(tmp_path, str(calendar.url), keys=keys, poll_seconds=60)
    config.write_text(config.read_text().replace("[users.alice]\n", f'[users.alice]\naccount = "{ask_kit.login()}"\n'))
    daemon = DaemonProcess(config).start()
    daemons.append(daemon)
    env = ask_kit.researcher_env(tmp_path / "home", GPUBOOK_DAEMON_ACCOUNT=ask_kit.login())
    wait_for("the daemon's first pass", lambda: (tmp_path / "state" / "daemon-status.json").exists(),
             timeout=60, daemon=daemon)

    done = ask_kit.gpubook("book", "--gpus", "1", "--hours", "1", "--json", env=env, timeout=120)
    assert done.returncode == 0, (done.stdout, done.stderr)
    answer = json.loads(done.stdout)
    cleanup.append(answer["id"])
    assert answer["state"] == "running", answer
    port = int(re.fullmatch(r"ssh -p (\d+) alice@\S+", answer["ssh"]).group(1))  # type: ignore[union-attr]
    client = wait_for("alice's login on the ssh line printed", lambda: try_login(port, "alice", keys["alice"]),
                      timeout=30, daemon=daemon)
    assert run(client, "id -un")[1].strip() == "alice"
    client.close()
    assert "running" in description(calendar, answer["id"])  # the event's own answer, as for a client's booking

    end = datetime.fromisoformat(answer["end"])
    done = ask_kit.gpubook("extend", "30m", "--json", env=env, timeout=120)
    assert done.returncode == 0, (done.stdout, done.stderr)
    extended = json.loads(done.stdout)
    assert extended["id"] == answer["id"] and datetime.fromisoformat(extended["end"]) == end + timedelta(minutes=30)
    event = calendar.event_by_uid(answer["id"]).icalendar_component
    assert event.decoded("DTEND") == end + timedelta(minutes=30)  # the calendar is the record

    done = ask_kit.gpubook("end", "--json", env=env, timeout=120)
    assert done.returncode == 0, (done.stdout, done.stderr)
    wait_for("the container stopped", lambda: running_container(engine, answer["id"]) is None, timeout=60,
             daemon=daemon)
    assert wait_for("the event says it ended", lambda: "ended:" in description(calendar, answer["id"]),
                    timeout=60, daemon=daemon)
