"""The lab's routes on the page (Flask): `/api/usage` on every daemon's page (this server's report
over a window, what the lab's report merges), and where [web] lab names other servers `/lab` and
`/api/lab` (every server's status in one view) and `/lab/usage` and `/api/lab/usage` (the lab's
month). Every route stands behind the same access.Access as the page; nothing here writes."""

from __future__ import annotations

from collections.abc import Callable
from datetime import date, datetime, time, timedelta
from typing import Any
from zoneinfo import ZoneInfo

from flask import Flask, Response, abort, jsonify, render_template, request

from gpubook.runtime.errors import GpubookError
from gpubook.scheduler import clock
from gpubook.scheduler.outbox.report import BY
from gpubook.scheduler.outbox.web.access import USER_KEY
from gpubook.scheduler.outbox.web.lab import Lab, lab_status, lab_usage, usage_path
from gpubook.scheduler.outbox.web.settings import WebConfig

Usage = Callable[[datetime, datetime, str], dict[str, Any]]  # (start, end, by) → report.to_json's


class BadQuery(ValueError):
    """A query parameter that cannot be read (one sentence, answered with HTTP 400)."""


def add_lab_routes(app: Flask, *, own: Callable[[], dict[str, Any]], web: WebConfig, host_name: str,
                   timezone: str, usage: Usage | None) -> None:
    """`own`: this page's data for the viewer asking; `usage`: this server's report (None: not served)."""
    zone = ZoneInfo(timezone)
    lab = Lab(web.lab, secret=web.lab_secret) if web.lab else None

    def viewer() -> str | None:
        return request.environ.get(USER_KEY)

    def refused(error: BadQuery) -> Response:
        answer = jsonify({"error": str(error)})
        answer.status_code = 400
        return answer

    if usage is not None:
        @app.get("/api/usage")
        def api_usage() -> Response:
            try:
                start, end, by = _window(request.args, zone)
            except BadQuery as error:
                return refused(error)
            try:
                return jsonify(usage(start, end, by))
            except GpubookError as error:  # the state database busy or unreadable: said, never a 500
                answer = jsonify({"error": f"{host_name}: the state database cannot be read: {error}"})
                answer.status_code = 503
                return answer

    if lab is None:
        return

    def merged_status() -> dict[str, Any]:
        return lab_status(own(), lab.answers(viewer(), "/api/status"), own_label=host_name, now=clock.now())

    def merged_usage() -> dict[str, Any]:
        start, end, by = _window(request.args, zone)
        if usage is None:
            abort(404)
        own_problem = None
        try:
            own_report = usage(start, end, by)
        except GpubookError as error:
            own_report = {"host": host_name, "by": by, "from": start.isoformat(), "to": end.isoformat(), "rows": []}
            own_problem = f"{host_name}: the state database cannot be read: {error}"
        answers = lab.answers(viewer(), usage_path(start=start.isoformat(), end=end.isoformat(), by=by))
        return {**lab_usage(own_report, answers, own_label=host_name, own_problem=own_problem),
                "month": f"{start:%Y-%m}",
                "previous": f"{(start - timedelta(days=1)):%Y-%m}", "next": f"{end:%Y-%m}", "viewer": viewer()}

    @app.get("/lab")
    def lab_index() -> str:
        return render_template("lab.html", data=merged_status())

    @app.get("/api/lab")
    def api_lab() -> Response:
        return jsonify(merged_status())

    @app.get("/lab/usage")
    def lab_usage_page() -> str | tuple[str, int]:
        try:
            return render_template("lab_usage.html", data=merged_usage())
        except BadQuery as error:
            return render_template("lab_usage.html", data=None, problem=str(error)), 400

    @app.get("/api/lab/usage")
    def api_lab_usage() -> Response:
        try:
            return jsonify(merged_usage())
        except BadQuery as error:
            return refused(error)


def _window(args: Any, zone: ZoneInfo) -> tuple[datetime, datetime, str]:
    """?month=YYYY-MM (default: this month, in the host's zone) or ?from=…&to=… (dates or ISO
    times), and ?by=user|gpu|template|project."""
    by = args.get("by", "user")
    if by not in BY:
        raise BadQuery(f"by={by[:40]!r} is not one of {', '.join(BY)}")
    if "from" in args or "to" in args:
        start, end = _moment(args.get("from", ""), zone, "from"), _moment(args.get("to", ""), zone, "to")
    else:
        month = args.get("month") or datetime.now(zone).strftime("%Y-%m")
        try:
            first = date.fromisoformat(f"{month}-01")
        except ValueError:
            raise BadQuery(f"month={month[:40]!r} is not a month such as 2026-11") from None
        start = datetime.combine(first, time(), zone)
        end = datetime.combine((first + timedelta(days=32)).replace(day=1), time(), zone)
    if end <= start:
        raise BadQuery("to is not after from: the window is empty")
    return start, end, by


def _moment(text: str, zone: ZoneInfo, name: str) -> datetime:
    try:
        parsed = datetime.combine(date.fromisoformat(text), time()) if len(text) == 10 else datetime.fromisoformat(text)
    except ValueError:
        raise BadQuery(f"{name}={text[:40]!r} is not a date (such as 2026-11-01) or an ISO 8601 time") from None
    return parsed if parsed.tzinfo is not None else parsed.replace(tzinfo=zone)
