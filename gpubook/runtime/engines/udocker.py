"""udocker (the seeds' engine where nobody installs podman or allows newuidmap): containers run as
the daemon's own user, with no daemon and no setuid helper.

udocker keeps the images and makes each booking's container (`udocker create`, a copy of the
image's files); `udocker run` runs it in R1 mode, the host's runc in an unprivileged user
namespace, with the runc in udocker_runc.py between them, which applies what udocker cannot be
told (read-only binds, the booked GPUs' nodes only, no capability, the log's bound). What this
engine gives, and what it cannot, against podman:

- One id. Without newuidmap an unprivileged user maps only its own uid into a namespace, so the
  booker runs as their uid inside (a nested user namespace maps it onto the daemon's uid) and
  there is no root and no sudo inside. Every file a booking writes belongs to the daemon's user
  on the host, which therefore reads them all (`data_owner_argv` is []).
- The host's network: udocker makes no network namespace. `[engine] network` must say "host",
  and doctor flags it as it does for podman; sshd binds the booking's port on the host and the
  probe trusts only the booking's own host key, so a squatter on the port cannot pass for it.
- No limits: rootless runc without a delegated cgroup tree sets no memory or process limit.
- PRoot (P1/P2) is refused: it runs a booker's processes as the daemon's user with no namespace
  at all (they could read the calendar's password and stop the daemon). R2/R3 and F modes need
  udocker's own tools tarball, which gpubook does not download.

A container is found again after a crash from what this engine writes beside it (gpubook.json,
its labels; gpubook-runc-id, the runc id the runc wrapper was given), never from files inside
the container's root, which the booker owns.
"""

from __future__ import annotations

import builtins
import contextlib
import fcntl
import hashlib
import json
import logging
import os
import platform
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpubook.runtime.checks import Check
from gpubook.runtime.engines import HOST_NETWORK_RISK, seccomp
from gpubook.runtime.engines.cli_engine import check_port_free, mount_problem
from gpubook.runtime.engines.cli_transport import EXEC_OUTPUT_LIMIT, QUICK_TIMEOUT, run_bounded
from gpubook.runtime.engines.runc_version import runc_check
from gpubook.runtime.engines.spec import (
    ContainerInfo,
    ContainerSpec,
    ExecResult,
    SpecTaken,
    info_from_labels,
    permanent,
)
from gpubook.runtime.engines.udocker_runc import KEPT_CAPABILITIES, POLICY_ENV, RUNC_ENV
from gpubook.runtime.errors import EngineError

if TYPE_CHECKING:
    from gpubook.runtime.engines import EngineOptions, EngineSettings

log = logging.getLogger(__name__)

MODE = "R1"
RUN_TIMEOUT = 300.0  # seconds from `udocker run` to a running container (create copies the image)
EXEC_TIMEOUT = 60.0
LOG_MAX = 10 * 1024 * 1024  # bytes of a container's output kept (two files of half)
LOG_READ_LIMIT = 1024 * 1024
LABELS_FILE = "gpubook.json"
RUNC_ID_FILE = "gpubook-runc-id"
POLICY_FILE = "gpubook-policy.json"
LOG_FILE = "gpubook.log"
RUN_FILE = "gpubook-run"  # "PID STARTTIME" of the container's `udocker run`
SPARE_PREFIX = "gpubook-spare-"  # a container made ahead of any booking of its image (`warm`), never run
SPARE_FILE = "gpubook-spare.json"  # beside a spare: its image and the image's layers when it was made
HELPER_DIR = "/.gpubook-host"  # the host's unshare, loader and libc, bound read-only
AS_BOOKER = "as-booker"  # the program there that runs its arguments as the booker
PROOT_REFUSED = ("udocker's P modes (PRoot) are refused: they run a booker's processes as the daemon's own user "
                 "with no namespace, so a booker could read gpubook's keys and the calendar's password and stop "
                 "the daemon")
NETWORK_REFUSED = ('udocker has no network namespaces: set [engine] network = "host" (bookings then share the host '
                   f"network: {HOST_NETWORK_RISK})")
# podman's docker-archive links each layer.tar to its blob, and udocker 1.3.17's `load` keeps the links,
# not the layers, and says it loaded the image; an OCI archive of the same image loads whole.
DOCKER_ARCHIVE = "udocker cannot load the layers of podman's docker-archive"
LOAD_WAY = "`podman save --format oci-archive -o FILE IMAGE` and `udocker load -i FILE`"
# doctor's network line: flagged as podman's "host" is, with the only way out (udocker makes no other).
HOST_NETWORK_CHECK = Check("engine network", False, f"udocker shares the host network: {HOST_NETWORK_RISK}",
                           'where bookers must not reach each other, use podman with [engine] network = "private"')
NO_ROOT = ("udocker: the booker is the container's only user (one id, the daemon's own, without newuidmap): no root "
           "and no sudo inside, no memory or process limits, and every file written belongs to the daemon's user")


class UdockerEngine:
    name = "udocker"
    # The networks it makes, and why not the others: the config refuses the rest with this sentence.
    networks = ("host",)
    network_refused = NETWORK_REFUSED
    # [gpus] mps, refused by the config: every udocker container is the daemon's own user on the host.
    mps_refused = ('cannot be used with [engine] name = "udocker": every booking runs as the daemon\'s own user, '
                   "so the MPS pipe folder every booking writes into would let one booker reach another's "
                   "GPU work; use podman, or set mps = false")

    def __init__(self, settings: EngineSettings, options: EngineOptions) -> None:
        if settings.network != "host":
            raise permanent(NETWORK_REFUSED)
        self.settings = settings
        self.network = settings.network
        self.global_args = tuple(options.global_args)
        self.binary = settings.binary or _udocker_binary()
        self.runc = settings.runtime or shutil.which("runc", path=_SEARCH_PATH) or "runc"
        self.top = Path(os.environ.get("UDOCKER_DIR") or Path.home() / ".udocker")
        self._filter: dict[str, Any] | None = None  # the seccomp filter, made once
        self._spares: dict[str, threading.Thread] = {}  # image → the spare being made in the background
        self._spares_lock = threading.Lock()

    # --- udocker and runc, argv lists only --------------------------------------------------------

    def _env(self, policy: Path | None = None) -> dict[str, str]:
        # udocker's temporary folders (its FileBind folder, bound into every container) in the
        # private store, never /tmp: a set-uid file a booker made there was the daemon's on the host,
        # reachable by every account (round 3, H1).
        wrapper = self._wrapper()
        temporary = str(wrapper.parent / "tmp")
        env = {**os.environ, "UDOCKER_DIR": str(self.top), "UDOCKER_TARBALL": "",
               "UDOCKER_DEFAULT_EXECUTION_MODE": MODE, "UDOCKER_USE_RUNC_EXECUTABLE": str(wrapper),
               RUNC_ENV: self.runc, "UDOCKER_LOGLEVEL": "2", "UDOCKER_TMP": temporary, "TMPDIR": temporary}
        env.pop(POLICY_ENV, None)
        if policy is not None:
            env[POLICY_ENV] = str(policy)
        return env

    def _udocker(self, args: Sequence[str], *, timeout: float = QUICK_TIMEOUT, check: bool = True,
                 keep_fds: Sequence[int] = ()) -> subprocess.CompletedProcess[str]:
        argv = [self.binary, *self.global_args, *args]
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=self._env(),
                                  stdin=subprocess.DEVNULL, check=False, pass_fds=tuple(keep_fds))
        except FileNotFoundError:
            raise permanent(f"udocker: {self.binary} is not installed (pip install 'gpubook[udocker]')") from None
        except subprocess.TimeoutExpired:
            raise EngineError(f"udocker {args[0]}: no answer within {timeout:.0f} s") from None
        if check and done.returncode != 0:
            raise EngineError(f"udocker {args[0]}: {_message(done)}")
        return done

    def _runc(self, folder: Path, args: Sequence[str], *, timeout: float = QUICK_TIMEOUT,
              limit: int = EXEC_OUTPUT_LIMIT) -> tuple[int, str, str]:
        """runc on a container's state folder (udocker's container folder), bounded in time and output."""
        return run_bounded([self.runc, "--root", str(folder), *args], timeout=timeout, limit=limit,
                           what=f"udocker: runc {args[0]}",
                           missing=f"udocker: runc ({self.runc}) is not installed (apt-get install runc)")

    def _wrapper(self) -> Path:
        """The runc udocker runs: udocker_runc, under this Python (it needs a name with "runc")."""
        # udocker makes its store with the umask (0755): every booking's root, its /tmp and what
        # the booker leaves there, would be readable by every account on the host.
        self.top.mkdir(mode=0o700, parents=True, exist_ok=True)
        if self.top.stat().st_mode & 0o077:
            self.top.chmod(0o700)
        path = self.top / "gpubook" / "gpubook-runc"
        text = (f"#!{sys.executable}\nimport sys\n"
                "from gpubook.runtime.engines.udocker_runc import main\nsys.exit(main())\n")
        if not path.exists() or path.read_text() != text:
            path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            temporary = path.with_suffix(".new")
            temporary.write_text(text)
            temporary.chmod(0o700)
            temporary.replace(path)
        (path.parent / "tmp").mkdir(mode=0o700, exist_ok=True)
        return path

    # --- images -----------------------------------------------------------------------------------

    def image_exists(self, image: str) -> bool:
        return self._udocker(["inspect", image], check=False).returncode == 0

    def ensure_image(self, image: str, *, pull: bool = False) -> None:
        if self.image_exists(image):
            return
        if problem := _name_problem(image):
            raise permanent(problem)
        if pull:
            self._udocker(["pull", image], timeout=RUN_TIMEOUT)
            return
        if image in self._listed():
            raise permanent(f"image {image} is in udocker's store ({self.top}) but udocker cannot use it (its layers "
                            f"are missing: {DOCKER_ARCHIVE}): `udocker rmi {image}`, then {LOAD_WAY}")
        raise permanent(f"image {image} is not present in udocker's store ({self.top}): {LOAD_WAY}, "
                        f"`udocker pull {image}`, or `gpubook templates build`")

    def _listed(self) -> set[str]:
        """The names `udocker images` lists, usable or not."""
        done = self._udocker(["images"], check=False)
        return {line.split()[0] for line in done.stdout.splitlines() if line.strip()} - {"REPOSITORY"}

    def import_rootfs(self, tarball: Path, tag: str) -> None:
        if self.image_exists(tag):
            self._remove(spare_name(tag))  # a spare of the old image would keep it (and be stale)
            self._udocker(["rmi", tag])
        self._udocker(["import", str(tarball), tag], timeout=RUN_TIMEOUT)

    def build(self, tag: str, context: Path, *, containerfile: str = "Containerfile") -> None:
        raise permanent(f"udocker cannot build images, and {tag} (sshd for a template with has_sshd = false) is not "
                        f"in its store: make an image with sshd with podman, load it ({LOAD_WAY}) and name it in "
                        "the template with has_sshd = true")

    # --- containers -------------------------------------------------------------------------------

    def _folder(self, name: str) -> Path | None:
        """The container folder of `name` (udocker's link from the name), if it is gpubook's."""
        link = self.top / "containers" / name
        if not link.is_symlink():
            return None
        folder = _linked(link)
        return folder if (folder / LABELS_FILE).is_file() else None

    def _runc_state(self, folder: Path) -> tuple[str | None, int]:
        """runc's status of the id the wrapper was given ("running", "created", "stopped", ...),
        and its first process; None when runc has none (not run yet, or gone)."""
        runc_id = _read(folder / RUNC_ID_FILE).strip()
        if not runc_id:
            return None, 0
        code, out, _ = self._runc(folder, ["state", runc_id])
        try:
            state = json.loads(out) if code == 0 else {}
        except ValueError:
            state = {}
        return state.get("status"), int(state.get("pid") or 0)

    def _state(self, folder: Path) -> tuple[str, int]:
        """("running", pid) or ("exited", 0). A container whose `udocker run` still runs and that
        runc has not reported stopped is running (pid 0 while it starts): a pass that looks during
        a start must never take it for dead, and remove it under its entrypoint."""
        status, pid = self._runc_state(folder)
        if status in ("running", "created"):
            return "running", pid
        if status != "stopped" and _run_process(folder) is not None:
            return "running", 0
        return "exited", 0

    def _info(self, folder: Path) -> ContainerInfo | None:
        try:
            record = json.loads((folder / LABELS_FILE).read_text())
        except (OSError, ValueError):
            return None
        state, pid = self._state(folder)
        return info_from_labels(name=record["name"], id=folder.name, state=state, image=record["image"],
                                labels=record["labels"], pid=pid)

    def inspect(self, name: str) -> ContainerInfo | None:
        folder = self._folder(name)
        return self._info(folder) if folder else None

    def list(self) -> builtins.list[ContainerInfo]:
        found = []
        containers = self.top / "containers"
        for folder in sorted(containers.iterdir()) if containers.is_dir() else []:
            if folder.is_symlink() or not (folder / LABELS_FILE).is_file():
                continue
            info = self._info(folder)
            if info is not None and info.booking_id:
                found.append(info)
        return found

    @contextlib.contextmanager
    def _name_lock(self, name: str) -> Iterator[int]:
        """Held while the container `name` is made, by this process and by its `udocker create`,
        which inherits it: a daemon started after a kill -9 waits for the killed one's create to
        end rather than race it for the name (the loser's copy of the image was left behind)."""
        folder = self.top / "gpubook" / "locks"
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(folder / f"{name}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            deadline = time.monotonic() + RUN_TIMEOUT
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise EngineError(f"container {name}: another udocker create of it still runs after "
                                          f"{RUN_TIMEOUT:.0f} s") from None
                    time.sleep(0.2)
            yield fd
        finally:
            os.close(fd)

    def start(self, spec: ContainerSpec) -> ContainerInfo:
        with self._name_lock(spec.name) as lock:
            return self._start(spec, lock=lock)

    def _start(self, spec: ContainerSpec, *, lock: int) -> ContainerInfo:
        current = self.inspect(spec.name)
        if current is not None:
            if current.running and current.spec_hash == spec.spec_hash:
                return current
            if current.running:
                raise SpecTaken(spec, current)
            self._remove(spec.name)
        elif (self.top / "containers" / spec.name).is_symlink() and self._folder(spec.name) is None:
            # gpubook's name with none of its labels beside it (read again here: `current` may be a
            # caller's stale view of someone else's running container): a start cut off between
            # `udocker create` and the labels (a kill -9 of the daemon). The name would refuse every create.
            log.warning("container %s: left by a start cut off before its labels; removed", spec.name)
            self._remove(spec.name)
        check_port_free(spec.booking_id, spec.port)
        self.ensure_image(spec.image)
        for mount in spec.mounts:
            if problem := mount_problem(mount):
                raise permanent(f"booking {spec.booking_id}: {problem}")
        folder = self._claim_spare(spec)
        if folder is None:
            folder = self._create(spec.name, spec.image, lock=lock)
        try:
            return self._run(spec, folder)
        except BaseException:
            self._remove(folder.name)
            raise

    def _create(self, name: str, image: str, *, lock: int) -> Path:
        """`udocker create`: the container's own copy of the image (seconds for a large one), its folder."""
        created = self._udocker(["create", f"--name={name}", image], timeout=RUN_TIMEOUT, check=False,
                                keep_fds=(lock,))
        container_id = created.stdout.strip().splitlines()[-1].strip() if created.stdout.strip() else ""
        folder = self.top / "containers" / container_id
        made = bool(container_id) and folder.is_dir() and not folder.is_symlink()
        if created.returncode != 0:
            if made:  # the copy was made and the name then taken (a killed daemon's create ending meanwhile)
                self._remove(container_id)
            raise EngineError(f"udocker create: {_message(created)}")
        if not made:
            raise EngineError(f"udocker create gave no container for {name}: {_message(created)}")
        return folder

    # --- spares: the image's copy made ahead, so that a booking for now does not wait for it ----------

    def warm(self, image: str) -> None:
        """A spare container of `image`: `udocker create` now (the image preparer calls this when the image
        is ready), so that the next booking of it starts without the copy. One per image; a spare of an
        image pulled again since is replaced."""
        name = spare_name(image)
        with self._name_lock(name) as lock:
            link = self.top / "containers" / name
            if link.is_symlink():
                if self._spare_fits(_linked(link), image):
                    return
                self._drop_spare(name)
            key = self._image_key(image)
            if key is None:
                return
            folder = self._create(name, image, lock=lock)
            (folder / SPARE_FILE).write_text(json.dumps({"image": image, "layers": key}))

    def keep_spare(self, image: str) -> None:
        """A spare of `image` in the background, where none fits (the image preparer, for an image it found
        here already: an admin's `udocker load`, or a spare a killed daemon left half-made)."""
        self._warm_later(image)

    def _warm_later(self, image: str) -> None:
        """The next spare of `image`, made in a thread of its own (a start never waits for it)."""
        def make() -> None:
            try:
                self.warm(image)
            except (EngineError, OSError) as error:
                log.warning("udocker: the next spare container of %s was not made: %s", image, error)

        with self._spares_lock:
            running = self._spares.get(image)
            if running is not None and running.is_alive():
                return
            self._spares[image] = thread = threading.Thread(target=make, name=f"spare {image}", daemon=True)
        thread.start()

    def _claim_spare(self, spec: ContainerSpec) -> Path | None:
        """The spare of the spec's image, named as the booking's container (udocker's name is a link in its
        containers folder: the booking's link made, the spare's removed), or None (no spare, one of an
        older pull: removed, or the booking's name already someone's)."""
        name = spare_name(spec.image)
        link = self.top / "containers" / name
        with self._name_lock(name):
            if not link.is_symlink():
                return None  # none made for it (only images the preparer readied get spares)
            folder = _linked(link)
            if not self._spare_fits(folder, spec.image):
                self._drop_spare(name)
                self._warm_later(spec.image)
                return None
            try:  # the booking's name made only where there is none: never another container's taken over
                os.symlink(os.readlink(link), self.top / "containers" / spec.name)
            except FileExistsError:
                return None  # someone's (a racing daemon's): the create below fails on that name, as it did
            link.unlink()
            (folder / SPARE_FILE).unlink()
        self._warm_later(spec.image)
        return folder

    def _drop_spare(self, name: str) -> None:
        """The spare `name` removed: one of an older pull, or one a killed daemon left half-made (its `udocker
        create` ended after the daemon, which never wrote the spare's file). A name whose folder is gone is a
        link udocker itself cannot remove (its `rm` finds no container by it): unlinked here."""
        link = self.top / "containers" / name
        if link.is_symlink() and not link.exists():
            link.unlink(missing_ok=True)
        else:
            self._remove(name)

    def _spare_fits(self, folder: Path, image: str) -> bool:
        """The spare in `folder` is of `image` as udocker's store holds it now (not of an older pull)."""
        try:
            made = json.loads((folder / SPARE_FILE).read_text())
        except (OSError, ValueError):
            return False
        return made.get("image") == image and made.get("layers") == self._image_key(image)

    def _image_key(self, image: str) -> str | None:
        """What identifies the image's content in udocker's store (its tag folder's layers and ancestry);
        None where it is not there."""
        repository, _, tag = image.rpartition(":") if ":" in image.rsplit("/", 1)[-1] else (image, "", "latest")
        folder = self.top / "repos" / repository / tag
        if not folder.is_dir():
            return None
        parts = sorted(entry.name for entry in folder.iterdir())
        for name in ("ancestry", "manifest", "TAG"):
            if (folder / name).is_file():
                parts.append((folder / name).read_text(errors="replace"))
        return hashlib.sha256("\n".join(parts).encode()).hexdigest()

    def _run(self, spec: ContainerSpec, folder: Path) -> ContainerInfo:
        (folder / LABELS_FILE).write_text(json.dumps(
            {"name": spec.name, "image": spec.image, "uid": spec.uid, "gid": spec.gid, "labels": spec.labels()}))
        policy = folder / POLICY_FILE
        policy.write_text(json.dumps(self.policy(spec, folder)))
        env_args = [f"--env={name}={value}" for name, value in (*spec.env, *_gpu_env(spec))]
        # udocker's own `-v` for the folders (it looks for the entrypoint there); the runc wrapper
        # binds them again with their mode, and binds the files udocker cannot.
        volumes = [f"-v={m.source}:{m.target}" for m in spec.mounts if m.source.is_dir()]
        argv = [self.binary, *self.global_args, "run", "--nobanner", "--entrypoint=", *env_args, *volumes,
                spec.name, *spec.entrypoint, *spec.command]
        with open(folder / "udocker-run.log", "wb") as run_log:
            process = subprocess.Popen(argv, env=self._env(policy), stdin=subprocess.DEVNULL, stdout=run_log,
                                       stderr=subprocess.STDOUT, start_new_session=True)
        (folder / RUN_FILE).write_text(f"{process.pid} {_start_time(process.pid)}")
        deadline = time.monotonic() + RUN_TIMEOUT
        while time.monotonic() < deadline:
            status, pid = self._runc_state(folder)
            if status in ("running", "created"):
                return info_from_labels(name=spec.name, id=folder.name, state="running", image=spec.image,
                                        labels=spec.labels(), pid=pid)
            if process.poll() is not None:
                why = (_read(folder / LOG_FILE) + _read(folder / "udocker-run.log"))[-1500:]
                raise EngineError(f"booking {spec.booking_id}: udocker run ended at once: {why.strip()}")
            time.sleep(0.05)
        process.kill()
        raise EngineError(f"booking {spec.booking_id}: udocker run did not start within {RUN_TIMEOUT:.0f} s")

    def policy(self, spec: ContainerSpec, folder: Path) -> dict[str, Any]:
        """What udocker_runc applies to udocker's spec for this booking (see there)."""
        as_booker = folder / AS_BOOKER
        as_booker.write_text(as_booker_script(spec.uid, spec.gid))
        as_booker.chmod(0o555)
        helper = {**host_helper(), AS_BOOKER: as_booker}
        mounts = [{"source": str(source), "target": f"{HELPER_DIR}/{target}", "read_only": True}
                  for target, source in helper.items()]
        mounts += [{"source": str(m.source), "target": m.target, "read_only": m.read_only} for m in spec.mounts]
        devices, masked = [], []
        if spec.gpu is not None:
            mounts += [{"source": str(b.source), "target": b.target, "read_only": b.read_only}
                       for b in spec.gpu.binds]
            devices = [{"host": str(d.host), "container": d.container} for d in spec.gpu.devices]
            masked = list(spec.gpu.hidden_proc_paths)
        return {"args": [*spec.entrypoint, *spec.command], "mounts": mounts, "devices": devices, "masked": masked,
                "env": [["GPUBOOK_AS_BOOKER", f"{HELPER_DIR}/{AS_BOOKER}"]], "log": str(folder / LOG_FILE),
                "log_max": LOG_MAX, "runc_id_file": str(folder / RUNC_ID_FILE), "shm_size": spec.shm_size,
                "private": str(self.top), "seccomp": self._seccomp()}

    def _seccomp(self) -> dict[str, Any]:
        if self._filter is None:
            self._filter = seccomp.oci_seccomp(seccomp.load_profile(), capabilities=KEPT_CAPABILITIES)
        return self._filter

    def stop(self, name: str, grace: float) -> None:
        """SIGTERM to the container's first process, `grace` seconds, SIGKILL (its whole PID
        namespace goes with it); then its folder is removed. The bound folders stay. A start of
        the same container in progress is waited for (its name's lock), never removed under it."""
        with self._name_lock(name):
            self._stop(name, grace)

    def _stop(self, name: str, grace: float) -> None:
        folder = self._folder(name)
        if folder is None:
            if (self.top / "containers" / name).is_symlink():
                self._remove(name)  # a start cut off before its labels: never ran
            return
        run = _run_process(folder)
        if run is not None and self._runc_state(folder)[0] is None:
            # its `udocker run` runs but runc has no container yet (a start cut off by a kill -9
            # of the daemon): end the run's whole session, and wait for it
            with contextlib.suppress(ProcessLookupError):
                os.killpg(run, signal.SIGKILL)
            deadline = time.monotonic() + QUICK_TIMEOUT
            while time.monotonic() < deadline and _run_process(folder) is not None:
                time.sleep(0.05)
        runc_id = _read(folder / RUNC_ID_FILE).strip()
        if runc_id and self._state(folder)[0] == "running":
            self._runc(folder, ["kill", runc_id, "TERM"])
            deadline = time.monotonic() + grace
            while time.monotonic() < deadline and self._state(folder)[0] == "running":
                time.sleep(0.1)
            if self._state(folder)[0] == "running":
                self._runc(folder, ["kill", runc_id, "KILL"])
                deadline = time.monotonic() + QUICK_TIMEOUT
                while time.monotonic() < deadline and self._state(folder)[0] == "running":
                    time.sleep(0.05)
        if runc_id:
            self._runc(folder, ["delete", "--force", runc_id])
        self._remove(folder.name)

    def _remove(self, name_or_id: str) -> None:
        self._udocker(["rm", "-f", name_or_id], check=False)

    def exec(self, name: str, argv: Sequence[str], *, user: str | None = None,
             timeout: float | None = None) -> ExecResult:
        """Run argv in the container (as its root, the daemon's id without capabilities; as the
        booker's uid with any other `user`), bounded in time and output."""
        folder = self._folder(name)
        runc_id = _read(folder / RUNC_ID_FILE).strip() if folder else ""
        if folder is None or not runc_id:
            raise EngineError(f"udocker exec: no container {name}")
        command = list(argv) if user in (None, "0", "root") else [f"{HELPER_DIR}/{AS_BOOKER}", *argv]
        code, out, err = self._runc(folder, ["exec", runc_id, *command],
                                    timeout=EXEC_TIMEOUT if timeout is None else timeout)
        if code != 0 and not out and "no answer" in err:
            raise EngineError(f"udocker exec: {err.strip()}")
        return ExecResult(code, out, err)

    def logs(self, name: str, *, tail: int | None = None) -> str:
        folder = self._folder(name)
        if folder is None:
            return ""
        text = (_read(folder / (LOG_FILE + ".1")) + _read(folder / LOG_FILE))[-LOG_READ_LIMIT:]
        if tail is not None:
            text = "".join(text.splitlines(keepends=True)[-tail:]) if tail else ""
        return text

    # --- ids: one, the daemon's own -------------------------------------------------------------

    def host_owner(self, uid: int, gid: int) -> tuple[int, int]:
        return os.getuid(), os.getgid()

    def chown(self, path: Path, uid: int, gid: int) -> None:
        try:
            os.chown(path, uid, gid, follow_symlinks=False)
        except PermissionError:
            # Another engine's ids (rootless podman's subordinate ids, from before a switch): a
            # file in the daemon's own folder (a booking's host key) goes and is made again.
            owner = path.lstat().st_uid
            if path.is_file() and not path.is_symlink():
                path.unlink()
                raise EngineError(f"{path} belonged to uid {owner} (another engine's ids); removed, made again "
                                  "at the next start") from None
            raise EngineError(f"{path} belongs to uid {owner} (another engine's ids): give it to the daemon's "
                              "user (with podman: podman unshare chown -R 0:0 PATH)") from None

    def data_owner_argv(self) -> builtins.list[str] | None:
        return []

    # --- doctor -----------------------------------------------------------------------------------

    def mode_line(self) -> str:
        """The engine and how it runs containers, for doctor and `gpubook status`."""
        return f"udocker {MODE}, the host's runc ({self.runc}) in an unprivileged user namespace"

    def preflight(self) -> builtins.list[Check]:
        checks = [self._binary_check()]
        if not checks[0].ok:
            return [*checks, HOST_NETWORK_CHECK]
        mode_problem = self.mode_problem()
        checks.append(Check("udocker mode", mode_problem is None,
                            mode_problem or f"{self.mode_line()}; PRoot (P modes) refused", "install runc and allow "
                            "unprivileged user namespaces (kernel.unprivileged_userns_clone = 1), or use podman"))
        if mode_problem is None:
            checks.append(runc_check(self.runc))
        checks.append(Check("udocker isolation", True, NO_ROOT))
        return [*checks, HOST_NETWORK_CHECK]

    def _binary_check(self) -> Check:
        try:
            done = self._udocker(["version"], check=False)
        except EngineError as error:
            return Check("engine", False, str(error), "pip install 'gpubook[udocker]' or set [engine] binary")
        line = next((text for text in done.stdout.splitlines() if "version" in text.lower()), done.stdout.strip())
        if done.returncode != 0:
            return Check("engine", False, f"udocker version: {_message(done)}", f"check that {self.binary} runs")
        return Check("engine", True, f"udocker {line.split(':')[-1].strip()}")

    def mode_problem(self) -> str | None:
        """None where R1 runs here, else what it needs, in one sentence."""
        if not Path(self.runc).is_file() and shutil.which(self.runc, path=_SEARCH_PATH) is None:
            return f"udocker mode {MODE} needs runc, and {self.runc} is not installed"
        try:
            helper = host_helper()
        except EngineError as error:
            return str(error)
        done = subprocess.run([str(helper["unshare"]), "--user", "--map-root-user", "true"],
                              capture_output=True, text=True, check=False)
        if done.returncode != 0:
            return (f"udocker mode {MODE} needs unprivileged user namespaces, and this host refuses them "
                    f"({done.stderr.strip()[:200]}); {PROOT_REFUSED}")
        return None


_SEARCH_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])


def _udocker_binary() -> str:
    """udocker on PATH, else beside this Python (a venv's bin, where pip put it)."""
    beside = Path(sys.executable).parent / "udocker"
    return shutil.which("udocker") or (str(beside) if beside.exists() else "udocker")


def _name_problem(image: str) -> str | None:
    """udocker 1.3.17 reads an image's tag from its first ':', so a registry's port breaks the name."""
    first, _, rest = image.partition("/")
    if not rest or ":" not in first:
        return None
    return (f"udocker cannot name an image whose registry has a port ({image}): pull it with `udocker pull "
            f"--registry=https://{first} {rest}` and name it {rest} in the template")


def host_helper() -> dict[str, Path]:
    """The host's `unshare` with the loader and libc it runs with, which every booking's first
    process runs under (bound read-only, so any image, of any libc, runs it)."""
    unshare = shutil.which("unshare", path=_SEARCH_PATH)
    loader = {"x86_64": "/lib64/ld-linux-x86-64.so.2", "aarch64": "/lib/ld-linux-aarch64.so.1"}.get(platform.machine())
    if unshare is None or loader is None or not Path(loader).exists():
        raise permanent("udocker needs the host's unshare (util-linux) and its loader, and this host lacks them")
    loader_path = Path(loader).resolve()
    libc = loader_path.parent / "libc.so.6"
    if not libc.exists():
        raise permanent(f"udocker: no libc.so.6 beside the loader {loader_path}")
    help_text = subprocess.run([unshare, "--help"], capture_output=True, text=True, check=False).stdout
    if "--map-user" not in help_text:
        raise permanent("udocker needs util-linux 2.38 or later on the host (unshare --map-user)")
    return {"ld.so": loader_path, "libc.so.6": libc.resolve(), "unshare": Path(unshare).resolve()}


def as_booker_script(uid: int, gid: int) -> str:
    """The booking's `as-booker`: its arguments run in a nested user namespace where the one id is
    the booker's uid, through the host's unshare with the host's loader and libc (any image)."""
    return (f"#!/bin/sh\nexec {HELPER_DIR}/ld.so --library-path {HELPER_DIR} {HELPER_DIR}/unshare "
            f"--map-user={int(uid)} --map-group={int(gid)} -- \"$@\"\n")


def _gpu_env(spec: ContainerSpec) -> tuple[tuple[str, str], ...]:
    return spec.gpu.environment if spec.gpu is not None else ()


def _start_time(pid: int) -> str:
    """The start time of process `pid` (field 22 of /proc/PID/stat), which tells it from a later
    process given the same pid; "" when it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return text[text.rindex(")") + 2:].split()[19]


def _run_process(folder: Path) -> int | None:
    """The pid of the container's `udocker run` while that very process runs, else None."""
    fields = _read(folder / RUN_FILE).split()
    if len(fields) != 2 or not fields[0].isdigit():
        return None
    pid = int(fields[0])
    if _start_time(pid) != fields[1]:
        return None
    try:
        state = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return None if state[state.rindex(")") + 2:].startswith("Z") else pid


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def _message(done: subprocess.CompletedProcess[str]) -> str:
    lines = [line for line in (done.stderr + done.stdout).splitlines()
             if line.strip() and not line.startswith(("Info:", "Warning: installation", " "))]
    return " ".join(lines)[-400:] or f"exit status {done.returncode}"


def _linked(link: Path) -> Path:
    """The container folder a name's link in udocker's containers folder leads to."""
    return (link.parent / os.readlink(link)).resolve()


def spare_name(image: str) -> str:
    """The name of the spare container of `image` (never a booking's: those begin "gpubook-" and a booking id)."""
    return SPARE_PREFIX + hashlib.sha256(image.encode()).hexdigest()[:16]
