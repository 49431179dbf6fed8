"""The generic part of the TOML reader: typed values out of TOML tables into settings dataclasses,
every error collected as `FILE: section.key: what is wrong` instead of stopping at the first."""

from __future__ import annotations

import dataclasses
import difflib
import os
import stat
import types
from collections.abc import Callable, Iterable, Mapping
from dataclasses import MISSING
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

from gpubook.scheduler.settings import Section, checks, key_of

REQUIRED = object()
Check = Callable[[Any], "str | None"]  # a settings.Check, or any function saying what is wrong


class Reader:
    """Reads typed values out of TOML tables, collecting every error instead of stopping."""

    def __init__(self, path: Path, facts: Mapping[str, Callable[[], Any]]) -> None:
        self.path = path
        self.base = path.parent  # relative paths and secret files are relative to the config
        self.facts = facts  # the host's facts that defaults name ("host name", "time zone")
        self.errors: list[str] = []

    def error(self, where: str, message: str) -> None:
        self.errors.append(f"{self.path}: {where}: {message}")

    def table(self, data: Mapping[str, Any], key: str, where: str) -> Mapping[str, Any]:
        value = data.get(key, {})
        if not isinstance(value, Mapping):
            self.error(where, f"must be a table ([{key}]), not {kind_of(value)}")
            return {}
        return value

    def unknown(self, table: Mapping[str, Any], where: str, known: list[str]) -> None:
        for key in table:
            if key not in known:
                close = difflib.get_close_matches(key, known, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else f"; known keys: {', '.join(known)}"
                self.error(join(where, key), f"unknown key{hint}")

    def get(
        self,
        table: Mapping[str, Any],
        where: str,
        key: str,
        kind: type | tuple[type, ...],
        default: Any = REQUIRED,
        check: Check | None = None,
    ) -> Any:
        place = join(where, key)
        if key not in table:
            if default is REQUIRED:
                self.error(place, "is required")
            return None if default is REQUIRED else default
        value = table[key]
        kinds = kind if isinstance(kind, tuple) else (kind,)
        # TOML booleans are ints in Python; never accept one where a number is meant.
        if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
            names = " or ".join(_type_name(k) for k in kinds)
            self.error(place, f"must be {names}, not {kind_of(value)} {value!r}")
            return None if default is REQUIRED else default
        if check is not None:
            problem = check(value)
            if problem:
                self.error(place, problem)
                return None if default is REQUIRED else default
        return value

    def strings(self, table: Mapping[str, Any], where: str, key: str, default: tuple[str, ...],
                check: Check | None = None) -> tuple[str, ...]:
        value = self.get(table, where, key, (list, str), default=list(default))
        items = [value] if isinstance(value, str) else list(value)
        result = []
        for position, item in enumerate(items):
            if not isinstance(item, str):
                self.error(f"{join(where, key)}[{position}]", f"must be a string, not {kind_of(item)}")
            elif check is not None and (problem := check(item)):
                self.error(f"{join(where, key)}[{position}]", problem)
            else:
                result.append(item)
        return tuple(result)

    def secret(self, where: str, secret_file: str) -> str | None:
        """A secret file's content; it must be readable by its owner only."""
        path = (self.base / secret_file).expanduser()
        if not self.owner_only(where, path):
            return None
        try:
            return path.read_text().strip()
        except OSError as error:
            self.error(where, f"cannot read {path}: {error.strerror}")
            return None

    def owner_only(self, where: str, path: Path) -> bool:
        """Whether `path` exists and is readable and writable by its owner only (else an error)."""
        try:
            info = path.stat()
        except OSError as error:
            self.error(where, f"cannot read {path}: {error.strerror}")
            return False
        if stat.S_IMODE(info.st_mode) & 0o077:
            self.error(where, f"{path} must be readable by its owner only (chmod 600 {path})")
            return False
        return True

    # -- the generic part: a TOML table into a settings dataclass ------------------------------

    def section(self, data: Mapping[str, Any], section: Section) -> Any:
        """A `[name]` table read by its declaration, then its own problems reported."""
        name = section.name
        value = section.cls(**self.settings(self.table(data, name, name), name, section.cls, checks=section.checks))
        for key, problem in section.problems(value) if section.problems else ():
            self.error(join(name, key), problem)
        return value

    def settings(self, table: Mapping[str, Any], where: str, cls: type, *,
                 checks: Mapping[str, Check] | None = None, given: Mapping[str, Any] | None = None,
                 only: Iterable[str] | None = None) -> dict[str, Any]:
        """Every field of `cls` read from `table` (unknown keys reported first), as keyword arguments.

        `given` fields are not read from TOML; `only` limits reading to those TOML keys."""
        given = dict(given or {})
        fields = [f for f in dataclasses.fields(cls) if f.init and f.name not in given]
        if only is not None:
            fields = [f for f in fields if key_of(f) in set(only)]
        else:
            self.unknown(table, where, [key_of(f) for f in fields])
        hints = get_type_hints(cls)
        values = given
        for item in fields:
            check = item.metadata.get("check") or (checks or {}).get(item.name)
            values[item.name] = self.value(table, where, item, hints[item.name], check, values)
        return values

    def value(self, table: Mapping[str, Any], where: str, item: dataclasses.Field[Any], hint: Any,
              check: Check | None, values: Mapping[str, Any]) -> Any:
        key, meta = key_of(item), item.metadata
        default: Any = REQUIRED
        if item.default is not MISSING:
            default = item.default
        elif item.default_factory is not MISSING:
            default = item.default_factory()
        elif meta.get("default_from"):
            default = values.get(meta["default_from"])
        if meta.get("fact"):
            default = self.facts[meta["fact"]]()
        kind = optional_of(hint)
        if isinstance(kind, type) and dataclasses.is_dataclass(kind):  # a sub-table, off unless `enabled`
            return self.switched(table, join(where, key), key, kind)
        if meta.get("secret"):
            secret_file = self.get(table, where, key, str, default=None)
            if secret_file is None:
                return os.environ.get(meta["env"]) if meta.get("env") else default
            if not secret_file and not meta.get("env"):  # [notify] always took "" for no secret
                return default
            return self.secret(join(where, key), secret_file)
        if get_origin(kind) is tuple:
            texts = self.strings(table, where, key, tuple(str(p) for p in default), check=check)
            return tuple(Path(text) for text in texts) if get_args(kind)[0] is Path else texts
        if get_origin(kind) is Literal:
            return self.get(table, where, key, str, default, check or checks.one_of(get_args(kind)))
        if kind is Path:
            text = self.get(table, where, key, str, default=default, check=check)
            path = (self.base / text).expanduser() if text else None
            if path is not None and meta.get("private") and not self.owner_only(join(where, key), path):
                return None
            return path
        if kind is float:
            number = self.get(table, where, key, (int, float), default=default, check=check)
            return float(number) if number is not None else None
        if kind in (str, int, bool):
            return self.get(table, where, key, kind, default=default, check=check)
        raise TypeError(f"{where}.{key}: the config reader cannot read a {hint!r}")

    def switched(self, data: Mapping[str, Any], where: str, key: str, cls: type[Any]) -> Any:
        table = self.table(data, key, where)
        self.unknown(table, where, ["enabled", *(key_of(f) for f in dataclasses.fields(cls))])
        if not self.get(table, where, "enabled", bool, default=False):
            return None
        return cls(**self.settings(table, where, cls, only=[key_of(f) for f in dataclasses.fields(cls)]))


def optional_of(hint: Any) -> Any:
    """`X | None` -> X; anything else as it is."""
    if get_origin(hint) in (Union, types.UnionType):
        kinds = [arg for arg in get_args(hint) if arg is not type(None)]
        if len(kinds) == 1:
            return kinds[0]
    return hint


def join(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key


def _type_name(kind: type) -> str:
    return {str: "a string", int: "an integer", float: "a number", bool: "true or false",
            list: "a list", dict: "a table"}.get(kind, kind.__name__)


def kind_of(value: Any) -> str:
    return {str: "a string", int: "an integer", float: "a number", bool: "a boolean",
            list: "a list", dict: "a table"}.get(type(value), type(value).__name__)
