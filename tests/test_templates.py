"""Template files: the shipped ones load; broken ones name the file and field, and are skipped."""

from __future__ import annotations

import json
from argparse import Namespace
from pathlib import Path

import pytest

from gpubook.runtime.errors import TemplateError
from gpubook.runtime.templates import cli as templates_cli
from gpubook.runtime.templates.catalog import get_template, load_all, load_template, template_names

SHIPPED = {
    "tensorflow-cuda9",
    "tensorflow-cuda8",
    "digits-cuda9",
    "digits-cuda8",
    "cuda9-base",
    "cuda8-base",
    "debian-ssh",
    "pytorch-cuda12",
    "cuda12-base",
}


def test_shipped_templates_are_valid() -> None:
    loaded = load_all()
    assert loaded.errors == {}
    assert set(loaded.templates) == SHIPPED == set(template_names())
    assert loaded.templates["tensorflow-cuda9"].cuda == "9.0"
    assert loaded.templates["cuda8-base"].cuda == "8.0"
    debian = loaded.templates["debian-ssh"]
    assert debian.cuda is None and debian.has_sshd and debian.build is not None
    assert "openssh-server" in debian.build.include


def write(folder: Path, name: str, text: str) -> Path:
    path = folder / f"{name}.toml"
    path.write_text(text)
    return path


def test_malformed_toml_names_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, "broken", 'image = "x\n')
    with pytest.raises(TemplateError, match=f"{path}: not valid TOML"):
        load_template(path)


def test_every_bad_field_is_named(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "bad",
        """
image = "debian:12"
cuda = "nine"
has_sshd = "yes"
command = "python train.py"
shm_sise = "1g"
memory = "lots"
[env]
GPUBOOK_USER = "root"
[[mounts]]
source = "relative/path"
target = "/data/output"
""",
    )
    with pytest.raises(TemplateError) as error:
        load_template(path)
    message = str(error.value)
    for field in (
        "cuda",
        "has_sshd",
        "command",
        "shm_sise: unknown key; did you mean 'shm_size'",
        "memory",
        "env.GPUBOOK_USER",
        "mounts[0].source",
        "mounts[0].target",
    ):
        assert f"{path}: {field}" in message
    assert "image" not in message.replace(str(path), "")


def test_a_broken_template_is_reported_and_skipped(tmp_path: Path) -> None:
    write(tmp_path, "good", 'image = "debian:12"\ncuda = "none"\n')
    write(tmp_path, "bad", 'cuda = "none"\n')
    loaded = load_all(tmp_path)
    assert set(loaded.templates) == {"good"}
    assert "image: is required" in loaded.errors["bad"]


def test_unknown_template_suggests_a_name(tmp_path: Path) -> None:
    with pytest.raises(TemplateError, match="did you mean 'debian-ssh'"):
        get_template("debian-shh")


def test_cli_list_show_validate(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert templates_cli.list_templates(Namespace(json=True, templates_dir=None)) == 0
    listed = json.loads(capsys.readouterr().out)
    assert {item["name"] for item in listed} == SHIPPED
    assert templates_cli.list_templates(Namespace(json=False, templates_dir=None)) == 0
    assert "Debian 12 (bookworm) minbase with sshd" in capsys.readouterr().out  # each with its description
    # `show`: the TOML file the admin edits, as it is (issue 41); --json: resolved, with the image a booking runs
    assert templates_cli.show(Namespace(name="debian-ssh", templates_dir=None)) == 0
    shown = capsys.readouterr().out
    assert shown.startswith("# ") and shown.endswith(get_template("debian-ssh").path.read_text())
    assert templates_cli.show(Namespace(name="debian-ssh", templates_dir=None, json=True)) == 0
    assert json.loads(capsys.readouterr().out)["image"] == "localhost/gpubook/debian-ssh:12"
    assert templates_cli.validate(Namespace(name=None, templates_dir=None)) == 0
    write(tmp_path, "bad", 'image = "debian:12"\ncuda = "x"\n')
    assert templates_cli.validate(Namespace(name=None, templates_dir=str(tmp_path))) == 1
    assert f"{tmp_path}/bad.toml: cuda" in capsys.readouterr().err
