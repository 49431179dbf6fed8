"""JupyterLab in a booking (templates with `jupyter = true`): where it listens and whether it runs.

The entrypoint (overlay/entrypoint.sh) starts the image's `jupyter-lab` as the booker, beside sshd,
bound to a unix socket in a folder only the booker may enter, never to a TCP port: on the host
network a container's loopback is the host's, so 127.0.0.1:8888 would be open to every host user
and every other booking. A socket file inside the container's own file system is reachable by
nobody outside it; the booker reaches it through their SSH login (`ssh -L 8888:SOCKET`, OpenSSH's
stream-local forwarding, which sshd does as the logged-in user). The token is made inside the
container, handed to JupyterLab in its environment (never its argv, which `ps` shows every host
user), and kept in a file mode 600 of the booker's; it is not written into the calendar, which the
whole lab reads.

Before sshd starts, the entrypoint writes whether the image has JupyterLab at all into
`STATE_FILE`; the host reads it once SSH answers (`availability`), so that the event says
"not available in this image" instead of the booking failing.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpubook.runtime.engines import Engine
from gpubook.runtime.errors import EngineError

FOLDER = "/run/gpubook/jupyter"  # the booker's, mode 700
SOCKET = f"{FOLDER}/socket"  # JupyterLab's unix socket, mode 600
URL_FILE = f"{FOLDER}/url"  # http://127.0.0.1:8888/lab?token=..., mode 600, the booker's
STATE_FILE = "/run/gpubook/jupyter-state"  # "starting", or why it cannot start (root's, 644)
LOCAL_PORT = 8888  # the port the booker's `ssh -L` opens on their own machine
ENV = "GPUBOOK_JUPYTER"  # set to "1" for a template with jupyter = true
NOT_AVAILABLE = "not available in this image"


@dataclass(frozen=True)
class Availability:
    """Whether a booking's JupyterLab was started, and if not, why (one sentence)."""

    started: bool
    reason: str = ""


def availability(engine: Engine, name: str, *, timeout: float = 10.0) -> Availability:
    """Read what the entrypoint decided before sshd ran (so it is there once SSH answers)."""
    try:
        done = engine.exec(name, ["cat", STATE_FILE], timeout=timeout)
    except EngineError as error:
        return Availability(False, f"its state could not be read ({str(error).splitlines()[0]})")
    said = done.stdout.strip()
    if done.returncode != 0 or not said:
        return Availability(False, "the entrypoint did not say whether it started")
    if said == "starting":
        return Availability(True)
    return Availability(False, " ".join(said.split())[:200])


def forward_line(*, port: int, user: str, host: str) -> str:
    """The booker's command: their local port LOCAL_PORT to the booking's socket, over SSH."""
    return f"ssh -N -L {LOCAL_PORT}:{SOCKET} -p {port} {user}@{host}"


def url_hint(*, port: int, user: str, host: str) -> str:
    """Where the booker finds the URL with its token: a file only they can read, after login."""
    return f"open what `ssh -p {port} {user}@{host} cat {URL_FILE}` prints (the token is not in the calendar)"
