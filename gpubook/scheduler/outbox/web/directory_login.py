"""The page's auth "ldap": HTTP basic auth checked against the lab's directory ([directory] source =
"ldap"), so the viewer is the same user the bookings name.

A name is asked of the directory only when it is one of gpubook's users (`login_names`: the booking
group's members and the [users.NAME] tables, as the daemon last read them; not a member who has left
the group, kept as departed only so that their running booking ends on time): the page is no oracle
for the password of any other directory account (an administrator's), and a name that is nobody never
reaches an LDAP filter. The directory then finds that user's entry with gpubook's own bind, and a second connection
binds as that entry with the given password (directory/ldap.py): gpubook's own credentials only ever
find the entry, they never vouch for the user. An empty password is refused before any bind.

Every refusal of a name or password is the same 401 with the same sentence (no user enumeration).
After `TRIES` refused logins of one name within `TRIES_WINDOW`, that name is refused without asking
the directory until the window has passed (the directory password is the user's password everywhere;
guessing it here stays slow, and the directory's own lockout is not driven by the page). A directory
that does not answer is once logged, and `Down` (access.py: a 503, unless it accepted that login
before); the page goes on serving. access.py remembers a login the directory accepted for
`REMEMBER_SECONDS` (the page asks every few seconds): a changed password ends it within that time, a
user gone from the group at once (on the daemon's next read of the directory).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gpubook.runtime.errors import ConfigError
from gpubook.runtime.names import user_name_problem
from gpubook.scheduler.directory import ldap
from gpubook.scheduler.directory.errors import DirectoryError
from gpubook.scheduler.directory.settings import DirectoryConfig

if TYPE_CHECKING:
    from gpubook.scheduler.settings import Config

log = logging.getLogger(__name__)

TRIES = 5  # refused logins of one name within TRIES_WINDOW before the name is refused unasked
TRIES_WINDOW = 60.0  # seconds
REMEMBER_SECONDS = 300.0  # how long a login the directory accepted is believed without asking again
_NAMES_KEPT = 4096  # names whose refusals are counted at once (more: the oldest counts are dropped)


def login_names(config: Config) -> frozenset[str]:
    """The names that may log in: gpubook's users, less the departed (no longer in the group)."""
    return frozenset(config.users) - frozenset(config.departed_users)


@dataclass(frozen=True)
class Down:
    """The directory did not answer: the login is neither accepted nor refused."""

    why: str


class DirectoryLogin:
    """`check(name, password)`: True, False (refused), or Down."""

    def __init__(self, directory: DirectoryConfig | None, *, members: Callable[[], Collection[str]],
                 verify: Callable[[DirectoryConfig, str, str], bool] = ldap.password_matches,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if directory is None or directory.source != "ldap":
            source = directory.source if directory is not None else "file"
            raise ConfigError(f'[web] auth = "ldap" checks the page\'s passwords by a bind to the lab\'s directory: '
                              f'it needs [directory] source = "ldap" (this config has source = "{source}")')
        self.directory = directory
        self.members = members
        self.verify = verify
        self.clock = clock
        self._refused: dict[str, deque[float]] = {}
        self._lock = threading.Lock()
        self._down = False

    def check(self, name: str, password: str) -> bool | Down:
        if self._throttled(name):
            log.warning("web: login of %r refused unasked: %d wrong tries within %.0f s", name[:64], TRIES,
                        TRIES_WINDOW)
            return False
        if not password or user_name_problem(name) or name not in self.members():
            self._count(name)
            return False
        try:
            accepted = self.verify(self.directory, name, password)
        except DirectoryError as error:
            if not self._down:
                log.error("web: the directory that checks the page's passwords does not answer: %s", error)
            self._down = True
            return Down(str(error))
        if self._down:
            log.warning("web: the directory that checks the page's passwords answers again")
            self._down = False
        if not accepted:
            self._count(name)
        return accepted

    def _throttled(self, name: str) -> bool:
        with self._lock:
            times = self._refused.get(name[:64])
            if times is None:
                return False
            while times and times[0] <= self.clock() - TRIES_WINDOW:
                times.popleft()
            return len(times) >= TRIES

    def _count(self, name: str) -> None:
        with self._lock:
            key = name[:64]  # a name is at most 32 characters; a longer one is counted by its start
            if key not in self._refused and len(self._refused) >= _NAMES_KEPT:
                del self._refused[next(iter(self._refused))]
            self._refused.setdefault(key, deque(maxlen=TRIES)).append(self.clock())
