"""Crash points (issue 26): a test-only switch that makes the daemon die hard at a named point.

`GPUBOOK_CRASH_AT=NAME` (or `NAME@N`, the Nth time the point is passed) in the daemon's environment,
read once when the daemon starts (`arm`), never from a config file: when the process passes that
point it sends itself SIGKILL, as `kill -9` would at exactly that moment. The points:

- `state.<write>:after`, after each State write commits (state/store.py's `_transaction`, whose
  callers must name their write: tests/test_crash_points.py lists them all and fails on a write
  without a name);
- `engine.<verb>:before` and `engine.<verb>:after`, around each engine call that changes something
  (`ENGINE_VERBS`, through `CrashingEngine`, which the wiring puts around the engine when armed);
- `writeback:before` and `writeback:after`, around each PUT of a calendar event.

Unarmed (the variable unset), a point is one comparison; nothing is wrapped.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import threading
from collections.abc import Mapping
from typing import Any

log = logging.getLogger(__name__)

ENV = "GPUBOOK_CRASH_AT"
# The verbs of the daemon's engine calls that change something. Not `import_rootfs`: only
# `gpubook templates build` makes an image from a root file system, never the daemon.
ENGINE_VERBS = ("start", "stop", "exec", "start_service", "signal", "build", "pull", "remove_image", "tag")
_SPEC = re.compile(r"^(?P<name>[a-z_.]+:(?:before|after))(?:@(?P<count>[1-9][0-9]*))?$")

_armed: tuple[str, int] | None = None
_passed: dict[str, int] = {}
_lock = threading.Lock()


def arm(environ: Mapping[str, str] = os.environ) -> str | None:
    """Read the switch; the point armed (None: unarmed). A malformed value is a ValueError that
    names it, so a test never runs unarmed by a typo."""
    global _armed
    text = environ.get(ENV, "")
    if not text:
        _armed = None
        return None
    match = _SPEC.match(text)
    if match is None:
        raise ValueError(f"{ENV}={text!r} is not like 'state.port_for:after' or 'engine.start:before@2'")
    _armed = (match.group("name"), int(match.group("count") or 1))
    _passed.clear()
    log.warning("crash point armed: this process dies at %s (pass %d)", *_armed)
    return match.group("name")


def armed() -> bool:
    return _armed is not None


def point(name: str) -> None:
    """Pass the point `name`; die here (SIGKILL) when it is the armed one, the armed time."""
    if _armed is None or _armed[0] != name:
        return
    with _lock:
        _passed[name] = _passed.get(name, 0) + 1
        if _passed[name] == _armed[1]:
            os.kill(os.getpid(), signal.SIGKILL)


class CrashingEngine:
    """An engine with the crash points `engine.<verb>:before/after` around its verbs that change
    something; everything else (capabilities included) is the engine's own."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine

    def __getattr__(self, attribute: str) -> Any:
        value = getattr(self._engine, attribute)
        if attribute not in ENGINE_VERBS or not callable(value):
            return value

        def verb(*args: Any, **kwargs: Any) -> Any:
            point(f"engine.{attribute}:before")
            result = value(*args, **kwargs)
            point(f"engine.{attribute}:after")
            return result

        return verb
