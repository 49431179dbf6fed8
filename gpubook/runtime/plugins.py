"""Loading what the config names as "package.module:name" (a GPU monitor; engines and calendar
sources keep their registries in their own packages)."""

from __future__ import annotations

import importlib
from typing import Any


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
