"""The `gpubook` command line. Each subcommand is a small function; errors become one line + exit code."""

from __future__ import annotations

import argparse
import difflib
import json
import logging
import os
import re
import sys
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta
from typing import NoReturn

from gpubook import __version__, logsafe
from gpubook.runtime.errors import GpubookError

DESCRIPTION = ("gpubook: book the lab's GPUs in a shared calendar; at the booking's start your container runs "
               "on exactly the booked GPUs, and you log in with ssh.")
EPILOG = ("Researchers: gpubook free, gpubook book, gpubook mine. Admins: gpubook setup, doctor, status, log. "
          "`gpubook COMMAND --help` for one command; the guides are in docs/.")
LOG_LEVELS = ("debug", "info", "warning", "error")
EXIT_OK, EXIT_PROBLEM, EXIT_USAGE = 0, 1, 2  # `gpubook status` adds 3: no daemon runs (admin.EXIT_NOT_RUNNING)
CONFIG_HELP = ("the daemon's TOML config file (default: $GPUBOOK_CONFIG, else the first that exists of "
               "~/.config/gpubook/gpubook.toml and /etc/gpubook/gpubook.toml)")
DAEMON_ACCOUNT_HELP = ("the account the gpubook daemon runs as, whose socket is asked and believed (default: "
                       "$GPUBOOK_DAEMON_ACCOUNT, else the owner of the installed gpubook, else 'gpubook')")


def _when(text: str, *, end: bool = False) -> datetime:
    """A time from the command line as people type it (core/when.py: now, now+2h, tomorrow 09:00,
    2026-12-01, a month 2026-12, or ISO 8601), in the host's time zone unless it names an offset.
    `end`: a month named as a window's end includes that month."""
    from tzlocal import get_localzone

    from gpubook.scheduler.core import when

    try:
        return when.moment(text, now=datetime.now(UTC), zone=get_localzone(), what="the time", end=end)
    except when.TimeWords as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _until(text: str) -> datetime:
    return _when(text, end=True)


def _config_path(args: argparse.Namespace) -> str:
    """--config, else the default config path (ConfigError naming the paths tried when none exists)."""
    from gpubook.scheduler import config

    return str(config.config_path(args.config))


def cmd_config_check(args: argparse.Namespace) -> int:
    from gpubook.scheduler import config

    if args.file and getattr(args, "config", None) and args.file != args.config:
        raise GpubookError(f"two config files named: {args.file} and --config {args.config}; check one")
    path = config.config_path(args.file or args.config)
    try:
        loaded = config.load(path)
    except GpubookError as error:
        if not args.json:
            raise
        json.dump({"path": str(path), "ok": False, "problems": str(error).splitlines()}, sys.stdout, indent=2)
        print()
        return EXIT_PROBLEM
    users = sorted(loaded.users)
    if problems := config.advisories(loaded):
        if args.json:
            json.dump({"path": str(loaded.path), "ok": False, "problems": problems}, sys.stdout, indent=2)
            print()
            return EXIT_PROBLEM
        raise GpubookError("\n".join(problems))
    if args.json:
        json.dump({"path": str(loaded.path), "ok": True, "calendars": len(loaded.calendars), "users": users,
                   "problems": []}, sys.stdout, indent=2)
        print()
    else:
        print(f"{loaded.path}: ok — {len(loaded.calendars)} calendar(s), users: {', '.join(users) or 'none'}")
    return EXIT_OK


def cmd_config_show(args: argparse.Namespace) -> int:
    from gpubook.scheduler import config
    from gpubook.scheduler.config import show

    data = show.effective(config.load(config.config_path(args.config)))
    if args.json:
        json.dump(data, sys.stdout, indent=2, ensure_ascii=False)
        print()
    else:
        print("\n".join(show.lines(data)))
    return EXIT_OK


def cmd_config_reference(args: argparse.Namespace) -> int:
    from gpubook.scheduler.config import reference

    sys.stdout.write(reference.reference())
    return EXIT_OK


def cmd_config_example(args: argparse.Namespace) -> int:
    from gpubook.scheduler.config import reference

    sys.stdout.write(reference.example())
    return EXIT_OK


OFFLINE_NOTE = ("gpubook: no daemon runs for this config: planned from the calendars alone (no running bookings, "
                "no earned priority; with a Slurm backend, on this machine's GPUs)")


def cmd_bookings(args: argparse.Namespace) -> int:
    from gpubook.scheduler.commands import ask

    now = datetime.now(UTC)
    if args.start and args.end and args.end <= args.start:
        raise GpubookError(f"--to ({args.end.isoformat()}) must be after --from ({args.start.isoformat()})")
    request = {"kind": "bookings", "from": args.start.isoformat() if args.start else None,
               "to": args.end.isoformat() if args.end else None}
    loaded = ask.admin_config(args.config)
    found = ask.answer(request, config=loaded, account=args.daemon_account)
    if found is not None:
        return _shown(found, as_json=args.json, printer=ask.print_bookings)
    assert loaded is not None  # an admin's config, and no daemon running
    return _bookings_offline(loaded, args, now=now)


def _bookings_offline(loaded, args: argparse.Namespace, *, now: datetime) -> int:  # type: ignore[no-untyped-def]
    """The admin's plan with no daemon running: read from the calendars (calendars.plan_window)."""
    from gpubook.scheduler import calendars
    from gpubook.scheduler.core import plan
    from gpubook.scheduler.hosts.backend import topology_of
    from gpubook.scheduler.sources.errors import printable, redact_url

    start = args.start or now
    end = args.end or start + timedelta(days=7)
    if end <= start:
        raise GpubookError(f"--to ({end.isoformat()}) must be after --from ({start.isoformat()})")
    result = calendars.plan_window(loaded, window_start=start, window_end=end, now=now,
                                   topology=topology_of(loaded))
    if args.json:
        json.dump(plan.to_json(result.plan), sys.stdout, indent=2)
        print()
        for problem in result.problems:
            where = printable(problem.uid or redact_url(problem.href))
            print(f"gpubook: not a booking: {where}: {printable(problem.reason)}", file=sys.stderr)
    else:
        print(calendars.describe_plan(result, timezone=loaded.host.timezone))
    print(OFFLINE_NOTE, file=sys.stderr)
    return EXIT_OK


def cmd_free(args: argparse.Namespace) -> int:
    from gpubook.scheduler.commands import ask, free

    request = {"kind": "free", "gpus": args.gpus, "hours": args.hours, "days": args.days, "model": args.model or "",
               **({"from": args.start.isoformat()} if args.start else {})}
    loaded = None if args.ics else ask.admin_config(args.config)
    if args.ics:  # the page's /free.ics, printed: the admin's, from the calendars (the daemon serves its own)
        return free.run(_config_path(args), gpus=args.gpus, hours=args.hours, model=args.model or "",
                        days=args.days, ics=True)
    found = ask.answer(request, config=loaded, account=args.daemon_account)
    if found is not None:
        return _shown(found, as_json=args.json, printer=ask.print_free)
    assert loaded is not None
    done = free.run(str(loaded.path), gpus=args.gpus, hours=args.hours, model=args.model or "", days=args.days,
                    start=args.start, as_json=args.json)
    print(OFFLINE_NOTE, file=sys.stderr)  # after the answer: a refusal stays one sentence
    return done


def cmd_mine(args: argparse.Namespace) -> int:
    from gpubook.scheduler.commands import ask

    found = ask.answer({"kind": "mine"}, config=ask.admin_config(args.config), account=args.daemon_account)
    assert found is not None  # `mine` always asks the daemon
    return _shown(found, as_json=args.json, printer=ask.print_mine)


def cmd_desk(args: argparse.Namespace) -> int:
    """`gpubook book`, `extend`, `end`, `cancel`: the daemon writes the booker's calendar and answers
    once its pass has (exit 1: refused)."""
    from gpubook.scheduler.commands import ask
    from gpubook.scheduler.outbox import desk

    request: dict[str, object] = {"kind": args.command}
    if args.command == "book":
        request |= {"gpus": args.gpus, "hours": args.hours, "at": args.at, "template": args.template,
                    "title": args.title, **({"standby": True} if args.standby else {})}
    else:
        request["id"] = args.id or ""
    if args.command == "extend":
        request["by"] = args.by
    if args.as_user:
        request["as"] = args.as_user
    found = ask.from_daemon(request, account=args.daemon_account, timeout=desk.WAIT_SECONDS + 30)
    _shown(found, as_json=args.json, printer=ask.print_desk)
    return EXIT_PROBLEM if found.get("state") == "refused" else EXIT_OK


def _shown(found: dict, *, as_json: bool, printer) -> int:  # type: ignore[no-untyped-def]
    """The daemon's answer, as JSON or as its command prints it."""
    if as_json:
        json.dump(found, sys.stdout, indent=2)
        print()
    else:
        printer(found)
    return EXIT_OK


def _optional_config(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    """--config, else the default config path if one exists; None: none (these commands work without)."""
    from gpubook.scheduler import config

    path = config.config_path(args.config, required=False)
    return config.load(path) if path is not None else None


def cmd_gpus(args: argparse.Namespace) -> int:
    from gpubook.runtime.nvidia import cdi, gpus

    loaded = _optional_config(args)
    if args.gpus_command == "cdi":
        return cdi.cli_gpus_cdi(args, extra_roots=loaded.nvidia.driver_roots if loaded else ())
    return gpus.cli_gpus(args, static_count=loaded.gpu_count if loaded else None)


def cmd_templates(args: argparse.Namespace) -> int:
    from gpubook.runtime.nvidia import cuda
    from gpubook.runtime.templates import cli as templates_cli
    from gpubook.runtime.templates.catalog import load_all

    loaded = _optional_config(args)
    if loaded is not None:
        args.templates_dir = loaded.templates_dir
        args.engine, args.binary = loaded.engine.name, loaded.engine.binary
        args.runtime, args.storage_driver = loaded.engine.runtime, loaded.engine.storage_driver
        args.network = loaded.engine.network  # udocker refuses any engine made without "host"
    action = {"list": templates_cli.list_templates, "show": templates_cli.show,
              "validate": templates_cli.validate, "build": templates_cli.build,
              "import": templates_cli.import_archive}[args.templates_command]
    status = action(args)
    if args.templates_command == "validate" and args.driver:
        templates = load_all(args.templates_dir).templates
        chosen = [t for t in templates.values() if not args.name or t.name == args.name]
        lines, driver_status = cuda.format_checks(
            cuda.validate_against_driver([(t.name, t.cuda or "none") for t in chosen], args.driver), args.driver)
        print("\n".join(lines))
        status = status or driver_status
    return status


def cmd_doctor(args: argparse.Namespace) -> int:
    from gpubook.scheduler.commands import doctor

    return doctor.run(args.config, as_json=args.json)


def cmd_demo(args: argparse.Namespace) -> int:
    from gpubook import extras

    extras.require("demo")
    from gpubook.scheduler.commands import demo

    return demo.run(plan_only=args.plan_only, until_ready=args.until_ready)


def cmd_run(args: argparse.Namespace) -> int:
    from gpubook.scheduler.commands import admin

    return admin.run(_config_path(args))


def cmd_status(args: argparse.Namespace) -> int:
    from gpubook.scheduler.commands import admin

    return admin.status(_config_path(args), as_json=args.json)


def cmd_stop(args: argparse.Namespace) -> int:
    from gpubook.scheduler.commands import admin

    return admin.stop(_config_path(args), args.booking)


def cmd_log(args: argparse.Namespace) -> int:
    from gpubook.scheduler.commands import admin

    return admin.show_log(_config_path(args), follow=args.follow, booking=args.booking, last=args.lines,
                          as_json=args.json)


def cmd_setup(args: argparse.Namespace) -> int:
    from gpubook.scheduler.commands import setup

    return setup.run(account=args.user, data_root=args.data_root, dry_run=args.dry_run, config_from=args.config_from)


def cmd_web(args: argparse.Namespace) -> int:
    from gpubook import extras

    extras.require("web")
    from gpubook.scheduler.commands import web

    return web.run(_config_path(args))


def cmd_images(args: argparse.Namespace) -> int:
    from gpubook.scheduler.commands import images

    return images.show(_config_path(args), as_json=args.json)


def cmd_report(args: argparse.Namespace) -> int:
    from pathlib import Path

    from gpubook.scheduler import config
    from gpubook.scheduler.commands import report

    paths = {kind: Path(value) if value else None for kind, value in (("csv", args.csv), ("png", args.png),
                                                                       ("html", args.html))}
    path = config.config_path(args.config, required=False)
    if args.lab:
        if any(paths.values()):
            raise report.ReportError("--lab prints the lab's table (or --json); --csv, --png and --html are one "
                                     "server's: run them without --lab")
        return report.run_lab(start_text=args.start, end_text=args.end, by=args.by,
                              config_path=str(path) if path else None, as_json=args.json)
    return report.run(start_text=args.start, end_text=args.end, by=args.by, outputs=report.Outputs(**paths),
                      config_path=str(path) if path else None, as_json=args.json)


class _Parser(argparse.ArgumentParser):
    """argparse's parser, with "did you mean" for a mistyped command or choice (as git and systemctl say it)."""

    def error(self, message: str) -> NoReturn:
        found = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message)
        if found:
            known = re.findall(r"'([^']*)'", found.group(2))
            close = difflib.get_close_matches(found.group(1), known, n=1, cutoff=0.6)
            if close:
                message = f"{message}; did you mean '{close[0]}'?"
        super().error(message)


def build_parser() -> argparse.ArgumentParser:
    # No abbreviated options: `gpubook setup --config X` must not be read as `--config-from X`.
    parser = _Parser(prog="gpubook", description=DESCRIPTION, epilog=EPILOG, allow_abbrev=False)
    parser.add_argument("-v", "--verbose", action="store_true", help="log what happens (to stderr)")
    parser.add_argument("--log-level", choices=LOG_LEVELS, type=str.lower, default=None,
                        help="log from this level on (default: warning; info with -v)")
    parser.add_argument("--version", action="version", version=f"gpubook {__version__}")
    parser.add_argument("--config", help=CONFIG_HELP)
    # --config, -v and --log-level are also taken after any (sub-)command; SUPPRESS keeps a value given before it.
    logging_options = argparse.ArgumentParser(add_help=False)
    logging_options.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                                 help="log what happens (to stderr)")
    logging_options.add_argument("--log-level", choices=LOG_LEVELS, type=str.lower, default=argparse.SUPPRESS,
                                 help="log from this level on (default: warning; info with -v)")
    with_config = argparse.ArgumentParser(add_help=False)
    with_config.add_argument("--config", default=argparse.SUPPRESS, help=CONFIG_HELP)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, handler: Callable[[argparse.Namespace], int] | None, help_text: str,
                parent: argparse._SubParsersAction = commands, *, config: bool = True,
                parents: Sequence[argparse.ArgumentParser] = ()) -> argparse.ArgumentParser:
        sub = parent.add_parser(name, help=help_text, description=help_text, allow_abbrev=False,
                                parents=[logging_options, *([with_config] if config else []), *parents])
        if handler is not None:
            sub.set_defaults(handler=handler)
        return sub

    # `bookings`, `free` and `mine` ask the running daemon (any account, no config: its socket).
    asking = argparse.ArgumentParser(add_help=False)
    asking.add_argument("--daemon-account", metavar="ACCOUNT", default=None, help=DAEMON_ACCOUNT_HELP)
    bookings = command("bookings", cmd_bookings, "show the plan as the running daemon decided it: your bookings "
                       "by name, the others' as busy time (an admin with the config: all)", parents=[asking])
    bookings.add_argument("--from", dest="start", type=_when, metavar="WHEN", help="window start: now+2h, 'tomorrow "
                          "09:00', 2026-12-01, 2026-12, ISO 8601 (default: now)")
    bookings.add_argument("--to", dest="end", type=_until, metavar="WHEN", help="window end, the same words (a month: "
                          "its end; default: start + 7 days)")
    bookings.add_argument("--json", action="store_true", help="print one JSON object")

    mine = command("mine", cmd_mine, "your own bookings as the running daemon knows them: running (with the ssh "
                   "line), upcoming, held, ended this week, and refused with why", parents=[asking])
    mine.add_argument("--json", action="store_true", help="print one JSON object")

    # `book`, `extend`, `end`, `cancel`: the daemon writes the asker's calendar (issue 40; outbox/desk.py).
    desk_options = argparse.ArgumentParser(add_help=False)
    desk_options.add_argument("--as", dest="as_user", metavar="NAME", help="the gpubook user to act as, where "
                              "your login is several")
    desk_options.add_argument("--json", action="store_true", help="print one JSON object")
    book = command("book", cmd_desk, "book GPUs without a calendar program: the daemon writes the booking into "
                   "your calendar and prints its answer (the ssh line, or why not and the next free slots); exit "
                   "1 when refused", parents=[asking, desk_options])
    book.add_argument("--gpus", type=int, default=1, metavar="N", help="how many GPUs (default 1)")
    book.add_argument("--hours", default="1", metavar="LENGTH", help="how long: 4, 2h, 90m, 1h30m (default 1 hour)")
    book.add_argument("--at", default="now", metavar="WHEN", help="when it starts: now (the default), now+2h, "
                      "14:00, 'tomorrow 09:00', '2026-12-01 09:00' (the server's time zone)")
    book.add_argument("--template", metavar="NAME", help="the template (default: the config's)")
    book.add_argument("--title", default="", help="the event's title (default: 'USER GPU booking')")
    book.add_argument("--standby", action="store_true", help="where the GPUs are taken (or a quota spent), wait "
                      "on standby instead of being refused: it runs as soon as they free up in its time (exit 0, "
                      "state standby)")
    standby = command("standby", cmd_desk, "wait on standby for the GPUs of one of your refused bookings instead: "
                      "the daemon adds 'standby: yes' to its event, and it runs as soon as they free up in its time",
                      parents=[asking, desk_options])
    standby.add_argument("id", metavar="ID", help="the refused booking (its id, as `gpubook mine` shows it)")
    extend = command("extend", cmd_desk, "make one of your bookings longer: its event's end moves (refused, and "
                     "left as it was, where the GPUs are booked after it)", parents=[asking, desk_options])
    extend.add_argument("by", metavar="LENGTH", help="how much longer: 2h, 30m, 1h30m")
    extend.add_argument("id", nargs="?", help="the booking (default: your one running booking)")
    end = command("end", cmd_desk, "end one of your running bookings now: its event ends now, the container "
                  "stops and your outputs are kept", parents=[asking, desk_options])
    end.add_argument("id", nargs="?", help="the booking (default: your one running booking)")
    cancel = command("cancel", cmd_desk, "cancel one of your bookings: its event is deleted from your calendar",
                     parents=[asking, desk_options])
    cancel.add_argument("id", help="the booking, as `gpubook mine` shows it")

    free = command("free", cmd_free, "which GPUs are free now and in the coming days, and the next slots that fit "
                   "a request (asked of the running daemon); --ics prints the availability calendar the page "
                   "serves", parents=[asking])
    free.add_argument("--gpus", type=int, default=1, metavar="N", help="the slots must fit N GPUs (default 1)")
    free.add_argument("--hours", type=float, default=1.0, metavar="H", help="for H hours (default 1)")
    free.add_argument("--model", metavar="MODEL", help="only this GPU model's GPUs, as /free/MODEL.ics names it "
                      "(a100-sxm4-80gb)")
    free.add_argument("--days", type=float, default=7.0, help="how far ahead of --from (default 7, at most the "
                      "daemon's window)")
    free.add_argument("--from", dest="start", type=_when, metavar="WHEN", help="from when: now+2h, 'tomorrow 09:00', "
                      "2026-12-01, ISO 8601 (default: now; not with --ics)")
    output = free.add_mutually_exclusive_group()
    output.add_argument("--ics", action="store_true", help="print the availability calendar (iCalendar, no names)")
    output.add_argument("--json", action="store_true", help="print one JSON object")

    config_group = command("config", None, "configuration tools").add_subparsers(
        dest="config_command", required=True, metavar="SUBCOMMAND")
    check = command("check", cmd_config_check, "validate a config file, listing every problem",
                    parent=config_group)
    check.add_argument("file", nargs="?", metavar="FILE", help="the config file to check, as promtool check config "
                       "takes it (default: --config, else the default path)")
    check.add_argument("--json", action="store_true", help="print one JSON object (path, ok, problems)")
    shown = command("show", cmd_config_show, "print the effective config, every default resolved (secrets only as "
                    "set)", parent=config_group)
    shown.add_argument("--json", action="store_true", help="print one JSON object")
    command("reference", cmd_config_reference, "print the config reference (Markdown) made from the declared "
            "settings", parent=config_group, config=False)
    command("example", cmd_config_example, "print an example config with every key", parent=config_group,
            config=False)

    gpus = command("gpus", cmd_gpus, "the host's GPUs (NVML, else the config's [gpus] count)")
    gpus.add_argument("--json", action="store_true", help="print one JSON object")
    gpus.set_defaults(gpus_command=None)
    gpus_sub = gpus.add_subparsers(dest="gpus_command", metavar="SUBCOMMAND")
    cdi = command("cdi", cmd_gpus, "print or write the nvidia.com/gpu CDI spec of this host", parent=gpus_sub)
    cdi.add_argument("--output", metavar="FILE", help="write the spec to FILE instead of printing it")
    cdi.add_argument("--cache-dir", metavar="DIR",
                     help="where the soname-link folder lives (it must outlive the spec)")

    templates_group = command("templates", cmd_templates, "list, show, validate, build or import container templates")
    templates_group.set_defaults(templates_dir=None, name=None, driver=None)
    templates_sub = templates_group.add_subparsers(dest="templates_command", required=True, metavar="SUBCOMMAND")
    listing = command("list", None, "the templates and whether each is valid", parent=templates_sub)
    listing.add_argument("--json", action="store_true", help="print JSON")
    show = command("show", None, "one template: the TOML file the admin edits (--json: resolved, with its "
                   "defaults and the image a booking runs)", parent=templates_sub)
    show.add_argument("name")
    show.add_argument("--json", action="store_true", help="print the template resolved, as one JSON object")
    validate = command("validate", None, "check templates; name the file and field at fault", parent=templates_sub)
    validate.add_argument("name", nargs="?")
    validate.add_argument("--driver", metavar="VERSION",
                          help="also check each template's CUDA version against this driver version")
    command("build", None, "build the image a template runs (local rootfs or SSH overlay)",
            parent=templates_sub).add_argument("name")
    imported = command("import", None, "load the image a template runs from an archive made on another machine "
                       "(podman save -o FILE IMAGE), named as the template names it: for a host that cannot build "
                       "it (no mmdebstrap) or pull it", parent=templates_sub)
    imported.add_argument("name")
    imported.add_argument("file", metavar="FILE", help="the archive (podman save or docker save)")

    users = command("users", cmd_users, "the users gpubook sees: name, uid, gid, calendar identities, number of "
                    "SSH keys, and whether each came from the directory or the config file")
    users.add_argument("--json", action="store_true", help="print one JSON object")

    doctor = command("doctor", cmd_doctor, "check driver, devices, engine, templates' images, calendars and "
                     "storage; each problem with its fix (exit 1 if any FAIL; a WARN does not fail)")
    doctor.add_argument("--json", action="store_true", help="print a JSON list of checks (name, level, detail, fix)")

    command("run", cmd_run, "run the daemon in the foreground (logs to stderr)")
    status = command("status", cmd_status, "GPUs, running bookings with ports and ends, next bookings, "
                     "last poll, problems (exit 3 if no daemon runs for the state folder)")
    status.add_argument("--json", action="store_true", help="print one JSON object")
    stop = command("stop", cmd_stop, "stop a booking's container now (admin); the event says it ended")
    stop.add_argument("booking", help="the booking id (or container name), as gpubook status shows it")
    images = command("images", cmd_images, "images prepared for upcoming bookings, those gpubook pulled or "
                     "built (sizes), and the engine's free space")
    images.add_argument("--json", action="store_true", help="print one JSON object")
    command("web", cmd_web, "serve the read-only status page ([web] in the config) from the "
                  "daemon's status file, until Ctrl-C")
    log_parser = command("log", cmd_log, "the daemon's event log")
    log_parser.add_argument("--follow", "-f", action="store_true", help="keep printing new entries")
    log_parser.add_argument("--booking", help="only this booking's entries")
    log_parser.add_argument("-n", "--lines", type=int, default=50, help="entries shown first (0: all)")
    log_parser.add_argument("--json", action="store_true", help="one JSON object a line (id, at, level, booking, "
                            "message)")

    report = command("report", cmd_report, "GPU-hours booked and used, the idle share, no-shows and rejected "
                     "requests over a window; as a table, CSV, a PNG plot or an HTML page")
    report.add_argument("--from", dest="start", metavar="WHEN", help="window start: a date (2026-11-01, midnight "
                        "in [host] timezone), a month (2026-11), today, or an ISO 8601 time (default: 30 days before "
                        "--to)")
    report.add_argument("--to", dest="end", metavar="WHEN", help="window end, not included: the same words; a month "
                        "includes that month (default: the end of today)")
    report.add_argument("--by", choices=("user", "gpu", "template", "project"), default="user",
                        help="one row per (default: user); project: per [groups.NAME] a booking counted against")
    report.add_argument("--csv", metavar="FILE", help="also write the table as CSV")
    report.add_argument("--png", metavar="FILE", help="write the plots (GPU-hours per user per week, "
                        "utilisation per GPU) as a PNG")
    report.add_argument("--html", metavar="FILE", help="write one HTML page: the table and the plots")
    report.add_argument("--json", action="store_true", help="print the table's rows as one JSON object")
    report.add_argument("--lab", action="store_true", help="the lab's servers together: this one's and each "
                        "[web] lab server's usage, summed (exit 1 when one did not answer)")

    setup = command("setup", cmd_setup, "set this host up for gpubook, once, as root: the daemon's account, its "
                    "data_root, podman, the config, the image and the user unit; then gpubook doctor", config=False)
    setup.add_argument("--user", required=True, metavar="ACCOUNT", help="the daemon's account (made if missing)")
    setup.add_argument("--data-root", required=True, metavar="PATH", help="[storage] data_root: bookers' folders")
    setup.add_argument("--dry-run", action="store_true", help="print what would be done; change nothing")
    setup.add_argument("--config-from", metavar="FILE", help="the account's new config (default: the example)")

    demo = command("demo", cmd_demo, "run gpubook on embedded defaults: a local Radicale with demo bookings, "
                   "the daemon, and an SSH login to your booking; Ctrl-C ends it", config=False)
    demo.add_argument("--plan-only", action="store_true", help="show the plan of the demo bookings and stop")
    demo.add_argument("--until-ready", action="store_true",
                      help="stop (and clean up) once your booking answers on SSH, instead of at Ctrl-C")

    completion = command("completion", cmd_completion, "print the shell completion script for bash, zsh or tcsh "
                         "(made from this parser by shtab): `source <(gpubook completion bash)`; the package also "
                         "installs them in share/ (docs/guides/install.md)", config=False)
    completion.add_argument("shell", choices=SHELLS, help="the shell")
    return parser


SHELLS = ("bash", "zsh", "tcsh")


def cmd_completion(args: argparse.Namespace) -> int:
    print(completion_script(args.shell), end="")
    return EXIT_OK


def completion_script(shell: str) -> str:
    """The shell's completion of every command and option, from the parser itself (shtab)."""
    import shtab

    return str(shtab.complete(build_parser(), shell=shell))


def cmd_users(args: argparse.Namespace) -> int:
    from gpubook.scheduler.commands import users

    return users.run(_config_path(args), as_json=args.json)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "ics", False) and getattr(args, "start", None):
        parser.error("free: --from does not go with --ics (the availability calendar shows each day it reads)")
    level = getattr(logging, args.log_level.upper()) if args.log_level else \
        logging.INFO if args.verbose else logging.WARNING
    logsafe.configure(level)
    try:
        return int(args.handler(args))
    except GpubookError as error:
        # One error may carry several lines (config validation lists every problem).
        print(f"gpubook: {error}", file=sys.stderr)
        return EXIT_PROBLEM
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # `gpubook free | head`: the reader left. No traceback, and none at exit either: Python's own
        # flush of stdout would meet the closed pipe again (the recipe of the signal module's docs).
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_PROBLEM


if __name__ == "__main__":
    sys.exit(main())
