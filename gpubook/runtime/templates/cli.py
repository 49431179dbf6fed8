"""`gpubook templates list|show|validate|build`: each takes parsed arguments, returns an exit code.

Arguments read: `templates_dir` (None: the default folder), `json` (list), `name` (show, validate,
build); build also reads `engine`, `binary`, `runtime`, `storage_driver` (None: podman, runc unset,
the user's own storage configuration, as the daemon) so it builds into the same storage the daemon
starts from.
"""

from __future__ import annotations

import json
import sys
from argparse import Namespace
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from gpubook.runtime import engines, private
from gpubook.runtime.engines import Engine, engine_from
from gpubook.runtime.errors import GpubookError, TemplateError
from gpubook.runtime.templates import overlay_image
from gpubook.runtime.templates.catalog import Template, get_template, load_all


def _folder(args: Namespace) -> Path | None:
    value = getattr(args, "templates_dir", None)
    return Path(value) if value else None


def _summary(template: Template) -> dict[str, Any]:
    return {
        "name": template.name,
        "image": template.image,
        "cuda": template.cuda,
        "has_sshd": template.has_sshd,
        "jupyter": template.jupyter,
        "description": template.description,
        "path": str(template.path),
    }


def list_templates(args: Namespace) -> int:
    loaded = load_all(_folder(args))
    if getattr(args, "json", False):
        items = [_summary(t) for t in loaded.templates.values()]
        items += [{"name": name, "error": message} for name, message in loaded.errors.items()]
        print(json.dumps(sorted(items, key=lambda item: item["name"]), indent=2))
        return 0
    for template in loaded.templates.values():
        print(f"{template.name:<20} cuda {template.cuda or '-':<5} {template.description or template.image}")
    for name, message in loaded.errors.items():
        print(f"{name:<20} INVALID: {message.splitlines()[0]}")
    return 0


def show(args: Namespace) -> int:
    try:
        template = get_template(args.name, _folder(args))
    except GpubookError as error:
        print(f"gpubook: {error}", file=sys.stderr)
        return 1
    if not getattr(args, "json", False):  # the file the admin edits, as it is
        print(f"# {template.path}")
        sys.stdout.write(Path(template.path).read_text())
        return 0
    data = asdict(template)
    data["path"] = str(template.path)
    data["mounts"] = [{"source": str(m.source), "target": m.target} for m in template.mounts]
    data["run_image"] = overlay_image.run_image(template)
    print(json.dumps(data, indent=2, default=str))
    return 0


def validate(args: Namespace) -> int:
    name = getattr(args, "name", None)
    if name:
        try:
            template = get_template(name, _folder(args))
        except GpubookError as error:
            print(error, file=sys.stderr)
            return 1
        print(f"{template.path}: ok")
        return 0
    loaded = load_all(_folder(args))
    for template in loaded.templates.values():
        print(f"{template.path}: ok")
    for message in loaded.errors.values():
        print(message, file=sys.stderr)
    return 1 if loaded.errors else 0


def import_archive(args: Namespace) -> int:
    """Load an image archive made on another machine (`podman save -o FILE IMAGE`) into this account's
    store under the template's image name: for a host that cannot build it (no mmdebstrap) or pull it."""
    def imported() -> None:
        template = get_template(args.name, _folder(args))
        archive = Path(args.file)
        if not archive.is_file():
            raise TemplateError(f"{archive}: no such file (make it on a machine that has the image: "
                                f"podman save -o {archive.name} {template.image})")
        engine = _engine(args)
        found = engines.loader(engine, why=f"importing template {template.name}'s image").load(archive)
        if template.image not in found:
            if len(found) != 1:
                raise TemplateError(f"{archive} holds {len(found)} images ({', '.join(found) or 'none named'}): "
                                    f"save only {template.name}'s, podman save -o FILE {template.image}")
            engines.loader(engine, why="naming the image").tag(found[0], template.image)
        _print_runnable(engine, template)

    return _said(imported)


def _print_runnable(engine: Engine, template: Template) -> None:
    """What the template's bookings run: its sshd overlay (built now) where it has no sshd, else its image."""
    print(overlay_image.build_overlay(engine, template) if not template.has_sshd else template.image)


def _said(action: Callable[[], None]) -> int:
    """Run a command's action: 0, or 1 with its error as one line on stderr."""
    try:
        action()
    except GpubookError as error:
        print(f"gpubook: {error}", file=sys.stderr)
        return 1
    return 0


def _engine(args: Namespace) -> Engine:
    return engine_from(getattr(args, "engine", None) or "podman", binary=getattr(args, "binary", None),
                       runtime=getattr(args, "runtime", None), storage_driver=getattr(args, "storage_driver", None),
                       network=getattr(args, "network", None) or "private")


def build(args: Namespace) -> int:
    """Make the image a template runs: mmdebstrap + import for [build] recipes, else the overlay."""
    def built() -> None:
        template = get_template(args.name, _folder(args))
        engine = _engine(args)
        if template.build is not None:
            overlay_image.build_rootfs_image(engine, template, cache_dir=private.default_cache_dir())
        _print_runnable(engine, template)

    return _said(built)
