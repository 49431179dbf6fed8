"""[sftp]: the always-on SFTP data service's settings, declared beside it (hosts/sftp.py)."""

from __future__ import annotations

from dataclasses import dataclass

from gpubook.scheduler.settings import Section, checks, setting


@dataclass(frozen=True)
class SftpConfig:
    """[sftp]: the always-on SFTP data service (needs [storage] data_root)."""

    enabled: bool = setting(False, "run the SFTP service: each user's input/, output/ (and home/) at any time")
    port: int = setting(2222, "host port of the SFTP service (bookings never get it)", check=checks.port)
    listen: str = setting("0.0.0.0", "host address the port is published on", check=checks.address)  # noqa: S104
    network: str = setting("host", '"host": sshd binds listen:port on the host\'s network (no user runs code '
                           'there: no shell, no forwarding); "private": its own namespace, the port published '
                           '(slower for many small files, see BENCHMARKS.md)', check=checks.one_of(("host", "private")))
    template: str = setting("debian-ssh", "template whose image runs the service (it needs OpenSSH's sshd "
                            "and pkill)", check=checks.template_name)
    check_seconds: float = setting(5.0, "seconds between checks of the service and of the quotas",
                                   check=checks.positive)
    measure_seconds: float = setting(20.0, "the longest one user's folder is walked to measure it; a walk that "
                                     "cannot finish counts as over quota (uploads refused until they delete)",
                                     check=checks.positive)


SECTION = Section("sftp", SftpConfig, "the SFTP data service: each user's folders at any time (needs [storage] "
                  "data_root)")
