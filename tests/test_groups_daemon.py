"""Groups as projects through the whole daemon (issue 38): a real `gpubook run` (on an engine that starts
nothing) reading a real Radicale calendar refuses a booking that would take its group over the group's
week quota, writes the sentence naming the group into the event, and `gpubook mine` shows each
booking's project. (Written with the feature; the pure and slapd tests are tests/test_groups.py and
tests/test_directory_ldap.py.)"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest

from tests.kits import ask_kit
from tests.kits.daemon_kit import DAEMON_MODULE, DaemonProcess, book, description, wait_for

pytestmark = DAEMON_MODULE

DAY = (datetime.now(UTC) + timedelta(days=2)).replace(hour=0, minute=0, second=0, microsecond=0)
GROUPS = """
[groups.vision]
week_gpu_hours = 3

[groups.nlp]
"""


@pytest.fixture(scope="module")
def daemon(radicale_server, tmp_path_factory) -> Iterator[dict]:  # type: ignore[no-untyped-def]
    """alice (this account; vision, then nlp) books 2 h for vision and 2 h for nlp; bob (vision) 2 h more
    for vision, which would make 4 of its 3 GPU-hours."""
    import paramiko

    folder = tmp_path_factory.mktemp("groups")
    calendar = radicale_server.new_calendar()
    keys = {"alice": paramiko.ECDSAKey.generate(bits=256), "bob": paramiko.ECDSAKey.generate(bits=256)}
    path = ask_kit.idle_config(folder, str(calendar.url), keys=keys,
                               accounts={"alice": ask_kit.login(), "bob": "nobody"})
    text = path.read_text()
    text = text.replace("[users.alice]\n", '[users.alice]\ngroups = ["vision", "nlp"]\n')
    text = text.replace("[users.bob]\n", '[users.bob]\ngroups = ["vision"]\n')
    path.write_text(text + GROUPS)
    book(calendar, "alice-vision@test", user="alice", start=DAY + timedelta(hours=8), end=DAY + timedelta(hours=10),
         summary="alice vision run")
    book(calendar, "alice-nlp@test", user="alice", start=DAY + timedelta(hours=10), end=DAY + timedelta(hours=12),
         description="project: nlp\n", summary="alice nlp run")
    book(calendar, "bob-vision@test", user="bob", start=DAY + timedelta(hours=12), end=DAY + timedelta(hours=14),
         summary="bob vision run")
    process = DaemonProcess(path).start()
    env = ask_kit.researcher_env(folder / "home", GPUBOOK_DAEMON_ACCOUNT=ask_kit.login())
    try:
        wait_for("bob's booking refused in its event", lambda: "rejected:" in description(calendar, "bob-vision@test"),
                 timeout=60, daemon=process)
        yield {"env": env, "calendar": calendar}
    finally:
        process.stop()


def test_a_group_over_its_quota_is_refused_naming_the_group(daemon: dict) -> None:
    written = description(daemon["calendar"], "bob-vision@test")
    assert "group vision has 2 of 3 GPU-hours in the week before this booking ends; this booking needs 2" in written
    assert "rejected:" not in description(daemon["calendar"], "alice-nlp@test")  # nlp has no quota


def test_mine_shows_each_bookings_project(daemon: dict) -> None:
    done = ask_kit.gpubook("mine", env=daemon["env"])
    assert done.returncode == 0, done.stderr
    rows = {line.split("project ")[1].split()[0] for line in done.stdout.splitlines() if "project " in line}
    assert rows == {"vision", "nlp"}, done.stdout
    assert "bob" not in done.stdout
