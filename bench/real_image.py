"""A real-size image for the benchmarks: gpubook's debian-ssh (Debian 12 with sshd) plus PyTorch and JAX
with their CUDA libraries from PyPI, in six layers as real images are layered, built once and pushed to
the tests' registry (tests/kits/registry_kit.py, whose storage is cached in ~/.cache/gpubook/registry);
the local copy is removed, so that a pull really pulls.

    python bench/real_image.py [--wheels DIR]    (as the account whose podman store is measured)

Layers above debian-ssh: (1) python3-venv and a venv in /opt/venv (apt-get over the host network),
(2) cuBLAS and cuDNN, (3) the other CUDA 13 libraries, (4) torch, (5) triton and torchvision, (6) JAX
with its own CUDA 12 stack (a lab image often carries two frameworks, each with its CUDA). The wheels
are downloaded once into DIR (default ~/.cache/gpubook/wheels) by `pip download`, with the caller's pip
configuration, and bound into the build (RUN --mount), so no layer holds a wheel.
"""

from __future__ import annotations

import argparse
import json
import ssl
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpubook.runtime.engines import Engine, engine_from  # noqa: E402
from gpubook.runtime.templates import overlay_image  # noqa: E402
from gpubook.runtime.templates.catalog import get_template  # noqa: E402
from tests.kits import registry_kit  # noqa: E402
from tests.kits.engine_suite import CACHE_DIR  # noqa: E402

REPOSITORY = "bench/pytorch-cuda"
TAG = "torch2.14.1-jax0.10.2-v1"  # a new tag whenever LAYERS or REQUIREMENTS change
WHEELS = CACHE_DIR / "wheels"
FACTS = CACHE_DIR / "real-image.json"  # what podman said of the local image when it was built
REQUIREMENTS = ("torch==2.14.1", "torchvision==0.29.1", "triton==3.8.0", "jax[cuda12]==0.10.2")
PIP = "/opt/venv/bin/pip install --no-index --no-cache-dir --find-links /wheels"
CUDA13 = ("nvidia-cuda-cupti nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse "
          "nvidia-cusparselt-cu13 nvidia-nccl-cu13 nvidia-nvshmem-cu13 nvidia-nvtx nvidia-nvjitlink "
          "nvidia-cuda-nvrtc nvidia-cuda-runtime")
TORCH_DEPS = ("sympy mpmath networkx jinja2 markupsafe fsspec filelock typing-extensions cuda-toolkit "
              "cuda-bindings cuda-pathfinder setuptools")
LAYERS = (
    "RUN apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "
    "python3-venv python3-pip && rm -rf /var/lib/apt/lists/* && python3 -m venv /opt/venv",
    f"RUN --mount=type=bind,target=/wheels {PIP} nvidia-cublas nvidia-cudnn-cu13",
    f"RUN --mount=type=bind,target=/wheels {PIP} {CUDA13}",
    f"RUN --mount=type=bind,target=/wheels {PIP} --no-deps torch==2.14.1 {TORCH_DEPS}",
    f"RUN --mount=type=bind,target=/wheels {PIP} triton==3.8.0 torchvision==0.29.1",
    f"RUN --mount=type=bind,target=/wheels {PIP} 'jax[cuda12]==0.10.2'",
)


@dataclass(frozen=True)
class Layer:
    digest: str
    compressed: int  # bytes, as the registry holds it


def manifest(registry: registry_kit.Registry, repository: str, tag: str) -> dict[str, object] | None:
    """The image's manifest from the registry's HTTP API (basic auth, the registry's own CA), or None
    when the registry has no such tag."""
    auth = json.loads(registry.auth_file.read_text())["auths"][registry.address]["auth"]
    request = urllib.request.Request(f"https://{registry.address}/v2/{repository}/manifests/{tag}", headers={
        "Authorization": f"Basic {auth}",
        "Accept": "application/vnd.oci.image.manifest.v1+json, application/vnd.docker.distribution.manifest.v2+json",
    })
    context = ssl.create_default_context(cafile=str(registry.folder / "ca.crt"))
    try:
        with urllib.request.urlopen(request, context=context, timeout=30) as answer:  # noqa: S310 - https only
            return json.loads(answer.read())  # type: ignore[no-any-return]
    except urllib.error.HTTPError as error:
        if error.code == 404:
            return None
        raise


def layers(registry: registry_kit.Registry, reference: str) -> list[Layer]:
    """The layers of `reference` (ADDRESS/REPOSITORY:TAG) as the registry lists them, base first."""
    repository, tag = reference.removeprefix(registry.address + "/").rsplit(":", 1)
    found = manifest(registry, repository, tag)
    if found is None:
        raise RuntimeError(f"the registry has no image {reference}")
    return [Layer(str(item["digest"]), int(item["size"])) for item in found["layers"]]  # type: ignore[attr-defined]


def download_wheels(folder: Path) -> None:
    """REQUIREMENTS and their dependencies as wheels for Debian 12's python 3.11 on x86_64, once."""
    done = folder / ".complete"
    if done.exists():
        return
    if sys.version_info[:2] != (3, 11) or not sys.platform.startswith("linux"):
        raise RuntimeError("the wheels are for Debian 12's python 3.11: run this with a python 3.11 on Linux")
    folder.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "--only-binary=:all:", "--dest", str(folder),
                    *REQUIREMENTS], check=True)
    done.touch()


def containerfile(base: str) -> str:
    return "\n".join([f"FROM {base}", *LAYERS, ""])


def build(engine: Engine, *, base: str, wheels: Path, tag: str) -> None:
    """One image layer per LAYERS line on `base`; the wheels folder is the build context."""
    with tempfile.TemporaryDirectory(prefix="gpubook-real-image-") as folder:
        path = Path(folder) / "Containerfile"
        path.write_text(containerfile(base))
        subprocess.run([*engine.global_argv(), "build", "--layers", "--network", "host",  # type: ignore[attr-defined]
                        "--file", str(path), "--tag", tag, str(wheels)], check=True)


def push(engine: Engine, registry: registry_kit.Registry, image: str, target: str) -> None:
    """registry_kit.push without its 10-minute limit: compressing 10 GB on 2 cores takes longer."""
    subprocess.run([*engine.global_argv(), "push", "--authfile", str(registry.auth_file),  # type: ignore[attr-defined]
                    image, f"{registry.address}/{target}"], check=True)


def local_facts(engine: Engine, image: str) -> dict[str, object]:
    """Podman's size of the image and of each layer (`podman history`, newest first)."""
    size = int(registry_kit.podman(engine, "image", "inspect", "--format", "{{.Size}}", image).strip())
    history = json.loads(registry_kit.podman(engine, "history", "--format", "json", image))
    return {"size": size, "layers": [int(entry["size"]) for entry in history if int(entry["size"]) > 0][::-1]}


def remove_built(engine: Engine, tag: str) -> None:
    """The built image and the build's intermediate images, so that nothing of it is left locally but
    the debian-ssh base."""
    chain = registry_kit.podman(engine, "history", "--quiet", "--format", "{{.ID}}", tag).split()
    base = registry_kit.podman(engine, "image", "inspect", "--format", "{{.Id}}",
                               "localhost/gpubook/debian-ssh:12").strip()
    registry_kit.remove(engine, tag)
    for image in chain:
        if image != "<missing>" and not base.startswith(image):
            registry_kit.remove(engine, image)


def real_image(engine: Engine, registry: registry_kit.Registry, *, wheels: Path = WHEELS) -> str:
    """The real-size image's reference in `registry`; built and pushed first if the registry's cached
    storage does not hold it yet (tens of minutes on 2 cores), and never left in podman's storage."""
    reference = f"{registry.address}/{REPOSITORY}:{TAG}"
    if manifest(registry, REPOSITORY, TAG) is not None:
        return reference
    base = overlay_image.build_rootfs_image(engine, get_template("debian-ssh"), cache_dir=CACHE_DIR)
    download_wheels(wheels)
    local = f"localhost/gpubook-bench/pytorch-cuda:{TAG}"
    build(engine, base=base, wheels=wheels, tag=local)
    FACTS.write_text(json.dumps(local_facts(engine, local)))
    push(engine, registry, local, f"{REPOSITORY}:{TAG}")
    remove_built(engine, local)
    return reference


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wheels", type=Path, default=WHEELS, help="the wheel cache (default %(default)s)")
    args = parser.parse_args()
    engine = engine_from("podman", runtime="runc", storage_driver="overlay")
    with registry_kit.running() as registry:
        reference = real_image(engine, registry, wheels=args.wheels)
        pushed = layers(registry, reference)
    facts = json.loads(FACTS.read_text()) if FACTS.exists() else {}
    print(f"reference: {reference} (the port changes with each registry run)")
    if facts:
        print(f"size (podman, when built): {facts['size'] / 1e9:.2f} GB; its layers, base first: "
              + " ".join(f"{size / 1e9:.2f}" for size in facts["layers"]) + " GB")
    total = sum(layer.compressed for layer in pushed)
    print(f"layers: {len(pushed)}; compressed in the registry: {total / 1e9:.2f} GB: "
          + " ".join(f"{layer.compressed / 1e9:.2f}" for layer in pushed) + " GB")


if __name__ == "__main__":
    main()
