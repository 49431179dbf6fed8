"""`gpubook free`, `gpubook bookings` and `gpubook mine` as any account on the server: asked of the
running daemon over its local socket (outbox/ask_socket.py), with no config and no secret, and
answered from what the daemon decided (outbox/asking.py: its last status, the page's model), as
the asker's host login may see it: their own bookings by name, everyone else's as busy time.

An admin whose config is readable (`--config`, $GPUBOOK_CONFIG, or a default path) reads the
running daemon's status file instead, and sees every booking; with no daemon running, `free` and
`bookings` plan from the calendars alone as before (said on stderr: no running bookings, no
earned priority), and `mine` says that no daemon runs.
"""

from __future__ import annotations

import json
import os
import pwd
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import gpubook
from gpubook.runtime.errors import GpubookError
from gpubook.scheduler import config as config_module
from gpubook.scheduler.core import free as free_core
from gpubook.scheduler.core import policy
from gpubook.scheduler.outbox import asking, desk
from gpubook.scheduler.outbox.ask_socket import NoDaemon, NotBelieved, ask
from gpubook.scheduler.outbox.status import Status
from gpubook.scheduler.outbox.status_file import STATUS_FILE
from gpubook.scheduler.outbox.timeline import short_title
from gpubook.scheduler.sources.errors import printable

ACCOUNT_ENV = "GPUBOOK_DAEMON_ACCOUNT"
DEFAULT_ACCOUNT = "gpubook"  # `gpubook setup --user gpubook`, as the install guide sets it up


class NoDaemonError(GpubookError):
    """No daemon answers: one sentence (exit 1, as every GpubookError)."""


def daemon_account(given: str | None, *, environ: Mapping[str, str] | None = None) -> pwd.struct_passwd:
    """The daemon's account: `--daemon-account`, else $GPUBOOK_DAEMON_ACCOUNT, else the owner of the
    installed gpubook (where that is not root), else the account `gpubook`. Never read from the
    socket: the answer is believed only from this account's uid."""
    environ = os.environ if environ is None else environ
    name = given or environ.get(ACCOUNT_ENV, "")
    if name:
        try:
            return pwd.getpwnam(name)
        except KeyError:
            raise GpubookError(f"there is no account {name!r} on this server (--daemon-account, "
                               f"${ACCOUNT_ENV})") from None
    owner = Path(gpubook.__file__).stat().st_uid
    if owner != 0:
        try:
            return pwd.getpwuid(owner)
        except KeyError:
            pass
    try:
        return pwd.getpwnam(DEFAULT_ACCOUNT)
    except KeyError:
        raise GpubookError(f"cannot tell which account runs the gpubook daemon here: give --daemon-account "
                           f"ACCOUNT (or set ${ACCOUNT_ENV})") from None


def from_daemon(request: Mapping[str, Any], *, account: str | None, timeout: float = 60.0) -> dict[str, Any]:
    """The running daemon's answer over its socket; a sentence (GpubookError) for each way it fails."""
    entry = daemon_account(account)
    try:
        answer = ask(request, uid=entry.pw_uid, timeout=timeout)
    except NoDaemon:
        raise NoDaemonError(f"no gpubook daemon is running for account {entry.pw_name} (nothing answers on its "
                            "socket): ask the admin to start it") from None
    except NotBelieved as refused:
        uid, pid = refused.args
        raise GpubookError(f"refused: the socket of {entry.pw_name}'s gpubook daemon is held by uid {uid} "
                           f"(pid {pid}), not by {entry.pw_name}; its answer is not believed: tell the admin") from None
    except (OSError, ValueError) as error:
        raise GpubookError(f"the gpubook daemon of {entry.pw_name} did not answer: {error}") from None
    if "error" in answer:
        raise GpubookError(f"the daemon says: {printable(str(answer['error']))}")
    return answer


def admin_config(given: str | None) -> config_module.Config | None:
    """The config, where this account reads one: `--config` or $GPUBOOK_CONFIG (errors as any
    command's), else a default path this account can read; None: ask the daemon's socket."""
    if given is not None or os.environ.get(config_module.CONFIG_ENV):
        return config_module.load(config_module.config_path(given))
    path = config_module.config_path(None, required=False)
    if path is None or not os.access(path, os.R_OK):
        return None
    return config_module.load(path)


def from_status_file(config: config_module.Config, request: Mapping[str, Any], *,
                     viewer: asking.Viewer) -> dict[str, Any] | None:
    """The admin's answer from the running daemon's status file; None when no daemon runs."""
    from gpubook.scheduler import clock
    from gpubook.scheduler.commands.admin import daemon_pid
    from gpubook.scheduler.wiring import state_dir

    folder = state_dir(config)
    if daemon_pid(folder) is None or not (folder / STATUS_FILE).is_file():
        return None
    status = Status.from_json(json.loads((folder / STATUS_FILE).read_text()))
    context = asking.Context(host_name=config.host.name, timezone=config.host.timezone,
                             reach_ahead=policy.reach_ahead(config))
    try:
        return asking.answer(status, request, viewer=viewer, context=context, now=clock.now())
    except asking.AskError as error:
        raise GpubookError(str(error)) from None


def answer(request: Mapping[str, Any], *, config: config_module.Config | None, account: str | None
           ) -> dict[str, Any] | None:
    """The answer to show: from the daemon (its socket, or the admin's status file); None: an
    admin's config and no daemon running (the caller plans from the calendars)."""
    if config is None:
        return from_daemon(request, account=account)
    login = pwd.getpwuid(os.getuid()).pw_name
    viewer = asking.viewer_of(login, config.users) if request.get("kind") == "mine" else asking.Viewer(everyone=True)
    found = from_status_file(config, request, viewer=viewer)
    if found is None and request.get("kind") == "mine":
        raise NoDaemonError(f"no gpubook daemon is running for {config.path}: `gpubook mine` asks the daemon")
    return found


# -- printing -----------------------------------------------------------------------------------


def _zone(answer: Mapping[str, Any]) -> ZoneInfo:
    return ZoneInfo(str(answer.get("timezone") or "UTC"))


def _when(text: str, zone: ZoneInfo) -> str:
    return datetime.fromisoformat(text).astimezone(zone).strftime("%a %Y-%m-%d %H:%M")


def _row(item: Mapping[str, Any], *, zone: ZoneInfo, several_hosts: bool) -> str:
    where = f"{item['host']} " if several_hosts else ""
    gpus = ",".join(map(str, item["gpus"]))
    head = f"  {_when(item['start'], zone)} → {_when(item['end'], zone)}  {where}GPU {gpus:<7}"
    if not item.get("own"):
        return f"{head} busy"
    title = short_title(str(item.get("title") or "")) or printable(str(item["id"]))
    note = f": {printable(str(item['note']))}" if item.get("note") else ""
    project = f"project {printable(str(item['project']))}  " if item.get("project") else ""
    return (f"{head} {printable(str(item['user'])):<12} {printable(str(item['template'])):<18} {title}  "
            f"{project}[{item['state']}{note}]")


def _rejected(rows: Sequence[Mapping[str, Any]], *, zone: ZoneInfo, title: str) -> list[str]:
    lines = [f"{title} ({len(rows)}):"]
    lines.extend(f"  {_when(r['start'], zone)} → {_when(r['end'], zone)}  {printable(str(r['user']) or '?'):<12} "
                 f"{printable(str(r['reason']))}" for r in rows)
    return lines


def _who(answer: Mapping[str, Any]) -> str:
    viewer = answer.get("viewer") or {}
    if viewer.get("everyone"):
        return "every booking by name (the admin's view)"
    users = ", ".join(viewer.get("users") or ())
    login = viewer.get("login") or "?"
    return (f"yours ({login}: {users}) by name, the others as busy time" if users
            else f"as busy time ({login} is no gpubook user here)")


def print_bookings(answer: Mapping[str, Any]) -> None:
    zone = _zone(answer)
    several = len(answer.get("hosts") or ()) > 1
    lines = [f"Bookings on {answer['host']}, times in {zone} ({_who(answer)}; "
             f"as the daemon planned at {_when(answer['updated'], zone) if answer.get('updated') else '-'}):"]
    rows = answer.get("bookings") or []
    lines.extend(_row(item, zone=zone, several_hosts=several) for item in rows)
    if not rows:
        lines.append("  none")
    lines.extend(_rejected(answer.get("rejected") or [], zone=zone,
                           title="Rejected" if (answer.get("viewer") or {}).get("everyone") else "Your rejected"))
    if answer.get("outage"):
        lines.append("The daemon cannot read the calendar now: this is the plan of its last good reading.")
    print("\n".join(lines))


def print_mine(answer: Mapping[str, Any]) -> None:
    zone = _zone(answer)
    viewer = answer.get("viewer") or {}
    if not viewer.get("users"):
        print(f"{viewer.get('login') or 'This account'} is no gpubook user on {answer['host']}: no booking is "
              "yours here (the admin maps a login with [users.NAME] account)")
        return
    lines = [f"Your bookings on {answer['host']} ({', '.join(viewer['users'])}), times in {zone}:"]
    rows = answer.get("bookings") or []
    for item in rows:
        lines.append(_row(item, zone=zone, several_hosts=False))
        if item.get("ssh"):
            lines.append(f"    {item['ssh']}")
    if not rows:
        lines.append("  none")
    lines.extend(_rejected(answer.get("rejected") or [], zone=zone, title="Rejected"))
    print("\n".join(lines))


def print_free(answer: Mapping[str, Any]) -> None:
    from gpubook.scheduler.commands.free import free_text, moment, since

    zone = _zone(answer)
    now, horizon = datetime.fromisoformat(answer["now"]), datetime.fromisoformat(answer["until"])
    start = datetime.fromisoformat(answer.get("from") or answer["now"])  # a daemon before --from: now
    hosts = answer.get("hosts") or []
    lines = [f"Free GPUs of {answer['host']}{since(start, zone=zone, now=now)}, times in {zone} (bookings read "
             f"until {moment(horizon, zone=zone, now=now)}; as the daemon planned):"]
    several = len(hosts) > 1
    for host in hosts:
        if several:
            lines.append(f"  {host['name']}:")
        if not host["gpus"]:
            lines.append("  no GPU (NVML lists none, and the config sets no [gpus] count)")
        width = max((len(g.get("model") or "") for g in host["gpus"]), default=0)
        for gpu in host["gpus"]:
            spans = [(datetime.fromisoformat(s), datetime.fromisoformat(e)) for s, e in gpu["free"]]
            model = f" {gpu.get('model') or '':<{width}}" if width else ""
            lines.append(f"  GPU {gpu['gpu']}{model}  " + free_text(spans, zone=zone, now=now, horizon=horizon,
                                                                       start=start))
    asked = answer["asked"]
    slots = [free_core.Slot(start=datetime.fromisoformat(s["start"]),
                            end=datetime.fromisoformat(s["end"]) if s["end"] else None,
                            placement=tuple((host, tuple(on)) for host, on in s["placement"]))
             for s in answer.get("slots") or []]
    what = f"{asked['gpus']} GPU{'' if asked['gpus'] == 1 else 's'} for {asked['hours']:g} h"
    found = free_core.describe(slots, zone=zone, now=now, one_host=not several) if slots \
        else f"none until {moment(horizon, zone=zone, now=now)}"
    lines.append(f"Next slots for {what}: {found}")
    if answer.get("capped"):
        lines.append(f"({answer['capped']})")
    print("\n".join(line.rstrip() for line in lines))


def print_desk(answer: Mapping[str, Any]) -> None:
    """`gpubook book`, `extend`, `end` and `cancel`: the booking's answer, its ssh line first."""
    print("\n".join(printable(line) for line in desk.shown(answer)))
