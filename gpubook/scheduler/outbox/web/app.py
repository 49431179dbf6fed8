"""The status page as a Flask app: `create_app(...)` gives the WSGI app that waitress serves.

Two views of one data set (web/page.py): `/` (HTML: tables rendered here, the timelines drawn by
static/app.js in the browser's time zone from the same data embedded as JSON) and `/api/status`
(that JSON); and the availability calendar `/free.ics`, `/free/<model>.ics` (web/free_route.py).
`mounts` (path → WSGI app, such as /metrics) are served beside them; access.Access
stands in front of all of it. The one thing a viewer can change is their own bookings, with the
booking forms (web/book_route.py), where the daemon serves the page; there is no cookie.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from flask import Flask, Response, jsonify, render_template, request
from werkzeug.middleware.dispatcher import DispatcherMiddleware

from gpubook.scheduler import clock
from gpubook.scheduler.core.plan import LOCAL
from gpubook.scheduler.outbox.status import Status
from gpubook.scheduler.outbox.web import free_route
from gpubook.scheduler.outbox.web.access import USER_KEY, Access
from gpubook.scheduler.outbox.web.book_route import PATHS, Booker, Forms, add_book_routes
from gpubook.scheduler.outbox.web.lab_page import Usage, add_lab_routes
from gpubook.scheduler.outbox.web.live import LiveGpus
from gpubook.scheduler.outbox.web.page import page_data
from gpubook.scheduler.outbox.web.settings import WebConfig

if TYPE_CHECKING:
    from _typeshed.wsgi import WSGIApplication

    from gpubook.scheduler.directory.settings import DirectoryConfig

# The page runs only its own script and style; it may not be framed, and its forms post only to
# itself. "same-origin": no address leaves for another site, and a form's POST carries its Origin
# (under "no-referrer" a browser sends `Origin: null`, which the origin check could not tell apart).
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
                               "connect-src 'self'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "same-origin",
}


def create_app(*, status: Callable[[], Status | None], web: WebConfig, host_name: str,
               live: Callable[[], LiveGpus] | None = None, mounts: Mapping[str, WSGIApplication] | None = None,
               users: Mapping[str, bytes] | None = None, stale_after: timedelta = timedelta(minutes=5),
               usage: Usage | None = None, timezone: str = "UTC", directory: DirectoryConfig | None = None,
               members: Callable[[], Collection[str]] | None = None, book: Booker | None = None,
               templates: Callable[[], list[str]] = list, booker_names: Callable[[], set[str]] = set) -> Flask:
    """`status`: the last Status (None before the first pass); `live`: this host's NVML reading
    (None: not shown); `users`: the basic-auth table (default: read from web.htpasswd_file);
    `directory`, `members`: auth "ldap"'s directory and gpubook's users now (access.Access);
    `stale_after`: a status older than this is flagged (the daemon may be down); `usage`: this
    server's report for /api/usage (None: not served); the lab's routes: web/lab_page.py; `book`:
    the daemon's desk for the page's user (None: no booking forms, as under `gpubook web`), with
    `templates` to offer and `booker_names`, gpubook's users now (only they get a form)."""
    app = Flask(__name__, static_folder="static", template_folder="templates")
    app.json.sort_keys = False  # type: ignore[attr-defined]  # keep the data in the page's order

    def data() -> dict[str, Any]:
        viewer = request.environ.get(USER_KEY)
        return page_data(status(), viewer=viewer, host_name=host_name, now=clock.now(),
                         live={LOCAL: live()} if live is not None else None, stale_after=stale_after)

    forms = Forms(book, templates=templates, users=booker_names, proxied=web.auth == "header") \
        if book is not None else None

    @app.get("/")
    def index() -> str:
        viewer = request.environ.get(USER_KEY)
        shown = data()
        if forms is not None:
            shown["answer"] = forms.kept(viewer, request.args.get("answer"))
            shown["book"] = forms.form(viewer)
        return render_template("index.html", data=shown, lab=bool(web.lab))

    @app.get("/api/status")
    def api_status() -> Response:
        return jsonify(data())

    feeds = free_route.FreeFeeds()

    @app.get("/free.ics")
    @app.get("/free/<model>.ics")
    def free_ics(model: str = "") -> Response:
        return feeds.answer(status(), model=model, viewer=request.environ.get(USER_KEY), host_name=host_name,
                            live=live() if live is not None else None)

    add_lab_routes(app, own=data, web=web, host_name=host_name, timezone=timezone, usage=usage)
    if forms is not None:
        add_book_routes(app, forms)

    @app.after_request
    def headers(response: Response) -> Response:
        response.headers.update(SECURITY_HEADERS)
        if request.path in ("/", "/api/status") or request.path.startswith(("/lab", "/api/")):
            response.headers["Cache-Control"] = "no-store"  # a booker's ssh line stays out of caches
        return response

    inner: WSGIApplication = app.wsgi_app
    if mounts:
        inner = DispatcherMiddleware(inner, dict(mounts))
    app.wsgi_app = Access(inner, web=web, users=users, directory=directory,  # type: ignore[method-assign]
                          members=members, writes=PATHS if forms is not None else ())
    return app
