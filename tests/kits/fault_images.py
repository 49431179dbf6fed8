"""The image side of the fault harness (tests/kits/faults_kit.py): a registry and templates whose
images the daemon must still prepare, so that the crash points around the image verbs are passed.

- `engine.pull` and `engine.tag`: a template pinned by digest to an image only in the registry
  (Debian's docker-registry, TLS and htpasswd): the preparer pulls it by its digest, verifies it and
  tags it with its local name. Each such point gets an image of its own (debian-ssh plus one small
  file), pushed, then untagged here: the layers stay, the name is gone, so the pull is quick.
- `engine.build`: a template on debian-ssh marked `has_sshd = false`: the preparer builds its sshd
  overlay. Each gets a template name of its own, so a new overlay tag; podman's layer cache (filled
  once at the start) makes the build a matter of seconds.
- `engine.remove_image`: one of those images prepared, its booking cancelled, and the daemon started
  with `[images] min_free_gb` above any disk: the cleanup removes gpubook's unneeded images.

A booking made for one of these starts minutes ahead (only its image is prepared now) and is
cancelled once the point is passed.
"""

from __future__ import annotations

import json
import secrets
import shutil
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path

from gpubook.runtime.engines import Engine
from gpubook.runtime.templates import overlay_image
from gpubook.runtime.templates.catalog import default_templates_dir, load_template
from tests.kits import registry_kit
from tests.kits.registry_kit import Registry

BASE = "localhost/gpubook/debian-ssh:12"
VERBS = ("pull", "tag", "build", "remove_image")
HUGE_FLOOR_GB = 10**9  # [images] min_free_gb above any disk: every unneeded image of gpubook's goes


def verb_of(point: str) -> str | None:
    """The image verb of a crash point (`engine.pull:before` → "pull"); None for the others."""
    if not point.startswith("engine."):
        return None
    verb = point.removeprefix("engine.").split(":")[0]
    return verb if verb in VERBS else None


@dataclass
class ImageSide:
    engine: Engine
    registry: Registry
    templates: Path  # the daemon's [templates] dir
    _serial: int = 0

    @classmethod
    def make(cls, engine: Engine, registry: Registry, folder: Path) -> ImageSide:
        templates = folder / "templates"
        templates.mkdir(parents=True)
        shutil.copy(default_templates_dir() / "debian-ssh.toml", templates)
        side = cls(engine, registry, templates)
        # The overlay's first build (apt-get from Debian's mirror) here, once: each later one comes
        # from podman's layer cache.
        overlay_image.build_overlay(engine, load_template(side._overlaid()))
        return side

    def config_lines(self) -> str:
        return f'\n[templates]\ndir = "{self.templates}"\n\n[images]\nauth_file = "{self.registry.auth_file}"\n'

    def template_for(self, verb: str) -> str:
        """A new template whose preparation passes `verb`; its name."""
        if verb == "build":
            return self._overlaid().stem
        return self._pinned().stem

    def run_image(self, name: str) -> str:
        """The image a booking of template `name` runs (gpubook's ledger lists it once prepared)."""
        return overlay_image.run_image(load_template(self.templates / f"{name}.toml"))

    def _next(self) -> int:
        self._serial += 1
        return self._serial

    def _overlaid(self) -> Path:
        path = self.templates / f"overlaid-{self._next()}.toml"
        path.write_text(f'image = "{BASE}"\ncuda = "none"\nhas_sshd = false\n')
        return path

    def _pinned(self) -> Path:
        number = self._next()
        local = registry_kit.tiny_image(self.engine, f"localhost/gpubench-faults/ssh:{secrets.token_hex(4)}",
                                        base=BASE)
        name = f"faults/ssh:{number}-{secrets.token_hex(3)}"
        digest = registry_kit.push(self.engine, self.registry, local, name)
        registry_kit.untag(self.engine, local)
        path = self.templates / f"pinned-{number}.toml"
        path.write_text(f'image = "{self.registry.address}/faults/ssh@{digest}"\ncuda = "none"\nhas_sshd = true\n')
        return path

    def ledger(self, state_dir: Path) -> list[str]:
        """The images gpubook's ledger holds (it removes only those)."""
        with suppress(OSError, ValueError):
            return [entry["image"] for entry in json.loads((state_dir / "images.json").read_text())]
        return []

    def close(self) -> None:
        """The images made here, out of podman's store by name (their layers stay, as registry_kit does)."""
        for path in self.templates.glob("*-*.toml"):
            template = load_template(path)
            for name in {overlay_image.base_image(template), overlay_image.run_image(template)} - {BASE}:
                registry_kit.untag(self.engine, name)
