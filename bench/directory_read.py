"""Reading the lab's users from an LDAP directory (issue 38): USERS posixAccount entries, each with a
mail, an alias, an SSH key and a password, members of the one booking group, loaded into a private
slapd (tests/kits/ldap_kit.py, LDAPS with its own CA), then read through gpubook's ldap source
(`scheduler.directory.ldap.read`), and read and merged into [users] the way the daemon does
(`scheduler.directory.fetch` + `with_users`); last, the status page's login of one user by an LDAP
bind (auth "ldap": a search with gpubook's bind, then a bind as the user). Prints figures, asserts
nothing.

    PYTHONPATH=. python bench/directory_read.py [USERS] [RUNS]

Each figure is the median of RUNS runs (5 by default), each on a new connection: wall and CPU time of
this process (slapd's own CPU is not counted). Memory: the peak of Python memory allocated during one
read (tracemalloc, measured on a run of its own), and how much the process's maximum resident size
grew over the reads (ru_maxrss after the reads less before them, ldap3 imported before).
"""

from __future__ import annotations

import os
import platform
import resource
import statistics
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpubook.scheduler import config, directory  # noqa: E402
from gpubook.scheduler.directory import ldap  # noqa: E402
from tests.kits import ldap_kit  # noqa: E402

KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIB6v3b9c0p7s5xXl0bN3cYk2s9mJ0b2cZc8n8kq0tq0Q u@laptop"


def timed(run: Callable[[], object], runs: int) -> tuple[float, float]:
    """The median wall and CPU seconds of `runs` calls of `run`."""
    walls, cpus = [], []
    for _ in range(runs):
        wall, cpu = time.perf_counter(), time.process_time()
        run()
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    return statistics.median(walls), statistics.median(cpus)


def main() -> None:
    count = int(sys.argv[1]) if len(sys.argv) > 1 else 1000
    runs = int(sys.argv[2]) if len(sys.argv) > 2 else 5
    folder = Path(tempfile.mkdtemp(prefix="gpubook-bench-ldap-"))
    server = ldap_kit.make(folder / "slapd")
    try:
        names = tuple(f"user{i:04d}" for i in range(count))
        ldif = "\n".join(ldap_kit.person(name, 10000 + i, mails=(f"{name}@lab.example", f"{name}.alias@lab.example"),
                                         keys=(KEY,), password=f"{name}-pw") for i, name in enumerate(names))
        server.add(ldif + "\n" + ldap_kit.posix_group(names))
        password = server.password_file(folder)
        path = folder / "gpubook.toml"
        path.write_text(f"""[[calendar]]
url = "http://127.0.0.1:5232/lab/devbox1/"
[daemon]
state_dir = "{folder / 'state'}"
[directory]
source = "ldap"
url = "{server.ldaps_url}"
ca_file = "{server.ca_file}"
bind_dn = "{ldap_kit.ADMIN}"
password_file = "{password}"
base = "{ldap_kit.BASE}"
group = "{ldap_kit.GROUP}"
""")
        base = config.load(path, directory="none")
        settings = base.directory
        assert settings is not None
        import ldap3  # noqa: F401 - imported before the resident size is taken: only the reads count

        rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        entries = len(ldap.read(settings))
        read_wall, read_cpu = timed(lambda: ldap.read(settings), runs)
        merged = directory.with_users(base, directory.fetch(base))
        merge_wall, merge_cpu = timed(lambda: directory.with_users(base, directory.fetch(base)), runs)
        login_wall, login_cpu = timed(lambda: ldap.password_matches(settings, names[-1], f"{names[-1]}-pw"), runs)
        rss_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        tracemalloc.start()
        ldap.read(settings)
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        print(f"machine: {platform.node()} ({os.cpu_count()} cores), Python {platform.python_version()}")
        print(f"{count} directory entries with keys; {entries} read, {len(merged.users)} users merged")
        print(f"read through the ldap source: {read_wall * 1000:.0f} ms wall, {read_cpu * 1000:.0f} ms CPU "
              f"(median of {runs})")
        print(f"read, checked and merged as the daemon does: {merge_wall * 1000:.0f} ms wall, "
              f"{merge_cpu * 1000:.0f} ms CPU (median of {runs})")
        print(f"one page login by LDAP bind (search + bind as the user): {login_wall * 1000:.1f} ms wall, "
              f"{login_cpu * 1000:.1f} ms CPU (median of {runs})")
        print(f"Python memory allocated at the peak of one read: {peak / 2**20:.1f} MiB; max RSS grew "
              f"{(rss_after - rss_before) / 1024:.1f} MiB over the reads, to {rss_after / 1024:.0f} MiB")
    finally:
        ldap_kit.remove(server)


if __name__ == "__main__":
    main()
