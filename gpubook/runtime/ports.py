"""Whether a TCP port can be bound here, asked the way sshd binds it."""

from __future__ import annotations

import ipaddress
import socket


def bind_error(address: str, port: int) -> int | None:
    """The errno of a bind of `port` on `address` as sshd makes it (SO_REUSEADDR: a TIME_WAIT left
    over is no owner; IPv6 only on "::"), None when it works or the host lacks that family (then
    nobody can squat it either)."""
    family = socket.AF_INET6 if ipaddress.ip_address(address).version == 6 else socket.AF_INET
    try:
        probe = socket.socket(family, socket.SOCK_STREAM)
    except OSError:
        return None
    with probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        try:
            probe.bind((address, port))
        except OSError as error:
            return error.errno
    return None
