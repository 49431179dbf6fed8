"""Where the daemon keeps its state: a function of the config alone, so that a command reading the
state (status, log, report) needs none of the daemon's parts."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gpubook.scheduler.settings import Config


def state_dir(config: Config) -> Path:
    """[daemon] state_dir, else $XDG_STATE_HOME/gpubook (~/.local/state/gpubook)."""
    if config.daemon.state_dir is not None:
        return config.daemon.state_dir
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "gpubook"
