"""`gpubook doctor`: every check an admin needs before trusting gpubook, each problem with its fix.

The driver and device checks come from gpubook.runtime.nvidia.gpus and the engine's from its own preflight; this
module adds the config, the templates and their images, the calendars and the data folders. Each check is
ok, WARN (not passed, but gpubook works without it) or FAIL; exit status 1 if any FAILed, else 0.
"""

from __future__ import annotations

import errno
import fnmatch
import ipaddress
import json
import os
import shutil
import socket
import sys
from collections.abc import Callable, Mapping
from contextlib import closing
from pathlib import Path

from gpubook.runtime import engines
from gpubook.runtime.booking import ssh
from gpubook.runtime.checks import Check, exit_status, format_checks
from gpubook.runtime.data import sftp, storage
from gpubook.runtime.engines import Engine
from gpubook.runtime.errors import EngineError, GpubookError
from gpubook.runtime.mounts import missing_mount_flags
from gpubook.runtime.nvidia import MPS_PIPE_DIRECTORY, gpus
from gpubook.runtime.templates import images, overlay_image
from gpubook.runtime.templates.catalog import Template, load_all
from gpubook.scheduler import config as config_module
from gpubook.scheduler import wiring
from gpubook.scheduler.commands import users as users_command
from gpubook.scheduler.hosts import backend as backends
from gpubook.scheduler.hosts import sftp as sftp_host
from gpubook.scheduler.sources import open_source
from gpubook.scheduler.sources.errors import redact_url
from gpubook.scheduler.state import port_range_problem


def _config_check(given: str | None) -> tuple[Check, config_module.Config | None]:
    """--config, else the default config path; without one only the host is checked."""
    try:
        path = config_module.config_path(given)
    except GpubookError as error:
        return Check("config", False, f"{error}; only host checks were made",
                     "run `gpubook doctor --config FILE` with the daemon's config, or put it in one of those "
                     "paths"), None
    try:
        loaded = config_module.load(path, directory="read")
    except GpubookError as error:
        return Check("config", False, str(error), "correct the lines named above"), None
    return Check("config", True, f"{loaded.path}: {len(loaded.calendars)} calendar(s), "
                 f"{len(loaded.users)} user(s)"), loaded


def _templates_check(loaded: config_module.Config | None) -> Check:
    templates = load_all(loaded.templates_dir if loaded else None)
    if templates.errors:
        return Check("templates", False, "; ".join(m.splitlines()[0] for m in templates.errors.values()),
                     "fix the named fields (`gpubook templates validate` lists them); invalid templates are skipped")
    return Check("templates", True, ", ".join(sorted(templates.templates)) or "none")


def allowed_templates(loaded: config_module.Config, known: list[str]) -> list[str]:
    """The templates bookings may run here: the default (and the SFTP service's), then every known
    template a user's patterns allow, in that order."""
    names = [loaded.defaults.template]
    if loaded.sftp.enabled:
        names.append(loaded.sftp.template)
    for name in sorted(known):
        if any(fnmatch.fnmatchcase(name, p) for user in loaded.users.values() for p in user.templates):
            names.append(name)
    return list(dict.fromkeys(names))


def image_checks(loaded: config_module.Config) -> list[Check]:
    """Is each allowed template's image in the engine's store? An image made on this machine is
    never pulled (its bookings fail until it is built); one from a registry is pulled ahead of its
    bookings by the image preparer."""
    templates = load_all(loaded.templates_dir).templates
    try:
        engine = wiring.make_engine(loaded)
    except GpubookError as error:
        return [Check("template images", False, f"cannot ask the engine: {error}", "see the engine checks above")]
    exists = getattr(engine, "image_exists", None)
    if exists is None:  # a site's engine plugin that cannot say
        return [Check("template images", True, f"engine {loaded.engine.name} cannot list its images; not checked")]
    result = [_image_store_check(loaded, engine), _progress_check()] if isinstance(engine, images.ImageEngine) else []
    for name in allowed_templates(loaded, list(templates)):
        template = templates.get(name)
        if template is None:
            result.append(Check(f"image {name}", False, f"template {name} (allowed by the config) does not exist "
                                "or is invalid (see templates above)", "add the template or change the config"))
            continue
        try:
            if isinstance(engine, images.ImageEngine):
                result.append(_image_check(template, exists, engine_name=loaded.engine.name))
            else:
                result.append(_store_check(template, engine))
        except GpubookError as error:
            result.append(Check(f"image {name}", False, f"cannot ask the engine: {error}",
                                "see the engine checks above"))
    return result


def _store_check(template: Template, engine: Engine) -> Check:
    """An engine gpubook does not pull with (udocker): the image is in its store, or the engine's
    sentence says how an admin puts it there; bookings wait for it, nothing pulls it."""
    image = overlay_image.base_image(template)
    try:
        engine.ensure_image(image)
    except EngineError as error:
        if error.temporary:
            raise
        return Check(f"image {template.name}", False, f"{error}; gpubook does not pull with engine {engine.name}, "
                     "so its bookings wait until it is there", f"as the daemon's user, put {image} into the store")
    if not template.has_sshd and not overlay_image.image_present(engine, overlay_image.run_image(template)):
        return Check(f"image {template.name}", False, f"{image} has no sshd (has_sshd = false), and its sshd "
                     f"overlay {overlay_image.run_image(template)} is not in engine {engine.name}'s store (udocker "
                     "builds no image): its bookings wait until it is there",
                     "make an image with sshd, put it into the store and name it in the template with has_sshd = true")
    return Check(f"image {template.name}", True, f"{image} is in the engine's store")


def _image_check(template: Template, exists: Callable[[str], bool], *, engine_name: str) -> Check:
    image = overlay_image.base_image(template)
    name = f"image {template.name}"
    if exists(image):
        return Check(name, True, f"{image} is in the engine's store")
    registry = images.parse_reference(template.image).registry
    if template.build is not None or (registry == "localhost" and not template.mirror):
        fix = (f"gpubook templates build {template.name}" if template.build is not None
               else f"build or load {image} into the engine's store as this user")
        fix += (f"; or, made on another machine (podman save -o {template.name}.tar {image}): gpubook templates "
                f"import {template.name} {template.name}.tar")
        return Check(name, False, f"{image} is not in the engine's store and is made on this machine, never "
                     "pulled: its bookings fail until it is there", fix)
    where = f"the mirror {template.mirror}, then {registry}" if template.mirror else registry
    return Check(name, False, f"{template.image} is not in the engine's store yet; the daemon pulls it from "
                 f"{where} ahead of its first booking ([images] prepare_hours)",
                 f"to have it now, as the daemon's user: {engine_name} pull {template.image}", optional=True)


def _calendar_checks(loaded: config_module.Config) -> list[Check]:
    checks = []
    for calendar in loaded.calendars:
        try:
            with closing(open_source(calendar, timeout=15)) as source:
                found = source.preflight()
        except GpubookError as error:
            checks.append(Check(f"calendar {redact_url(calendar.url)}", False, str(error),
                                "check the URL, the credentials and that the server is up"))
        else:
            checks.append(Check(f"calendar {redact_url(calendar.url)}", True, found))
    return checks


def _storage_check(loaded: config_module.Config) -> Check:
    root = loaded.storage.data_root
    if root is None:
        return Check("data_root", True, "not set: bookings get no input/output folders")
    if not root.is_dir():
        return Check("data_root", False, f"{root} does not exist",
                     f"create it and give it to the daemon's user (mkdir -p {root})")
    if not os.access(root, os.W_OK | os.X_OK):
        return Check("data_root", False, f"{root} is not writable by this user",
                     f"chown it to the daemon's user (chown {os.getuid()} {root})")
    for problem in (storage.root_mode_problem(root), storage.mount_problem(root)):
        if problem is not None:
            detail, _, fix = problem.partition("; ")
            return Check("data_root", False, detail, fix + " (bookings are refused until then)")
    inside = namespace_check(loaded)
    if inside is not None:
        return inside
    return Check("data_root", True, f"{root} (nosuid,nodev)")


def namespace_check(loaded: config_module.Config) -> Check | None:
    """The engine sees data_root as the host does (a nosuid,nodev mount), where the engine runs its
    containers in a mount namespace of its own and says so (`data_root_check`: rootless podman)."""
    root = loaded.storage.data_root
    if root is None:
        return None
    try:
        engine = wiring.make_engine(loaded)
    except GpubookError:
        return None  # the engine's own checks say why
    check = getattr(engine, "data_root_check", None)
    return None if check is None else check(root)  # type: ignore[no-any-return]


def mps_check(environ: Mapping[str, str] | None = None) -> Check:
    """With [gpus] mps: the MPS pipe folder (bound writable into every GPU booking) is on a
    nosuid,nodev mount, else each booking's start fails while MPS runs (issue 22, finding 4)."""
    folder = Path((os.environ if environ is None else environ).get("CUDA_MPS_PIPE_DIRECTORY", MPS_PIPE_DIRECTORY))
    if not (folder / "control").exists():
        return Check("mps", True, f"no MPS control daemon runs ({folder}/control is absent): nothing is bound")
    try:
        missing = missing_mount_flags(folder)
    except OSError as error:
        return Check("mps", False, f"the MPS pipe folder {folder}: {error.strerror}", "check CUDA_MPS_PIPE_DIRECTORY")
    if missing:
        return Check("mps", False, f"the MPS pipe folder {folder} is on a mount without {','.join(missing)}: GPU "
                     "bookings are refused while MPS runs", "run nvidia-cuda-mps-control with CUDA_MPS_PIPE_DIRECTORY "
                     "on a nosuid,nodev mount (such as /run/nvidia-mps), the daemon with the same variable")
    return Check("mps", True, f"the MPS pipe folder {folder} (nosuid,nodev) is bound into GPU bookings")


def port_check(listen: str, port: int) -> Check:
    """The SFTP port is free on its address (when the service does not hold it already)."""
    family = socket.AF_INET6 if ":" in listen else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((listen, port))
        except OSError as error:
            why = "is taken by another program" if error.errno == errno.EADDRINUSE else f": {error.strerror}"
            return Check("sftp port", False, f"port {port} on {listen} {why}",
                         f"stop what listens there (ss -ltnp 'sport = :{port}') or choose another [sftp] port")
    return Check("sftp port", True, f"{listen}:{port} is free")


def sftp_key_check(loaded: config_module.Config) -> Check:
    """Every user gets in: a valid name, their own ids, keys that decode."""
    kept, left_out = sftp.usable(sftp_host.users_of(loaded))
    for user in kept:
        for key in user.keys:
            try:
                ssh.fingerprint(key)
            except (ValueError, IndexError):
                left_out.append(f"user {user.name}: key {key[:30]}... does not decode")
    if left_out:
        return Check("sftp users", False, "; ".join(left_out),
                     "give each user an ssh_keys line of their own public key and a uid of their own")
    return Check("sftp users", True, f"{len(kept)} user(s) with keys")


def _sftp_checks(loaded: config_module.Config) -> list[Check]:
    settings = loaded.sftp
    if not settings.enabled:
        return [Check("sftp", True, "off ([sftp] enabled = false): no data access outside bookings")]
    result = [sftp_key_check(loaded)]
    try:
        services = engines.service_runner(wiring.make_engine(loaded), why="[sftp] enabled")
        running = services.inspect_service(sftp.SERVICE_NAME)
    except GpubookError as error:
        return [*result, Check("sftp", False, f"cannot ask the engine: {error}", "see the engine checks above")]
    if running is not None and running.running:
        result.append(Check("sftp", True, f"{sftp.SERVICE_NAME} runs on {settings.listen}:{settings.port}"))
    else:
        result.append(port_check(settings.listen, settings.port))
    if not sftp.DEFAULT_SECCOMP.is_file():
        result.append(Check("sftp seccomp", False, f"{sftp.DEFAULT_SECCOMP} is missing: the service runs with a "
                            "profile that only refuses set-id chmod", "install containers-common (podman's default "
                            "seccomp profile)", optional=True))
    return result


def identity_check(loaded: config_module.Config) -> Check:
    """A shared calendar whose events name their booker lets any writer book as anyone (issue 22, finding 7)."""
    shared = [redact_url(c.url) for c in loaded.calendars if c.user is None]
    if not shared or loaded.policy.identity != "description":
        how = "per-user calendars" if not shared else "the ORGANIZER ([policy] identity = \"organizer\")"
        return Check("identity", True, f"who books is vouched for by the calendar server: {how}")
    return Check("identity", False, f"{', '.join(shared)}: a shared calendar whose events say who they are for "
                 "(a `user:` line): anyone who can write it can book as any user (their quota, their reminder "
                 "mail, their no-show)",
                 'give each user a calendar only they can write, with [[calendar]] user = "NAME" (Radicale: '
                 'rights owner_only or from_file), or set [policy] identity = "organizer" if the server sets '
                 "ORGANIZER from its login", optional=True)


def web_check(loaded: config_module.Config) -> Check:
    """Who can see the page, and as whom (issue 22, finding 10): any local account reaches a loopback port."""
    web = loaded.web
    if not web.enabled:
        return Check("web page", True, "off ([web] enabled = false)")
    if web.auth == "none":
        return Check("web page", False, f'[web] auth = "none": every account on this host that opens {web.listen} '
                     "sees every booking of every user", 'set auth = "basic" with an htpasswd_file (htpasswd -B)',
                     optional=True)
    if web.auth == "header":
        loopback = [p for p in web.trusted_proxies if ipaddress.ip_network(p, strict=False).overlaps(
            ipaddress.ip_network("127.0.0.0/8" if ":" not in p else "::1/128"))]
        if loopback:
            return Check("web page", False, f"[web] trusted_proxies has {', '.join(loopback)}: every account on "
                         f"this host can connect from there, send {web.trusted_header} itself and be anyone",
                         "run the proxy on an address of its own (or in a container) and trust only that, "
                         'or use auth = "basic"', optional=True)
    return Check("web page", True, f"auth {web.auth} on {web.listen}")


EPHEMERAL = Path("/proc/sys/net/ipv4/ip_local_port_range")


def ports_check(loaded: config_module.Config, *, ephemeral: Path = EPHEMERAL) -> Check:
    """Bookings' SSH ports inside the kernel's ephemeral range can be taken by any outgoing connection
    between the choice of a port and sshd's bind (with the host network: between arming and the start)."""
    low, high = loaded.ssh.port_min, loaded.ssh.port_max
    try:
        first, last = (int(part) for part in ephemeral.read_text().split())
    except (OSError, ValueError):
        return Check("ssh ports", True, f"{low}-{high} (the kernel's ephemeral range could not be read)")
    if high < first or low > last:
        return Check("ssh ports", True, f"{low}-{high}, outside the ephemeral range {first}-{last}")
    detail = (f"[ssh] port_min/port_max {low}-{high} overlap the kernel's ephemeral range {first}-{last}: "
              "an outgoing connection can take a booking's port before its sshd listens")
    if loaded.engine.network != "host":
        return Check("ssh ports", True, detail + " (the private network holds it from the container's start)")
    return Check("ssh ports", False, detail, f"choose [ssh] ports below {first} (the default is 2200-2299)")


def driver_section(driver: list[Check], *, gpu_count: int | None) -> list[Check]:
    """The driver's checks, or one line where a host declared GPU-less on purpose ([gpus] count) has
    no usable driver. An optional driver check (no CDI spec) is a WARN: only a failed one means
    "no usable driver"; a host with a driver and a static count keeps its driver's lines."""
    if gpu_count is not None and any(c.level == "fail" for c in driver):
        return [Check("driver", True, f"no NVIDIA driver; the config's [gpus] count = {gpu_count} "
                      "is used and containers get no GPU")]
    return driver


def ports_taken_check(loaded: config_module.Config) -> Check:
    """No other process holds the bookings' ports (a port found busy is skipped at a start: a host
    login that binds the whole range stops every start)."""
    held = {loaded.sftp.port} if loaded.sftp.enabled else set()
    try:  # the ports of gpubook's own running bookings are no squatter's
        held |= {info.port for info in wiring.make_engine(loaded).list() if info.port is not None}
    except GpubookError:
        pass
    low, high = loaded.ssh.port_min, loaded.ssh.port_max
    problem = port_range_problem(low, high, held=held)
    if problem is None:
        return Check("ssh ports free", True, f"no other process listens on {low}-{high}")
    if "bookings cannot start" in problem:
        return Check("ssh ports free", False, problem, "stop what listens there, or choose another [ssh] port range")
    return Check("ssh ports free", True, problem)


def _image_store_check(loaded: config_module.Config, engine: images.ImageEngine) -> Check:
    """The engine's image store: its images' size, the free space of its file system, and the floor
    under which gpubook removes its own unused images ([images] min_free_gb)."""
    try:
        path = engine.storage_path()
        stats = os.statvfs(path)
    except (GpubookError, OSError) as error:
        return Check("image store", False, f"cannot read the engine's store: {error}", "see the engine checks above")
    free, size = stats.f_bavail * stats.f_frsize, stats.f_blocks * stats.f_frsize
    usage = getattr(engine, "store_usage", None)
    try:
        counted = usage() if usage is not None else None
    except GpubookError:
        counted = None
    held = f"{counted[0]} images, {counted[1] / 1e9:.1f} GB; " if counted else ""
    floor = loaded.images.min_free_gb
    detail = f"{path}: {held}{free / 1e9:.1f} GB free of {size / 1e9:.0f} GB"
    if floor:
        detail += f" (gpubook removes its unused images under {floor:g} GB free)"
    if floor and free < floor * 1e9:
        return Check("image store", False, f"{detail}: under the floor now",
                     "free space on that file system or lower [images] min_free_gb; `gpubook images` lists what "
                     "gpubook pulled and for which bookings")
    return Check("image store", True, detail)


def _progress_check() -> Check:
    """skopeo reads an image's size from its registry: a booking waiting for its image is told how far
    the pull is ("4.1 of 9.3 GB, ready about 10:42"); without it, the bytes downloaded only."""
    found = shutil.which("skopeo")
    if found:
        return Check("image progress", True, f"{found} reads each image's size from its registry")
    return Check("image progress", False, "skopeo is not installed: a booking waiting for its image is told the "
                 "bytes downloaded, without a total or a ready time", "apt-get install skopeo", optional=True)


def checks(config_path: str | None) -> list[Check]:
    config_check, loaded = _config_check(config_path)
    result = [config_check]
    driver = gpus.driver_checks(gpus.DoctorOptions(extra_roots=loaded.nvidia.driver_roots if loaded else ()))
    result.extend(driver_section(driver, gpu_count=loaded.gpu_count if loaded else None))
    engine = loaded.engine if loaded else engines.EngineSettings()
    result.extend(engines.preflight(engine))  # the engine's own network checks included
    result.append(_templates_check(loaded))
    if loaded is not None:
        result.extend(image_checks(loaded))
        result.extend(_calendar_checks(loaded))
        result.append(identity_check(loaded))
        result.append(users_command.directory_check(loaded))
        result.append(_storage_check(loaded))
        if loaded.gpu_mps:
            result.append(mps_check())
        result.append(ports_check(loaded))
        result.append(ports_taken_check(loaded))
        result.append(web_check(loaded))
        result.extend(_sftp_checks(loaded))
        result.extend(backends.preflight(loaded))
    return result


def run(config_path: str | None, *, as_json: bool = False) -> int:
    """Print every check (or a JSON list of them); 1 if any failed, 0 with only warnings."""
    found = checks(config_path)
    if as_json:
        json.dump([c.to_json() for c in found], sys.stdout, indent=2)
        print()
        return exit_status(found)
    lines, status = format_checks(found)
    print("\n".join(lines))
    return status



