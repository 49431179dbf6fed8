"""What the two sources share about HTTP: safe URLs, wire accounting, one-line error messages."""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote, urlsplit, urlunsplit

from gpubook.scheduler.sources.errors import CalendarDataError, CalendarError, short

XML_TYPES = ("text/xml", "application/xml")


def split_credentials(url: str) -> tuple[str, str | None, str | None]:
    """Return the URL without `user:password@` and the credentials it carried (never logged)."""
    parts = urlsplit(url)
    if parts.username is None and parts.password is None:
        return url, None, None
    host = parts.hostname or ""
    if ":" in host:  # an IPv6 literal
        host = f"[{host}]"
    netloc = f"{host}:{parts.port}" if parts.port else host
    clean = urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))
    user = unquote(parts.username) if parts.username is not None else None
    password = unquote(parts.password) if parts.password is not None else None
    return clean, user, password


def _header_bytes(headers: Any) -> int:
    return sum(len(str(k)) + len(str(v)) + 4 for k, v in headers.items()) + 2


@dataclass
class WireCounter:
    """Counts one poll's HTTP requests and bytes through a requests/niquests response hook.

    Header bytes are counted as `Name: value\\r\\n`; bodies by Content-Length when the server sent
    one (the compressed size on the wire), else by the decoded length.
    """

    requests: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    answers: list[tuple[str, int, str]] = field(default_factory=list)  # method, status, type

    def reset(self) -> None:
        self.requests = self.bytes_sent = self.bytes_received = 0
        self.answers = []

    def hook(self, response: Any, *args: Any, **kwargs: Any) -> Any:
        request = response.request
        body = request.body or b""
        self.requests += 1
        self.bytes_sent += (len(f"{request.method} {request.url} HTTP/1.1\r\n")
                            + _header_bytes(request.headers) + len(body))
        length = response.headers.get("Content-Length")
        # Streamed feeds must not be read here: their body is counted by the reader.
        if length is not None and length.isdigit():
            body_size = int(length)
        elif getattr(response, "_content_consumed", False):
            body_size = len(response.content or b"")
        else:
            body_size = 0
        status_line = len("HTTP/1.1 200 OK\r\n")
        self.bytes_received += status_line + _header_bytes(response.headers) + body_size
        content_type = response.headers.get("Content-Type", "")
        self.answers.append((str(request.method), int(response.status_code), content_type))
        return response

    def add_streamed(self, size: int) -> None:
        self.bytes_received += size

    def check_dav_answers(self, url: str) -> None:
        """A WebDAV method answered 2xx with HTML or other non-XML: not a CalDAV server."""
        for method, status, content_type in self.answers:
            if method in ("PROPFIND", "REPORT") and 200 <= status < 300:
                if not content_type.lower().startswith(XML_TYPES):
                    shown = content_type.split(";", 1)[0] or "no content type"
                    raise CalendarDataError(
                        f"{url}: not a CalDAV calendar: {method} answered {status} with {shown} "
                        "instead of WebDAV XML")


def http_status_error(url: str, status: int, reason: str = "") -> CalendarError:
    """One line for an HTTP error status; permanent (data) errors where a retry cannot help."""
    if status == 401:
        return CalendarError(f"{url}: credentials refused (HTTP 401)")
    if status == 403:
        return CalendarError(f"{url}: access forbidden, credentials refused (HTTP 403)")
    if status == 404:
        return CalendarDataError(f"{url}: no such calendar (HTTP 404)")
    if status >= 500:
        return CalendarError(f"{url}: server error (HTTP {status}{' ' + reason if reason else ''})")
    return CalendarError(f"{url}: unexpected answer HTTP {status}{' ' + reason if reason else ''}")


def transport_error(url: str, error: BaseException, *, timeout: float) -> CalendarError | None:
    """Map a requests/niquests/socket failure to one line, or None when it is not one of those."""
    chain: list[BaseException] = []
    cause: BaseException | None = error
    while cause is not None and len(chain) < 10:
        chain.append(cause)
        cause = cause.__cause__ or cause.__context__
    names = " ".join(type(e).__name__ for e in chain)
    text = " ".join(str(e) for e in chain)
    if "Timeout" in names or isinstance(error, socket.timeout) or "timed out" in text:
        return CalendarError(f"{url}: no answer within {timeout:g} s (timeout)")
    if any(isinstance(e, ConnectionRefusedError) for e in chain) or "refused" in text.lower():
        return CalendarError(f"{url}: connection refused")
    if any(isinstance(e, socket.gaierror) for e in chain) or "Name or service" in text:
        return CalendarError(f"{url}: host name not found")
    if "SSL" in names or "SSLError" in text:
        return CalendarError(f"{url}: TLS failed: {short(error)}")
    if "ConnectionError" in names or "RemoteDisconnected" in names or isinstance(error, OSError):
        return CalendarError(f"{url}: connection failed: {short(error)}")
    return None
