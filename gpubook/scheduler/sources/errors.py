"""The calendar sources' errors, and the one way they shorten a library's failure to one line.

Temporary (`CalendarError`: unreachable, refused, timed out) means the daemon keeps the last
good snapshot and polls again; permanent (`CalendarDataError`: a 404, HTML, malformed data)
needs the admin to fix the config or the feed.
"""

from __future__ import annotations

import re
from urllib.parse import urlsplit, urlunsplit

from gpubook.runtime.errors import GpubookError

# What a transport failure comes down to, found inside urllib3's nested reprs.
KNOWN_CAUSES = ("Connection refused", "timed out", "Name or service not known", "No route to host")


class CalendarError(GpubookError):
    """A calendar source could not be read (unreachable, refused, not a calendar)."""

    temporary = True


class CalendarDataError(CalendarError):
    """A calendar answered, but with something that is not usable calendar data."""

    temporary = False


def short(failure: object, *, empty: str = "no details") -> str:
    """The first line of a failure's text, at most 200 characters: library errors span pages."""
    lines = str(failure).strip().splitlines()
    return lines[0][:200] if lines else empty


def cause(failure: BaseException) -> str:
    """A transport failure's cause without urllib3's nesting: "Connection refused" rather than a
    300-character repr; else its first line, else its type's name."""
    text = str(failure)
    for known in KNOWN_CAUSES:
        if known in text:
            return known
    return short(failure, empty=type(failure).__name__)


# Control characters (C0, DEL, C1): an ESC from a calendar must not reach an admin's terminal.
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def redact_url(url: str) -> str:
    """A calendar URL fit to print or log: a password written into it (`user:secret@host`)
    becomes `***`. Every place that shows a configured calendar URL goes through here."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return re.sub(r"//[^/@]*@", "//***@", url)
    if parts.password is None:
        return url
    netloc = f"{parts.username or ''}:***@{parts.netloc.rpartition('@')[2]}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


_URL = re.compile(r"\b[A-Za-z][A-Za-z0-9+.-]*://[^\s\"'<>]+")


def redact_urls(text: str) -> str:
    """`text` with each URL cut to scheme://host/… (no user part, path or query): what the web
    page and /metrics show of a calendar, since a private address carries its secret in the path
    (Google's private ICS address) or the query (`?token=`)."""

    def cut(match: re.Match[str]) -> str:
        try:
            parts = urlsplit(match[0])
            host = parts.hostname or "?"
            port = f":{parts.port}" if parts.port else ""
        except ValueError:
            return "(a URL)"
        return f"{parts.scheme}://{host}{port}/…"

    return _URL.sub(cut, text)


def printable(text: object) -> str:
    """Text from a calendar made safe for a terminal: control characters (ESC, CR, …) escaped
    as \\xNN, so a UID or title cannot move the cursor, recolour or rewrite an admin's output."""
    return _CONTROL.sub(lambda match: f"\\x{ord(match[0]):02x}", str(text))
