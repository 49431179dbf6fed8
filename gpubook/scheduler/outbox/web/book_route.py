"""Booking from the page (issue 40): a logged-in viewer books, ends or cancels their own bookings
with a form, and the daemon's desk (outbox/desk.py) writes the event into the calendar that books
for them, exactly as `gpubook book` does. The page books nothing behind the calendar's back: the
answer is the daemon's next pass over the calendar as written.

- **Who**: only the page's own login (web/access.py puts it in the environ), a gpubook user; a
  form never names a user. Auth "none" has nobody, so it has no form, and a lab request (another
  server's page asking in its viewer's name) cannot post (access.py lets POST through only here).
- **Cross-site requests**: each form carries a token made for its viewer (an HMAC of their name and
  when it was made, with a key this page keeps in memory), good for TOKEN_SECONDS; and a request
  whose `Origin` is not this page's host, or whose `Sec-Fetch-Site` is not same-origin, is refused
  whatever its token (the page's Referrer-Policy is same-origin, so a browser sends its Origin).
- **The answer**: kept for its viewer under a random id (ANSWERS of them, each ANSWER_SECONDS),
  and the form's POST is answered with 303 to `./?answer=ID`: the page shows it at the top, a
  reload or the page's own refresh shows it again, and nothing is posted twice.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from flask import Flask, Response, redirect, request
from werkzeug.wrappers import Response as WerkzeugResponse

from gpubook.scheduler.outbox.asking import AskError
from gpubook.scheduler.outbox.web.access import USER_KEY

if TYPE_CHECKING:
    from _typeshed.wsgi import WSGIEnvironment

FORMS = ("book", "end", "cancel", "standby")  # each form posts to /KIND, the desk's request of that kind
PATHS = frozenset(f"/{kind}" for kind in FORMS)  # the only paths a POST may reach (access.py)
TOKEN_SECONDS = 12 * 3600.0  # a form older than this is refused: reload the page
ANSWERS = 256
ANSWER_SECONDS = 600.0
FIELD_LIMIT = 200  # characters of any one form field read at all

# (request, the page's user) → the desk's answer, or AskError with the sentence (daemon.page_desk).
Booker = Callable[[Mapping[str, Any], str], dict[str, Any]]


class Forms:
    """The page's forms: their tokens, the origin check, and the answers kept for their viewers."""

    def __init__(self, book: Booker, *, templates: Callable[[], list[str]], users: Callable[[], set[str]],
                 proxied: bool = False) -> None:
        """`templates`: the names offered; `users`: gpubook's users now (only they book); `proxied`:
        the page is reached through a trusted proxy (auth "header"), whose X-Forwarded-Host is its host."""
        self.book, self.templates, self.users, self.proxied = book, templates, users, proxied
        self._key = secrets.token_bytes(32)
        self._answers: OrderedDict[str, tuple[str, float, dict[str, Any]]] = OrderedDict()
        self._lock = threading.Lock()

    def token(self, user: str, *, now: float | None = None) -> str:
        made = int(time.time() if now is None else now)
        return f"{made}.{self._sign(user, made)}"

    def token_problem(self, user: str, token: str) -> str | None:
        made_text, _, signature = token.partition(".")
        if not made_text.isdigit() or not hmac.compare_digest(signature, self._sign(user, int(made_text))):
            return "this form was not made for you by this page: reload the page and send it again"
        if time.time() - int(made_text) > TOKEN_SECONDS:
            return "this form is too old: reload the page and send it again"
        return None

    def _sign(self, user: str, made: int) -> str:
        return hmac.new(self._key, f"{user}\0{made}".encode(), hashlib.sha256).hexdigest()

    def origin_problem(self, environ: WSGIEnvironment) -> str | None:
        """Why the request did not come from this page in a browser (None: it did, or from no browser)."""
        site = environ.get("HTTP_SEC_FETCH_SITE")
        if site is not None and site != "same-origin":
            return f"a request from another site ({site}) cannot book here"
        origin = environ.get("HTTP_ORIGIN")
        if origin is None:
            return None  # no browser sends a form without it; the token still has to be right
        hosts = {environ.get("HTTP_HOST", "")}
        if self.proxied and environ.get("HTTP_X_FORWARDED_HOST"):
            hosts.add(environ["HTTP_X_FORWARDED_HOST"].split(",")[0].strip())
        if origin == "null" or urlsplit(origin).netloc not in hosts:
            return f"a request from another origin ({origin[:80]}) cannot book here"
        return None

    def keep(self, user: str, answer: dict[str, Any]) -> str:
        key = secrets.token_urlsafe(12)
        with self._lock:
            self._answers[key] = (user, time.monotonic(), answer)
            while len(self._answers) > ANSWERS:
                self._answers.popitem(last=False)
        return key

    def kept(self, user: str | None, key: str | None) -> dict[str, Any] | None:
        """The answer kept under `key` for `user` (None: none, another's, or too old)."""
        if not user or not key:
            return None
        with self._lock:
            found = self._answers.get(key)
        if found is None or found[0] != user or time.monotonic() - found[1] > ANSWER_SECONDS:
            return None
        return found[2]

    def form(self, user: str | None) -> dict[str, Any] | None:
        """What the page needs to show the form to `user` (None: no form for them)."""
        if not user or user not in self.users():
            return None
        return {"token": self.token(user), "templates": self.templates()}


def _field(name: str, default: str = "") -> str:
    return str(request.form.get(name, default))[:FIELD_LIMIT].strip()


def _request(kind: str) -> dict[str, Any]:
    """The desk's request from the form (the desk checks every value; a user is never taken from it)."""
    if kind != "book":
        return {"kind": kind, "id": _field("id")}
    gpus_text = _field("gpus", "1")
    try:
        gpus: Any = int(gpus_text)
    except ValueError:
        gpus = gpus_text  # the desk says what is wrong with it
    return {"kind": "book", "gpus": gpus, "hours": _field("hours", "1") or "1", "at": _field("at") or "now",
            "template": _field("template") or None, "title": _field("title"),
            **({"standby": True} if _field("standby") else {})}


def add_book_routes(app: Flask, forms: Forms) -> None:
    def answer(kind: str) -> WerkzeugResponse:
        user = str(request.environ.get(USER_KEY) or "")
        problem = forms.origin_problem(request.environ)
        if problem is None and (not user or user not in forms.users()):
            problem = "only a gpubook user logged in to this page can book here"
        if problem is None:
            problem = forms.token_problem(user, _field("token"))
        if problem is not None:
            return Response(problem + "\n", status=403, mimetype="text/plain")
        try:
            result = forms.book(_request(kind), user)
        except AskError as error:
            result = {"kind": kind, "state": "not done", "error": str(error)}
        return redirect(f"./?answer={forms.keep(user, result)}", code=303)

    for kind in FORMS:
        app.add_url_rule(f"/{kind}", f"form_{kind}", functools.partial(answer, kind), methods=["POST"])
