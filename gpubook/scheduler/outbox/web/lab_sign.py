"""How one lab page asks another in its viewer's name: each request signed, never the secret sent.

The lab's shared secret ([web] lab_secret_file) used to travel with every request, in plain http to
a loopback address too: whoever held that port while the peer was down (or [::1] for a peer named
`localhost`, which Debian resolves to ::1 first) got it, and with it was any viewer on every server
of the lab (round 3 of the hostile review, M2). Now a request carries its viewer, the time and an
HMAC-SHA256 of (method, the page's path and query, viewer, time) under the secret. A captured
request names only that one view, is believed for `SKEW` seconds, and tells nothing of the secret.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import Mapping
from typing import Any

LAB_USER_HEADER = "X-Gpubook-Lab-User"  # the viewer the asking page authenticated ("" for none)
LAB_TIME_HEADER = "X-Gpubook-Lab-Time"  # unix seconds, when the request was signed
LAB_SIGNATURE_HEADER = "X-Gpubook-Lab-Signature"
SKEW = 120  # seconds a signed request is believed either side of this server's clock
_VERSION = "gpubook-lab-1"


def signature(secret: bytes, *, method: str, target: str, viewer: str, at: int) -> str:
    message = "\n".join((_VERSION, method.upper(), target, viewer, str(at))).encode()
    return hmac.new(secret, message, hashlib.sha256).hexdigest()


def signed_headers(secret: str, *, target: str, viewer: str | None, method: str = "GET",
                   now: float | None = None) -> dict[str, str]:
    """The headers of a lab request for `target` (path and query, as the asked page sees them)."""
    at = int(time.time() if now is None else now)
    return {LAB_USER_HEADER: viewer or "", LAB_TIME_HEADER: str(at),
            LAB_SIGNATURE_HEADER: signature(secret.strip().encode(), method=method, target=target,
                                            viewer=viewer or "", at=at)}


def _environ_key(header: str) -> str:
    return "HTTP_" + header.upper().replace("-", "_")


SIGNATURE_KEY = _environ_key(LAB_SIGNATURE_HEADER)


def verified_viewer(secret: bytes, environ: Mapping[str, Any], *, now: float | None = None) -> tuple[str | None, str]:
    """(the viewer a signed request names, "") when its signature holds; (None, why) when not."""
    try:
        at = int(str(environ.get(_environ_key(LAB_TIME_HEADER), "")))
    except ValueError:
        return None, "the lab request has no time"
    if abs((time.time() if now is None else now) - at) > SKEW:
        return None, (f"the lab request was signed more than {SKEW} s from this server's time (clocks apart, "
                      "or replayed)")
    viewer = str(environ.get(_environ_key(LAB_USER_HEADER), "")).strip()
    query = str(environ.get("QUERY_STRING", ""))
    target = str(environ.get("PATH_INFO", "")) + (f"?{query}" if query else "")
    wanted = signature(secret, method=str(environ.get("REQUEST_METHOD", "GET")), target=target, viewer=viewer, at=at)
    if not hmac.compare_digest(str(environ.get(SIGNATURE_KEY, "")).encode(), wanted.encode()):
        return None, "the lab request's signature is wrong: [web] lab_secret_file differs between servers"
    return viewer, ""
