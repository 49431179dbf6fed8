"""gpubook's systemd user unit, run by a real user manager in a container booted with systemd.

How this is proven where no systemd runs as PID 1: rootful podman boots a Debian 12 image (made by
tests/kits/systemd_kit.py with mmdebstrap) with `--systemd=always` and /sbin/init as PID 1. gpubook's
wheel, built from this tree, goes into /opt/gpubook/venv there, and `gpubook setup --user gpubook
--data-root /srv/gpubook` does the rest as on a server: linger (logind starts user@UID.service),
the nosuid,nodev bind mount, storage.conf, the delegation drop-in, the config, the image, and the
unit, enabled and started in the account's user manager; doctor all ok. The tests then drive that
unit with `systemctl --user --machine=gpubook@.host`.

What booting needed on this VM (cgroup v1 hybrid, kernel 6.18, podman 4.3, runc):
- `--systemd=always` itself gives systemd what it checks for: tmpfs on /run, /run/lock, /tmp and
  /var/log/journal, `container=podman`, and the name=systemd hierarchy writable at the container's
  cgroup. systemd 252 runs in its cgroup-v1 mode ("Tainted: cgroupsv1") and delegates
  user@UID.service's subtree as usual; booting alone needed no cgroup namespace.
- `--ulimit` at or below the host's hard limits: this VM withholds CAP_SYS_RESOURCE from root, so
  runc cannot set podman's defaults and the container never starts ("error setting rlimit type 7:
  operation not permitted").
- podman's own system units masked in the image: podman.service fails there on socket activation,
  and a failed unit would make the boot "degraded" instead of "running".

What the bookings' rootless podman inside needed (systemd_kit.NESTED says why each): CAP_SYS_ADMIN
(newuidmap is setuid root), `--security-opt unmask=ALL` (mounting a new /proc), `--cgroupns=private`
(runc finds the container's cgroup by its path), /dev/net/tun (slirp4netns), and /home on the host's
file system (the overlay store's upper layer cannot be on the container's overlay root). With them,
a booking's container starts and answers SSH there. That container's conmon runs in a transient
podman-N.scope of the user manager, not in gpubook.service's cgroup (rootless podman moves itself
there when it finds the user's bus), so on such a host it outlives a stop by that alone; the unit's
KillMode=process keeps it alive where podman stays in the service's cgroup.

CAP_SYS_ADMIN is also what lets setup bind-mount the data_root there, as root does on a server.

The unit is setup's (the tree's, with ExecStart on the venv's gpubook) plus one drop-in:
WatchdogSec=120 would make the watchdog test wait minutes, so the drop-in sets WatchdogSec=10 (the
daemon pings every WatchdogSec/2) and TimeoutAbortSec=5 (how long systemd waits after the
watchdog's SIGABRT before SIGKILL).
"""

from __future__ import annotations

import json
import re
import shutil
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import icalendar
import pytest

from tests.kits import systemd_kit as kit
from tests.kits.daemon_kit import event_text

pytestmark = [
    pytest.mark.systemd,
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("podman") is None or shutil.which("mmdebstrap") is None,
                       reason="needs podman and mmdebstrap"),
    pytest.mark.skipif(not hasattr(__import__("os"), "geteuid") or __import__("os").geteuid() != 0,
                       reason="boots a container with rootful podman: run as root"),
]

UNIT = Path(__file__).resolve().parent.parent / "gpubook" / "systemd" / "gpubook.service"
WATCHDOG_SECONDS = 10
POLL_SECONDS = 15
DROPIN = f"[Service]\nWatchdogSec={WATCHDOG_SECONDS}\nTimeoutAbortSec=5\n"
KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIB6v3b9c0p7s5xXl0bN3cYk2s9mJ0b2cZc8n8kq0tq0Q alice@laptop"
STATUS_LINE = re.compile(r"^\d+ booking\(s\) now, \d+ upcoming, \d+ rejected; last poll \S+")


def config_text(feed: str, *, with_bob: bool = False, poll_seconds: int = POLL_SECONDS) -> str:
    lines = ['[host]', 'name = "systemd-test"', 'timezone = "UTC"', '',
             '[[calendar]]', f'url = "{feed}"', 'gpus = "all"', '',
             '[gpus]', 'count = 2', '',
             '[engine]', 'name = "podman"', 'runtime = "runc"', 'storage_driver = "overlay"', '',
             '[storage]', f'data_root = "{kit.DATA_ROOT}"', '',
             '[daemon]', f'poll_seconds = {poll_seconds}', '']
    for number, user in enumerate(["alice", "bob"] if with_bob else ["alice"]):
        lines += [f'[users.{user}]', f'uid = {2001 + number}', f'email = ["{user}@lab.example"]',
                  f'ssh_keys = ["{KEY}"]', '']
    return "\n".join(lines)


def feed_text() -> str:
    """alice's booking runs now (a container); bob's, tomorrow, is rejected until bob is configured."""
    now = datetime.now(UTC).replace(microsecond=0)
    events = [event_text("alice-now", user="alice", start=now - timedelta(minutes=1), end=now + timedelta(hours=2)),
              event_text("bob-tomorrow", user="bob", start=now + timedelta(days=1),
                         end=now + timedelta(days=1, hours=1))]
    calendar = icalendar.Calendar.from_ical(events[0])
    for event in icalendar.Calendar.from_ical(events[1]).walk("VEVENT"):
        calendar.add_component(event)
    return calendar.to_ical().decode()


class Service:
    """The booted container with gpubook installed for the account, its unit not yet started."""

    def __init__(self, machine: kit.Booted, feed: str) -> None:
        self.machine = machine
        self.feed = feed

    def show(self) -> dict[str, str]:
        return self.machine.unit("ActiveState", "SubState", "MainPID", "StatusText", "NRestarts", "Result")

    def active(self) -> dict[str, str]:
        """Start the unit unless it runs (a test before may have stopped it); its properties."""
        if self.show()["ActiveState"] != "active":
            self.machine.user_systemctl("start", "gpubook.service")
        shown = self.show()
        assert shown["ActiveState"] == "active", shown
        return shown

    def daemon_status(self) -> dict[str, object]:
        """The status file the daemon writes after each pass (what `gpubook status` reads)."""
        text = self.machine.sh("cat ~/.local/state/gpubook/daemon-status.json", user=kit.ACCOUNT).stdout
        return json.loads(text)

    def status_is(self, start: str) -> dict[str, str] | None:
        """The unit's properties once its StatusText begins with `start` and is the status line of
        the daemon's last pass, as its status file has it."""
        shown = self.show()
        text = shown["StatusText"]
        if STATUS_LINE.match(text) and text.startswith(start) and text == self.daemon_status()["status"]:
            return shown
        return None

    def containers(self) -> list[str]:
        """The account's running containers, as `ID NAME` lines."""
        listed = self.machine.sh("podman ps --format '{{.ID}} {{.Names}}'", user=kit.ACCOUNT)
        return listed.stdout.split("\n")[:-1]

    def event_log(self) -> str:
        """`gpubook log`, run by the account with the installed gpubook."""
        return self.machine.sh(f"{kit.GPUBOOK} log --config ~/.config/gpubook/gpubook.toml --lines 0",
                               user=kit.ACCOUNT).stdout

    def reload(self, config: str) -> None:
        kit.write_config(self.machine, config)
        self.machine.user_systemctl("reload", "gpubook.service")


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    wheels = kit.wheelhouse(tmp_path_factory.mktemp("wheels"))
    with kit.booted(wheels=wheels) as (machine, timing):
        print(f"\nsystemd-booted container: 'running' {timing.boot_seconds:.1f} s after podman run")
        assert machine.sh("cat /proc/1/comm").stdout.strip() == "systemd"
        kit.create_account(machine)
        kit.install_venv(machine)
        # No booking while setup's own start of the unit runs: the tests' bookings come after.
        feed = kit.serve_feed(machine, icalendar.Calendar().to_ical().decode())
        started = time.monotonic()
        said = kit.setup(machine, config_text(feed))
        print(f"gpubook setup: {time.monotonic() - started:.1f} s\n{said}")
        # setup enabled and started the unit, on the venv's gpubook; the tests start it themselves.
        assert machine.user_systemctl("is-enabled", "gpubook.service").stdout.strip() == "enabled"
        assert machine.unit("ExecStart")["ExecStart"].startswith(f"{{ path={kit.GPUBOOK} ;")
        assert machine.unit("ActiveState")["ActiveState"] == "active"
        installed = machine.sh(f"cat ~{kit.ACCOUNT}/.config/systemd/user/gpubook.service").stdout
        assert installed == UNIT.read_text().replace(
            "ExecStart=%h/.local/share/gpubook/venv/bin/gpubook", f"ExecStart={kit.GPUBOOK}")
        machine.user_systemctl("stop", "gpubook.service")
        kit.publish(machine, feed_text())
        kit.install_dropin(machine, "test-watchdog.conf", DROPIN)
        yield Service(machine, feed)
    assert kit.leftovers() == []


def test_start_is_done_only_after_ready_and_shows_the_daemons_status(service: Service) -> None:
    machine = service.machine
    assert machine.unit("DropInPaths")["DropInPaths"].endswith("/gpubook.service.d/test-watchdog.conf")
    # The user manager loaded the unit without a complaint ("gpubook.service:12: Unknown key ...").
    complaints = machine.sh(f"journalctl --no-pager -o cat _UID=$(id -u {kit.ACCOUNT}) _COMM=systemd",
                            check=False).stdout
    assert re.findall(r"^.*gpubook\.service:\d+: .*$", complaints, flags=re.M) == []
    # The feed server stopped: the daemon's first poll waits on it, so its first pass, and READY=1, wait too.
    machine.sh("systemctl kill --signal=SIGSTOP feed.service")
    started = time.monotonic()
    machine.user_systemctl("start", "--no-block", "gpubook.service")
    activating = kit.wait_for("the unit to start its daemon", lambda: (
        (shown := service.show())["MainPID"] != "0" and shown), timeout=60)
    assert isinstance(activating, dict)
    time.sleep(3)  # the daemon runs and polls; without READY=1 the start job must still be waiting
    held = service.show()
    assert (held["ActiveState"], held["SubState"]) == ("activating", "start"), held
    assert held["MainPID"] == activating["MainPID"]
    machine.sh("systemctl kill --signal=SIGCONT feed.service")
    kit.wait_for("the unit to become active", lambda: service.show()["ActiveState"] == "active", timeout=120)
    print(f"unit start: active {time.monotonic() - started:.1f} s after `systemctl --user start` "
          "(3 s of it with the feed held)")
    shown = service.show()
    assert shown["SubState"] == "running" and shown["MainPID"] == held["MainPID"]
    # alice's booking: its image is prepared by the first pass, its container started by a later one.
    kit.wait_for("alice's booking to answer on SSH", lambda: "booking alice-now: started on GPU 0"
                 in machine.journal(), timeout=POLL_SECONDS + 90)
    assert len(service.containers()) == 1
    # READY=1 keeps the STATUS= line the first pass sent: the daemon's status line.
    settled = kit.wait_for("STATUS= to be the daemon's status line",
                           lambda: service.status_is("1 booking(s) now, 0 upcoming, 1 rejected"),
                           timeout=POLL_SECONDS + 60)
    assert isinstance(settled, dict) and settled["MainPID"] == held["MainPID"]
    assert f"daemon started (pid {held['MainPID']})" in service.event_log()


def test_reload_rereads_the_config_in_the_same_process(service: Service) -> None:
    before = service.active()
    containers = service.containers()
    service.reload(config_text(service.feed, with_bob=True))
    accepted = kit.wait_for("the reloaded config to accept bob's booking",
                            lambda: service.status_is("1 booking(s) now, 1 upcoming, 0 rejected"), timeout=60)
    assert isinstance(accepted, dict)
    assert accepted["MainPID"] == before["MainPID"] and accepted["NRestarts"] == before["NRestarts"]
    assert "templates reloaded" in service.machine.journal()
    assert service.containers() == containers


def test_an_invalid_config_is_refused_on_reload_and_the_old_one_kept(service: Service) -> None:
    machine = service.machine
    service.reload(config_text(service.feed))
    kit.wait_for("bob's booking to be rejected again",
                 lambda: service.status_is("1 booking(s) now, 0 upcoming, 1 rejected"), timeout=60)
    before = kit.wait_for("a status line", lambda: service.status_is("1 booking(s) now"), timeout=60)
    assert isinstance(before, dict)
    # Valid TOML that adds bob, but with a poll interval that is not a number: refused as a whole.
    invalid = config_text(service.feed, with_bob=True).replace(f"poll_seconds = {POLL_SECONDS}",
                                                               'poll_seconds = "soon"')
    service.reload(invalid)
    kit.wait_for("the refusal in the unit's journal",
                 lambda: "reload refused, keeping the running config" in machine.journal(), timeout=60)
    kit.wait_for("the unit to be active after the refused reload",
                 lambda: service.show()["ActiveState"] == "active", timeout=30)
    refusal = machine.journal().split("reload refused, keeping the running config", 1)[1].splitlines()[0]
    assert "poll_seconds" in refusal
    # The old config still rules: the next poll's pass still rejects bob's booking.
    kept = kit.wait_for("a later pass's status line", lambda: (
        (shown := service.status_is("1 booking(s) now, 0 upcoming, 1 rejected"))
        and shown["StatusText"] != before["StatusText"] and shown), timeout=60)  # another "last poll"
    assert isinstance(kept, dict)
    assert kept["MainPID"] == before["MainPID"] and kept["NRestarts"] == before["NRestarts"]
    kit.write_config(machine, config_text(service.feed))


def test_journalctl_priority_filters_the_daemons_lines(service: Service) -> None:
    """The daemon writes `<N>` before each line under journald: `journalctl -p warning` shows its
    warnings (the refused reload above) and none of its info lines (a start, a reload)."""
    machine = service.machine

    def entries(priority: str) -> list[dict[str, str]]:
        shown = machine.sh("journalctl --no-pager -o json -p " + priority +
                           f" _SYSTEMD_USER_UNIT=gpubook.service _UID=$(id -u {kit.ACCOUNT})", check=False).stdout
        return [json.loads(line) for line in shown.splitlines() if line.startswith("{")]

    warnings, everything = entries("warning"), entries("debug")
    said = [entry["MESSAGE"] for entry in warnings]
    assert any("reload refused, keeping the running config" in line for line in said), said
    assert all(int(entry["PRIORITY"]) <= 4 for entry in warnings), warnings
    assert not any("started on GPU" in line or "templates reloaded" in line for line in said), said
    infos = [entry["MESSAGE"] for entry in everything if entry["PRIORITY"] == "6"]
    assert any("booking alice-now: started on GPU 0" in line for line in infos), infos[-20:]
    # journald took the prefix as the priority: no message keeps a literal `<N>`, and none a time of its own.
    messages = [entry["MESSAGE"] for entry in everything]
    assert not [line for line in messages if re.match(r"<\d>", line)], messages[-20:]
    assert not [line for line in messages if re.match(r"\d{4}-\d\d-\d\d ", line)], messages[-20:]


def test_the_watchdog_is_fed_and_a_stuck_daemon_is_restarted(service: Service) -> None:
    machine = service.machine
    before = service.active()
    containers = service.containers()
    assert machine.unit("WatchdogUSec")["WatchdogUSec"] == f"{WATCHDOG_SECONDS}s"  # the drop-in's
    time.sleep(2.5 * WATCHDOG_SECONDS)  # the daemon must ping through two and a half watchdog periods
    fed = service.show()
    assert fed["ActiveState"] == "active", fed
    assert fed["MainPID"] == before["MainPID"] and fed["NRestarts"] == before["NRestarts"]
    # The check above can fail: a daemon that stops pinging (SIGSTOP) is killed by the watchdog and restarted.
    machine.sh(f"kill -STOP {before['MainPID']}")
    restarted = kit.wait_for("the watchdog to restart the stopped daemon", lambda: (
        (shown := service.show())["NRestarts"] != before["NRestarts"] and shown), timeout=WATCHDOG_SECONDS + 60)
    assert isinstance(restarted, dict)
    assert "Watchdog timeout" in machine.sh("journalctl --no-pager -o cat --since=-5min", check=False).stdout
    kit.wait_for("the restarted daemon to be active", lambda: service.show()["ActiveState"] == "active",
                 timeout=120)
    assert service.show()["MainPID"] not in ("0", before["MainPID"])
    assert service.containers() == containers  # KillMode=process: the booking outlived the daemon


def test_stop_ends_the_daemon_and_leaves_the_booking_running(service: Service) -> None:
    machine = service.machine
    before = service.active()
    containers = service.containers()
    assert len(containers) == 1
    machine.user_systemctl("stop", "gpubook.service")
    stopped = service.show()
    assert stopped["ActiveState"] == "inactive" and stopped["MainPID"] == "0", stopped
    assert machine.sh(f"kill -0 {before['MainPID']}", check=False).returncode != 0
    assert "daemon stopped; containers keep running" in service.event_log()
    assert service.containers() == containers  # the same container, still running
    # The next start adopts it instead of starting another.
    started = time.monotonic()
    service.active()  # `systemctl --user start`, which returns once READY=1 came
    print(f"unit start with a booking to adopt: active {time.monotonic() - started:.1f} s after "
          "`systemctl --user start`")
    kit.wait_for("the restarted daemon's status line",
                 lambda: service.status_is("1 booking(s) now"), timeout=POLL_SECONDS + 60)
    assert service.containers() == containers
