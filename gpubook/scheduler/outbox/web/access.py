"""Who may see the status page, as one WSGI middleware in front of the page and every mount.

- "none": anyone who reaches the port (the config allows it on a loopback address only); nobody
  is anybody, so no ssh line is ever shown.
- "basic": HTTP basic auth against an htpasswd file of bcrypt entries (`htpasswd -B`); any other
  hash kind is refused when the file is read, naming its line.
- "header": a reverse proxy authenticated the user and names them in `trusted_header`; the header
  is believed only from `trusted_proxies` (a request from anywhere else is refused outright, with
  or without the header: it went around the proxy).
- "ldap": HTTP basic auth checked by a bind to the lab's directory as that user ([directory]
  source = "ldap"; web/directory_login.py), for gpubook's users only; a directory that does not
  answer is a 503, not a refusal.

A request from another server of the lab (its lab page asking this one, web/lab.py) carries the
lab's shared secret ([web] lab_secret_file) as a signature of the request and its viewer's name
(web/lab_sign.py): with a right signature the name is believed (whatever the mode), and the answer is
what that viewer would get here directly; a wrong secret is refused; without a name only auth
"none" answers (a page without a login must not show what this one shows only after one).

Every method but GET and HEAD is refused here, for the page and the mounts alike, but a POST to the
page's booking forms (`writes`: web/book_route.py's paths, where the daemon serves them) from a viewer
logged in here (never auth "none", never a lab request). The user, once known, is put in the WSGI
environ under `USER_KEY`.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import ipaddress
import logging
import re
import secrets
import threading
import time
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import bcrypt

from gpubook.runtime.errors import ConfigError
from gpubook.runtime.names import user_name_problem
from gpubook.scheduler.outbox.web import lab_sign
from gpubook.scheduler.outbox.web.directory_login import REMEMBER_SECONDS, DirectoryLogin, Down
from gpubook.scheduler.outbox.web.settings import WebConfig

if TYPE_CHECKING:
    from _typeshed.wsgi import StartResponse, WSGIApplication, WSGIEnvironment

    from gpubook.scheduler.directory.settings import DirectoryConfig

log = logging.getLogger(__name__)

USER_KEY = "gpubook.user"  # the authenticated user's name in the WSGI environ (absent: nobody)
BCRYPT_PREFIXES = ("$2a$", "$2b$", "$2y$")
_REMEMBERED = 256  # credentials checked once and remembered (bcrypt costs ~0.1-0.3 s a check)
_BCRYPT = re.compile(r"\$2[aby]\$(0[4-9]|[12][0-9]|3[01])\$[./A-Za-z0-9]{53}")
_DEFAULT_COST = 5  # `htpasswd -B`'s own default cost


@dataclass(frozen=True)
class Refusal:
    status: str  # "401 Unauthorized", "403 Forbidden", "405 Method Not Allowed", "503 Service Unavailable"
    text: str
    challenge: bool = False  # send WWW-Authenticate: Basic


def read_htpasswd(path: Path) -> dict[str, bytes]:
    """`user:hash` lines, bcrypt only; ConfigError naming the line of anything else."""
    try:
        text = path.read_text()
    except OSError as error:
        raise ConfigError(f"[web] htpasswd_file {path} cannot be read: {error.strerror}") from None
    users: dict[str, bytes] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        user, colon, hashed = line.strip().partition(":")
        where = f"[web] htpasswd_file {path} line {number}"
        if not colon or not user:
            raise ConfigError(f"{where}: not a user:hash line")
        if not hashed.startswith(BCRYPT_PREFIXES):
            kind = "apr1-MD5" if hashed.startswith("$apr1$") else "SHA-1" if hashed.startswith("{SHA}") \
                else "crypt or plain text"
            raise ConfigError(f"{where} (user {user}): a {kind} entry, not bcrypt; gpubook takes bcrypt only: "
                              f"make it again with htpasswd -B")
        if _BCRYPT.fullmatch(hashed) is None:
            raise ConfigError(f"{where} (user {user}): a damaged bcrypt entry; make it again with htpasswd -B")
        users[user] = hashed.encode()
    return users


def bcrypt_cost(hashed: bytes) -> int:
    """The cost (log2 rounds) written in a bcrypt hash: `$2y$05$...` is 5."""
    return int(hashed.split(b"$")[2])


def dummy_hash(users: Mapping[str, bytes]) -> bytes:
    """A hash checked for an unknown user name, at the cost most of the file's entries have, so that
    a wrong name takes as long as a wrong password: with a fixed cost 10 against `htpasswd -B`'s 5,
    the answer's time told which names exist (issue 22, finding 16)."""
    costs = Counter(bcrypt_cost(hashed) for hashed in users.values())
    cost = costs.most_common(1)[0][0] if costs else _DEFAULT_COST
    return bcrypt.hashpw(b"not a password", bcrypt.gensalt(rounds=cost))


def _networks(texts: Iterable[str]) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]:
    return tuple(ipaddress.ip_network(text, strict=False) for text in texts)


class Access:
    """The middleware: `Access(app, web=WebConfig)`; refuses, or passes on with the user known.
    Auth "ldap" takes `directory` ([directory]) and `members`, gpubook's users now (the names a
    login may have)."""

    def __init__(self, app: WSGIApplication, *, web: WebConfig, users: Mapping[str, bytes] | None = None,
                 directory: DirectoryConfig | None = None,
                 members: Callable[[], Collection[str]] | None = None, writes: Collection[str] = ()) -> None:
        self.app = app
        self.writes = frozenset(writes)
        self.mode = web.auth
        if users is None and web.auth == "basic":
            if web.htpasswd_file is None:
                raise ConfigError('[web] auth = "basic" needs htpasswd_file (user:bcrypt lines, htpasswd -B)')
            users = read_htpasswd(web.htpasswd_file)
        self.users = dict(users or {})
        self.dummy = dummy_hash(self.users) if web.auth == "basic" else b""
        self.login: DirectoryLogin | None = None
        if web.auth == "ldap":
            self.login = DirectoryLogin(directory, members=members or (lambda: ()))
        self.header_key = "HTTP_" + web.trusted_header.upper().replace("-", "_")
        self.proxies = _networks(web.trusted_proxies)
        self.lab_secret = web.lab_secret.strip().encode() if web.lab_secret else None
        self._key = secrets.token_bytes(32)
        # A keyed digest of checked credentials → the user and until when (time.monotonic) it is believed.
        self._known: dict[bytes, tuple[str, float]] = {}
        self._lock = threading.Lock()

    def __call__(self, environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        method = environ.get("REQUEST_METHOD", "GET")
        posting = method == "POST" and environ.get("PATH_INFO") in self.writes
        if method not in ("GET", "HEAD") and not posting:
            return _refuse(Refusal("405 Method Not Allowed", "this page only shows; it changes nothing"),
                           start_response, allow="GET, HEAD")
        if posting and (self.mode == "none" or lab_sign.SIGNATURE_KEY in environ):
            return _refuse(Refusal("403 Forbidden", "only a viewer logged in to this page can book here"),
                           start_response)
        found = self.identify(environ)
        if isinstance(found, Refusal):
            return _refuse(found, start_response)
        if found is not None:
            environ[USER_KEY] = found
        return self.app(environ, start_response)

    def identify(self, environ: WSGIEnvironment) -> str | Refusal | None:
        """The user asking (None: access without a name, auth none), or why they are refused."""
        if self.lab_secret is not None and lab_sign.SIGNATURE_KEY in environ:
            return self._from_lab(environ)
        if self.mode == "header":
            return self._from_proxy(environ)
        if self.mode in ("basic", "ldap"):
            return self._from_password(environ.get("HTTP_AUTHORIZATION", ""))
        return None

    def _from_proxy(self, environ: WSGIEnvironment) -> str | Refusal:
        try:
            peer: ipaddress.IPv4Address | ipaddress.IPv6Address | None = ipaddress.ip_address(
                environ.get("REMOTE_ADDR", ""))
        except ValueError:
            peer = None
        if isinstance(peer, ipaddress.IPv6Address) and peer.ipv4_mapped is not None:
            peer = peer.ipv4_mapped  # an IPv4 proxy reaching a dual-stack listen address
        if peer is None or not any(peer in network for network in self.proxies):
            log.warning("web: refused a request from %s, which is not a trusted proxy", environ.get("REMOTE_ADDR"))
            return Refusal("403 Forbidden", "this page is reached through its reverse proxy only")
        user = environ.get(self.header_key, "").strip()
        if not user or user_name_problem(user):
            return Refusal("403 Forbidden", "the proxy named no valid user")
        return str(user)

    def _from_lab(self, environ: WSGIEnvironment) -> str | Refusal | None:
        """Another server's lab page, asking in its viewer's name."""
        assert self.lab_secret is not None
        user, why = lab_sign.verified_viewer(self.lab_secret, environ)
        if user is None:
            log.warning("web: refused a lab request from %s: %s", environ.get("REMOTE_ADDR"), why)
            return Refusal("403 Forbidden", why)
        if not user:
            return None if self.mode == "none" else Refusal(
                "403 Forbidden", f"this page has auth {self.mode}: a lab request must name its viewer")
        if user_name_problem(user):
            return Refusal("403 Forbidden", "the lab request named no valid user")
        return user

    def _from_password(self, header: str) -> str | Refusal:
        denied = Refusal("401 Unauthorized", "log in with your lab account's user name and password"
                         if self.login is not None else "log in with your gpubook page user name and password",
                         challenge=True)
        scheme, _, encoded = header.partition(" ")
        if scheme.lower() != "basic":
            return denied
        try:
            user, colon, password = base64.b64decode(encoded.strip(), validate=True).decode().partition(":")
        except (binascii.Error, UnicodeDecodeError):
            return denied
        if not colon:
            return denied
        digest = hmac.new(self._key, f"{user}\0{password}".encode(), hashlib.sha256).digest()
        with self._lock:
            known = self._known.get(digest)
        remembered = known is not None and known[0] == user and (self.login is None or user in self.login.members())
        if remembered and known is not None and time.monotonic() < known[1]:
            return user
        if self.login is not None:
            checked = self.login.check(user, password)
            if isinstance(checked, Down):
                if remembered:  # accepted by the directory before, and it cannot say otherwise now
                    return user
                return Refusal("503 Service Unavailable", "the lab's directory, which checks this page's passwords, "
                               "does not answer; try again in a few minutes")
            until = time.monotonic() + REMEMBER_SECONDS
        else:
            hashed = self.users.get(user)
            # The dummy check makes an unknown user cost what a known one does (no user-name oracle).
            checked = bcrypt.checkpw(password.encode(), hashed or self.dummy) and hashed is not None
            until = float("inf")
        if not checked:
            log.warning("web: a wrong user name or password for %r", user[:64])
            return denied
        with self._lock:
            if len(self._known) >= _REMEMBERED:
                self._known.clear()
            self._known[digest] = (user, until)
        return user


def _refuse(refusal: Refusal, start_response: StartResponse, *, allow: str | None = None) -> list[bytes]:
    body = (refusal.text + "\n").encode()
    headers = [("Content-Type", "text/plain; charset=utf-8"), ("Content-Length", str(len(body))),
               ("Cache-Control", "no-store")]
    if refusal.challenge:
        headers.append(("WWW-Authenticate", 'Basic realm="gpubook", charset="UTF-8"'))
    if allow:
        headers.append(("Allow", allow))
    start_response(refusal.status, headers)
    return [body]
