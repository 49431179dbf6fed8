"""The CLI engines' transport: running the engine's binary (argv lists only, never a shell), with a
deadline and bounded output, and its failures as one-line EngineErrors; containers read back from
`inspect`'s JSON. `CliTransport` is the base the argv and image phases build on (cli_argv.py,
cli_images.py); `CliEngine` (cli_engine.py) puts them together.
"""

from __future__ import annotations

import builtins
import json
import logging
import os
import re
import selectors
import shutil
import subprocess
import time
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any, ClassVar

from gpubook.runtime.checks import Check
from gpubook.runtime.engines.spec import ContainerInfo, info_from_labels, permanent
from gpubook.runtime.errors import EngineError

if TYPE_CHECKING:
    from gpubook.runtime.engines import EngineOptions, EngineSettings

log = logging.getLogger(__name__)

QUICK_TIMEOUT = 60.0  # seconds for commands that should answer at once
EXEC_OUTPUT_LIMIT = 64 * 1024  # bytes of an exec's stdout and of its stderr kept; the rest is read and dropped


class CliTransport:
    """One engine binary and the settings every phase reads; how it is run and how it fails."""

    name: ClassVar[str]
    package: ClassVar[str]  # the Debian package that installs the binary, for doctor's fix

    def __init__(self, settings: EngineSettings, options: EngineOptions) -> None:
        self.settings = settings
        self.binary = settings.binary or self.name
        self.network = settings.network
        self.ulimits = tuple(settings.ulimits)
        self.pids_limit = settings.pids_limit
        self.memory = settings.memory
        self.global_args = tuple(options.global_args)
        self.host_memory = options.host_memory
        self.host_gpus = options.host_gpus

    def global_argv(self) -> builtins.list[str]:
        return [self.binary, *self.global_args]


    def binary_check(self) -> Check:
        path = shutil.which(self.binary)
        if path is None:
            return Check(
                "engine",
                False,
                f"{self.binary} is not installed or not on PATH",
                f"install it (apt-get install {self.package}) or set [engine] binary",
            )
        try:
            done = subprocess.run(
                [path, "--version"], capture_output=True, text=True, timeout=30, check=False
            )
        except (OSError, subprocess.TimeoutExpired) as error:
            return Check("engine", False, f"{path} --version failed: {error}", f"check that {path} runs")
        if done.returncode != 0:
            return Check(
                "engine", False, f"{path} --version: {done.stderr.strip()[:200]}", f"check that {path} runs"
            )
        return Check("engine", True, done.stdout.strip())


    def _inspect_raw(
        self, names: Sequence[str], *, missing_ok: bool = False
    ) -> builtins.list[dict[str, Any]]:
        done = self._process(["container", "inspect", *names], timeout=QUICK_TIMEOUT)
        if done.returncode != 0:
            if missing_ok and _is_missing(done.stderr):
                return []
            raise EngineError(f"{self.name} inspect: {message_of(done)}")
        try:
            return list(json.loads(done.stdout or "[]"))
        except ValueError as error:
            raise EngineError(f"{self.name} inspect gave unreadable JSON: {error}") from None

    def _remove(self, name: str) -> None:
        """`rm --force`; one that fails leaves the (stopped) container to the next pass's clearing of
        dead leftovers, and says why in the log."""
        done = self._process(["rm", "--force", name], timeout=QUICK_TIMEOUT)
        if done.returncode != 0 and not _is_missing(done.stderr):
            log.warning("%s rm %s failed (the next pass clears it): %s", self.name, name, message_of(done))

    def _info(self, raw: dict[str, Any]) -> ContainerInfo:
        config = raw.get("Config") or {}
        image = config.get("Image") or raw.get("ImageName") or raw.get("Image") or ""
        return info_from_labels(
            name=raw.get("Name", ""),
            id=raw.get("Id", ""),
            state=(raw.get("State") or {}).get("Status", "unknown"),
            image=image,
            labels=labels_of(raw),
            pid=int((raw.get("State") or {}).get("Pid") or 0),
        )

    def command_lock(self, *, exclusive: bool = False, timeout: float = QUICK_TIMEOUT) -> AbstractContextManager[None]:
        """Held around each engine command: nothing here (podman's: podman.PodmanEngine.command_lock)."""
        return nullcontext()

    def first_use(self, image: str, kind: str) -> bool:
        """Whether a container of `image` with the id map of `kind` ("booking", "service") may be the
        first, which makes the image's chowned copy: such a start runs alone (command_lock). Never here."""
        return False

    def used(self, image: str, kind: str) -> None:
        """A container of `image` with the id map of `kind` was made (first_use)."""

    def unused(self, image: str) -> None:
        """The name `image` is (or may be) another image now: pulled, built, tagged or removed."""

    def _process(self, args: Sequence[str], *, timeout: float, env: Mapping[str, str] | None = None,
                 exclusive: bool = False) -> subprocess.CompletedProcess[str]:
        argv = [*self.global_argv(), *args]
        try:
            with self.command_lock(exclusive=exclusive, timeout=timeout):
                return subprocess.run(
                    argv,
                    capture_output=True,
                    text=True,
                    timeout=timeout,
                    stdin=subprocess.DEVNULL,
                    check=False,
                    env=env,
                )
        except FileNotFoundError:
            raise permanent(f"{self.name}: {self.binary} is not installed or not on PATH") from None
        except subprocess.TimeoutExpired:
            raise EngineError(f"{self.name} {args[0]}: no answer within {timeout:.0f} s") from None

    def _bounded(self, args: Sequence[str], *, timeout: float, limit: int = EXEC_OUTPUT_LIMIT,
                 keep_end: bool = False) -> tuple[int, str, str]:
        """Run the engine with a deadline, keeping at most `limit` bytes of stdout and of stderr
        (the first ones, or the last with `keep_end`)."""
        with self.command_lock(timeout=timeout):
            return run_bounded([*self.global_argv(), *args], timeout=timeout, limit=limit, keep_end=keep_end,
                               what=f"{self.name} {args[0]}",
                               missing=f"{self.name}: {self.binary} is not installed or not on PATH")

    def _call(
        self, args: Sequence[str], *, timeout: float = QUICK_TIMEOUT, missing_ok: bool = False,
        exclusive: bool = False,
    ) -> str:
        done = self._process(args, timeout=timeout, exclusive=exclusive)
        if done.returncode != 0 and not (missing_ok and _is_missing(done.stderr)):
            raise EngineError(f"{self.name} {args[0]}: {message_of(done)}")
        return done.stdout




def run_bounded(argv: Sequence[str], *, timeout: float, what: str, missing: str, limit: int = EXEC_OUTPUT_LIMIT,
                keep_end: bool = False) -> tuple[int, str, str]:
    """Run `argv` with a deadline, keeping at most `limit` bytes of stdout and of stderr (the first
    ones, or the last with `keep_end`); past the deadline it is killed and "`what`: no answer within
    N s" raised; `missing` is the permanent error when the binary is not there."""
    try:
        process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    except FileNotFoundError:
        raise permanent(missing) from None
    deadline = time.monotonic() + timeout
    kept = _read_bounded(process, deadline=deadline, limit=limit, keep_end=keep_end)
    if kept is not None:
        try:
            return process.wait(timeout=max(0.0, deadline - time.monotonic())), kept[0], kept[1]
        except subprocess.TimeoutExpired:
            pass
    process.kill()
    process.wait()
    raise EngineError(f"{what}: no answer within {timeout:.0f} s")


def _read_bounded(process: subprocess.Popen[bytes], *, deadline: float,
                  limit: int, keep_end: bool = False) -> tuple[str, str] | None:
    """Read both pipes to their end, keeping `limit` bytes of each (the last ones with
    `keep_end`); None past the deadline."""
    assert process.stdout is not None and process.stderr is not None  # noqa: S101 - made with PIPE
    kept = {process.stdout.fileno(): bytearray(), process.stderr.fileno(): bytearray()}
    with selectors.DefaultSelector() as selector, process.stdout, process.stderr:
        for pipe in (process.stdout, process.stderr):
            selector.register(pipe, selectors.EVENT_READ)
        while selector.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            for key, _ in selector.select(timeout=left):
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    selector.unregister(key.fileobj)
                    continue
                buffer = kept[key.fd]
                if keep_end:
                    buffer += chunk
                    del buffer[: max(0, len(buffer) - limit)]
                else:
                    buffer += chunk[: max(0, limit - len(buffer))]
    out, err = (bytes(kept[fd]).decode(errors="replace") for fd in kept)
    return out, err


def labels_of(raw: dict[str, Any]) -> dict[str, str]:
    """A container's labels from `inspect`'s JSON."""
    return dict((raw.get("Config") or {}).get("Labels") or {})




def _is_missing(stderr: str) -> bool:
    text = stderr.lower()
    return "no such" in text or "not known" in text or "no container with name" in text


def message_of(done: subprocess.CompletedProcess[str]) -> str:
    """What a failed engine command said: its "Error:" lines when it wrote some (podman and docker
    write warnings first, such as rootless cgroups v1's "Resource limits are not supported", which
    must not stand for the error), else its logged errors (podman's `level=error msg="…"`: a lost
    pause process says "invalid internal status, try resetting the pause process with podman system
    migrate" only so), else all it wrote; with the exit status where no "Error:" line says it."""
    text = (done.stderr or done.stdout).strip()
    errors = [line.removeprefix("Error: ").strip() for line in text.splitlines() if line.startswith("Error: ")]
    if errors:
        return "; ".join(errors)
    status = (f"killed by signal {-done.returncode}" if done.returncode < 0
              else f"exit status {done.returncode}")
    logged = [_logged_message(match) for match in _LOGGED_ERROR.finditer(text)]
    if logged:
        return f"{'; '.join(logged)} ({status})"
    return f"{text} ({status})" if text else status


# logrus's text format, as podman writes its errors before "Error:" (or instead of it):
# time="…" level=error msg="…" (the message a Go-quoted string).
_LOGGED_ERROR = re.compile(r'level=(?:error|fatal) msg="((?:[^"\\]|\\.)*)"')


def _logged_message(match: re.Match[str]) -> str:
    return re.sub(r"\\(.)", r"\1", match.group(1))
