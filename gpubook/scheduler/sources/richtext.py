"""Event descriptions as calendar programs write them: plain text, or HTML (Google, Outlook).

Google Calendar stores a description typed in its editor as HTML (`user: bob<br>gpus: 1`,
`<p>…</p>`, `&nbsp;`, links); Outlook adds an `X-ALT-DESC;FMTTYPE=text/html` beside a plain
DESCRIPTION. The booker sees lines, so gpubook reads lines: `lines()` turns either form into the
lines a person sees. Both the booking parser and the event block (gpubook/scheduler/sources/block.py)
use it, so what is read and what is written agree on where a line ends.

Everything here is linear in the text's length (a calendar writer chooses the text): one scan
with a pattern that cannot backtrack across '<' or '>', and `html.unescape`. Pure: no I/O.
"""

from __future__ import annotations

import html
import re

import icalendar

# A description longer than this is read only up to here: the booker's lines come first, and a
# calendar writer must not make every poll read megabytes.
READ_LIMIT = 64 * 1024

# Tags that start a new line where a calendar program shows them.
_LINE_TAGS = frozenset({"br", "p", "div", "li", "ul", "ol", "tr", "table", "blockquote", "pre",
                        "h1", "h2", "h3", "h4", "h5", "h6", "hr", "dd", "dt", "body", "html"})
# Tags whose content is never shown.
_HIDDEN_TAGS = frozenset({"head", "title", "style", "script"})
# A tag or a markup declaration; `[^<>]*` cannot run past the next '<' or '>', so the scan is linear.
_TAG = re.compile(r"<(/?)([A-Za-z][A-Za-z0-9]*)?[^<>]*>")
# What marks a description as HTML: one of the tags calendar programs write, or a known entity.
_HTML_SIGN = re.compile(r"<(?:br|p|div|span|a|b|i|u|em|strong|font|ul|ol|li|table|tr|td|html|body|"
                        r"!DOCTYPE)(?:[\s/>])|&(?:nbsp|amp|lt|gt|quot|#[0-9]{1,7});", re.IGNORECASE)


def is_html(text: str) -> bool:
    """Whether a description is HTML (Google and Outlook write it so) rather than plain text."""
    return _HTML_SIGN.search(text[:READ_LIMIT]) is not None


def html_lines(text: str) -> list[str]:
    """The lines a person sees in an HTML description: tags that break lines break them, other
    tags vanish, entities (`&nbsp;`, `&amp;`) become their characters."""
    pieces: list[str] = []
    hidden: str | None = None
    position = 0
    for tag in _TAG.finditer(text):
        if hidden is None:
            pieces.append(text[position:tag.start()])
        position = tag.end()
        closing, name = tag[1] == "/", (tag[2] or "").lower()
        if hidden is not None:
            if closing and name == hidden:
                hidden = None
            continue
        if not closing and name in _HIDDEN_TAGS and not tag[0].endswith("/>"):
            hidden = name
        elif name in _LINE_TAGS:
            pieces.append("\n")
    if hidden is None:
        pieces.append(text[position:])
    # Newlines in HTML source are spaces to a reader; only tags break lines.
    joined = "".join(piece if piece == "\n" else piece.replace("\r", "").replace("\n", " ")
                     for piece in pieces)
    return [html.unescape(line).replace("\xa0", " ") for line in joined.split("\n")]


def lines(text: str, *, as_html: bool = False) -> list[str]:
    """A description's lines as a person sees them, plain or HTML; read up to READ_LIMIT."""
    text = text[:READ_LIMIT]
    return html_lines(text) if as_html or is_html(text) else text.splitlines()


def description_source(component: icalendar.cal.Component) -> tuple[str, bool]:
    """The text an event's description is read from, and whether it is HTML by its type:
    DESCRIPTION, or Outlook's X-ALT-DESC (text/html) when DESCRIPTION is empty."""
    description = component.get("DESCRIPTION")
    if description is not None and str(description).strip():
        return str(description), False
    alternative = component.get("X-ALT-DESC")
    if alternative is not None and _is_html_type(alternative):
        return str(alternative), True
    return "", False


def _is_html_type(prop: object) -> bool:
    params = getattr(prop, "params", {})
    return str(params.get("FMTTYPE", "")).lower() == "text/html"
