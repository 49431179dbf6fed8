"""A booking's GPUs as a `GpuInjection`: device nodes, read-only binds, environment, and the /proc
entries of the other GPUs to hide. Engines turn it into their own arguments; they never look for
driver files themselves.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path

from gpubook.runtime.errors import DriverError
from gpubook.runtime.mounts import Mount, missing_mount_flags
from gpubook.runtime.nvidia.catalog import (
    CONTAINER_BINARY_DIR,
    CONTAINER_LIBRARY_DIR,
    DEFAULT_CAPABILITIES,
    DEVELOPMENT_LINKS,
    LD_SO_CONF,
    PROC_GPUS,
)
from gpubook.runtime.nvidia.devices import mig_access_minor
from gpubook.runtime.nvidia.discovery import discover
from gpubook.runtime.nvidia.model import Device, Driver, GpuInjection, MigInstance
from gpubook.runtime.nvidia.paths import under


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "gpubook" / "nvidia"


def soname_links(driver: Driver) -> list[tuple[str, str]]:
    """(link name, target name) for the library folder: SONAME links plus development links."""
    links: dict[str, str] = {}
    for library in driver.libraries:
        if library.soname and library.soname != library.name:
            links[library.soname] = library.name
    for name in DEVELOPMENT_LINKS:
        target = next((soname for soname in links if soname.startswith(name + ".")), None)
        if target is not None and name not in links:
            links[name] = target
    return sorted(links.items())


def link_folder(driver: Driver, *, library_dir: str, cache_dir: Path) -> Path:
    """A host folder holding the library folder's symlinks, an empty mount point per library
    file, and the ld.so.conf.d entry; made once per driver and reused.

    Why a folder of symlinks, bound read-only over `library_dir`, with each library then bound
    onto its placeholder: the container gets exactly what a driver installation has (real files
    plus SONAME links), so the loader finds libcuda.so.1 through LD_LIBRARY_PATH when the image has
    no ldconfig (musl, distroless), and ldconfig, where the image has it, finds the links already
    correct and has nothing to write into the read-only folder. Binding each library a second time
    under its SONAME would work too, but ldconfig then warns about every such file on each start.
    """
    links = soname_links(driver)
    key = hashlib.sha256(
        repr(
            (driver.version, library_dir, sorted(f.name for f in driver.libraries), links)
        ).encode()
    ).hexdigest()[:16]
    folder = cache_dir / f"{driver.version}-{key}"
    if (folder / "complete").is_file():
        return folder
    cache_dir.mkdir(parents=True, exist_ok=True)
    staging = cache_dir / f".{folder.name}.{os.getpid()}.{threading.get_ident()}"
    shutil.rmtree(staging, ignore_errors=True)
    (staging / "lib").mkdir(parents=True)
    for library in driver.libraries:
        (staging / "lib" / library.name).touch(mode=0o644)
    for link, target in links:
        os.symlink(target, staging / "lib" / link)
    (staging / "ld.so.conf").write_text(
        f"# gpubook: the host's NVIDIA driver {driver.version}\n{library_dir}\n"
    )
    (staging / "complete").touch()
    try:
        os.rename(staging, folder)
    except OSError:
        # Another process made it first; theirs is identical.
        shutil.rmtree(staging, ignore_errors=True)
        if not (folder / "complete").is_file():
            raise DriverError(f"cannot create {folder}") from None
    return folder


def driver_binds(
    driver: Driver, *, library_dir: str = CONTAINER_LIBRARY_DIR, cache_dir: Path | None = None,
    mps: bool = False,
) -> tuple[tuple[Mount, ...], tuple[tuple[str, str], ...]]:
    """The binds every GPU container of this driver gets, and the soname links they carry; the MPS
    pipe folder only with `mps` (it lets any client stop MPS for everyone)."""
    folder = link_folder(
        driver, library_dir=library_dir, cache_dir=cache_dir or default_cache_dir()
    )
    binds = [Mount(folder / "lib", library_dir)]
    binds += [Mount(lib.host_path, f"{library_dir}/{lib.name}") for lib in driver.libraries]
    binds.append(Mount(folder / "ld.so.conf", LD_SO_CONF))
    binds += [Mount(b.host_path, f"{CONTAINER_BINARY_DIR}/{b.name}") for b in driver.binaries]
    binds += list(driver.ipc)
    if mps and driver.mps is not None:
        binds.append(mps_mount(driver.mps))
    links = tuple((f"{library_dir}/{link}", target) for link, target in soname_links(driver))
    return tuple(binds), links


def mps_mount(mount: Mount) -> Mount:
    """The MPS pipe folder, bound writable (MPS clients need it), only where it is on a nosuid,nodev
    mount: root inside a container owns what it writes there, on the host, where a setuid copy of a
    shell would run as that owner for any host login (issue 22, finding 4). MPS's default, /tmp,
    is rarely such a mount."""
    try:
        missing = missing_mount_flags(mount.source)
    except OSError as error:
        raise DriverError(f"the MPS pipe folder {mount.source}: {error.strerror}") from None
    if missing:
        raise DriverError(
            f"the MPS pipe folder {mount.source} is on a mount without {','.join(missing)}, so a setuid or "
            f"device file a container writes there would work on the host; run nvidia-cuda-mps-control with "
            f"CUDA_MPS_PIPE_DIRECTORY on a nosuid,nodev mount (such as /run/nvidia-mps) and give the daemon "
            f"the same variable, or set [gpus] mps = false")
    return mount


def inject(
    driver: Driver,
    gpus: Sequence[int | MigInstance],
    *,
    library_dir: str = CONTAINER_LIBRARY_DIR,
    cache_dir: Path | None = None,
    mps: bool = False,
) -> GpuInjection:
    """The injection for the booked `gpus` (nvidia-smi indices, or MIG instances); the MPS pipe
    folder only with `mps`."""
    if not gpus:
        raise DriverError("a GPU injection needs at least one booked GPU")
    parents = [g.gpu if isinstance(g, MigInstance) else g for g in gpus]
    whole = {g for g in gpus if not isinstance(g, MigInstance)}
    if len(set(gpus)) != len(gpus) or whole & {g.gpu for g in gpus if isinstance(g, MigInstance)}:
        raise DriverError(f"a GPU is booked twice: {list(gpus)}")
    devices = list(driver.control_devices)
    for booked in gpus:
        gpu = driver.gpu(booked.gpu if isinstance(booked, MigInstance) else booked)
        node = f"/dev/nvidia{gpu.minor}"
        if not any(d.container == node for d in devices):
            host = under(driver.root, node)
            if not host.exists():
                raise DriverError(
                    f"{node} (GPU {gpu.index}, bus {gpu.bus_id}) is missing: "
                    "run nvidia-smi once as root, or nvidia-modprobe -c=" + str(gpu.minor)
                )
            devices.append(Device(host, node))
        if isinstance(booked, MigInstance):
            # Only this instance's access capabilities, never all of /dev/nvidia-caps.
            for minor in (
                mig_access_minor(driver.root, gpu.device_minor, booked.gi),
                mig_access_minor(driver.root, gpu.device_minor, booked.gi, booked.ci),
            ):
                cap = f"/dev/nvidia-caps/nvidia-cap{minor}"
                if not under(driver.root, cap).exists():
                    raise DriverError(
                        f"{cap} is missing (nvidia-modprobe -f /proc/driver/nvidia/"
                        f"capabilities/gpu{gpu.minor}/mig/gi{booked.gi}/access)"
                    )
                devices.append(Device(under(driver.root, cap), cap))
    binds, links = driver_binds(driver, library_dir=library_dir, cache_dir=cache_dir, mps=mps)
    booked_buses = {driver.gpu(index).bus_id for index in parents}
    # Not each other GPU's /proc/driver/nvidia/gpus/<bus id> folder, as libnvidia-container does:
    # the engines' mask lists are ':'-separated and every bus id has colons. So the whole folder is
    # masked when some GPU is not booked; NVML and CUDA work from the device nodes, not from it.
    others = any(bus not in booked_buses for bus, _ in driver.proc_gpu_entries)
    hidden = (PROC_GPUS,) if others else ()
    environment = (
        # Overrides an image's NVIDIA_VISIBLE_DEVICES=all, so that where Docker's default runtime is
        # nvidia (nvidia-docker sites) its hook exposes the same GPUs and not every one.
        ("NVIDIA_VISIBLE_DEVICES", _visible_devices(driver, gpus)),
        ("CUDA_VISIBLE_DEVICES", ",".join(str(n) for n in range(len(gpus)))),
        ("NVIDIA_DRIVER_CAPABILITIES", ",".join(driver.capabilities)),
        ("GPUBOOK_LIBRARY_DIR", library_dir),
    )
    return GpuInjection(
        driver_version=driver.version,
        gpus=tuple(dict.fromkeys(parents)),
        devices=tuple(devices),
        binds=binds,
        soname_links=links,
        library_dir=library_dir,
        environment=environment,
        hidden_proc_paths=hidden,
    )


def _visible_devices(driver: Driver, gpus: Sequence[int | MigInstance]) -> str:
    if any(isinstance(g, MigInstance) for g in gpus):
        # The hook would want MIG UUIDs, which only NVML knows; "void" keeps it out altogether.
        return "void"
    return ",".join(driver.gpu(g).uuid or str(g) for g in gpus if isinstance(g, int))


def injection(
    gpus: Sequence[int | MigInstance],
    *,
    capabilities: Sequence[str] | str = DEFAULT_CAPABILITIES,
    root: Path = Path("/"),
    extra_roots: Sequence[Path] = (),
    ld_cache: str | None = None,
    environ: Mapping[str, str] | None = None,
    machine: str | None = None,
    use_nvml: bool | None = None,
    cache_dir: Path | None = None,
    library_dir: str = CONTAINER_LIBRARY_DIR,
    mps: bool = False,
) -> GpuInjection:
    """Discover the host driver and build the injection for the booked GPUs. Called at every
    booking start: the file search of an earlier start with the same driver version is reused."""
    driver = discover(
        reuse=True,
        capabilities=capabilities,
        root=root,
        extra_roots=extra_roots,
        ld_cache=ld_cache,
        environ=environ,
        machine=machine,
        use_nvml=use_nvml,
    )
    return inject(driver, gpus, library_dir=library_dir, cache_dir=cache_dir, mps=mps)

