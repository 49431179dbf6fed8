"""`gpubook config show [--json]`: the effective config, every default resolved, as the daemon reads
it (issue 41). Secrets (passwords, tokens, the lab's secret) are shown only as set or not."""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterator, Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

from gpubook.scheduler.settings import Config

SECRET = re.compile(r"password|secret|token", re.IGNORECASE)
# Config's fields made from others (each user's effective policy) or kept for the daemon's own use
DERIVED = frozenset({"policies", "user_overrides", "file_users", "directory_users", "departed_users"})


def effective(config: Config) -> dict[str, Any]:
    """The config as plain JSON-able data: sections, keys, values, secrets hidden."""
    return {field.name: _plain(getattr(config, field.name), field.name)
            for field in dataclasses.fields(config) if field.name not in DERIVED}


def _plain(value: Any, key: str = "") -> Any:
    if SECRET.search(key) and value not in (None, "", ()):
        return "(set, not shown)"
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {field.name: _plain(getattr(value, field.name), field.name) for field in dataclasses.fields(value)
                if field.init}
    if isinstance(value, Mapping):
        return {str(k): _plain(v, str(k)) for k, v in value.items()}
    if isinstance(value, frozenset | set):
        return sorted(_plain(v) for v in value)
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, datetime):
        return value.isoformat()
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return str(value)


def lines(data: Mapping[str, Any], prefix: str = "") -> Iterator[str]:
    """`section.key = value`, one a line (as `git config --list` lists), values as JSON."""
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            yield from lines(value, f"{name}.")
        elif isinstance(value, list) and value and all(isinstance(item, Mapping) for item in value):
            for number, item in enumerate(value):
                yield from lines(item, f"{name}[{number}].")
        else:
            yield f"{name} = {'(unset)' if value is None else json.dumps(value, ensure_ascii=False)}"
