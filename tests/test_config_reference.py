"""The config reference (docs/reference/config.md) and the example config are generated from the
declared settings: each equals what `gpubook config reference`/`example` prints now, no declared key
is missing from either, and the reader loads the example."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import get_type_hints

import pytest

from gpubook.scheduler import config
from gpubook.scheduler.commands import cli
from gpubook.scheduler.config import reference
from gpubook.scheduler.config.reader import optional_of
from gpubook.scheduler.config.sections import SECTIONS
from gpubook.scheduler.settings import key_of

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "reference" / "config.md"
EXAMPLE = REPO / "gpubook" / "config" / "gpubook.example.toml"
REGENERATE = "regenerate it: gpubook config {0} > {1}"


def printed(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    assert cli.main(list(argv)) == 0
    return capsys.readouterr().out


def test_the_reference_page_is_what_gpubook_config_reference_prints(capsys: pytest.CaptureFixture[str]) -> None:
    assert DOC.read_text() == printed(capsys, "config", "reference"), REGENERATE.format("reference", DOC)


def test_the_example_config_is_what_gpubook_config_example_prints_and_it_loads(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert EXAMPLE.read_text() == printed(capsys, "config", "example"), REGENERATE.format("example", EXAMPLE)
    loaded = config.load(EXAMPLE)
    assert loaded.users["alice"].uid == 1000 and loaded.calendars[0].gpus is None


def _declared(cls: type, table: str) -> list[tuple[str, str]]:
    """(table, key) of every field of a settings class, sub-tables walked, read from the dataclass itself."""
    found = []
    types = get_type_hints(cls)
    for item in dataclasses.fields(cls):
        if not item.init or (table.endswith(".NAME") and item.name == "name"):
            continue
        kind = optional_of(types[item.name])
        if isinstance(kind, type) and dataclasses.is_dataclass(kind):
            sub = f"{table}.{key_of(item)}"
            found += [(sub, "enabled"), *_declared(kind, sub)]
        else:
            found.append((table, key_of(item)))
    return found


def _tables(text: str, heading: str) -> dict[str, str]:
    """The text under each table heading (`## \\`[x]\\`` in the page, `[x]` lines in the example)."""
    parts = re.split(heading, text)
    return {parts[i]: parts[i + 1] for i in range(1, len(parts) - 1, 2)}


def test_no_declared_key_is_missing_from_the_reference_or_the_example() -> None:
    names = {"calendar": "[calendar]", "users": "users.NAME", "groups": "groups.NAME"}
    declared = [pair for section in SECTIONS for pair in _declared(section.cls, names.get(section.name, section.name))]
    assert len(declared) > 100
    page = _tables(DOC.read_text(), r"(?m)^## `\[(.+)\]`$")
    example = _tables(EXAMPLE.read_text(), r"(?m)^\[{1,2}([^\]]+)\]{1,2}$")
    example = {{"calendar": "[calendar]", "users.alice": "users.NAME", "groups.vision": "groups.NAME"}.get(k, k): v
               for k, v in example.items()}
    for table, key in declared:
        assert re.search(rf"(?m)^\| `{re.escape(key)}` \|", page.get(table, "")), f"[{table}] {key} not in {DOC}"
        in_example = re.search(rf"(?m)^(# )?{re.escape(key)} = ", example.get(table, ""))
        assert in_example, f"[{table}] {key} not in the example"
    # What the hand-written table and example used to leave out (issue 23).
    for table, key in [("web", "auth"), ("backend", "shared_dir"), ("nvidia", "driver_roots"), ("gpus", "monitor"),
                       ("gpus", "mps"), ("engine", "pids_limit"), ("engine", "memory"), ("engine", "binary")]:
        assert (table, key) in declared


def test_every_check_and_key_is_said_in_words() -> None:
    for key in reference.keys():
        check = key.section.check_of(key.item)
        assert key.help, f"[{key.table}] {key.key} has no help"
        assert check is None or getattr(check, "words", ""), f"[{key.table}] {key.key}'s check says no rule"
