"""Reading the lab's users from an LDAP directory (issue 38): USERS posixAccount entries, each with a
mail, an alias and an SSH key, members of the booking group, loaded into a private slapd
(tests/kits/ldap_kit.py, LDAPS with its own CA), then read the way the daemon reads them
(`scheduler.directory.fetch` + the merge into [users]). Prints figures, asserts nothing.

    PYTHONPATH=. python bench/ldap_users.py [USERS]

Wall and CPU time of the read (best of 3, each a new connection) and the peak of Python memory
allocated during one read (tracemalloc), and the process's maximum resident size after it.
"""

from __future__ import annotations

import os
import platform
import resource
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpubook.scheduler import config, directory  # noqa: E402
from tests.kits import ldap_kit  # noqa: E402

KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIB6v3b9c0p7s5xXl0bN3cYk2s9mJ0b2cZc8n8kq0tq0Q u@laptop"


def main() -> None:
    count = int(sys.argv[1]) if len(sys.argv) > 1 else 1000
    folder = Path(tempfile.mkdtemp(prefix="gpubook-bench-ldap-"))
    server = ldap_kit.make(folder / "slapd")
    try:
        names = tuple(f"user{i:04d}" for i in range(count))
        ldif = "\n".join(ldap_kit.person(name, 10000 + i, mails=(f"{name}@lab.example", f"{name}.alias@lab.example"),
                                         keys=(KEY,)) for i, name in enumerate(names))
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
        best_wall = best_cpu = float("inf")
        users = 0
        for _ in range(3):
            wall, cpu = time.perf_counter(), time.process_time()
            merged = directory.with_users(base, directory.fetch(base))
            best_wall = min(best_wall, time.perf_counter() - wall)
            best_cpu = min(best_cpu, time.process_time() - cpu)
            users = len(merged.users)
        tracemalloc.start()
        directory.with_users(base, directory.fetch(base))
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(f"machine: {platform.node()} ({os.cpu_count()} cores), Python {platform.python_version()}")
        print(f"{count} directory entries with keys, {users} users merged")
        print(f"read and merge: {best_wall * 1000:.0f} ms wall, {best_cpu * 1000:.0f} ms CPU (best of 3)")
        print(f"Python memory allocated at the peak of one read: {peak / 2**20:.1f} MiB; max RSS {rss:.0f} MiB")
    finally:
        ldap_kit.remove(server)


if __name__ == "__main__":
    main()
