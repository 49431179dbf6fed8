"""The lab's settings and its trust rules without daemons: [web] lab's addresses, lab_secret_file
required where a viewer must be named, the secret believed in every auth mode (and only the right
one), and the sum of several servers' reports. The two-daemon tests are in test_lab.py."""

from __future__ import annotations

import time
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from gpubook.runtime.errors import ConfigError
from gpubook.scheduler.config import load
from gpubook.scheduler.outbox.report import merge_usage
from gpubook.scheduler.outbox.web.access import USER_KEY, Access
from gpubook.scheduler.outbox.web.lab import Answer, lab_status
from gpubook.scheduler.outbox.web.lab_sign import SKEW, signed_headers
from gpubook.scheduler.outbox.web.settings import WebConfig
from tests.kits.web_kit import web_config

BASE = ('[host]\nname = "gpu1"\n[[calendar]]\nurl = "http://127.0.0.1:5232/c/"\n[users.alice]\nuid = 2001\n'
        '[web]\nenabled = true\nlisten = "127.0.0.1:0"\nauth = "none"\n')
SECRET = "0123456789abcdef0123"


def config_with(tmp_path: Path, web: str, *, secret: str | None = None):  # type: ignore[no-untyped-def]
    if secret is not None:
        (tmp_path / "lab-secret").write_text(secret + "\n")
        (tmp_path / "lab-secret").chmod(0o600)
        web += 'lab_secret_file = "lab-secret"\n'
    path = tmp_path / "gpubook.toml"
    path.write_text(BASE + web)
    return load(path)


@pytest.mark.parametrize(("address", "problem"), [
    ("http://10.0.0.2:8380", "must be https:// (plain http only to a loopback address)"),
    ("http://localhost:8381", "not localhost"),  # round 3, M2: ::1 first, where any account may listen
    ("https://alice:pw@gpu2.lab", "must not carry a user or password"),
    ("ftp://gpu2.lab", "must be an http(s):// URL"),
])
def test_a_lab_address_that_would_leak_the_secret_is_refused(tmp_path: Path, address: str, problem: str) -> None:
    with pytest.raises(ConfigError) as refused:
        config_with(tmp_path, f'lab = ["{address}"]\n', secret=SECRET)
    assert problem in str(refused.value) and "lab" in str(refused.value)


def test_the_lab_secret_is_needed_where_the_viewer_must_be_named_and_must_be_long(tmp_path: Path) -> None:
    assert config_with(tmp_path, 'lab = ["http://127.0.0.1:8381", "https://gpu2.lab:8443"]\n').web.lab == (
        "http://127.0.0.1:8381", "https://gpu2.lab:8443")  # auth none: nobody to name
    header = 'auth = "header"\ntrusted_proxies = ["10.0.0.9"]\nlab = ["https://gpu2.lab:8443"]\n'
    with pytest.raises(ConfigError, match='auth = "header" needs lab_secret_file'):
        load(_write(tmp_path, BASE.replace('auth = "none"\n', "") + header))
    with pytest.raises(ConfigError, match="fewer than 16 characters"):
        config_with(tmp_path, "", secret="short")
    assert config_with(tmp_path, "", secret=SECRET).web.lab_secret.strip() == SECRET


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "gpubook.toml"
    path.write_text(text)
    return path


def ask(access: Access, **headers: str) -> tuple[str, Any]:
    """The middleware's answer to a GET from 10.0.0.5 (no trusted proxy) with these headers."""
    seen: dict[str, Any] = {}

    def app(environ: dict[str, Any], start_response: Any) -> list[bytes]:
        seen["user"] = environ.get(USER_KEY)
        start_response("200 OK", [])
        return []

    statuses: list[str] = []
    environ = {"REQUEST_METHOD": "GET", "REMOTE_ADDR": "10.0.0.5", "PATH_INFO": "/api/status",
               **{"HTTP_" + name.upper().replace("-", "_"): value for name, value in headers.items()}}
    access.app = app
    access(environ, lambda status, headers: statuses.append(status))  # type: ignore[arg-type]
    return statuses[0], seen.get("user")


def test_the_secret_names_the_viewer_in_every_mode_and_only_the_right_one(tmp_path: Path) -> None:
    def signed(viewer: str | None, *, secret: str = SECRET, target: str = "/api/status", **more: Any) -> dict[str, str]:
        return {**signed_headers(secret, target=target, viewer=viewer, **more)}

    def web(**settings: Any) -> WebConfig:
        return replace(web_config(tmp_path, **settings).web, lab_secret=SECRET)

    header = Access(lambda e, s: [], web=web(auth="header", trusted_proxies=["10.0.0.9"]))
    assert ask(header, **signed("alice")) == ("200 OK", "alice")  # not from the proxy, but signed
    assert ask(header, **{"X-Forwarded-User": "alice"})[0] == "403 Forbidden"  # around the proxy, unsigned
    assert ask(header, **signed("alice", secret=SECRET + "x"))[0] == "403 Forbidden"
    assert ask(header, **signed(None))[0] == "403 Forbidden"  # nobody named
    assert ask(header, **signed("not a name"))[0] == "403 Forbidden"
    assert ask(header, **signed("alice", target="/api/usage"))[0] == "403 Forbidden"  # signed for another path
    assert ask(header, **signed("alice", now=time.time() - SKEW - 5))[0] == "403 Forbidden"  # stale
    assert ask(header, **{**signed("alice"), "X-Gpubook-Lab-User": "bob"})[0] == "403 Forbidden"  # another viewer
    assert ask(header, **{"X-Gpubook-Lab-Secret": SECRET, "X-Gpubook-Lab-User": "alice"})[0] == "403 Forbidden"
    basic = Access(lambda e, s: [], web=web(auth="basic"), users={})
    assert ask(basic, **signed("alice")) == ("200 OK", "alice")
    assert ask(basic, **{"X-Gpubook-Lab-User": "alice"})[0] == "401 Unauthorized"
    none = Access(lambda e, s: [], web=web())
    assert ask(none, **signed(None)) == ("200 OK", None)
    unlabbed = Access(lambda e, s: [], web=web_config(tmp_path, auth="basic").web, users={})
    assert ask(unlabbed, **signed("alice"))[0] == "401 Unauthorized"  # no secret here: the headers mean nothing


def test_another_servers_answer_is_taken_as_data_only() -> None:
    """A wrong shape is one sentence; wrong types inside are left out, never passed to the page."""
    own = {"viewer": "alice", "summary": "x", "hosts": [{"name": "gpu1", "gpus": {"count": 1}, "timeline": []}]}
    odd = {"hosts": [{"name": "<b>gpu2</b>", "gpus": "many", "running": [{"booking": 5, "gpus": ["0", 1, True]}],
                      "timeline": "none", "next": None}]}
    view = lab_status(own, [Answer("https://gpu2.lab", odd), Answer("https://gpu3.lab", ["not", "a", "status"])],
                      own_label="gpu1", now=datetime.now(UTC))
    gpu2 = next(h for h in view["hosts"] if h["server"] == "gpu2.lab")
    assert gpu2["name"] == "<b>gpu2</b>" and gpu2["count"] == 0 and gpu2["free"] == []
    assert gpu2["running"] == [{"booking": "", "user": "", "gpus": [1], "end": "", "state": "", "ssh": None}]
    assert [s["problem"] for s in view["servers"]] == [
        None, None, "gpu3.lab answered something that is not a gpubook status"]


def test_the_lab_report_sums_rows_by_key() -> None:
    def report(host: str, rows: list[dict[str, Any]], rejections: dict[str, int]) -> dict[str, Any]:
        return {"host": host, "from": "2026-11-01", "to": "2026-12-01", "by": "user", "rows": rows,
                "rejections": rejections, "gpu_samples": True}

    def row(user: str, bookings: int, booked: float, used: float, rejected: int) -> dict[str, Any]:
        return {"user": user, "bookings": bookings, "booked_gpu_hours": booked, "used_gpu_hours": used,
                "no_shows": 0, "rejected": rejected}

    merged = merge_usage([report("gpu1", [row("alice", 2, 10.0, 5.0, 1)], {"quota": 1}),
                          report("gpu2", [row("alice", 1, 10.0, 0.0, 0), row("bob", 1, 4.0, 4.0, 2),
                                          {"user": None}, "junk"], {"quota": 1, "taken": 1})])
    assert merged["hosts"] == ["gpu1", "gpu2"]
    assert [(r["user"], r["bookings"], r["booked_gpu_hours"], r["used_gpu_hours"], r["idle_share"], r["rejected"])
            for r in merged["rows"]] == [("alice", 3, 20.0, 5.0, 0.75, 1), ("bob", 1, 4.0, 4.0, 0.0, 2)]
    assert merged["total"]["booked_gpu_hours"] == 24.0 and merged["rejected"] == 3
    assert merged["rejections"] == {"quota": 2, "taken": 1}
