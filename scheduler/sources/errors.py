"""The calendar sources' errors, and the one way they shorten a library's failure to one line.

Temporary (`CalendarError`: unreachable, refused, timed out) means the daemon keeps the last
good snapshot and polls again; permanent (`CalendarDataError`: a 404, HTML, malformed data)
needs the admin to fix the config or the feed.
"""

from __future__ import annotations

from runtime.errors import GpubookError

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
