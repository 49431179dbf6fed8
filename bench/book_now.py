"""Book for right now: from saving a booking whose start has passed to the booker's first SSH login,
and what the daemon costs meanwhile when nothing happens. Prints the figures.

    PYTHONPATH=. python bench/book_now.py [--count 20] [--events 40] [--idle-seconds 60]
                                          [--servers radicale,xandikos] [--engine podman|udocker] [--gap S]

Run as an account with rootless podman (the debian-ssh image is built once, as the daemon tests
do). For each server (real Radicale and Xandikos, started here): a calendar of `--events` other
bookings (another user's, on other days), `gpubook run` as a real process on default [daemon]
settings (poll_seconds 60, check_seconds 1), its calendar URL behind a counting front
(tests/kits/front.py; one extra loopback hop). Then `--count` times, one after the other: a
booking with its start 30 s ago is saved (one PUT through caldav, straight to the server), and
the time from just before the PUT to the booker's first successful SSH login (paramiko; the port
read from the state database as soon as the daemon allocates it) is measured. The saves come at
random phases of the check's second. Then, once the bookings have ended, `--idle-seconds` of
nothing: the daemon's CPU (utime + stime from /proc, its own and its finished children's, as a
share of one core) and the requests it sent to the calendar server per minute, by method.

Targets (issue 24): login <= 3 s after the save, worst of 20; idle CPU <= 1 %; per minute, no more
than one small request per check and calendar, plus the poll's.

`--via terminal` (issue 40): each booking is made by `gpubook book --gpus 1` run in a shell on the
server instead (the account's login is alice's), timed from the command's start to the booker's
first SSH login on the port of the ssh line it printed, and to the answer printed.

`--via page` (issue 40): each booking is made with the status page's form, as a browser sends it
(the daemon serves the page, auth basic, alice logged in): the page is read for the form's token,
the form posted (with the page's own Origin and `Sec-Fetch-Site: same-origin`), the 303 followed to
the answer shown; timed from the POST to the login on the port of the answer's ssh line, and to the
answer shown. (tests/test_web_book_browser.py drives the same form in Chromium.)
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from collections import Counter
from datetime import UTC, datetime, timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import paramiko  # noqa: E402

from gpubook.runtime.engines import container_name  # noqa: E402
from gpubook.scheduler.state import State  # noqa: E402

BOOKING_SECONDS = 25  # each booking's time left when saved: the bench's bookings end one after another


def machine() -> str:
    cores = os.cpu_count()
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    load = os.getloadavg()[0]
    return (f"{platform.platform()}, {cores} cores, {memory:.0f} GiB, load {load:.1f}, "
            f"Python {platform.python_version()}")


def cpu_seconds(pid: int) -> tuple[float, float]:
    """(the process's own CPU seconds, those of its finished children: the podman commands it ran)."""
    ticks = os.sysconf("SC_CLK_TCK")
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / ticks, (int(fields[13]) + int(fields[14])) / ticks


def fill(calendar, count: int) -> None:  # type: ignore[no-untyped-def]
    """`count` bookings of bob's, an hour each, from tomorrow on: the calendar a lab has."""
    from tests.kits.daemon_kit import book

    first = (datetime.now(UTC) + timedelta(days=1)).replace(minute=0, second=0, microsecond=0)
    for number in range(count):
        start = first + timedelta(hours=3 * number)
        book(calendar, f"other-{number}@bench", user="bob", start=start, end=start + timedelta(hours=1), gpus="2")


def save(calendar, booking_id: str, *, start: datetime, end: datetime) -> int:  # type: ignore[no-untyped-def]
    """Save the booking as a calendar program does: again after a moment while the server answers
    423 Locked (Xandikos, while gpubook writes another booking's outcome). Returns the retries."""
    from caldav.lib import error as dav_error

    from tests.kits.daemon_kit import book

    for retries in range(100):
        try:
            book(calendar, booking_id, user="alice", start=start, end=end)
        except dav_error.PutError as failure:
            if "423" not in str(failure):
                raise
            time.sleep(0.05)
            continue
        return retries
    raise SystemExit(f"{booking_id}: the server answered 423 Locked 100 times")


def book_from_terminal(env: dict[str, str]) -> tuple[str, int, float]:
    """`gpubook book --gpus 1` for now, as a researcher types it in a shell on the server: (the
    booking's id, its SSH port from the ssh line printed, the seconds until the answer was printed)."""
    import json
    import re

    from tests.kits import ask_kit

    began = time.monotonic()
    done = ask_kit.gpubook("book", "--gpus", "1", "--hours", f"{BOOKING_SECONDS / 60:g}m", "--json", env=env,
                           timeout=120)
    printed = time.monotonic() - began
    if done.returncode != 0:
        raise SystemExit(f"gpubook book failed (exit {done.returncode}): {done.stdout} {done.stderr}")
    answer = json.loads(done.stdout)
    found = re.fullmatch(r"ssh -p (\d+) \S+", str(answer.get("ssh", "")))
    if found is None:
        raise SystemExit(f"gpubook book printed no ssh line: {answer}")
    return str(answer["id"]), int(found.group(1)), printed


PAGE_PASSWORD = "bench-page-pw"  # noqa: S105 - the bench's own throwaway page login


def book_from_page(url: str) -> tuple[str, int, float]:
    """The page's Book form for now, sent as a browser sends it: (the booking's id, its SSH port from
    the answer's ssh line, the seconds until the answer was shown)."""
    import re
    from urllib.parse import urlsplit

    import requests

    session = requests.Session()
    session.auth = ("alice", PAGE_PASSWORD)
    page = session.get(url, timeout=30)
    page.raise_for_status()
    token = re.search(r'name="token" value="([^"]+)"', page.text)
    if token is None:
        raise SystemExit("the page shows no booking form to alice")
    origin = "{0.scheme}://{0.netloc}".format(urlsplit(url))
    began = time.monotonic()
    posted = session.post(url + "book", data={"token": token.group(1), "gpus": "1", "at": "now",
                                              "hours": f"{BOOKING_SECONDS / 60:g}m"},
                          headers={"Origin": origin, "Sec-Fetch-Site": "same-origin"}, allow_redirects=False,
                          timeout=120)
    if posted.status_code != 303:
        raise SystemExit(f"the form was answered {posted.status_code}: {posted.text[:300]}")
    shown = session.get(url + posted.headers["Location"].removeprefix("./"), timeout=30).text
    printed = time.monotonic() - began
    found = re.search(r'<code class="ssh">ssh -p (\d+) \S+</code>', shown)
    booking = re.search(r"Booking <code>([^<]+)</code>", shown)
    if found is None or booking is None:
        answer = re.search(r'<section id="answer".*?</section>', shown, re.DOTALL)
        raise SystemExit(f"the page's answer has no ssh line: {answer.group(0) if answer else shown[:500]}")
    return booking.group(1), int(found.group(1)), printed


def one_server(kind: str, *, count: int, events: int, idle_seconds: float, key: paramiko.PKey,
               via: str = "calendar", engine_name: str = "podman", gap: float | None = None) -> dict:
    from tests.kits import servers
    from tests.kits.daemon_kit import DaemonProcess, try_login, write_config
    from tests.kits.front import CountingFront

    make = servers.radicale if kind == "radicale" else servers.xandikos
    figures: list[float] = []
    answered: list[float] = []  # --via terminal or page: `gpubook book` run or the form sent → its answer
    ids: list[str] = []
    locked = 0
    with tempfile.TemporaryDirectory(prefix="gpubook-book-now-") as folder, servers.running(make) as server:
        calendar = server.new_calendar()
        fill(calendar, events)
        front = CountingFront(server.base_url).start()
        daemon = None
        try:
            url = front.base_url + calendar.url.path
            config = write_config(Path(folder), url, keys={"alice": key, "bob": paramiko.ECDSAKey.generate(bits=256)},
                                  poll_seconds=60, gpus=count + 4,  # one GPU each: none refused for want of one
                                  engine=engine_name)
            from tests.kits import ask_kit

            env = ask_kit.researcher_env(Path(folder) / "home", GPUBOOK_DAEMON_ACCOUNT=ask_kit.login())
            if via == "terminal":  # this account's login is alice's: `gpubook book` books as her
                config.write_text(config.read_text().replace(
                    "[users.alice]\n", f'[users.alice]\naccount = "{ask_kit.login()}"\n'))
            page = None
            if via == "page":  # the daemon's page, alice's login on it
                import bcrypt

                from gpubook.scheduler.commands.embedded import free_port

                htpasswd = Path(folder) / "htpasswd"
                htpasswd.write_text(f"alice:{bcrypt.hashpw(PAGE_PASSWORD.encode(), bcrypt.gensalt(5)).decode()}\n")
                htpasswd.chmod(0o600)
                web_port = free_port()
                config.write_text(config.read_text() + f'\n[web]\nenabled = true\nlisten = "127.0.0.1:{web_port}"\n'
                                  f'auth = "basic"\nhtpasswd_file = "{htpasswd}"\n')
                page = f"http://127.0.0.1:{web_port}/"
            daemon = DaemonProcess(config).start()
            state_path = Path(folder) / "state" / "state.sqlite"
            status = Path(folder) / "state" / "daemon-status.json"
            deadline = time.monotonic() + 120
            while not status.exists():
                if time.monotonic() > deadline:
                    raise SystemExit(f"{kind}: no first pass within 120 s\n{daemon.tail()}")
                time.sleep(0.1)
            with State(state_path) as state:
                for n in range(count):
                    time.sleep(gap if gap is not None else 1 + random.random())  # noqa: S311 - a phase, not a secret
                    began = time.monotonic()
                    client = port = None
                    if via == "terminal":
                        booking_id, port, printed = book_from_terminal(env)
                        answered.append(printed)
                    elif page is not None:
                        booking_id, port, printed = book_from_page(page)
                        answered.append(printed)
                    else:
                        booking_id = f"now-{n}@bench"
                        now = datetime.now(UTC).replace(microsecond=0)
                        locked += save(calendar, booking_id, start=now - timedelta(seconds=30),
                                       end=now + timedelta(seconds=BOOKING_SECONDS))
                    ids.append(booking_id)
                    while client is None:
                        port = port or state.ports().get(booking_id)
                        client = try_login(port, "alice", key, timeout=2) if port else None
                        if client is None:
                            time.sleep(0.01)
                        if time.monotonic() - began > 90:
                            raise SystemExit(f"{kind} {booking_id}: no login within 90 s\n{daemon.tail()}")
                    seconds = time.monotonic() - began
                    client.close()
                    figures.append(seconds)
                    print(f"  {kind} {booking_id}: saved → logged in {seconds:.3f} s", flush=True)
            time.sleep(BOOKING_SECONDS + 15)  # the last booking ends and is stopped: idle from here
            assert daemon.process is not None
            pid = daemon.process.pid
            before, since = cpu_seconds(pid), time.monotonic()
            time.sleep(idle_seconds)
            after, wall = cpu_seconds(pid), time.monotonic() - since
            sent = Counter(method for _, method, _ in front.requests(since=since))
            if daemon.process.poll() is not None:
                raise SystemExit(f"{kind}: the daemon exited during the idle run\n{daemon.tail()}")
        finally:
            if daemon is not None:
                daemon.stop()
                if len(figures) < count:  # kept for a look at what went wrong
                    kept = Path(tempfile.gettempdir()) / f"book_now-{kind}-daemon.log"
                    kept.write_bytes(daemon.log.read_bytes())
                    print(f"{kind}: the daemon's log is kept in {kept}", file=sys.stderr)
            front.stop()
            engine = bench_engine(engine_name)
            for booking_id in ids:
                engine.stop(container_name(booking_id), 0)
    own, children = after[0] - before[0], after[1] - before[1]
    return {"server": kind, "logins": figures, "answered": answered, "locked": locked, "idle_wall": wall,
            "cpu_own": own, "cpu_children": children, "per_minute": {m: n * 60 / wall for m, n in sorted(sent.items())}}


def bench_engine(name: str):  # type: ignore[no-untyped-def]
    """The engine the daemon runs, as the bench reaches it (its image built, its containers stopped)."""
    from gpubook.runtime.engines import engine_from

    if name == "udocker":  # the host's network only
        return engine_from("udocker", network="host")
    return engine_from("podman", runtime="runc", storage_driver="overlay")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=20)
    parser.add_argument("--events", type=int, default=40)
    parser.add_argument("--idle-seconds", type=float, default=60)
    parser.add_argument("--servers", default="radicale,xandikos")
    parser.add_argument("--via", choices=("calendar", "terminal", "page"), default="calendar",
                        help="how each booking is made: saved into the calendar (a PUT, as a calendar program "
                        "does), `gpubook book` in a shell on the server, or the status page's form (issue 40)")
    parser.add_argument("--engine", choices=("podman", "udocker"), default="podman",
                        help="the daemon's engine (udocker: its store in $UDOCKER_DIR or ~/.udocker, a spare "
                        "container of the image made ahead for each booking for now, issue 42)")
    parser.add_argument("--gap", type=float, help="seconds between bookings (default: 1 to 2 at random); "
                        "udocker's next spare is made in the background after each start")
    args = parser.parse_args()
    logging.getLogger("paramiko").setLevel(logging.CRITICAL)  # logins tried before sshd listens are expected

    from gpubook.runtime.templates import overlay_image
    from gpubook.runtime.templates.catalog import get_template
    from tests.kits.engine_suite import CACHE_DIR

    overlay_image.build_rootfs_image(bench_engine(args.engine), get_template("debian-ssh"), cache_dir=CACHE_DIR)
    key = paramiko.ECDSAKey.generate(bits=256)
    print(f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC; {machine()}")
    made = {"calendar": "saved (PUT)", "terminal": "`gpubook book` run", "page": "the page's form posted"}[args.via]
    print(f"{made} → booker's first SSH login, {args.count} bookings, {args.events}-event calendar, default "
          "[daemon] settings (poll_seconds 60, check_seconds 1), target worst <= 3 s; then idle, nothing "
          "changing (target daemon CPU <= 1 % of one core)")
    for kind in args.servers.split(","):
        result = one_server(kind, count=args.count, events=args.events, idle_seconds=args.idle_seconds, key=key,
                            via=args.via, engine_name=args.engine, gap=args.gap)
        logins = result["logins"]
        if result["answered"]:
            answered = result["answered"]
            print(f"{kind}: {made} → its ssh line shown: median {statistics.median(answered):.2f} s, "
                  f"worst {max(answered):.2f} s, best {min(answered):.2f} s")
        print(f"{kind} ({args.via}, {args.engine}): login median {statistics.median(logins):.2f} s, "
              f"worst {max(logins):.2f} s, best {min(logins):.2f} s "
              f"({result['locked']} saves answered 423 Locked and sent again)")
        wall, own, children = result["idle_wall"], result["cpu_own"], result["cpu_children"]
        requests = ", ".join(f"{method} {rate:.1f}" for method, rate in result["per_minute"].items()) or "none"
        print(f"{kind}: idle over {wall:.0f} s: daemon CPU {100 * own / wall:.2f} %, with the podman commands it "
              f"ran {100 * (own + children) / wall:.2f} %; requests to the server per minute: {requests}",
              flush=True)


if __name__ == "__main__":
    main()
