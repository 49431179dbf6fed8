"""Small real servers for the notices: an SMTP server (just enough of RFC 5321 for smtplib) and an
HTTP server taking webhook POSTs; each keeps what it received (tests/plugins/notify.py serves them
as fixtures)."""

from __future__ import annotations

import json
import socketserver
from http.server import BaseHTTPRequestHandler


class SmtpHandler(socketserver.StreamRequestHandler):
    """Just enough SMTP (RFC 5321) for smtplib: EHLO, MAIL, RCPT, DATA, RSET, NOOP, QUIT."""

    def handle(self) -> None:
        self.wfile.write(b"220 test ESMTP\r\n")
        envelope: dict[str, object] = {"to": []}
        while line := self.rfile.readline():
            verb = line[:4].upper()
            if verb == b"EHLO":
                self.wfile.write(b"250-test\r\n250 8BITMIME\r\n")
            elif verb == b"MAIL":
                envelope["from"] = line.decode().split(":", 1)[1].strip()
                self.wfile.write(b"250 ok\r\n")
            elif verb == b"RCPT":
                envelope["to"].append(line.decode().split(":", 1)[1].strip())  # type: ignore[union-attr]
                self.wfile.write(b"250 ok\r\n")
            elif verb == b"DATA":
                self.wfile.write(b"354 go on\r\n")
                data = b""
                while (chunk := self.rfile.readline()) not in (b".\r\n", b""):
                    data += chunk[1:] if chunk.startswith(b"..") else chunk
                envelope["data"] = data
                self.server.received.append(dict(envelope))  # type: ignore[attr-defined]
                self.wfile.write(b"250 queued\r\n")
            elif verb == b"QUIT":
                self.wfile.write(b"221 bye\r\n")
                return
            else:
                self.wfile.write(b"250 ok\r\n")



class HookHandler(BaseHTTPRequestHandler):
    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.server.received.append((dict(self.headers), json.loads(body)))  # type: ignore[attr-defined]
        self.send_response(self.server.answer)  # type: ignore[attr-defined]
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass
