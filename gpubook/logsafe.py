"""Log lines that stay one line: every message gpubook logs is written with its control characters
escaped, whatever a calendar put into the values it names (a UID with a newline would otherwise
forge a log line of its own: round 3 of the hostile review, M1). A traceback, added by logging
after the message, keeps its lines."""

from __future__ import annotations

import logging

_ESCAPES = {code: f"\\x{code:02x}" for code in (*range(32), 0x7F)} | {ord("\n"): "\\n", ord("\r"): "\\r",
                                                                     ord("\t"): "\\t"}


def one_line(text: str) -> str:
    return text.translate(_ESCAPES)


class OneLineFormatter(logging.Formatter):
    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 - logging's name
        return one_line(super().formatMessage(record))


def configure(level: int, fmt: str) -> None:
    """logging.basicConfig, with the formatter above on the root logger's handlers."""
    logging.basicConfig(level=level, format=fmt)
    for handler in logging.getLogger().handlers:
        handler.setFormatter(OneLineFormatter(fmt))
