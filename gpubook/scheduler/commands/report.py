"""`gpubook report --from DATE --to DATE [--by user|gpu|template|project] [--csv F] [--png F] [--html F]`:
GPU-hours booked and used, the idle share, no-shows and rejected requests over a window, from the
daemon's state database (read only: the report never starts a database of its own).

Dates are the host's ([host] timezone; UTC without --config). Bad input is one sentence; every file
is made in memory first and then written beside its target and renamed, so a report either writes
all its files or, when a target cannot be written, none.
"""

from __future__ import annotations

import getpass
import json
import os
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, time, timedelta, tzinfo
from io import StringIO
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

from gpubook import extras
from gpubook.runtime.errors import GpubookError
from gpubook.scheduler import config as config_module
from gpubook.scheduler.core import when
from gpubook.scheduler.core.plan import LOCAL
from gpubook.scheduler.outbox import report as report_module
from gpubook.scheduler.state import State
from gpubook.scheduler.wiring import state_dir


class ReportError(GpubookError):
    """The report's input or its files (one sentence)."""

    temporary = False


@dataclass(frozen=True)
class Outputs:
    csv: Path | None = None
    png: Path | None = None
    html: Path | None = None


def moment(text: str, zone: tzinfo, *, flag: str, now: datetime | None = None, end: bool = False) -> datetime:
    """A date (midnight), a month (its first midnight; as the window's `end`, the next month's), today,
    or an ISO 8601 time, in `zone` unless it names an offset (core/when.py reads them)."""
    try:
        return when.moment(text, now=now or datetime.now(UTC), zone=zone, what=flag, end=end)
    except when.TimeWords as error:
        raise ReportError(f"{str(error).split(': say ')[0]} (say e.g. 2026-11-01, 2026-11, today or an ISO 8601 "
                          "time)") from None


DEFAULT_DAYS = 30  # the window without --from: the last 30 days (--to: the end of today)


def window(start_text: str | None, end_text: str | None, zone: tzinfo, *, now: datetime) -> tuple[datetime, datetime]:
    """The report's window: --from and --to as given, else the last DEFAULT_DAYS days to the end of today."""
    today_end = datetime.combine(now.astimezone(zone).date() + timedelta(days=1), time(), tzinfo=zone)
    end = moment(end_text, zone, flag="--to", now=now, end=True) if end_text else today_end
    start = moment(start_text, zone, flag="--from", now=now) if start_text else end - timedelta(days=DEFAULT_DAYS)
    if end <= start:
        raise ReportError(f"--to {end_text or end.date().isoformat()} is not after --from "
                          f"{start_text or start.date().isoformat()}: the window is empty")
    return start, end


def run(*, start_text: str | None, end_text: str | None, by: str = "user", outputs: Outputs = Outputs(),  # noqa: B008 - frozen
        config_path: str | None = None, now: datetime | None = None, print_line: Callable[[str], None] = print,
        as_json: bool = False) -> int:
    """The table (or with `as_json` its rows as one JSON object) and the files asked for."""
    config = config_module.load(config_path) if config_path else None
    zone: tzinfo = ZoneInfo(config.host.timezone) if config is not None else UTC
    start, end = window(start_text, end_text, zone, now=now or datetime.now(UTC))
    targets = [(path, kind) for path, kind in ((outputs.csv, "CSV"), (outputs.png, "PNG"), (outputs.html, "HTML"))
               if path is not None]
    for path, kind in targets:
        _check_writable(path, kind)
    if outputs.png is not None or outputs.html is not None:
        extras.require("report")  # before anything is read or written
    database = _database(config)
    with State(database) as state:
        report = report_module.build(state, start=start, end=end, now=now or datetime.now(UTC), by=by,
                                     host_name=config.host.name if config is not None else LOCAL)
    files = _render(report, outputs)
    if as_json:
        print_line(json.dumps(to_json(report), indent=2))
    else:
        for line in report_module.table(report):
            print_line(line)
    for path, data in files.items():
        _write(path, data)
        if as_json:  # stdout stays one JSON object
            print(f"wrote {path}", file=sys.stderr)
        else:
            print_line(f"wrote {path}")
    return 0


def to_json(report: report_module.Report) -> dict[str, Any]:
    """The table's rows as the CSV has them (outbox/report.py's to_json)."""
    return report_module.to_json(report)


def run_lab(*, start_text: str | None, end_text: str | None, by: str = "user", config_path: str | None,
            now: datetime | None = None, print_line: Callable[[str], None] = print, as_json: bool = False) -> int:
    """`gpubook report --lab`: this server's report and each [web] lab server's (its /api/usage, asked
    as the page's lab view asks: with the lab secret), summed by user, template or GPU."""
    if config_path is None:
        raise ReportError("--lab needs --config: the lab's servers are its [web] lab")
    config = config_module.load(config_path)
    if not config.web.lab:
        raise ReportError(f"--lab: {config_path} names no other server in [web] lab")
    zone = ZoneInfo(config.host.timezone)
    start, end = window(start_text, end_text, zone, now=now or datetime.now(UTC))
    with State(_database(config)) as state:
        own = report_module.build(state, start=start, end=end, now=now or datetime.now(UTC), by=by,
                                  host_name=config.host.name)
    from gpubook.scheduler.outbox.web import lab  # no Flask: the fetching and merging only

    answers = lab.Lab(config.web.lab, secret=config.web.lab_secret).answers(
        getpass.getuser(), lab.usage_path(start=start.isoformat(), end=end.isoformat(), by=by))
    merged = lab.lab_usage(report_module.to_json(own, host_name=config.host.name), answers,
                           own_label=config.host.name)
    if as_json:
        print_line(json.dumps(merged, indent=2))
    else:
        for line in report_module.json_table(merged):
            print_line(line)
        for server in merged["servers"]:
            if server["problem"]:
                print_line(f"NOT COUNTED: {server['problem']}")
    return 0 if merged["complete"] else 1


def _database(config: config_module.Config | None) -> Path:
    if config is not None:
        folder = state_dir(config)
    else:
        base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
        folder = Path(base) / "gpubook"
    database = folder / "state.sqlite"
    if not database.is_file():
        raise ReportError(f"no state database at {database}: the daemon has not run with this config "
                          "(or --config names another [daemon] state_dir)")
    return database


def _render(report: report_module.Report, outputs: Outputs) -> dict[Path, bytes]:
    files: dict[Path, bytes] = {}
    if outputs.csv is not None:
        text = StringIO(newline="")
        report_module.write_csv(report, text)
        files[outputs.csv] = text.getvalue().encode()
    if outputs.png is not None or outputs.html is not None:
        from gpubook.scheduler.outbox import report_plots  # matplotlib: only when a picture is asked for

        picture = report_plots.png(report)
        if outputs.png is not None:
            files[outputs.png] = picture
        if outputs.html is not None:
            files[outputs.html] = report_plots.html_page(report, picture=picture).encode()
    return files


def _check_writable(path: Path, kind: str) -> None:
    folder = path.parent
    if path.is_dir():
        raise ReportError(f"cannot write the {kind} file {path}: it is a folder")
    if not folder.is_dir():
        raise ReportError(f"cannot write the {kind} file {path}: the folder {folder} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise ReportError(f"cannot write the {kind} file {path}: permission denied")


def _write(path: Path, data: bytes) -> None:
    """Written beside the target and renamed: a reader never sees half a file."""
    temporary: str | None = None
    try:
        fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        with os.fdopen(fd, "wb") as out:
            out.write(data)
        mask = os.umask(0o022)
        os.umask(mask)
        os.chmod(temporary, 0o666 & ~mask)  # as an ordinary new file (mkstemp makes 0600)
        os.replace(temporary, path)
    except OSError as error:
        if temporary is not None:
            Path(temporary).unlink(missing_ok=True)
        raise ReportError(f"cannot write {path}: {error.strerror or error}") from None
