"""Event descriptions as calendar programs write them: plain text, or HTML (Google, Outlook).

Google Calendar stores a description typed in its editor as HTML (`user: bob<br>gpus: 1`,
`<p>…</p>`, `&nbsp;`, links); Outlook adds an `X-ALT-DESC;FMTTYPE=text/html` beside a plain
DESCRIPTION. The booker sees lines, so gpubook reads lines: `lines()` turns either form into the
lines a person sees. Both the booking parser and the event block (gpubook/scheduler/sources/block.py)
use it, so what is read and what is written agree on where a line ends.

HTML is read by libxml2's HTML parser (lxml, which caldav already brings), as a browser reads it: an
attribute value holding `>`, a comment holding a tag, Outlook's conditional comments and its `<xml>`
settings are no text (a regular-expression tag scanner misread all three, issue 41). Not the standard
library's html.parser: on Python 3.11 it took 31 s for 60 KB of `<a ` and raised on `<![<![`, and a
calendar writer chooses the text. Read up to READ_LIMIT, in time linear in its length. Pure: no I/O.
"""

from __future__ import annotations

import re

import icalendar
from lxml import etree

# A description longer than this is read only up to here: the booker's lines come first, and a
# calendar writer must not make every poll read megabytes.
READ_LIMIT = 64 * 1024

# Tags that start a new line where a calendar program shows them (libxml2 adds <html> and <body> to
# every document: they are its ends, not lines).
_LINE_TAGS = frozenset({"br", "p", "div", "li", "ul", "ol", "tr", "table", "blockquote", "pre",
                        "h1", "h2", "h3", "h4", "h5", "h6", "hr", "dd", "dt"})
_EMPTY_TAGS = frozenset({"br", "hr"})  # one line break each, where a closing tag is none
# Tags whose content is never shown (Outlook's `<xml>` holds Word's settings: `<o:PixelsPerInch>96`).
_HIDDEN_TAGS = frozenset({"head", "title", "style", "script", "xml"})
# What marks a description as HTML: one of the tags calendar programs write, or a known entity.
_HTML_SIGN = re.compile(r"<(?:br|p|div|span|a|b|i|u|em|strong|font|ul|ol|li|table|tr|td|html|body|"
                        r"!DOCTYPE)(?:[\s/>])|&(?:nbsp|amp|lt|gt|quot|#[0-9]{1,7});", re.IGNORECASE)


def is_html(text: str) -> bool:
    """Whether a description is HTML (Google and Outlook write it so) rather than plain text."""
    return _HTML_SIGN.search(text[:READ_LIMIT]) is not None


_PARSER = etree.HTMLParser(recover=True, no_network=True, remove_comments=True, remove_pis=True,
                           default_doctype=False)


def html_lines(text: str) -> list[str]:
    """The lines a person sees in an HTML description: tags that break lines break them, other
    tags, comments and declarations vanish, entities (`&nbsp;`, `&amp;`) become their characters."""
    try:
        root = etree.fromstring(text, _PARSER) if text.strip() else None
    except etree.ParserError:  # nothing libxml2 could read as HTML (a description of markup only)
        root = None
    if root is None:
        return [""]
    pieces: list[str] = []
    hidden = 0  # the hidden elements open around the walk now
    for event, element in etree.iterwalk(root, events=("start", "end")):
        tag = element.tag.lower() if isinstance(element.tag, str) else ""
        if event == "start":
            if hidden or tag in _HIDDEN_TAGS:
                hidden += 1
                continue
            if tag in _LINE_TAGS:
                pieces.append("\n")
            if element.text:
                pieces.append(_spaced(element.text))
            continue
        if hidden:
            hidden -= 1
        elif tag in _LINE_TAGS and tag not in _EMPTY_TAGS:
            pieces.append("\n")
        if element.tail and not hidden and element is not root:
            pieces.append(_spaced(element.tail))
    return [line.replace("\xa0", " ") for line in "".join(pieces).split("\n")]


def _spaced(text: str) -> str:
    """Newlines in HTML source are spaces to a reader; only tags break lines."""
    return text.replace("\r", "").replace("\n", " ")


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
