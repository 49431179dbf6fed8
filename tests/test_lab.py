"""One lab, several servers: two real daemons (`gpubook run`, each with its own calendar on Radicale,
its own state and its own page), gpu1's page told of gpu2 and of a server that is down. The lab page
merges both servers' bookings by host, shows the one down as unreachable, keeps auth (between the
servers too) and shows each viewer no more than each server shows them directly; `gpubook report
--lab` sums both servers' month; the metrics name each host by its [host] name."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from gpubook.scheduler.outbox.web import serve
from gpubook.scheduler.outbox.web.lab import ANSWER_LIMIT, Lab
from gpubook.scheduler.outbox.web.lab_sign import LAB_SIGNATURE_HEADER, LAB_USER_HEADER, signed_headers
from gpubook.scheduler.state import State
from tests.kits import lab_kit
from tests.kits.daemon_kit import ROOT, book, child_env, wait_for
from tests.kits.servers import FeedServer, Reply
from tests.kits.web_kit import CHROMEDRIVER, CHROMIUM, browser, rendered, served, web_config

pytestmark = [pytest.mark.caldav, pytest.mark.slow, pytest.mark.daemon]  # the lab fixture runs two daemons

NOW = datetime.now(UTC).replace(microsecond=0)
HOUR = timedelta(hours=1)


@dataclass
class Lab2:
    gpu1: lab_kit.Server
    gpu2: lab_kit.Server
    down: str  # a lab address where nothing listens


def _booking(booking: str, user: str, gpus: list[int], port: int, start: datetime, end: datetime) -> dict[str, object]:
    return {"booking": booking, "user": user, "gpus": gpus, "port": port, "start": start.isoformat(),
            "end": end.isoformat()}


@pytest.fixture(scope="module")
def lab(radicale_server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab2]:  # type: ignore[no-untyped-def]
    """gpu1: alice runs on GPU 0 (port 2201), bob is booked in 3 h; gpu2: bob runs on GPU 1
    (port 2202), alice is booked on GPU 0 in 2 h. gpu1's page knows gpu2 and a server that is down."""
    folder = tmp_path_factory.mktemp("lab")
    port1, port2, dead = lab_kit.free_port(), lab_kit.free_port(), lab_kit.free_port()
    calendar1, calendar2 = radicale_server.new_calendar(), radicale_server.new_calendar()
    started, ends = NOW - HOUR, NOW + 2 * HOUR
    book(calendar1, "alice-run@gpu1", user="alice", start=started, end=ends)
    book(calendar1, "bob-later@gpu1", user="bob", start=NOW + 3 * HOUR, end=NOW + 4 * HOUR)
    book(calendar2, "bob-run@gpu2", user="bob", start=started, end=ends)
    book(calendar2, "alice-later@gpu2", user="alice", start=NOW + 2 * HOUR, end=NOW + 5 * HOUR)
    (folder / "gpu1").mkdir()
    (folder / "gpu2").mkdir()
    lab_kit.running(folder / "gpu1", _booking("alice-run@gpu1", "alice", [0], 2201, started, ends))
    lab_kit.running(folder / "gpu2", _booking("bob-run@gpu2", "bob", [1], 2202, started, ends))
    down = f"http://127.0.0.1:{dead}"
    config1 = lab_kit.write_config(folder / "gpu1", name="gpu1", calendar_url=str(calendar1.url), port=port1,
                                   lab=[f"http://127.0.0.1:{port2}", down])
    config2 = lab_kit.write_config(folder / "gpu2", name="gpu2", calendar_url=str(calendar2.url), port=port2)
    with lab_kit.serving(folder / "gpu2", config2, name="gpu2", port=port2) as gpu2, \
            lab_kit.serving(folder / "gpu1", config1, name="gpu1", port=port1) as gpu1:
        yield Lab2(gpu1=gpu1, gpu2=gpu2, down=down)


def hosts(view: dict) -> dict[str, dict]:  # type: ignore[type-arg]
    return {host["name"]: host for host in view["hosts"]}


def test_the_lab_page_shows_both_servers_bookings_by_host(lab: Lab2) -> None:
    answer = lab.gpu1.get("/api/lab", user="alice")
    assert answer.status_code == 200, answer.text
    view = answer.json()
    assert set(hosts(view)) == {"gpu1", "gpu2"}
    gpu1, gpu2 = hosts(view)["gpu1"], hosts(view)["gpu2"]
    assert [(r["booking"], r["user"], r["gpus"]) for r in gpu1["running"]] == [("alice-run@gpu1", "alice", [0])]
    assert [(r["booking"], r["user"], r["gpus"]) for r in gpu2["running"]] == [("bob-run@gpu2", "bob", [1])]
    assert [n["booking"] for n in gpu1["next"]] == ["bob-later@gpu1"]
    assert [n["booking"] for n in gpu2["next"]] == ["alice-later@gpu2"]
    # Where a GPU is free now, and until when: gpu1's GPU 1 for as far as the plan sees (bob's later
    # booking goes to GPU 0, free by then), gpu2's GPU 0 until alice's booking.
    assert [n["gpus"] for n in gpu1["next"]] == [[0]]
    assert gpu1["free"] == [{"gpu": 1, "until": None}]
    assert [(f["gpu"], datetime.fromisoformat(f["until"])) for f in gpu2["free"]] == [(0, NOW + 2 * HOUR)]
    page = lab.gpu1.get("/lab", user="alice")
    assert page.status_code == 200
    for booking in ("alice-run@gpu1", "bob-run@gpu2", "bob-later@gpu1", "alice-later@gpu2"):
        assert f'data-booking="{booking}"' in page.text


def test_a_server_that_is_down_is_shown_unreachable_and_the_page_still_serves(lab: Lab2) -> None:
    view = lab.gpu1.get("/api/lab", user="alice").json()
    servers = {s["server"]: s for s in view["servers"]}
    down = servers[lab.down.removeprefix("http://")]
    assert down["problem"].startswith(f"{lab.down.removeprefix('http://')} cannot be reached: ")
    assert servers["gpu1"]["problem"] is None
    assert servers[lab.gpu2.url.removeprefix("http://")]["problem"] is None
    assert view["summary"] == "2 GPU(s) free now on 2 host(s); 2 of 3 server(s) answered"
    page = lab.gpu1.get("/lab", user="bob")
    assert page.status_code == 200
    assert "Unreachable: " in page.text and 'class="unreachable"' in page.text


def test_a_viewer_sees_no_more_through_the_lab_page_than_directly(lab: Lab2) -> None:
    """Each user's ssh lines on gpu2, directly and through gpu1's lab page, are the same: their own only."""
    for user in ("alice", "bob"):
        direct = lab.gpu2.get("/api/status", user=user).json()
        direct_lines = {(r["booking"], r["ssh"]) for h in direct["hosts"] for r in h["running"]}
        merged = hosts(lab.gpu1.get("/api/lab", user=user).json())["gpu2"]
        assert {(r["booking"], r["ssh"]) for r in merged["running"]} == direct_lines
    bob_view = hosts(lab.gpu1.get("/api/lab", user="bob").json())
    assert bob_view["gpu2"]["running"][0]["ssh"] == "ssh -p 2202 bob@gpu2"
    assert bob_view["gpu1"]["running"][0]["ssh"] is None  # alice's booking: not bob's line
    alice_view = hosts(lab.gpu1.get("/api/lab", user="alice").json())
    assert alice_view["gpu2"]["running"][0]["ssh"] is None
    assert alice_view["gpu1"]["running"][0]["ssh"] == "ssh -p 2201 alice@gpu1"
    assert "2202" not in lab.gpu1.get("/lab", user="alice").text


def test_auth_is_kept_on_the_lab_page_and_between_the_servers(lab: Lab2) -> None:
    for path in ("/lab", "/api/lab", "/lab/usage", "/api/usage"):
        assert lab.gpu1.get(path).status_code == 401
        assert requests.get(lab.gpu1.url + path, auth=("alice", "wrong"), timeout=30).status_code == 401
    status = lab.gpu2.url + "/api/status"
    # The viewer's name alone is not believed, nor signed with a wrong secret, nor signed without a name.
    assert requests.get(status, headers={LAB_USER_HEADER: "bob"}, timeout=30).status_code == 401
    wrong = requests.get(status, headers=signed_headers("x" * 32, target="/api/status", viewer="bob"), timeout=30)
    assert wrong.status_code == 403 and "signature is wrong" in wrong.text
    nameless = requests.get(status, headers=signed_headers(lab_kit.SECRET, target="/api/status", viewer=None),
                            timeout=30)
    assert nameless.status_code == 403 and "must name its viewer" in nameless.text
    right = requests.get(status, headers=signed_headers(lab_kit.SECRET, target="/api/status", viewer="bob"),
                         timeout=30)
    assert right.status_code == 200 and right.json()["viewer"] == "bob"
    # A page with another secret is refused by gpu2, and says so on its lab page.
    refused = Lab([lab.gpu2.url], secret="another-secret-0123456789").answers("alice", "/api/status")
    assert refused[0].data is None
    assert refused[0].problem is not None and refused[0].problem.startswith(
        f"{lab.gpu2.url.removeprefix('http://')} refused this page's request (HTTP 403)")


def test_a_lab_page_behind_a_proxy_forwards_the_proxys_user(lab: Lab2, tmp_path: Path) -> None:
    """A third page with auth "header" (its proxy on loopback) shows gpu2, which has auth basic, as the
    proxy's user would see it there: bob his own line, alice none; a request around the proxy nothing."""
    secret = tmp_path / "lab-secret"
    secret.write_text(lab_kit.SECRET)
    secret.chmod(0o600)
    config = web_config(tmp_path, auth="header", trusted_proxies=["127.0.0.1"], lab=[lab.gpu2.url],
                        lab_secret_file=str(secret))
    with served(config, None) as url:
        for user, line in (("bob", "ssh -p 2202 bob@gpu2"), ("alice", None)):
            view = requests.get(url + "/api/lab", headers={"X-Forwarded-User": user}, timeout=30).json()
            assert view["viewer"] == user and [s["problem"] for s in view["servers"]] == [None, None]
            assert [r["ssh"] for r in hosts(view)["gpu2"]["running"]] == [line]
        assert requests.get(url + "/api/lab", timeout=30).status_code == 403  # no user named by the proxy


def test_the_metrics_name_each_host(lab: Lab2) -> None:
    for server in (lab.gpu1, lab.gpu2):
        text = server.get("/metrics", user="alice").text
        samples = [s for f in text_string_to_metric_families(text) for s in f.samples]
        hosts_named = {s.labels["host"] for s in samples if "host" in s.labels}
        assert hosts_named == {server.name}, hosts_named
        running = [s.value for s in samples if s.name == "gpubook_containers_running"]
        assert running == [1.0]
    assert hosts(lab.gpu2.get("/api/status", user="bob").json()).keys() == {"gpu2"}


def month() -> tuple[str, str]:
    first = NOW.replace(day=1, hour=0, minute=0, second=0)
    return f"{first:%Y-%m-%d}", f"{(first + timedelta(days=32)).replace(day=1):%Y-%m-%d}"


def test_the_lab_report_sums_both_servers(lab: Lab2) -> None:
    if NOW.day == 1 and NOW.hour < 2:
        pytest.skip("the running bookings started last month: the month's report would not hold them")
    config = lab.gpu1.folder / "gpubook.toml"
    text = config.read_text().replace(f', "{lab.down}"', "")  # the same server without the one that is down
    reachable = lab.gpu1.folder / "lab-only.toml"
    reachable.write_text(text)
    start, end = month()

    def report(path: Path, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "gpubook.scheduler.commands.cli", "report", "--lab",
                               "--from", start, "--to", end, "--config", str(path), *args],
                              capture_output=True, text=True, timeout=120, cwd=ROOT, env=child_env())

    done = report(reachable, "--json")
    assert done.returncode == 0, done.stderr
    merged = json.loads(done.stdout)
    assert merged["hosts"] == ["gpu1", "gpu2"] and merged["complete"] is True
    rows = {row["user"]: row for row in merged["rows"]}
    assert {user: rows[user]["bookings"] for user in rows} == {"alice": 1, "bob": 1}
    # each ran an hour before NOW, one GPU, and on since: NOW is the module's, fixed when it was imported
    # (the flake hunt repeats the session, 30 minutes later: 1.54 h was right, not over)
    since = (datetime.now(UTC) - NOW).total_seconds() / 3600
    for user in ("alice", "bob"):
        assert 1.0 <= rows[user]["booked_gpu_hours"] < 1.5 + since
    by_gpu = json.loads(report(reachable, "--json", "--by", "gpu").stdout)
    assert [row["gpu"] for row in by_gpu["rows"]] == ["gpu1:0", "gpu2:1"]
    # With the server that is down: the sums of those that answered, the one down named, exit 1.
    partial = report(config)
    assert partial.returncode == 1
    assert f"NOT COUNTED: {lab.down.removeprefix('http://')} cannot be reached" in partial.stdout
    page = lab.gpu1.get("/lab/usage", user="alice", params={"month": start[:7]})
    assert page.status_code == 200 and 'data-key="alice"' in page.text and "Not counted: " in page.text
    assert lab.gpu1.get("/api/lab/usage", user="alice", params={"month": "2026-13"}).status_code == 400


@pytest.fixture
def feed() -> Iterator[FeedServer]:
    server = FeedServer().start()
    yield server
    server.stop()


def test_a_lab_fetch_follows_no_redirect_and_caps_the_answer(feed: FeedServer) -> None:
    feed.replies["/moved/api/status"] = Reply(status=302, headers={"Location": "http://elsewhere.example/api/status"})
    feed.replies["/huge/api/status"] = Reply(body=lambda: iter([b"[" + b" " * 65536] * (ANSWER_LIMIT // 65536 + 2)),
                                             headers={"Content-Type": "application/json"})
    feed.replies["/html/api/status"] = Reply(body=b"<html></html>", headers={"Content-Type": "text/html"})
    answers = Lab([f"{feed.base_url}/moved", f"{feed.base_url}/huge", f"{feed.base_url}/html"],
                  secret=lab_kit.SECRET).answers("alice", "/api/status")
    where = feed.base_url.removeprefix("http://")
    assert [a.problem for a in answers] == [
        f"{where} answered with a redirect (HTTP 302) to elsewhere.example; none is followed: write the final "
        "address in [web] lab",
        f"{where} answered more than 4 MiB; not shown",
        f"{where} answered text/html, not JSON: is it a gpubook page?"]
    assert [path for _, path, _ in feed.requests].count("/moved/api/status") == 1
    assert all(headers.get(LAB_USER_HEADER) == "alice" for _, _, headers in feed.requests)


def test_a_silent_server_costs_the_lab_page_its_timeout_only(feed: FeedServer) -> None:
    feed.replies["/silent/api/status"] = Reply(body=b"{}", delay=30, headers={"Content-Type": "application/json"})
    asked = time.monotonic()
    answers = Lab([f"{feed.base_url}/silent"], secret=None, timeout=0.5).answers(None, "/api/status")
    assert time.monotonic() - asked < 20  # bounded by the timeout (0.5 s a read; 2 s in all), not the server's 30 s
    assert answers[0].data is None and answers[0].problem is not None
    assert answers[0].problem.startswith(f"{feed.base_url.removeprefix('http://')} did not answer within ")


@pytest.mark.browser
@pytest.mark.skipif(not (Path(CHROMIUM).exists() and Path(CHROMEDRIVER).exists()),
                    reason="Debian's chromium and chromium-driver are not installed")
def test_the_lab_page_in_a_browser(lab: Lab2) -> None:
    """Chromium (in Europe/Paris) logged in as bob: both hosts, the server down, bob's own ssh line
    only, and the times in the browser's zone."""
    with browser(timezone="Europe/Paris") as driver:
        rendered(driver, lab.gpu1.url.replace("http://", f"http://bob:{lab_kit.PASSWORDS['bob']}@") + "/lab")
        sections = driver.find_elements("css selector", "section.host")
        assert [s.get_attribute("data-host") for s in sections] == ["gpu1", "gpu2"]
        assert [c.text for c in driver.find_elements("css selector", "code.ssh")] == ["ssh -p 2202 bob@gpu2"]
        assert len(driver.find_elements("css selector", "tr.unreachable")) == 1
        assert driver.find_element("css selector", "#zone").text == "Europe/Paris"
        start = driver.find_element("css selector", 'table.next tr[data-booking="alice-later@gpu2"] time')
        assert start.get_attribute("title") == (NOW + 2 * HOUR).isoformat()
        assert start.text != start.get_attribute("title")  # shown in the browser's words and zone


def test_a_malformed_or_trickling_peer_is_one_sentence_never_the_pages_failure(lab: Lab2, tmp_path: Path,
                                                                                feed: FeedServer) -> None:
    """Round 3, L3: a peer's time without an offset made /lab fail with HTTP 500 (naive against aware),
    its `rejections` as a list made /lab/usage fail; a peer sending a byte now and then kept each
    fetch thread for as long as it liked. A third real page, told of gpu2 and of that peer."""
    naive = {"hosts": [{"name": "odd", "gpus": {}, "timeline": [
        {"gpu": 0, "segments": [{"kind": "booked", "start": "2026-11-29T09:00:00", "end": "2026-11-29T17:00:00"}]}]}]}
    feed.replies["/odd/api/status"] = Reply(body=json.dumps(naive).encode(),
                                            headers={"Content-Type": "application/json"})
    feed.replies["/odd/api/usage"] = Reply(body=json.dumps({"rows": [], "rejections": ["x"]}).encode(),
                                           headers={"Content-Type": "application/json"})

    def trickle() -> Iterator[bytes]:
        for _ in range(60):
            time.sleep(1)
            yield b" "
    feed.replies["/slow/api/status"] = Reply(body=trickle, headers={"Content-Type": "application/json"})
    secret = tmp_path / "lab-secret"
    secret.write_text(lab_kit.SECRET)
    secret.chmod(0o600)
    config = web_config(tmp_path, auth="header", trusted_proxies=["127.0.0.1"], lab_secret_file=str(secret),
                        lab=[lab.gpu2.url, f"{feed.base_url}/odd", f"{feed.base_url}/slow"])
    with State(tmp_path / "state.sqlite") as state:
        server = serve.start(config, status=lambda: None, state=state)  # with this server's usage report
        try:
            _malformed_peers_shown(f"http://{server.address}", lab)
        finally:
            server.stop()


def _malformed_peers_shown(url: str, lab: Lab2) -> None:
    who = {"X-Forwarded-User": "bob"}
    page = requests.get(url + "/lab", headers=who, timeout=60)
    assert page.status_code == 200, page.text[-2000:]
    view = requests.get(url + "/api/lab", headers=who, timeout=60).json()
    problems = {s["server"]: s["problem"] for s in view["servers"]}
    assert problems[lab.gpu2.url.removeprefix("http://")] is None  # the good peer is shown
    assert any(p and ("took too long to send its answer" in p or "did not answer within" in p)
               for p in problems.values()), problems
    # the trickling peer's fetch thread ends at its deadline, not when the peer stops (60 s)
    wait_for("the lab's fetch threads to end",
             lambda: not [t for t in threading.enumerate() if t.name.startswith("gpubook-lab")], timeout=30)
    assert "odd" in hosts(view)  # shown, its naive times left out
    month = datetime.now(UTC).strftime("%Y-%m")
    usage = requests.get(url + "/lab/usage", headers=who, params={"month": month}, timeout=60)
    assert usage.status_code == 200, usage.text[-2000:]


def test_a_squatter_on_a_lab_address_gets_no_secret_and_cannot_replay_for_another_view(lab: Lab2) -> None:
    """Round 3, M2: a page sent the lab secret with every request, in plain http to a loopback
    address too; whoever listened there (the peer down; [::1] for a peer named `localhost`) got it,
    and with it was any viewer on every lab server. Now gpu1 asks a squatter on its down address,
    which records what it gets and replays it at gpu2, for its own view and for another."""
    squatter = FeedServer().start()
    try:
        squatter.replies["/api/status"] = Reply(body=b"{}", headers={"Content-Type": "application/json"})
        Lab([squatter.base_url], secret=lab_kit.SECRET).answers("alice", "/api/status")
        (_, path, got), = [r for r in squatter.requests if r[1] == "/api/status"]
        assert lab_kit.SECRET not in " ".join(f"{k}: {v}" for k, v in got.items())  # never the secret
        assert got[LAB_USER_HEADER] == "alice" and got[LAB_SIGNATURE_HEADER]
        status = lab.gpu2.url + "/api/status"
        replayed = requests.get(status, headers=dict(got), timeout=30)  # the very request: alice's own view
        assert replayed.status_code == 200 and replayed.json()["viewer"] == "alice"
        as_bob = requests.get(status, headers={**got, LAB_USER_HEADER: "bob"}, timeout=30)
        assert as_bob.status_code == 403 and "signature is wrong" in as_bob.text
        usage = requests.get(lab.gpu2.url + "/api/usage", headers=dict(got), timeout=30)
        assert usage.status_code == 403  # another path
    finally:
        squatter.stop()
