"""One way to name a plug-in: a registered name, or "package.module:Name" for one outside gpubook.

Engines, calendar sources and backends keep a `Registry` each in their own package (registering
costs no import: targets are "module:Class" strings, imported when used); a GPU monitor is a
plain "package.module:name" (`load_callable`). Errors are one sentence naming what is wrong.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any, Generic, TypeVar

T = TypeVar("T")


def load_callable(target: str, *, what: str) -> Any:
    """The callable `target` ("package.module:name") names; ValueError says what is wrong in one line."""
    module_name, colon, attribute = target.partition(":")
    if not colon or not module_name or not attribute:
        raise ValueError(f'{what} {target!r} must be "package.module:name"')
    try:
        found = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"{what} {target!r} cannot be loaded: {error}") from None
    if not callable(found):
        raise ValueError(f"{what} {target!r} is not callable")
    return found


class Registry(Generic[T]):
    """Names of one kind of plug-in (`what`: "engine", "calendar source", "backend") and what they
    mean: a class or factory, or its "package.module:Name" imported on first use. `error` is the
    exception type its problems raise (each package's own GpubookError)."""

    def __init__(self, what: str, *, error: Callable[[str], Exception] = ValueError) -> None:
        self.what = what
        self.error = error
        self._targets: dict[str, str | T] = {}

    def register(self, name: str, target: str | T) -> None:
        """Make `name` mean `target` (a class, a factory or "package.module:Name")."""
        self._targets[name] = target

    def names(self) -> list[str]:
        return list(self._targets)

    def known(self) -> str:
        """The registered names for a sentence: '"podman", "docker"'."""
        return ", ".join(f'"{name}"' for name in self._targets)

    def load(self, name: str) -> T:
        """What `name` means: a registered name, or "package.module:Name"; raises `error`."""
        target = self._targets.get(name, name if ":" in name else None)
        if target is None:
            raise self.error(f'unknown {self.what} {name!r} (known: {self.known()}, or "package.module:Class")')
        if not isinstance(target, str):
            return target
        module_name, _, attribute = target.partition(":")
        if not module_name or not attribute:
            raise self.error(f'{self.what} {name!r}: {target!r} must be "package.module:Class"')
        try:
            found = getattr(importlib.import_module(module_name), attribute)
        except (ImportError, AttributeError) as error:
            raise self.error(f"{self.what} {name!r}: cannot load {target}: {error}") from None
        if not callable(found):
            raise self.error(f"{self.what} {name!r}: {target} is not a class")
        return found  # type: ignore[no-any-return]

    def problem(self, name: str) -> str | None:
        """None when `name` can be loaded, else what is wrong, in one sentence (for config checks)."""
        try:
            self.load(name)
        except Exception as error:  # noqa: BLE001 - `error` is the registry's own type
            return str(error)
        return None
