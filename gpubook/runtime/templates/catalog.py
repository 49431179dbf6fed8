"""Container templates: one TOML file per template, edited by admins.

A template names an image, its CUDA version, environment, extra read-only mounts, a command, shm
size and memory, whether the image already has sshd and sudo (else gpubook builds a derived image
with them, see gpubook/runtime/templates/overlay_image.py), and whether gpubook starts JupyterLab inside. A template
that fails validation is reported with its file and field, and skipped; it never stops the others.
`template_names` and `default_templates_dir` keep their signatures: the scheduler's plan uses them.
"""

from __future__ import annotations

import difflib
import hashlib
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from gpubook.runtime.errors import TemplateError
from gpubook.runtime.mounts import Mount
from gpubook.runtime.names import TEMPLATE_NAME
from gpubook.runtime.templates import images

_SIZE = re.compile(r"^[1-9][0-9]*[bkmg]?$")
_CUDA = re.compile(r"^[0-9]+\.[0-9]+$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_IMAGE = re.compile(r"^[a-z0-9][a-z0-9._/:@-]*$", re.IGNORECASE)
_TEMPLATE_VERSION = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,39}$")
_PACKAGE = re.compile(r"^[a-z0-9][a-z0-9+.-]+$")
KEYS = [
    "description",
    "image",
    "cuda",
    "has_sshd",
    "command",
    "env",
    "mounts",
    "shm_size",
    "memory",
    "build",
    "jupyter",
    "mirror",
    "version",
]
BUILD_KEYS = ["tool", "suite", "variant", "include"]


@dataclass(frozen=True)
class BuildRecipe:
    """How `gpubook templates build` makes the image locally (no registry): mmdebstrap + import."""

    suite: str = "bookworm"
    variant: str = "minbase"
    include: tuple[str, ...] = ()
    tool: str = "mmdebstrap"


@dataclass(frozen=True)
class Template:
    name: str
    path: Path
    image: str
    description: str = ""
    cuda: str | None = None  # "9.0"; None: the image needs no CUDA
    has_sshd: bool = False  # the image already has sshd and sudo; else a derived image adds them
    command: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    mounts: tuple[Mount, ...] = ()  # extra host folders, always read-only
    shm_size: str | None = None
    memory: str | None = None
    build: BuildRecipe | None = None
    # gpubook starts JupyterLab inside as the booker, on a unix socket only the booker's SSH reaches
    # (gpubook/runtime/booking/jupyter.py); an image without JupyterLab still starts, and its event says so
    jupyter: bool = False
    mirror: str | None = None  # a registry (host[/path]) tried first for the image, then its own
    # The admin's version of the template ("3", "2026-11"): in each booking's provenance card; None: not given.
    version: str | None = None
    sha256: str | None = None  # of the template's file as read: the provenance card's exact version


@dataclass(frozen=True)
class TemplateSet:
    """Every template of a folder: the valid ones, and one message per file that is not."""

    templates: Mapping[str, Template]
    errors: Mapping[str, str] = field(default_factory=dict)


def default_templates_dir() -> Path:
    """The templates shipped with gpubook (package data: the same in a checkout and an installed wheel)."""
    return Path(__file__).resolve().parents[2] / "templates"


def template_names(directory: Path | None = None) -> frozenset[str]:
    """Names of the templates present (file stem of each *.toml), valid or not."""
    folder = directory or default_templates_dir()
    return frozenset(path.stem for path in folder.glob("*.toml"))


def load_all(directory: Path | None = None) -> TemplateSet:
    """Load every template; a broken one is reported in `errors` and skipped."""
    folder = directory or default_templates_dir()
    templates: dict[str, Template] = {}
    errors: dict[str, str] = {}
    for path in sorted(folder.glob("*.toml")):
        try:
            templates[path.stem] = load_template(path)
        except TemplateError as error:
            errors[path.stem] = str(error)
    return TemplateSet(templates=templates, errors=errors)


def get_template(name: str, directory: Path | None = None) -> Template:
    folder = directory or default_templates_dir()
    if not TEMPLATE_NAME.fullmatch(name):
        raise TemplateError(f"{name!r} is not a valid template name")
    path = folder / f"{name}.toml"
    if not path.is_file():
        known = sorted(template_names(folder))
        close = difflib.get_close_matches(name, known, n=1)
        hint = (
            f"; did you mean {close[0]!r}?" if close else f"; known: {', '.join(known) or 'none'}"
        )
        raise TemplateError(f"no template {name!r} in {folder}{hint}")
    return load_template(path)


def load_template(path: Path) -> Template:
    """Read and validate one template file; TemplateError lists each problem: `file: field: ...`."""
    try:
        raw = path.read_bytes()
        data = tomllib.loads(raw.decode())
    except OSError as error:
        raise TemplateError(f"{path}: cannot read: {error.strerror}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as error:
        raise TemplateError(f"{path}: not valid TOML: {error}") from None
    checker = _Checker(path)
    template = checker.template(data)
    if checker.errors or template is None:
        raise TemplateError("\n".join(checker.errors))
    return replace(template, sha256=hashlib.sha256(raw).hexdigest())


class _Checker:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.errors: list[str] = []

    def error(self, where: str, message: str) -> None:
        self.errors.append(f"{self.path}: {where}: {message}")

    def template(self, data: Mapping[str, Any]) -> Template | None:
        name = self.path.stem
        if not TEMPLATE_NAME.fullmatch(name):
            self.error(
                "file name",
                "must be a template name: lower-case ASCII letters, digits, "
                "'.', '_' and '-', at most 64 characters, then .toml",
            )
        self.unknown(data, "", KEYS)
        image = self.string(
            data,
            "image",
            required=True,
            pattern=_IMAGE,
            hint="an image name such as 'nvidia/cuda:9.0-base-ubuntu16.04' or a digest",
        )
        cuda = self.string(
            data,
            "cuda",
            required=True,
            pattern=re.compile(r"^(none|[0-9]+\.[0-9]+)$"),
            hint='a CUDA version such as "9.0", or "none"',
        )
        template = Template(
            name=name,
            path=self.path,
            image=image or "",
            description=self.string(data, "description") or "",
            cuda=None if cuda in (None, "none") else cuda,
            has_sshd=self.boolean(data, "has_sshd"),
            command=self.command(data),
            env=self.env(data),
            mounts=self.mounts(data),
            shm_size=self.string(
                data, "shm_size", pattern=_SIZE, hint="a size such as '512m' or '2g'"
            ),
            memory=self.string(data, "memory", pattern=_SIZE, hint="a size such as '16g'"),
            build=self.build(data),
            jupyter=self.boolean(data, "jupyter"),
            mirror=self.mirror(data),
            version=self.version(data),
        )
        if image:
            try:
                images.parse_reference(image)
            except TemplateError as error:
                self.error("image", str(error))
        return None if self.errors else template

    def version(self, data: Mapping[str, Any]) -> str | None:
        value = data.get("version")
        if value is None:
            return None
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return str(value)
        if isinstance(value, str) and _TEMPLATE_VERSION.match(value):
            return value
        self.error("version", f"{value!r} is not a version such as 3 or \"2026-11.1\" "
                              "(letters, digits, '.', '_', '+' and '-', at most 40 characters)")
        return None

    def mirror(self, data: Mapping[str, Any]) -> str | None:
        mirror = self.string(data, "mirror")
        problem = images.mirror_problem(mirror) if mirror is not None else None
        if problem:
            self.error("mirror", f"{mirror!r} {problem}")
            return None
        return mirror

    def unknown(self, table: Mapping[str, Any], where: str, known: list[str]) -> None:
        for key in table:
            if key not in known:
                close = difflib.get_close_matches(key, known, n=1)
                hint = f"did you mean {close[0]!r}?" if close else f"known keys: {', '.join(known)}"
                self.error(f"{where}{key}", f"unknown key; {hint}")

    def string(
        self,
        table: Mapping[str, Any],
        key: str,
        *,
        where: str = "",
        required: bool = False,
        pattern: re.Pattern[str] | None = None,
        hint: str = "",
    ) -> str | None:
        if key not in table:
            if required:
                self.error(f"{where}{key}", "is required" + (f" ({hint})" if hint else ""))
            return None
        value = table[key]
        if not isinstance(value, str):
            self.error(f"{where}{key}", f"must be a string, not {type(value).__name__} {value!r}")
            return None
        if pattern is not None and not pattern.match(value):
            self.error(f"{where}{key}", f"{value!r} is not {hint}")
            return None
        return value

    def boolean(self, table: Mapping[str, Any], key: str) -> bool:
        value = table.get(key, False)
        if not isinstance(value, bool):
            self.error(key, f"must be true or false, not {value!r}")
            return False
        return value

    def command(self, data: Mapping[str, Any]) -> tuple[str, ...]:
        value = data.get("command", [])
        if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
            self.error(
                "command",
                'must be a list of strings (an argv, e.g. ["jupyter", "notebook"]), '
                "never a shell string",
            )
            return ()
        return tuple(value)

    def env(self, data: Mapping[str, Any]) -> tuple[tuple[str, str], ...]:
        table = data.get("env", {})
        if not isinstance(table, Mapping):
            self.error("env", 'must be a table of NAME = "value"')
            return ()
        pairs = []
        for name, value in table.items():
            if not _ENV_NAME.match(name) or name.startswith("GPUBOOK_"):
                self.error(
                    f"env.{name}", "is not a usable variable name (GPUBOOK_* is gpubook's own)"
                )
            elif not isinstance(value, str) or "\n" in value or "\0" in value:
                self.error(f"env.{name}", "must be a one-line string")
            else:
                pairs.append((name, value))
        return tuple(sorted(pairs))

    def mounts(self, data: Mapping[str, Any]) -> tuple[Mount, ...]:
        items = data.get("mounts", [])
        if not isinstance(items, list):
            self.error("mounts", "must be a list of tables ([[mounts]] source = ..., target = ...)")
            return ()
        mounts = []
        for position, item in enumerate(items):
            where = f"mounts[{position}]."
            if not isinstance(item, Mapping):
                self.error(f"mounts[{position}]", "must be a table with source and target")
                continue
            self.unknown(item, where, ["source", "target"])
            path = re.compile(r"^/[^:,\0\n]*$")
            hint = "an absolute path without ':' or ','"
            source = self.string(
                item, "source", where=where, required=True, pattern=path, hint=hint
            )
            target = self.string(
                item, "target", where=where, required=True, pattern=path, hint=hint
            )
            if target is not None and (
                target in ("/", "/data/input", "/data/output", "/.gpubook")
                or ".." in target.split("/")
            ):
                self.error(f"{where}target", f"{target!r} is reserved or climbs out with '..'")
            elif source and target:
                mounts.append(Mount(Path(source), target, read_only=True))
        return tuple(mounts)

    def build(self, data: Mapping[str, Any]) -> BuildRecipe | None:
        table = data.get("build")
        if table is None:
            return None
        if not isinstance(table, Mapping):
            self.error("build", "must be a table ([build])")
            return None
        self.unknown(table, "build.", BUILD_KEYS)
        tool = (
            self.string(
                table,
                "tool",
                where="build.",
                pattern=re.compile("^mmdebstrap$"),
                hint='"mmdebstrap" (the only builder)',
            )
            or "mmdebstrap"
        )
        suite = (
            self.string(
                table,
                "suite",
                where="build.",
                pattern=re.compile(r"^[a-z]+$"),
                hint="a Debian suite such as 'bookworm'",
            )
            or "bookworm"
        )
        variant = (
            self.string(
                table,
                "variant",
                where="build.",
                pattern=re.compile(r"^[a-z]+$"),
                hint="an mmdebstrap variant such as 'minbase'",
            )
            or "minbase"
        )
        include = table.get("include", [])
        if not isinstance(include, list) or not all(
            isinstance(p, str) and _PACKAGE.match(p) for p in include
        ):
            self.error("build.include", "must be a list of Debian package names")
            include = []
        return BuildRecipe(suite=suite, variant=variant, include=tuple(include), tool=tool)
