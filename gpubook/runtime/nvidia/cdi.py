"""The same injection as a CDI spec (Container Device Interface), for `gpubook gpus cdi`.

One device per GPU index ("0", "1", …), one per UUID ("GPU-…"), and "all". The driver's files,
the soname-link folder, the control nodes and IPC sockets are the spec's common edits; each device
adds its /dev/nvidiaN. Written as JSON, which CDI accepts as well as YAML.

What a CDI spec cannot say, and the engine must still add: `--cap-drop MKNOD`, masking
/proc/driver/nvidia/gpus (CDI has no masked paths), and CUDA_VISIBLE_DEVICES=0..n-1 (a per-device
value would be overwritten when several devices are requested). Each engine's GPU arguments
(runtime.engines) do all of these for the explicit form.

cdiVersion is the lowest version the content needs, decided as the CDI project's own
specs-go/version.go does (cncf-tags/container-device-interface): 0.3.0 is the earliest still
accepted; 0.4.0 added a mount `type`; 0.5.0 allowed device names that start with a digit and the
`hostPath` of device nodes; 0.6.0 annotations and dots in the kind's class; 0.7.0 IntelRdt and
additionalGIDs; 0.8.0 changed only the Go API. Index names ("0") make 0.5.0 the usual answer;
podman >= 4.1 reads it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

from gpubook.runtime.errors import DriverError
from gpubook.runtime.mounts import Mount
from gpubook.runtime.nvidia.catalog import CONTAINER_LIBRARY_DIR, DEFAULT_CAPABILITIES
from gpubook.runtime.nvidia.discovery import discover
from gpubook.runtime.nvidia.injection import driver_binds
from gpubook.runtime.nvidia.model import Device, Driver

KIND = "nvidia.com/gpu"
MOUNT_OPTIONS = ["ro", "nosuid", "nodev", "bind"]
_VERSIONS = ("0.3.0", "0.4.0", "0.5.0", "0.6.0", "0.7.0", "0.8.0")


def _edits_of(spec: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    return [spec.get("containerEdits", {})] + [
        d.get("containerEdits", {}) for d in spec.get("devices", [])
    ]


def minimum_version(spec: Mapping[str, Any]) -> str:
    """The lowest cdiVersion whose features cover `spec`."""
    edits = _edits_of(spec)
    if any(e.get("intelRdt") or e.get("additionalGids") for e in edits):
        return "0.7.0"
    vendor, _, kind_class = str(spec.get("kind", "")).partition("/")
    if (
        spec.get("annotations")
        or any(d.get("annotations") for d in spec.get("devices", []))
        or "." in kind_class
    ):
        return "0.6.0"
    if any(not str(d.get("name", "a"))[:1].isalpha() for d in spec.get("devices", [])) or any(
        n.get("hostPath") for e in edits for n in e.get("deviceNodes", [])
    ):
        return "0.5.0"
    if any(m.get("type") for e in edits for m in e.get("mounts", [])):
        return "0.4.0"
    return "0.3.0"


def _node(device: Device) -> dict[str, str]:
    node = {"path": device.container}
    if str(device.host) != device.container:
        node["hostPath"] = str(device.host)
    return node


def _mount(bind: Mount) -> dict[str, Any]:
    options = MOUNT_OPTIONS if bind.read_only else ["nosuid", "nodev", "bind"]
    return {"hostPath": str(bind.source), "containerPath": bind.target, "options": list(options)}


def spec(
    driver: Driver,
    *,
    library_dir: str = CONTAINER_LIBRARY_DIR,
    cache_dir: Path | None = None,
) -> dict[str, Any]:
    """The CDI spec of this host's driver and GPUs (MIG instances are not listed)."""
    if not driver.gpus:
        raise DriverError("the driver lists no GPU, so there is nothing to describe")
    binds, _links = driver_binds(driver, library_dir=library_dir, cache_dir=cache_dir)
    devices: list[dict[str, Any]] = []
    for gpu in driver.gpus:
        node = _node(
            Device(driver.root / f"dev/nvidia{gpu.minor}", f"/dev/nvidia{gpu.minor}")
        )
        devices.append({"name": str(gpu.index), "containerEdits": {"deviceNodes": [node]}})
    for gpu in driver.gpus:
        if gpu.uuid:
            devices.append(
                {"name": gpu.uuid, "containerEdits": devices[gpu.index]["containerEdits"]}
            )
    devices.append(
        {
            "name": "all",
            "containerEdits": {
                "deviceNodes": [
                    n
                    for d in devices[: len(driver.gpus)]
                    for n in d["containerEdits"]["deviceNodes"]
                ]
            },
        }
    )
    result: dict[str, Any] = {
        "cdiVersion": "",
        "kind": KIND,
        "devices": devices,
        "containerEdits": {
            "env": [
                f"NVIDIA_DRIVER_CAPABILITIES={','.join(driver.capabilities)}",
                f"GPUBOOK_LIBRARY_DIR={library_dir}",
            ],
            "deviceNodes": [_node(d) for d in driver.control_devices],
            "mounts": [_mount(b) for b in binds],
        },
    }
    result["cdiVersion"] = minimum_version(result)
    return result


def render(cdi_spec: Mapping[str, Any]) -> str:
    return json.dumps(cdi_spec, indent=2) + "\n"


def write(cdi_spec: Mapping[str, Any], path: Path) -> None:
    """Write atomically (a runtime reading the folder never sees half a file), mode 0644."""
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(descriptor, "w") as file:
            file.write(render(cdi_spec))
        os.chmod(temporary, 0o644)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def cli_gpus_cdi(
    args: argparse.Namespace, *, extra_roots: Sequence[Path] = (), out: TextIO | None = None
) -> int:
    """`gpubook gpus cdi [--output FILE]`: print the spec, or write it to FILE."""
    out = out or sys.stdout
    try:
        driver = discover(capabilities=DEFAULT_CAPABILITIES, extra_roots=tuple(extra_roots))
        cache_dir = getattr(args, "cache_dir", None)
        # The spec names the soname-link folder by path: it must outlive this command (for a spec
        # in /etc/cdi, pass a system folder such as /var/lib/gpubook/nvidia).
        cdi_spec = spec(driver, cache_dir=Path(cache_dir) if cache_dir else None)
    except DriverError as error:
        print(f"no CDI spec: {error}", file=out)
        return 1
    output = getattr(args, "output", None)
    if output:
        try:
            write(cdi_spec, Path(output))
        except OSError as error:
            print(f"cannot write {output}: {error.strerror}", file=out)
            return 1
        print(
            f"wrote {output}: CDI {cdi_spec['cdiVersion']}, {KIND}, "
            f"{len(driver.gpus)} GPU(s), driver {driver.version}",
            file=out,
        )
    else:
        out.write(render(cdi_spec))
    return 0
