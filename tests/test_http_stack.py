"""One HTTP stack in the daemon: caldav's niquests (over urllib3-future) carries gpubook's own HTTP too.

caldav (>= 2) needs niquests, whose urllib3-future takes over the `urllib3` package folder when
requests' urllib3 is installed beside it; requests would then run on a fork it was never tested with.
gpubook's ICS feed, webhook and embedded Radicale probe use niquests, so no part of the daemon runs
on requests. These tests hold that, and check what the feed relies on from niquests against real
local servers: TLS verification, redirects, and (in tests/test_sources_ics.py) timeouts and a
streamed download stopped at its size cap.
"""

from __future__ import annotations

import datetime
import ipaddress
import ssl
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import caldav
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from gpubook.scheduler.outbox.notices import Message, NotifyError, WebhookSettings, post_webhook
from gpubook.scheduler.sources.errors import CalendarError
from gpubook.scheduler.sources.ics_feed import IcsFeedSource
from tests.kits import servers
from tests.kits.booking_kit import FEED

ROOT = Path(__file__).resolve().parent.parent

# Everything the daemon's pass touches over HTTP: the sources, the write-back, the notices.
DAEMON_HTTP_MODULES = ("gpubook.scheduler.daemon", "gpubook.scheduler.sources.ics_feed",
                       "gpubook.scheduler.sources.caldav_source", "gpubook.scheduler.sources.caldav_writer",
                       "gpubook.scheduler.outbox.notices", "gpubook.scheduler.commands.embedded")


@pytest.mark.slow  # a second or more: out of the fast lane
def test_the_daemon_never_imports_requests() -> None:
    code = ("import importlib, sys\n"
            f"for name in {DAEMON_HTTP_MODULES!r}: importlib.import_module(name)\n"
            "print('requests' in sys.modules, 'niquests' in sys.modules)")
    shown = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert shown.stdout.split() == ["False", "True"], shown.stderr


def _self_signed(folder: Path) -> tuple[Path, Path]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    certificate = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
                   .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(hours=1))
                   .not_valid_after(now + datetime.timedelta(days=1))
                   .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                                  critical=False)
                   .sign(key, hashes.SHA256()))
    cert_path, key_path = folder / "cert.pem", folder / "key.pem"
    cert_path.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


class TlsFeedServer(servers.FeedServer):
    """The feed server behind TLS with a certificate no trust store knows."""

    def __init__(self, folder: Path) -> None:
        super().__init__()
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(*_self_signed(folder))
        self._server.socket = context.wrap_socket(self._server.socket, server_side=True)

    @property
    def base_url(self) -> str:
        return super().base_url.replace("http://", "https://")


@pytest.fixture
def tls_server(tmp_path: Path) -> Iterator[TlsFeedServer]:
    server = TlsFeedServer(tmp_path).start()
    server.replies["/lab.ics"] = servers.Reply(body=FEED.encode(), headers={"Content-Type": "text/calendar"})
    yield server
    server.stop()


def test_an_untrusted_certificate_is_refused_by_the_feed(tls_server: TlsFeedServer) -> None:
    with pytest.raises(CalendarError, match="TLS failed"):
        IcsFeedSource(tls_server.base_url + "/lab.ics", timeout=5).poll()
    assert tls_server.requests == []  # nothing was sent over the unverified connection


def test_an_untrusted_certificate_is_refused_by_caldav_and_the_webhook(tls_server: TlsFeedServer) -> None:
    client = caldav.DAVClient(url=tls_server.base_url + "/dav/", timeout=5)  # type: ignore[operator]
    with pytest.raises(Exception) as caught:  # noqa: PT011 - caldav wraps it in its own classes
        client.principal()
    assert "certificate" in str(caught.value).lower() or "ssl" in type(caught.value).__name__.lower()
    message = Message(booking_id="b1", user="alice", subject="s", text="t", kind="ended")
    with pytest.raises(NotifyError, match="webhook"):
        post_webhook(WebhookSettings(url=tls_server.base_url + "/hook", timeout=5), message)
    assert tls_server.requests == []


def test_the_feed_follows_a_redirect_to_its_new_place(feed_server: servers.FeedServer) -> None:
    feed_server.replies["/old.ics"] = servers.Reply(status=301, headers={"Location": "/new.ics"})
    feed_server.replies["/new.ics"] = servers.Reply(body=FEED.encode(), headers={"Content-Type": "text/calendar"})
    url = feed_server.base_url + "/old.ics"
    snapshot = IcsFeedSource(url, timeout=5).poll()
    assert set(snapshot.objects) == {url + "#weekly@lab", url + "#floating@lab"}
    assert [path for _, path, _ in feed_server.requests] == ["/old.ics", "/new.ics"]
    assert snapshot.stats.requests == 2


class PostServer(servers.FeedServer):
    """The feed server answering POST too (a webhook receiver)."""

    def _handler(self):  # type: ignore[no-untyped-def]
        handler = super()._handler()
        handler.do_POST = handler._answer  # type: ignore[attr-defined]
        return handler


def test_the_webhook_does_not_follow_a_redirect() -> None:
    feed_server = PostServer().start()
    feed_server.replies["/hook"] = servers.Reply(status=302, headers={"Location": "/elsewhere"})
    message = Message(booking_id="b1", user="alice", subject="s", text="t", kind="ended")
    with pytest.raises(NotifyError, match="answered 302"):
        post_webhook(WebhookSettings(url=feed_server.base_url + "/hook", timeout=5), message)
    feed_server.stop()
    assert [(method, path) for method, path, _ in feed_server.requests] == [("POST", "/hook")]
