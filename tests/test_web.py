"""The status page without a browser: the timeline model from plain data, and the page served by
the real waitress server, asked with requests. The hostile checks (a wrong password, a header from
a peer that is no trusted proxy, another user's ssh line, a path out of the static folder, a
calendar password in a problem line, a write) are here."""

from __future__ import annotations

import json
import subprocess
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import requests

from gpubook.runtime.engines import ContainerInfo, container_name
from gpubook.runtime.errors import ConfigError
from gpubook.scheduler.commands import doctor
from gpubook.scheduler.config import load
from gpubook.scheduler.core.plan import Plan
from gpubook.scheduler.outbox import status, timeline
from gpubook.scheduler.outbox.web.access import Access, bcrypt_cost, read_htpasswd
from gpubook.scheduler.state.records import ContainerRecord
from tests.kits.web_kit import (
    accepted,
    booking,
    generated_plan,
    now_utc,
    rejection,
    served,
    status_of,
    web_config,
)

NOW = now_utc()
PASSWORDS = {"alice": "alice-pw-1", "bob": "bob-pw-2"}


def running_info(item, gpus: tuple[int, ...], *, port: int = 2201) -> ContainerInfo:  # type: ignore[no-untyped-def]
    return ContainerInfo(name=container_name(item.id), id="c", state="running", image="i", booking_id=item.id,
                         user=item.user, gpus=gpus, end=item.end, spec_hash="h", port=port, template=item.template,
                         start=item.start)


def lab_status() -> status.Status:
    """alice runs on GPU 0, bob is booked on GPU 1 later, carol is held on GPU 1 now, dave ran and
    ended on GPU 0 (in the plan no more: placed by the previous status), erin was refused."""
    alice = booking("alice-run@lab", user="alice", start=NOW - timedelta(hours=1), end=NOW + timedelta(hours=1))
    bob = booking("bob-later@lab", user="bob", start=NOW + timedelta(hours=3), end=NOW + timedelta(hours=4))
    carol = booking("carol-held@lab", user="carol", start=NOW - timedelta(minutes=5), end=NOW + timedelta(hours=2))
    dave = booking("dave-done@lab", user="dave", start=NOW - timedelta(hours=30), end=NOW - timedelta(hours=28))
    plan = Plan(accepted=(accepted(carol, 1), accepted(alice, 0), accepted(bob, 1)),
                rejected=(rejection("erin-no@lab", user="erin", start=NOW + timedelta(hours=2),
                                    reason="erin may use at most 1 GPU(s) at once, asked for 4"),),
                next_wakeup=None)
    before = status.Status(hosts=(status.HostStatus(name="local", gpus=status.GpuSummary("config", 2), timeline=(
        timeline.GpuTimeline(gpu=0, segments=(timeline.Segment(
            kind="running", booking=dave.id, user="dave", start=dave.start.isoformat(), end=dave.end.isoformat()),)),
    )),))
    record = ContainerRecord(id=1, booking_id=dave.id, name=container_name(dave.id), user="dave", gpu_count=1,
                             started_at=dave.start, stopped_at=dave.end, exit_reason="ended", restarts=0)
    return status_of(plan, now=NOW, gpus=2, containers=[running_info(alice, (0,))], ports={},
                     held={carol.id: "GPU 1 still used by someone"}, records=[record], previous=before)


def segments(report: status.Status, gpu: int) -> dict[str, tuple[str, str]]:
    lane = next(lane for lane in report.main.timeline if lane.gpu == gpu)
    return {s.booking: (s.kind, s.note) for s in lane.segments}


def test_timelines_show_booked_running_held_and_ended_per_gpu() -> None:
    report = lab_status()
    assert segments(report, 0) == {"alice-run@lab": ("running", ""), "dave-done@lab": ("ended", "ended")}
    assert segments(report, 1) == {"carol-held@lab": ("held", "GPU 1 still used by someone"),
                                   "bob-later@lab": ("booked", "")}
    assert [(r.id, r.user, r.reason) for r in report.rejected] == [
        ("erin-no@lab", "erin", "erin may use at most 1 GPU(s) at once, asked for 4")]


def test_the_status_file_keeps_timelines_and_refusals() -> None:
    report = lab_status()
    again = status.Status.from_json(json.loads(json.dumps(report.to_json())))
    assert again.main.timeline == report.main.timeline
    assert again.rejected == report.rejected
    assert again.main.running[0].template == "debian-ssh"


def test_a_status_file_of_an_older_version_still_reads() -> None:
    old = lab_status().to_json()
    del old["rejected"]
    for host in old["hosts"]:
        del host["timeline"], host["gpus"]["indices"]
    assert status.Status.from_json(old).main.timeline == ()


# -- served -------------------------------------------------------------------------------------


def htpasswd(folder: Path, users: dict[str, str]) -> Path:
    """An htpasswd file made by Apache's own tool, bcrypt (-B)."""
    path = folder / "htpasswd"
    for number, (user, password) in enumerate(users.items()):
        subprocess.run(["htpasswd", "-B", "-b", "-C", "5", *(["-c"] if number == 0 else []), str(path), user,
                        password], check=True, capture_output=True)
    path.chmod(0o600)  # the config refuses one others may read
    return path


@pytest.fixture
def basic(tmp_path: Path):  # type: ignore[no-untyped-def]
    config = web_config(tmp_path, auth="basic", htpasswd_file=str(htpasswd(tmp_path, PASSWORDS)))
    with served(config, lab_status(), mounts={"/metrics": metrics_app}) as url:
        yield url


def metrics_app(environ, start_response):  # type: ignore[no-untyped-def]
    start_response("200 OK", [("Content-Type", "text/plain")])
    return [b"gpubook_up 1\n"]


def test_basic_auth_refuses_a_wrong_password_an_unknown_user_and_no_login(basic: str) -> None:
    assert requests.get(basic + "/", auth=("alice", "wrong"), timeout=10).status_code == 401
    assert requests.get(basic + "/", auth=("mallory", "alice-pw-1"), timeout=10).status_code == 401
    anonymous = requests.get(basic + "/api/status", timeout=10)
    assert anonymous.status_code == 401 and "alice-run@lab" not in anonymous.text
    assert anonymous.headers["WWW-Authenticate"].startswith("Basic")
    assert requests.get(basic + "/", auth=("alice", "alice-pw-1"), timeout=10).status_code == 200


def test_mounts_stand_behind_the_same_login(basic: str) -> None:
    assert requests.get(basic + "/metrics", timeout=10).status_code == 401
    assert requests.get(basic + "/metrics", auth=("bob", "wrong"), timeout=10).status_code == 401
    answer = requests.get(basic + "/metrics", auth=("bob", "bob-pw-2"), timeout=10)
    assert answer.status_code == 200 and answer.text == "gpubook_up 1\n"


def test_the_ssh_line_goes_to_its_booker_only(basic: str) -> None:
    mine = requests.get(basic + "/", auth=("alice", "alice-pw-1"), timeout=10).text
    assert "ssh -p 2201 alice@devbox1" in mine
    for page in (requests.get(basic + "/", auth=("bob", "bob-pw-2"), timeout=10).text,
                 requests.get(basic + "/api/status", auth=("bob", "bob-pw-2"), timeout=10).text):
        assert "alice-run@lab" in page  # bob sees the booking ...
        assert "ssh -p" not in page and "2201" not in page  # ... not how to log in to it


def test_with_auth_none_nobody_gets_an_ssh_line(tmp_path: Path) -> None:
    with served(web_config(tmp_path), lab_status()) as url:
        page = requests.get(url + "/", timeout=10).text
        data = requests.get(url + "/api/status", timeout=10).json()
    assert "alice-run@lab" in page and "ssh -p" not in page and "2201" not in page
    assert data["hosts"][0]["running"][0]["ssh"] is None and data["hosts"][0]["running"][0]["port"] is None


def test_a_trusted_header_counts_only_from_a_trusted_proxy(tmp_path: Path) -> None:
    untrusted = web_config(tmp_path, auth="header", trusted_proxies=["10.9.9.9"])
    with served(untrusted, lab_status()) as url:
        answer = requests.get(url + "/", headers={"X-Forwarded-User": "alice"}, timeout=10)
    assert answer.status_code == 403 and "alice-run@lab" not in answer.text
    trusted = web_config(tmp_path, auth="header", trusted_proxies=["127.0.0.0/8"])
    with served(trusted, lab_status()) as url:
        assert requests.get(url + "/", timeout=10).status_code == 403  # the proxy named nobody
        page = requests.get(url + "/", headers={"X-Forwarded-User": "alice"}, timeout=10)
        other = requests.get(url + "/", headers={"X-Forwarded-User": "bob"}, timeout=10)
    assert page.status_code == 200 and "ssh -p 2201 alice@devbox1" in page.text
    assert other.status_code == 200 and "ssh -p" not in other.text


@pytest.mark.parametrize("path", ["/static/../app.py", "/static/%2e%2e/app.py", "/static/..%2fapp.py",
                                  "/static/%2e%2e%2f%2e%2e%2fconfig.py", "/static//etc/passwd",
                                  "/static/..%5capp.py", "/static/%2e%2e/templates/index.html"])
def test_static_files_stay_in_their_folder(tmp_path: Path, path: str) -> None:
    with served(web_config(tmp_path), lab_status()) as url:
        answer = requests.get(url + path, timeout=10)
        assert requests.get(url + "/static/app.js", timeout=10).status_code == 200
    assert answer.status_code == 404
    assert "import" not in answer.text and "root:" not in answer.text and "{%" not in answer.text


def test_the_page_changes_nothing_and_shows_no_calendar_secret(tmp_path: Path) -> None:
    report = lab_status()
    leaky = status.Status(**{**report.__dict__, "problems": (
        "calendar https://alice:hunter2@cal.example/lab/?token=s3cr3t cannot be read: 401",),
        "outage": "https://cal.example/private-abcdef123/lab.ics: timed out"})
    with served(web_config(tmp_path), leaky, mounts={"/metrics": metrics_app}) as url:
        pages = [requests.get(url + path, timeout=10).text for path in ("/", "/api/status")]
        writes = [requests.request(method, url + path, timeout=10).status_code for method in ("POST", "PUT", "DELETE")
                  for path in ("/", "/api/status", "/static/app.js", "/metrics")]
    for page in pages:
        assert "https://cal.example/" in page
        assert "hunter2" not in page and "s3cr3t" not in page and "private-abcdef123" not in page
    assert set(writes) == {405}


def test_auth_none_on_a_network_address_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "gpubook.toml"
    path.write_text('[[calendar]]\nurl = "http://127.0.0.1:5232/c/"\n[users.alice]\nuid = 2001\n'
                    '[web]\nenabled = true\nlisten = "0.0.0.0:8380"\nauth = "none"\n')
    with pytest.raises(ConfigError, match='not a loopback address.*auth = "basic" or "header"'):
        load(path)
    with pytest.raises(ConfigError, match="not a loopback address"), \
            served(web_config(tmp_path, listen="0.0.0.0:0"), None):  # noqa: S104 - refused is the point
        pass


def test_the_page_is_not_open_to_every_local_account_by_default(tmp_path: Path) -> None:
    """Finding 10 of issue 22: auth "none" was the default (every local account saw every booking)
    and "header" trusted loopback by default (every local account could send the header and be
    anyone). Now "basic" is the default, "none" must be written out, "header" needs its proxies
    written out; doctor warns about "none" and a loopback proxy, with the fix."""
    path = tmp_path / "gpubook.toml"
    base = '[[calendar]]\nurl = "http://127.0.0.1:5232/c/"\n[users.alice]\nuid = 2001\n[web]\nenabled = true\n'
    base += 'listen = "127.0.0.1:0"\n'
    path.write_text(base)
    with pytest.raises(ConfigError, match='auth = "basic" \\(the default\\) needs htpasswd_file'):
        load(path)
    path.write_text(base + 'auth = "header"\n')
    with pytest.raises(ConfigError, match='auth = "header" needs trusted_proxies'):
        load(path)
    header = load_checked(path, 'auth = "header"\ntrusted_proxies = ["127.0.0.1"]\n', base)
    assert header.web.auth == "header"
    warned = doctor.web_check(header)
    assert not warned.ok and warned.optional and "send X-Forwarded-User itself and be anyone" in warned.detail
    with served(header, lab_status()) as url:  # what the warning is about: a local account names itself alice
        assert "ssh -p 2201 alice@" in requests.get(url + "/", headers={"X-Forwarded-User": "alice"},
                                                           timeout=10).text
    none = load_checked(path, 'auth = "none"\n', base)
    warned = doctor.web_check(none)
    assert not warned.ok and warned.optional and "sees every booking" in warned.detail
    passwords = htpasswd(tmp_path, PASSWORDS)
    basic = load_checked(path, f'htpasswd_file = "{passwords}"\n', base)
    assert basic.web.auth == "basic" and doctor.web_check(basic).ok
    with served(basic, lab_status()) as url:
        assert requests.get(url + "/", timeout=10).status_code == 401


def load_checked(path: Path, web: str, base: str):  # type: ignore[no-untyped-def]
    path.write_text(base + web)
    return load(path)


def test_an_htpasswd_entry_other_than_bcrypt_is_refused_by_its_line(tmp_path: Path) -> None:
    path = htpasswd(tmp_path, {"alice": "pw"})
    subprocess.run(["htpasswd", "-m", "-b", str(path), "bob", "pw"], check=True, capture_output=True)  # apr1 MD5
    with pytest.raises(ConfigError, match=r"line 2 \(user bob\): a apr1-MD5 entry, not bcrypt"):
        read_htpasswd(path)
    with pytest.raises(ConfigError, match="line 2"), \
            served(web_config(tmp_path, auth="basic", htpasswd_file=str(path)), None):
        pass


@pytest.mark.parametrize("costs", [(None, None), (7, 7, 4)])
def test_an_unknown_user_is_checked_at_the_cost_of_the_files_entries(tmp_path: Path,
                                                                      costs: tuple[int | None, ...]) -> None:
    """Finding 16 of issue 22: the dummy hash checked for an unknown name had cost 10 while
    `htpasswd -B` writes cost 5, so a fast 401 meant "this name exists". The dummy now costs what
    the file's entries cost (the most common one when they differ); None: htpasswd's own default."""
    path = tmp_path / "htpasswd"
    for number, cost in enumerate(costs):
        subprocess.run(["htpasswd", "-B", "-b", *(["-C", str(cost)] if cost else []),
                        *(["-c"] if number == 0 else []), str(path), f"user{number}", "pw"],
                       check=True, capture_output=True)
    path.chmod(0o600)  # htpasswd makes it 0644; gpubook reads only a file of its owner (finding 12)
    entries = read_htpasswd(path)
    access = Access(metrics_app, web=web_config(tmp_path, auth="basic", htpasswd_file=str(path)).web)
    assert bcrypt_cost(access.dummy) == bcrypt_cost(entries["user0"]) == (costs[0] or 5)


def test_no_gpu_is_said_so(tmp_path: Path) -> None:
    """This machine has no NVIDIA driver: the live view, read from NVML, says so."""
    with served(web_config(tmp_path), lab_status()) as url:
        data = requests.get(url + "/api/status", timeout=10).json()
        page = requests.get(url + "/", timeout=10).text
    live = data["hosts"][0]["live"]
    if live["gpus"]:
        pytest.skip("this machine has an NVIDIA GPU")
    assert live["problem"] and "No GPU" in page


def test_a_thousand_bookings_make_a_file_and_page_of_bounded_size(tmp_path: Path) -> None:
    report = status_of(generated_plan(NOW), now=NOW)
    text = json.dumps(report.to_json(), indent=2)
    assert sum(len(lane.segments) for lane in report.main.timeline) > 500  # the past half ended: not in the plan
    with served(web_config(tmp_path), report) as url:
        page = requests.get(url + "/", timeout=30)
    assert page.status_code == 200 and "gen0999@lab" in page.text
    assert len(text) < 2_000_000 and len(page.text) < 2_000_000


def test_calendar_text_is_shown_as_text_never_as_markup(tmp_path: Path) -> None:
    """A booking id, user or reason comes from a calendar: it must not become HTML or script."""
    hostile = "<script>alert(1)</script><img src=x onerror=alert(2)>"
    report = status_of(Plan(accepted=(), rejected=(rejection(f"x{hostile}@lab", user="erin", start=NOW,
                                                                reason=f"refused: {hostile}"),), next_wakeup=None),
                       now=NOW, gpus=1)
    with served(web_config(tmp_path), report) as url:
        page = requests.get(url + "/", timeout=10).text
    assert "<script>alert" not in page and "<img src=x" not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page  # the table shows it, escaped


def test_sighup_serves_the_page_with_the_reloaded_web_settings(tmp_path: Path) -> None:
    """An admin changes a password (or the whole [web] section) and sends SIGHUP: the page must
    follow, as the rest of the config does, without a restart that would stop the bookings' daemon."""
    from tests.kits.daemon_kit import in_process_daemon

    daemon = in_process_daemon(tmp_path)
    passwords = htpasswd(tmp_path, {"alice": "old-password"})
    daemon.config.path.write_text(daemon.config.path.read_text() + '[web]\nenabled = true\nlisten = "127.0.0.1:0"\n'
                                  f'auth = "basic"\nhtpasswd_file = "{passwords}"\n')
    daemon.scheduler.start()
    daemon._schedule_polls(first=datetime.now(UTC) + timedelta(hours=1))  # reload() reschedules the poll
    assert daemon.reload()
    try:
        assert daemon.web is not None
        url = f"http://{daemon.web.address}/api/status"
        assert requests.get(url, auth=("alice", "old-password"), timeout=10).status_code == 200
        htpasswd(tmp_path, {"alice": "new-password"})
        assert daemon.reload() and daemon.web is not None
        url = f"http://{daemon.web.address}/api/status"
        assert requests.get(url, auth=("alice", "old-password"), timeout=10).status_code == 401
        assert requests.get(url, auth=("alice", "new-password"), timeout=10).status_code == 200
    finally:
        if daemon.web is not None:
            daemon.web.stop()
        daemon.scheduler.shutdown(wait=False)
        daemon.passes.close()
        daemon.state.close()


def test_the_page_gives_the_sftp_services_known_hosts_line(tmp_path: Path) -> None:
    """The SFTP host key reaches bookers (issue 22, finding 2): before, it was only in `gpubook status`."""
    from dataclasses import replace

    key = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIB2gcXY3Lrx9tHCfQyR0Ch5Y2dt7/hv3NlBT8j+3oQ9H"
    report = replace(lab_status(), sftp={"port": 2222, "listen": "127.0.0.1", "running": True, "host_key": key})
    with served(web_config(tmp_path), report) as url:
        page = requests.get(url + "/", timeout=10).text
        data = requests.get(url + "/api/status", timeout=10).json()
    assert f"[devbox1]:2222 {key}" in page
    assert data["sftp"]["known_hosts"] == f"[devbox1]:2222 {key}"


def test_the_page_links_the_availability_calendar_and_the_lab_page_where_there_is_one(basic: str,
                                                                                     tmp_path: Path) -> None:
    page = requests.get(basic + "/", auth=("alice", "alice-pw-1"), timeout=10).text
    assert 'href="free.ics"' in page and 'href="lab"' not in page
    feed = requests.get(basic + "/free.ics", auth=("alice", "alice-pw-1"), timeout=10)
    assert feed.status_code == 200 and feed.text.startswith("BEGIN:VCALENDAR")
    secret = tmp_path / "lab-secret"
    secret.write_text("s" * 32)
    secret.chmod(0o600)
    config = web_config(tmp_path, auth="none", lab=["https://gpu2.lab.example:8443"], lab_secret_file=str(secret))
    with served(config, lab_status()) as url:
        page = requests.get(url + "/", timeout=10).text
    assert 'href="lab"' in page and 'href="lab/usage"' in page
