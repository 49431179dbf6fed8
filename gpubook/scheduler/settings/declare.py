"""How a setting is declared: `setting(default, help, check=...)` on a frozen dataclass field, and
`Section`, the declaration of one TOML table, which the reader (scheduler.config) reads and the
reference (`gpubook config reference`) and the example config are generated from.

Pure: no file is read here. A default that depends on the host (its name, its time zone) is named
as a `fact`, which the reader supplies.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from dataclasses import MISSING, dataclass, field
from types import MappingProxyType
from typing import Any, Literal


@dataclass(frozen=True)
class Check:
    """A value's check: `problem(value)` is None when it is fine, else what is wrong with it;
    `words` says the rule in the reference ("greater than 0")."""

    words: str
    problem: Callable[[Any], str | None]

    def __call__(self, value: Any) -> str | None:
        return self.problem(value)


def setting(default: Any = MISSING, help: str = "", *, check: Check | None = None,
            factory: Callable[[], Any] | None = None, key: str | None = None,
            secret: bool = False, env: str | None = None, default_from: str | None = None,
            private: bool = False, fact: str | None = None, example: Any = None, sample: Any = None) -> Any:
    """A config field: its default (or `factory`), help with its unit, and its check.

    `check` gets the TOML value (each item, for a list); `key` is the TOML key when it is not the
    field's name; `secret`: the key names a file (mode 0600) whose content is the value, else the
    variable `env`; `default_from`: the default is the value read for that other field; `fact`: the
    default is this fact of the host, which the reader looks up ("host name", "time zone"). A
    `Path` is relative to the config file's folder; a tuple of them is taken as written; `private`:
    the Path names a file of credentials read later, which must be its owner's only (mode 0600).
    `example`: a value the example config sets; `sample`: what a value looks like, shown there
    commented out for a key whose default is None (unset)."""
    metadata = {"help": help, "check": check, "key": key, "secret": secret, "env": env,
                "default_from": default_from, "private": private, "fact": fact, "example": example,
                "sample": sample}
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    if fact is not None:
        return field(default="", metadata=metadata)
    return field(default=default, metadata=metadata, repr=not secret)


Shape = Literal["table", "tables", "named"]  # [name], [[name]], [name.KEY]


@dataclass(frozen=True)
class Section:
    """One top-level TOML table, declared beside the code that uses it.

    `shape`: "table" ([name]), "tables" ([[name]], a list) or "named" ([name.KEY] per key);
    `checks`/`helps`/`samples`: checks, help and sample values of fields declared without them (`[engine]`, declared in
    runtime.engines); `problems(value)` lists (key, what is wrong) of the section as a whole, once
    read; `refusal(value)` is a sentence why the daemon must not start with it, asked only when
    everything else read without error."""

    name: str
    cls: type
    about: str
    shape: Shape = "table"
    checks: Mapping[str, Check] = field(default_factory=lambda: MappingProxyType({}))
    helps: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    samples: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    problems: Callable[[Any], Iterable[tuple[str, str]]] | None = None
    refusal: Callable[[Any], str | None] | None = None

    def fields(self) -> list[dataclasses.Field[Any]]:
        return [item for item in dataclasses.fields(self.cls) if item.init]

    def help_of(self, item: dataclasses.Field[Any]) -> str:
        return str(item.metadata.get("help") or self.helps.get(item.name, ""))

    def check_of(self, item: dataclasses.Field[Any]) -> Check | None:
        check: Check | None = item.metadata.get("check") or self.checks.get(item.name)
        return check


def key_of(item: dataclasses.Field[Any]) -> str:
    """The TOML key of a field: its `key`, else its name."""
    return str(item.metadata.get("key") or item.name)
