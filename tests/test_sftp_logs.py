"""What the SFTP service's start check reads in sshd's log (the fast lane; the real service's check
is in tests/test_sftp_service.py)."""

from __future__ import annotations

from gpubook.runtime.data.sftp import bind_failures


def test_sftp_bind_failures_are_sshds_own_lines() -> None:
    """Round 3, L1: a client's user name is logged ("Invalid user NAME from …"); a name that is sshd's
    bind failure must not pass for one, on any address, with or without the final period."""
    log = ("Server listening on 0.0.0.0 port 2222.\n"
           "Invalid user Bind to port 2222 on :: failed: Address already in use from 10.0.0.66 port 4444\n"
           "Connection closed by invalid user Bind to port 2222 on 0.0.0.0 failed: Address already in use "
           "10.0.0.66 port 4444 [preauth]\n")
    assert bind_failures(log, 2222) == []
    real = "Bind to port 2222 on :: failed: Address already in use.\r\nServer listening on 0.0.0.0 port 2222.\n"
    assert bind_failures(real, 2222) == ["::"]
    assert bind_failures(real, 2223) == []
