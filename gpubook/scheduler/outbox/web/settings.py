"""[web]: the read-only status page's settings, declared beside the page (no Flask imported here)."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from gpubook.scheduler.settings import Check, Section, checks, setting

WEB_AUTH = ("none", "basic", "header", "ldap")


def _listen_problem(value: str) -> str | None:
    host, _, port = value.rpartition(":")
    if not port.isdigit() or int(port) > 65535 or checks.address_problem(host.strip("[]")):
        return 'must be ADDRESS:PORT, such as "127.0.0.1:8380" or "[::1]:8380"'
    return None


def _network_problem(value: str) -> str | None:
    try:
        ipaddress.ip_network(value, strict=False)
    except ValueError:
        return f"{value!r} is not an IP address or network (such as 10.0.0.5 or 10.0.0.0/24)"
    return None


@dataclass(frozen=True)
class WebConfig:
    """[web]: the read-only status page (gpubook/scheduler/outbox/web), served by the daemon or `gpubook web`."""

    enabled: bool = setting(False, "the daemon serves the page (`gpubook web` serves it on its own either way)")
    listen: str = setting("127.0.0.1:8380", "ADDRESS:PORT the page is served on (port 0: any free "
                          "one, logged); with auth none only a loopback address",
                          check=Check("ADDRESS:PORT", _listen_problem))
    # Not "none" by default: every local account can reach a loopback port (issue 22, finding 10).
    auth: str = setting("basic", '"basic" (HTTP basic auth against htpasswd_file, bcrypt entries), "ldap" (HTTP '
                        "basic auth checked by a bind as that user to the lab's directory: [directory] source "
                        '"ldap", gpubook\'s users only), "header" (a reverse proxy\'s trusted_header, from '
                        'trusted_proxies only) or "none" (every local account sees every booking; loopback only, '
                        "and only when written here)", check=checks.one_of(WEB_AUTH))
    htpasswd_file: Path | None = setting(None, "user:bcrypt-hash lines (htpasswd -B) for auth basic, mode 0600",
                                         private=True, sample="htpasswd")
    trusted_header: str = setting("X-Forwarded-User", "the header naming the logged-in user, set by the proxy",
                                  check=checks.matches(r"[A-Za-z0-9-]{1,64}", "a header name (letters, digits, -)",
                                                       "must be a header name (letters, digits, -)"))
    trusted_proxies: tuple[str, ...] = setting((), "addresses or networks of the reverse proxies whose "
                                               "trusted_header is believed; none by default: auth header needs "
                                               "them written (a loopback one lets every local account name "
                                               "itself anyone)", check=Check("each an IP address or network",
                                                                             _network_problem))
    metrics: bool = setting(True, "serve /metrics (Prometheus) beside the page, under the same access rules")
    lab: tuple[str, ...] = setting((), "the page addresses of the lab's other servers (such as "
                                   '"https://gpu2.lab:8443"); this page then serves /lab, one read-only view '
                                   "merging their /api/status with its own, and /lab/usage, the lab's month; "
                                   "plain http only to a loopback address", check=Check(
                                       "each an http:// or https:// URL, http only on a loopback address",
                                       lambda url: checks.http_url.problem(url) or _lab_url_problem(url)))
    lab_secret: str | None = setting(None, "read from lab_secret_file (mode 0600): one secret shared by the lab's "
                                     "servers; a page that knows it asks the others in its viewer's name, and a "
                                     "request signed with it is believed to name its viewer (auth basic or "
                                     "header); the secret itself never travels",
                                     key="lab_secret_file", secret=True, sample="lab-secret")


def _lab_url_problem(url: str) -> str | None:
    """Plain http only to a loopback address written as one: the viewer's name and what the other
    page answers (their ssh lines) travel with each request. Not `localhost`: Debian resolves it to
    ::1 first, where any account may listen while the peer listens on 127.0.0.1 (round 3, M2)."""
    parts = urlsplit(url)
    if parts.username is not None or parts.password is not None:
        return "must not carry a user or password (the lab's servers authenticate with lab_secret_file)"
    if parts.scheme == "http" and not _loopback(parts.hostname or ""):
        hint = " (write 127.0.0.1 or [::1], as the page listens, not localhost)" \
            if parts.hostname == "localhost" else ""
        return ("must be https:// (plain http only to a loopback address)" + hint + ": the viewer's name and "
                "their ssh lines go with each request")
    return None


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def web_problem(web: WebConfig) -> str | None:
    """Why the page must not start with these settings (None: it may)."""
    if web.lab and web.auth != "none" and not web.lab_secret:
        return (f'[web] lab names other servers, and [web] auth = "{web.auth}" needs lab_secret_file (the same '
                "secret on every server of the lab) to ask them in the viewer's name")
    if web.lab_secret is not None and len(web.lab_secret.strip()) < 16:
        return "[web] lab_secret_file holds fewer than 16 characters: make a longer secret (openssl rand -hex 32)"
    host = web.listen.rpartition(":")[0].strip("[]")
    if web.auth == "none" and not ipaddress.ip_address(host).is_loopback:
        return (f'[web] listen = "{web.listen}" is not a loopback address, and [web] auth = "none" would show '
                f'every booking to anyone who reaches it: set auth = "basic" or "header", or listen on 127.0.0.1')
    if web.auth == "basic" and web.htpasswd_file is None:
        return ('[web] auth = "basic" (the default) needs htpasswd_file (user:bcrypt lines, made with htpasswd -B); '
                'auth = "none" shows every booking to every local account and must be written out')
    if web.auth == "header" and not web.trusted_proxies:
        return ('[web] auth = "header" needs trusted_proxies: the address of the reverse proxy that sets '
                f'{web.trusted_header} (nobody else may set it)')
    return None


SECTION = Section("web", WebConfig, "the read-only status page and /metrics",
                  refusal=lambda web: web_problem(web) if web.enabled else None)
