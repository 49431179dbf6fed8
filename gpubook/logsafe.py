"""Log lines that stay one line: every message gpubook logs is written with its control characters
escaped, whatever a calendar put into the values it names (a UID with a newline would otherwise
forge a log line of its own: round 3 of the hostile review, M1). A traceback, added by logging
after the message, keeps its lines."""

from __future__ import annotations

import logging
import os

_ESCAPES = {code: f"\\x{code:02x}" for code in (*range(32), 0x7F)} | {ord("\n"): "\\n", ord("\r"): "\\r",
                                                                     ord("\t"): "\\t"}


def one_line(text: str) -> str:
    return text.translate(_ESCAPES)


# syslog's priorities, which journald reads from a line's `<N>` prefix (`journalctl -p warning`)
_PRIORITY = {logging.DEBUG: 7, logging.INFO: 6, logging.WARNING: 4, logging.ERROR: 3, logging.CRITICAL: 2}


class OneLineFormatter(logging.Formatter):
    def __init__(self, fmt: str | None = None, datefmt: str | None = None, *, journal: bool = False) -> None:
        super().__init__(fmt, datefmt)
        self.journal = journal

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 - logging's name
        line = one_line(super().formatMessage(record))
        if self.journal:
            return f"<{_PRIORITY.get(record.levelno, 6)}>{line}"
        return line


def under_journald(environ: dict[str, str] | None = None, *, stream: int = 2) -> bool:
    """Whether `stream` (stderr) is journald's: $JOURNAL_STREAM names its device and inode
    (systemd.exec(5)), so that a child writing elsewhere is not taken for one."""
    value = (os.environ if environ is None else environ).get("JOURNAL_STREAM", "")
    device, _, inode = value.partition(":")
    try:
        found = os.fstat(stream)
        return bool(value) and (found.st_dev, found.st_ino) == (int(device), int(inode))
    except (OSError, ValueError):
        return False


def configure(level: int, *, times: bool = False) -> None:
    """The root logger on stderr, each line one line (escaped): under journald with its `<N>` priority
    (journald adds the time and the unit), elsewhere with its time where `times` (the daemon's log;
    a command's few lines go without). Lines name the logger (a module path) only at debug level: a
    user reads the message. Called again, it sets the handlers' format anew."""
    journal = under_journald()
    parts = ["%(levelname)s", "%(name)s: %(message)s" if level <= logging.DEBUG else "%(message)s"]
    if times and not journal:
        parts.insert(0, "%(asctime)s")
    fmt = " ".join(parts)
    logging.basicConfig(level=level, format=fmt)
    for handler in logging.getLogger().handlers:
        handler.setFormatter(OneLineFormatter(fmt, "%Y-%m-%d %H:%M:%S", journal=journal))
    # paramiko's transport says each SSH probe's "Connected (version 2.0, ...)" and "Authentication (publickey)
    # successful!" at info: two lines per start beside the daemon's own "SSH answered after ...". Its
    # warnings stay; at debug level all of it.
    logging.getLogger("paramiko").setLevel(logging.NOTSET if level <= logging.DEBUG else logging.WARNING)
