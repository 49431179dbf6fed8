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
    exception type its problems raise (each package's own GpubookError); `base`, where given, is
    the class every plug-in of this kind must subclass.

    One error style for every kind: `load` raises `error` naming the plug-in ("engine 'lxc': ..."),
    and `problem` says the same for a config key ("must be ...", "cannot load the engine ...")."""

    def __init__(self, what: str, *, error: Callable[[str], Exception] = ValueError,
                 base: type | None = None) -> None:
        self.what = what
        self.error = error
        self.base = base
        self._targets: dict[str, str | T] = {}

    def register(self, name: str, target: str | T) -> None:
        """Make `name` mean `target` (a class, a factory or "package.module:Name")."""
        self._targets[name] = target

    def unregister(self, name: str) -> None:
        """Forget `name` (tests that registered a plug-in of their own)."""
        self._targets.pop(name, None)

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
        found, problem = self._import(target)
        if problem is not None:
            raise self.error(f"{self.what} {name!r}: {problem}")
        return found  # type: ignore[return-value]

    def problem(self, name: str) -> str | None:
        """None when `name` can be loaded, else what is wrong, in one sentence (for config checks)."""
        target = self._targets.get(name, name if ":" in name else None)
        if target is None:
            names = [f'"{known}"' for known in self._targets]
            return "must be " + (names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}")
        if not isinstance(target, str):
            return None
        problem = self._import(target)[1]
        return None if problem is None else problem.replace("cannot load ", f"cannot load the {self.what} ", 1)

    def _import(self, target: str) -> tuple[object, str | None]:
        """The object `target` names, or what is wrong with it ("cannot load X: why", ...)."""
        module_name, _, attribute = target.partition(":")
        if not module_name or not attribute:
            return None, f'{target!r} must be "package.module:Class"'
        try:
            found = getattr(importlib.import_module(module_name), attribute)
        except (ImportError, AttributeError) as error:
            return None, f"cannot load {target}: {error}"
        if not callable(found):
            return None, f"{target} is not a class"
        if self.base is not None and not (isinstance(found, type) and issubclass(found, self.base)):
            return None, (f"{target} is not a {self.what} (a subclass of "
                          f"{self.base.__module__.removeprefix('gpubook.')}.{self.base.__name__})")
        return found, None
