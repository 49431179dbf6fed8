"""The page's booking forms (issue 40), their guards read through the real app and its access layer
with Flask's test client: the desk behind them is a recorder here (tests/test_web_book_browser.py runs
the real daemon, Radicale and Chromium). Hostile: a form from another origin or site, a token made for
another viewer or none, a user named in the form, auth "none" and a lab request: none reaches the desk."""

from __future__ import annotations

import base64
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import bcrypt
import pytest

from gpubook.scheduler.outbox.asking import AskError
from gpubook.scheduler.outbox.web import lab_sign
from gpubook.scheduler.outbox.web.app import create_app
from gpubook.scheduler.outbox.web.book_route import Forms
from gpubook.scheduler.outbox.web.settings import WebConfig

HOST = "127.0.0.1:8380"
PASSWORDS = {"alice": "alice-pw", "bob": "bob-pw", "carol": "carol-pw"}  # carol: a page login, no gpubook user


class Desk:
    """Records what reaches it and answers like the daemon's desk."""

    def __init__(self) -> None:
        self.asked: list[tuple[dict[str, Any], str]] = []

    def __call__(self, request: Mapping[str, Any], user: str) -> dict[str, Any]:
        self.asked.append((dict(request), user))
        if request.get("gpus") == 9:
            raise AskError("--gpus must be a whole number from 1 to 8")
        return {"kind": request["kind"], "id": "b1@gpubook-desk", "state": "running",
                "start": "2026-12-01T09:00:00+00:00", "end": "2026-12-01T11:00:00+00:00",
                "ssh": f"ssh -p 2201 {user}@devbox1"}


def app_for(auth: str = "basic", *, desk: Desk, lab_secret: str | None = None):  # type: ignore[no-untyped-def]
    web = WebConfig(enabled=True, listen=HOST, auth=auth, trusted_proxies=("127.0.0.0/8",),
                    lab_secret=lab_secret)
    users = {name: bcrypt.hashpw(password.encode(), bcrypt.gensalt(rounds=4)) for name, password in PASSWORDS.items()}
    app = create_app(status=lambda: None, web=web, host_name="devbox1", users=users if auth == "basic" else None,
                     book=desk, templates=lambda: ["pytorch"], booker_names=lambda: {"alice", "bob"})
    return app.test_client()


def login(user: str) -> dict[str, str]:
    token = base64.b64encode(f"{user}:{PASSWORDS[user]}".encode()).decode()
    return {"Authorization": f"Basic {token}", "Host": HOST}


def form_token(client, user: str) -> str:  # type: ignore[no-untyped-def]
    page = client.get("/", headers=login(user)).get_data(as_text=True)
    return page.split('name="token" value="', 1)[1].split('"', 1)[0]


def post(client, path: str, user: str, fields: dict[str, str], **headers: str):  # type: ignore[no-untyped-def]
    return client.post(path, data=fields, headers={**login(user), "Origin": f"http://{HOST}",
                                                   "Sec-Fetch-Site": "same-origin", **headers})


def test_a_booking_form_reaches_the_desk_as_its_viewer_and_the_answer_is_shown_to_them_only() -> None:
    desk = Desk()
    client = app_for(desk=desk)
    token = form_token(client, "alice")
    answer = post(client, "/book", "alice", {"token": token, "gpus": "2", "hours": "2h", "at": "tomorrow 09:00",
                                             "template": "pytorch", "title": "fine-tune", "user": "bob"})
    assert answer.status_code == 303
    assert answer.headers["Location"].startswith("./?answer=")
    # The viewer is the login; a `user` field in the form is not read at all.
    assert desk.asked == [({"kind": "book", "gpus": 2, "hours": "2h", "at": "tomorrow 09:00", "template": "pytorch",
                            "title": "fine-tune"}, "alice")]
    shown = client.get("/" + answer.headers["Location"][2:], headers=login("alice")).get_data(as_text=True)
    assert 'id="answer"' in shown and "ssh -p 2201 alice@devbox1" in shown
    other = client.get("/" + answer.headers["Location"][2:], headers=login("bob")).get_data(as_text=True)
    assert 'id="answer"' not in other and "alice@devbox1" not in other


def test_a_refusal_of_the_desk_is_shown_as_its_sentence() -> None:
    desk = Desk()
    client = app_for(desk=desk)
    answer = post(client, "/book", "alice", {"token": form_token(client, "alice"), "gpus": "9"})
    shown = client.get("/" + answer.headers["Location"][2:], headers=login("alice")).get_data(as_text=True)
    assert "--gpus must be a whole number from 1 to 8" in shown and 'data-state="not done"' in shown


@pytest.mark.parametrize(("headers", "said"), [
    ({"Origin": "http://evil.example"}, "another origin (http://evil.example)"),
    ({"Origin": "null"}, "another origin (null)"),
    ({"Sec-Fetch-Site": "cross-site"}, "another site (cross-site)"),
    ({"Sec-Fetch-Site": "same-site", "Origin": "http://127.0.0.1:9999"}, "another site (same-site)"),
])
def test_hostile_a_form_from_another_origin_is_refused_even_with_a_right_token(headers: dict[str, str],
                                                                               said: str) -> None:
    desk = Desk()
    client = app_for(desk=desk)
    answer = post(client, "/book", "alice", {"token": form_token(client, "alice"), "gpus": "1"}, **headers)
    assert answer.status_code == 403 and said in answer.get_data(as_text=True)
    assert desk.asked == []


def test_hostile_a_token_made_for_another_viewer_or_none_or_forged_is_refused() -> None:
    desk = Desk()
    client = app_for(desk=desk)
    bobs = form_token(client, "bob")
    made, _, signature = bobs.partition(".")
    for token in (bobs, "", "1.abc", f"{made}.{'0' * len(signature)}", f"{int(made) + 1}.{signature}"):
        answer = post(client, "/cancel", "alice", {"token": token, "id": "b1@gpubook-desk"})
        assert answer.status_code == 403, token
        assert "this form was not made for you by this page" in answer.get_data(as_text=True)
    assert desk.asked == []


def test_an_old_form_is_refused_with_reload_the_page() -> None:
    forms = Forms(Desk(), templates=list, users=lambda: {"alice"})
    old = forms.token("alice", now=1_000_000.0)
    assert forms.token_problem("alice", old) == "this form is too old: reload the page and send it again"
    assert forms.token_problem("alice", forms.token("alice")) is None


def test_hostile_a_page_login_that_is_no_gpubook_user_gets_no_form_and_cannot_post() -> None:
    desk = Desk()
    client = app_for(desk=desk)
    page = client.get("/", headers=login("carol")).get_data(as_text=True)
    assert 'id="book-form"' not in page
    alices = form_token(client, "alice")
    answer = post(client, "/book", "carol", {"token": alices, "gpus": "1"})
    assert answer.status_code == 403 and "only a gpubook user" in answer.get_data(as_text=True)
    assert desk.asked == []


def test_hostile_without_a_login_nothing_posts(tmp_path: Path) -> None:
    desk = Desk()
    client = app_for("none", desk=desk)
    assert 'id="book-form"' not in client.get("/", headers={"Host": HOST}).get_data(as_text=True)
    answer = client.post("/book", data={"gpus": "1"}, headers={"Host": HOST, "Origin": f"http://{HOST}"})
    assert answer.status_code == 403 and "only a viewer logged in" in answer.get_data(as_text=True)
    assert client.post("/", headers={"Host": HOST}).status_code == 405  # every other path stays read-only
    assert desk.asked == []


def test_hostile_a_lab_request_cannot_book_in_its_viewers_name() -> None:
    desk = Desk()
    secret = "s" * 40
    client = app_for("basic", desk=desk, lab_secret=secret)
    signed = lab_sign.signed_headers(secret, target="/book", viewer="alice", method="POST")
    answer = client.post("/book", data={"gpus": "1"}, headers={"Host": HOST, "Origin": f"http://{HOST}", **signed})
    assert answer.status_code == 403 and "only a viewer logged in" in answer.get_data(as_text=True)
    assert desk.asked == []


def test_the_page_without_a_desk_has_no_form_and_refuses_every_post() -> None:
    web = WebConfig(enabled=True, listen=HOST, auth="header", trusted_proxies=("127.0.0.0/8",))
    client = create_app(status=lambda: None, web=web, host_name="devbox1").test_client()
    headers = {"Host": HOST, "X-Forwarded-User": "alice"}
    assert 'id="book-form"' not in client.get("/", headers=headers).get_data(as_text=True)
    assert client.post("/book", headers=headers).status_code == 405


@pytest.mark.parametrize("kind", ["end", "cancel", "standby"])
def test_each_button_reaches_the_desk_as_its_kind_for_the_named_booking(kind: str) -> None:
    desk = Desk()
    client = app_for(desk=desk)
    answer = post(client, f"/{kind}", "alice", {"token": form_token(client, "alice"), "id": "b1@gpubook-desk"})
    assert answer.status_code == 303
    assert desk.asked == [({"kind": kind, "id": "b1@gpubook-desk"}, "alice")]
