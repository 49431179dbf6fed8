"""The image a booking runs when its template's image lacks sshd or sudo, and images built locally.

- A derived image (FROM the template's image + openssh-server + sudo, Debian/Ubuntu or RHEL
  family) is built once and tagged with a hash of image and recipe, so a change of either builds
  a new one. The image preparer (gpubook/scheduler/hosts/images.py) builds it in the background, ahead of
  the booking, so no pass and no start waits for an `apt-get`.
- A template with a [build] recipe gets its image made here with mmdebstrap (the tarball cached).

gpubook/runtime/booking/ssh.py starts the booking on the image `run_image` names.
"""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import tempfile
from pathlib import Path

from gpubook.runtime import engines
from gpubook.runtime.engines import Engine
from gpubook.runtime.errors import EngineError, TemplateError
from gpubook.runtime.templates import images
from gpubook.runtime.templates.catalog import Template

log = logging.getLogger(__name__)

OVERLAY_CONTAINERFILE = """\
FROM {image}
# gpubook overlay: sshd and sudo for images that lack them (Debian/Ubuntu, then RHEL family).
RUN set -e; \\
    if command -v apt-get >/dev/null 2>&1; then \\
      apt-get update; \\
      DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \\
        openssh-server sudo; \\
      rm -rf /var/lib/apt/lists/*; \\
    elif command -v dnf >/dev/null 2>&1; then dnf install -y openssh-server sudo; dnf clean all; \\
    elif command -v yum >/dev/null 2>&1; then yum install -y openssh-server sudo; yum clean all; \\
    else echo "gpubook overlay: no apt-get, dnf or yum in {image}" >&2; exit 1; fi
LABEL gpubook.overlay-of="{image}"
"""


def base_image(template: Template) -> str:
    """The name the template's image has here (a pinned digest's verified local tag)."""
    return images.parse_reference(template.image).local_name() if "@" in template.image else template.image


def overlay_tag(template: Template) -> str:
    recipe = OVERLAY_CONTAINERFILE.format(image=base_image(template))
    digest = hashlib.sha256(f"{template.image}\n{recipe}".encode()).hexdigest()[:12]
    return f"localhost/gpubook/overlay-{template.name}:{digest}"


def run_image(template: Template) -> str:
    """The image a booking of this template runs: the template's own, or its derived overlay."""
    return base_image(template) if template.has_sshd else overlay_tag(template)


def build_overlay(engine: Engine, template: Template) -> str:
    """Build the derived image with sshd and sudo unless it is there already; give its tag."""
    tag = overlay_tag(template)
    if image_present(engine, tag):
        return tag
    builder = engines.builder(engine, why=f"template {template.name}'s sshd overlay (its image has no sshd)")
    engine.ensure_image(base_image(template))
    with tempfile.TemporaryDirectory(prefix="gpubook-overlay-") as context:
        (Path(context) / "Containerfile").write_text(
            OVERLAY_CONTAINERFILE.format(image=base_image(template))
        )
        builder.build(tag, Path(context))
    return tag


def build_rootfs_image(engine: Engine, template: Template, *, cache_dir: Path) -> str:
    """Make a template's image locally with mmdebstrap (its [build] recipe), the tarball cached."""
    if template.build is None:
        raise TemplateError(f"{template.path}: build: this template has no [build] recipe")
    if image_present(engine, template.image):
        return template.image
    builder = engines.builder(engine, why=f"template {template.name}'s image from its [build] recipe")
    builder.import_rootfs(rootfs_tarball(template, cache_dir=cache_dir), template.image)
    return template.image


def rootfs_tarball(template: Template, *, cache_dir: Path) -> Path:
    """The root file system of a template's [build] recipe as a tarball in `cache_dir/rootfs`, named by
    the recipe; made with mmdebstrap when it is not there yet."""
    recipe = template.build
    if recipe is None:
        raise TemplateError(f"{template.path}: build: this template has no [build] recipe")
    key = f"{recipe.suite} {recipe.variant} {','.join(sorted(recipe.include))}"
    tarball = cache_dir / "rootfs" / f"{hashlib.sha256(key.encode()).hexdigest()[:16]}.tar"
    if tarball.is_file():
        return tarball
    tarball.parent.mkdir(parents=True, exist_ok=True)
    partial = tarball.with_suffix(".partial.tar")
    mode = "root" if os.geteuid() == 0 else "unshare"
    argv = ["mmdebstrap", f"--mode={mode}", f"--variant={recipe.variant}", "--quiet"]
    if recipe.include:
        argv.append("--include=" + ",".join(recipe.include))
    argv += [recipe.suite, str(partial)]
    log.info("template %s: building its root file system with mmdebstrap", template.name)
    done = subprocess.run(argv, capture_output=True, text=True, check=False, stdin=subprocess.DEVNULL)
    if done.returncode != 0:
        partial.unlink(missing_ok=True)
        raise EngineError(
            f"template {template.name}: mmdebstrap failed: {(done.stderr or done.stdout).strip()[-2000:]}"
        )
    partial.replace(tarball)
    return tarball


def image_present(engine: Engine, image: str) -> bool:
    """Whether `image` is in the engine's store (any engine: its `ensure_image` without a pull)."""
    try:
        engine.ensure_image(image)
    except EngineError:
        return False
    return True
