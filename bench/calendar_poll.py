"""How much a CalDAV poll costs: CaldavSource against the naive download and the server's floor.

    PYTHONPATH=. /opt/gpubook/venv/bin/python bench/calendar_poll.py [--events 10000]
        [--servers radicale,xandikos] [--repeat 5]

For each server a calendar of N generated events (icalendar) is written straight into the
server's storage before it starts (Radicale: one .ics file per event in its filesystem folder;
Xandikos: the same files committed into the collection's git repository with `git`), which is
seconds instead of N PUTs. The server is then warmed up with one full download (Radicale builds
its item cache on first access) and measured:

- first load: a new CaldavSource's first poll (sync-collection listing + calendar-multiget);
- no change: a poll when nothing changed;
- one change: a poll after one event was edited (the edit itself is not timed);
- naive: a full calendar-query REPORT with calendar-data, sent with plain requests (a cron job);
- floor: a bare no-change sync-collection REPORT with the current token, sent with plain requests;
- floor + one GET: after one edit, the bare sync-collection that reports it plus a plain GET
  of the changed event: what a one-change poll cannot beat.

Wall time (time.perf_counter), client CPU time of the measuring thread (time.thread_time: only
this thread, so the byte-counting proxy's threads are not charged) and bytes on the wire. Bytes
are counted in a separate pass through a small TCP proxy on 127.0.0.1 that counts every byte
each way (HTTP headers included); times are taken on direct connections, so the proxy adds no
latency to them. Each figure is the median of --repeat runs.
"""

from __future__ import annotations

import argparse
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import requests
from icalendar import Calendar, Event

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpubook.scheduler.sources.caldav_source import CaldavSource  # noqa: E402
from tests.kits import servers  # noqa: E402

SYNC_BODY = ('<?xml version="1.0" encoding="utf-8"?><sync-collection xmlns="DAV:">'
             '<sync-token>{token}</sync-token><sync-level>1</sync-level>'
             '<prop><getetag/></prop></sync-collection>')
QUERY_BODY = ('<?xml version="1.0" encoding="utf-8"?>'
              '<C:calendar-query xmlns:D="DAV:" xmlns:C="urn:ietf:params:xml:ns:caldav">'
              '<D:prop><D:getetag/><C:calendar-data/></D:prop>'
              '<C:filter><C:comp-filter name="VCALENDAR"><C:comp-filter name="VEVENT"/>'
              '</C:comp-filter></C:filter></C:calendar-query>')
REPORT_HEADERS = {"Content-Type": "application/xml; charset=utf-8", "Depth": "1"}


# -- data ------------------------------------------------------------------------------------------

def event_text(number: int, *, summary: str | None = None) -> str:
    calendar = Calendar()
    calendar.add("prodid", "-//gpubook bench//")
    calendar.add("version", "2.0")
    event = Event()
    start = datetime(2026, 1, 1, 8, tzinfo=UTC) + timedelta(hours=7 * number)
    event.add("uid", f"bench-{number}@gpubook")
    event.add("dtstamp", datetime(2026, 1, 1, tzinfo=UTC))
    event.add("dtstart", start)
    event.add("dtend", start + timedelta(hours=3))
    event.add("summary", summary or f"user{number % 40} debian-ssh gpus={1 + number % 4}")
    event.add("description", f"template: debian-ssh\nbooking number {number} of the benchmark")
    calendar.add_component(event)
    return calendar.to_ical().decode()


def write_events(folder: Path, count: int) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for number in range(count):
        (folder / f"bench-{number}.ics").write_text(event_text(number), newline="")


def radicale_with_events(storage: Path, count: int) -> tuple[servers.CalendarServer, str]:
    server = servers.radicale(storage)
    folder = storage / "collections" / "collection-root" / "test" / "bench"
    write_events(folder, count)
    (folder / ".Radicale.props").write_text(
        '{"C:supported-calendar-component-set": "VEVENT", "tag": "VCALENDAR"}')
    server.start()
    return server, f"{server.base_url}/test/bench/"


def xandikos_with_events(storage: Path, count: int) -> tuple[servers.CalendarServer, str]:
    server = servers.xandikos(storage).start()
    url = f"{server.base_url}/user/calendars/bench/"
    if server.client().mkcalendar(url).status not in (200, 201):
        raise RuntimeError("MKCALENDAR failed on Xandikos")
    server.stop()
    folder = storage / "data" / "user" / "calendars" / "bench"
    write_events(folder, count)
    git = ["git", "-C", str(folder), "-c", "user.name=bench", "-c", "user.email=bench@localhost"]
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "benchmark events"], check=True)
    server.start()
    return server, url


# -- byte counting proxy ------------------------------------------------------------------

class CountingProxy:
    """Forwards 127.0.0.1:port to the server, counting bytes each way."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.sent = self.received = 0
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def reset(self) -> None:
        with self._lock:
            self.sent = self.received = 0

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
            threading.Thread(target=self._pump, args=(client, upstream, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, False), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, outgoing: bool) -> None:
        try:
            while data := source.recv(65536):
                with self._lock:
                    if outgoing:
                        self.sent += len(data)
                    else:
                        self.received += len(data)
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for end in (source, sink):
                try:
                    end.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self._listener.close()


# -- measuring ----------------------------------------------------------------------------

@dataclass
class Figures:
    wall: list[float]
    cpu: list[float]
    wire: int = 0

    def row(self, name: str) -> str:
        wall = statistics.median(self.wall) * 1000
        cpu = statistics.median(self.cpu) * 1000
        return f"  {name:<22} {wall:10.1f} {cpu:10.1f} {self.wire:12,d}"


def timed(action: Callable[[], object]) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.thread_time()
    action()
    return time.perf_counter() - wall, time.thread_time() - cpu


class Bench:
    def __init__(self, url: str, server: servers.CalendarServer, proxy: CountingProxy) -> None:
        self.url = url
        self.proxied_url = url.replace(f":{server.port}/", f":{proxy.port}/")
        self.server = server
        self.proxy = proxy
        self.http = requests.Session()
        self.http.trust_env = False
        if server.username:
            self.http.auth = (server.username, server.password or "")
        self.edits = 0

    def source(self, url: str) -> CaldavSource:
        return CaldavSource(url, username=self.server.username, password=self.server.password,
                            timeout=120)

    def naive(self, url: str) -> None:
        answer = self.http.request("REPORT", url, data=QUERY_BODY, headers=REPORT_HEADERS,
                                   timeout=120)
        assert answer.status_code == 207 and b"BEGIN:VCALENDAR" in answer.content

    def floor(self, url: str, token: str) -> None:
        answer = self.http.request("REPORT", url, data=SYNC_BODY.format(token=token),
                                   headers=REPORT_HEADERS, timeout=120)
        assert answer.status_code == 207, answer.status_code

    def get_one(self, url: str) -> None:
        answer = self.http.get(url + "bench-7.ics", timeout=120)
        assert answer.status_code == 200

    def edit_one(self) -> None:
        self.edits += 1
        text = event_text(7, summary=f"user7 debian-ssh gpus=2 edit {self.edits}")
        answer = self.http.put(self.url + "bench-7.ics", data=text.encode(),
                               headers={"Content-Type": "text/calendar"}, timeout=120)
        assert answer.status_code in (201, 204), answer.status_code

    def wire(self, action: Callable[[], object]) -> int:
        self.proxy.reset()
        action()
        time.sleep(0.05)  # let the pump threads count the last bytes
        return self.proxy.sent + self.proxy.received

    def run(self, repeat: int, count: int) -> dict[str, Figures]:
        self.naive(self.url)  # warm-up: Radicale fills its item cache on first access
        figures = {name: Figures([], []) for name in
                   ("first load", "naive (full query)", "no change", "floor (bare sync)",
                    "one change", "floor + one GET")}
        source = None
        for _ in range(max(2, repeat // 2)):
            fresh = self.source(self.url)
            wall, cpu = timed(fresh.poll)
            figures["first load"].wall.append(wall)
            figures["first load"].cpu.append(cpu)
            source = fresh
        assert source is not None
        first = source.poll()
        assert len(first.objects) == count, (len(first.objects), count)
        for round_ in range(repeat):
            self._one_round(figures, source, round_)
        self._count_bytes(figures, count)
        return figures

    def _one_round(self, figures: dict[str, Figures], source: CaldavSource, round_: int) -> None:
        self._measure(figures, "naive (full query)", lambda: self.naive(self.url))
        # Server times vary a lot on a shared machine (Xandikos: 100-350 ms for the same
        # REPORT just after an edit), so each poll and its floor take turns going first.
        pairs = [(self._no_change, self._no_change_floor),
                 (self._one_change, self._one_change_floor)]
        for pair in pairs:
            for step in pair if round_ % 2 == 0 else reversed(pair):
                step(figures, source)

    def _no_change(self, figures: dict[str, Figures], source: CaldavSource) -> None:
        polls: list = []
        self._measure(figures, "no change", lambda: polls.append(source.poll()))
        assert not polls[-1].changed and polls[-1].stats.requests == 1

    def _no_change_floor(self, figures: dict[str, Figures], source: CaldavSource) -> None:
        token = source.sync_token or ""
        self._measure(figures, "floor (bare sync)", lambda: self.floor(self.url, token))

    def _one_change(self, figures: dict[str, Figures], source: CaldavSource) -> None:
        self.edit_one()
        polls: list = []
        self._measure(figures, "one change", lambda: polls.append(source.poll()))
        assert polls[-1].changed and polls[-1].stats.requests == 2

    def _one_change_floor(self, figures: dict[str, Figures], source: CaldavSource) -> None:
        """The same kind of edit, the bare sync-collection that reports it, a plain GET of it."""
        token = source.sync_token or ""
        self.edit_one()
        self._measure(figures, "floor + one GET",
                      lambda: (self.floor(self.url, token), self.get_one(self.url)))
        source.poll()  # catch up with that edit, untimed

    def _measure(self, figures: dict[str, Figures], name: str,
                 action: Callable[[], object]) -> None:
        wall, cpu = timed(action)
        figures[name].wall.append(wall)
        figures[name].cpu.append(cpu)

    def _count_bytes(self, figures: dict[str, Figures], count: int) -> None:
        proxied = self.source(self.proxied_url)
        figures["first load"].wire = self.wire(proxied.poll)
        figures["no change"].wire = self.wire(proxied.poll)
        self.edit_one()
        figures["one change"].wire = self.wire(proxied.poll)
        token = proxied.sync_token or ""
        figures["floor (bare sync)"].wire = self.wire(lambda: self.floor(self.proxied_url, token))
        self.edit_one()
        figures["floor + one GET"].wire = self.wire(
            lambda: (self.floor(self.proxied_url, token), self.get_one(self.proxied_url)))
        figures["naive (full query)"].wire = self.wire(lambda: self.naive(self.proxied_url))
        self.http.close()  # new connections through the proxy were made above; start clean


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--events", type=int, default=10_000)
    parser.add_argument("--servers", default="radicale,xandikos")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    makers = {"radicale": radicale_with_events, "xandikos": xandikos_with_events}
    print(f"machine: {platform.platform()}, {len(__import__('os').sched_getaffinity(0))} CPUs, "
          f"Python {platform.python_version()}")
    for name in args.servers.split(","):
        storage = Path(tempfile.mkdtemp(prefix=f"gpubook-bench-{name}-"))
        server = None
        try:
            started = time.perf_counter()
            server, url = makers[name](storage, args.events)
            print(f"\n{name}: {args.events} events written and server started in "
                  f"{time.perf_counter() - started:.1f} s; medians of {args.repeat} runs")
            proxy = CountingProxy(server.port)
            figures = Bench(url, server, proxy).run(args.repeat, args.events)
            proxy.close()
            print(f"  {'':<22} {'wall ms':>10} {'cpu ms':>10} {'wire bytes':>12}")
            for key, value in figures.items():
                print(value.row(key))
            report_targets(figures)
        finally:
            if server is not None:
                server.stop()
            shutil.rmtree(storage, ignore_errors=True)
    return 0


def report_targets(figures: dict[str, Figures]) -> None:
    def wall(name: str) -> float:
        return statistics.median(figures[name].wall)

    no_change = wall("no change") / wall("floor (bare sync)")
    one_change = wall("one change") / wall("floor + one GET")
    cpu = statistics.median(figures["no change"].cpu) * 1000
    print(f"  no change / floor: {no_change:.2f} (target <= 1.10); "
          f"wire {figures['no change'].wire} B (target <= 1024); cpu {cpu:.1f} ms (target <= 20)")
    print(f"  one change / (floor + one GET): {one_change:.2f} (target <= 1.10)")


if __name__ == "__main__":
    sys.exit(main())
