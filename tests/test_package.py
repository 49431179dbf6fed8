"""The package as a lab gets it: every import declared, a lean daemon, one sentence for a missing
extra, and (marker `install`) the wheel built from a clean copy of the tree, installed into a fresh
venv outside the checkout at the locked versions, used from an unrelated directory."""

from __future__ import annotations

import ast
import importlib.metadata
import os
import re
import subprocess
import sys
import tarfile
import tomllib
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpubook import __version__, extras

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT_FILE = tomllib.loads((ROOT / "pyproject.toml").read_text())
PYPROJECT = PYPROJECT_FILE["project"]
# The modules that exist only for one extra (everything else is the daemon and its commands).
EXTRA_MODULES = {"gpubook.scheduler.outbox.web": "web", "gpubook.scheduler.commands.web": "web",
                 "gpubook.scheduler.outbox.report_plots": "report", "gpubook.scheduler.directory.ldap": "ldap"}
EXTRA_PACKAGES = sorted({name for _, modules in extras.EXTRAS.values() for name in modules})
NOT_RUNTIME = {"_typeshed"}  # type-checking-only imports


def _name(requirement: str) -> str:
    """`caldav>=3.6` -> `caldav`, normalised as PEP 503 does."""
    return re.sub(r"[-_.]+", "-", re.split(r"[\s<>=!~;\[]", requirement, maxsplit=1)[0]).lower()


def _declared(extra: str | None) -> set[str]:
    names = {_name(r) for r in PYPROJECT["dependencies"]}
    if extra is not None:
        names |= {_name(r) for r in PYPROJECT["optional-dependencies"][extra]}
    return names


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _extra_of(module: str) -> str | None:
    return next((extra for prefix, extra in EXTRA_MODULES.items()
                 if module == prefix or module.startswith(prefix + ".")), None)


def _third_party_imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return {n for n in names if n not in sys.stdlib_module_names and n != "gpubook" and n not in NOT_RUNTIME}


@pytest.mark.slow  # a second or more: out of the fast lane
def test_every_import_is_declared_in_the_base_install_or_its_modules_extra() -> None:
    distributions = importlib.metadata.packages_distributions()
    undeclared = []
    for path in sorted((ROOT / "gpubook").rglob("*.py")):
        module = _module_name(path)
        allowed = _declared(_extra_of(module))
        for imported in sorted(_third_party_imports(path)):
            dists = {_name(d) for d in distributions.get(imported, [imported])}
            if not dists & allowed:
                undeclared.append(f"{module}: {imported} ({', '.join(sorted(dists))})")
    assert undeclared == []


def test_each_extras_modules_come_with_that_extra() -> None:
    distributions = importlib.metadata.packages_distributions()
    for extra, (_, modules) in extras.EXTRAS.items():
        for module in modules:
            assert {_name(d) for d in distributions[module]} & _declared(extra) - _declared(None), (extra, module)


@pytest.mark.slow  # a second or more: out of the fast lane
def test_the_daemons_modules_import_none_of_the_extras_packages() -> None:
    """Every module but the extras' own, imported together: no Flask, matplotlib, Radicale or requests."""
    modules = sorted(m for m in map(_module_name, (ROOT / "gpubook").rglob("*.py"))
                     if _extra_of(m) is None and not m.endswith("__main__"))  # __main__ runs the CLI
    assert "gpubook.scheduler.daemon" in modules and "gpubook.scheduler.commands.demo" in modules
    code = ("import importlib, sys\n"
            f"for name in {modules!r}: importlib.import_module(name)\n"
            f"print(sorted(n for n in {[*EXTRA_PACKAGES, 'requests']!r} if n in sys.modules))")
    shown = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                           check=False)
    assert shown.returncode == 0, shown.stderr[-2000:]
    assert shown.stdout.strip() == "[]"


@pytest.mark.parametrize(("argv", "extra", "hidden"), [
    (["web", "--config", "/nonexistent.toml"], "web", "flask"),
    (["report", "--from", "2026-11-01", "--to", "2026-11-02", "--png", "{tmp}/plot.png"], "report", "matplotlib"),
    (["demo", "--plan-only"], "demo", "radicale"),
])
@pytest.mark.slow  # a second or more: out of the fast lane
def test_a_command_without_its_extra_says_which_to_install(tmp_path: Path, argv: list[str], extra: str,
                                                         hidden: str) -> None:
    argv = [arg.replace("{tmp}", str(tmp_path)) for arg in argv]
    # sys.modules[name] = None: the package counts as absent for import and for find_spec.
    code = (f"import sys; sys.modules[{hidden!r}] = None\n"
            "from gpubook.scheduler.commands.cli import main\n"
            f"sys.exit(main({argv!r}))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          check=False)
    what = extras.EXTRAS[extra][0]
    assert (done.returncode, done.stderr) == (1, f"gpubook: {what} needs gpubook[{extra}]: "
                                                 f"pip install 'gpubook[{extra}]'\n")
    assert not (tmp_path / "plot.png").exists()


@pytest.mark.slow  # a second or more: out of the fast lane
def test_a_daemon_serving_the_page_without_the_web_extra_says_so_and_runs_on(tmp_path: Path) -> None:
    """[web] enabled but Flask absent: one logged sentence, no page, and the daemon is still up."""
    code = ("import logging, sys; sys.modules['flask'] = None; logging.basicConfig(format='%(message)s')\n"
            "from pathlib import Path\nfrom tests.kits.daemon_kit import in_process_daemon\n"
            f"daemon = in_process_daemon(Path({str(tmp_path)!r}))\n"
            "daemon.config.path.write_text(daemon.config.path.read_text()\n"
            "                              + '[web]\\nenabled = true\\nlisten = \"127.0.0.1:0\"\\n'\n"
            "                              + 'auth = \"none\"\\n')\n"
            "from datetime import UTC, datetime, timedelta\n"
            "daemon.scheduler.start()\n"
            "daemon._schedule_polls(first=datetime.now(UTC) + timedelta(hours=1))  # reload() reschedules it\n"
            "print(daemon.reload(), daemon.web)\n"
            "daemon.scheduler.shutdown(wait=False); daemon.passes.close(); daemon.state.close()")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          check=False)
    assert (done.returncode, done.stdout) == (0, "True None\n"), done.stderr[-2000:]
    assert ("the status page does not start: the status page needs gpubook[web]: pip install 'gpubook[web]'"
            in done.stderr.splitlines())


# The installed wheel (root's part of CI: pip needs the package index, through this machine's mirrors).

def _pip(venv: Path, *args: str) -> None:
    # Without the checkout on PYTHONPATH (quickstart exports it): pip would take the checkout's gpubook
    # for installed and skip the wheel.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "--disable-pip-version-check", "-q", *args],
                          capture_output=True, text=True, timeout=900, check=False, env=env)
    assert done.returncode == 0, done.stderr[-3000:]


def _run(venv: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    """A command of the venv, from /, with no checkout anywhere on its path."""
    env = {"PATH": f"{venv / 'bin'}:/usr/bin:/bin", "HOME": os.environ.get("HOME", "/root"), "LANG": "C.UTF-8"}
    return subprocess.run([str(venv / "bin" / argv[0]), *argv[1:]], cwd="/", env=env, capture_output=True,
                          text=True, timeout=300, check=False)


def _distributions(venv: Path) -> set[str]:
    code = "import importlib.metadata as m; print('\\n'.join(d.metadata['Name'] for d in m.distributions()))"
    return {_name(line) for line in _run(venv, "python", "-c", code).stdout.split()}


@pytest.fixture(scope="module")
def release(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A release's files as tools/release.sh makes them (the one command), from this working tree."""
    out = tmp_path_factory.mktemp("dist")
    done = subprocess.run(["bash", str(ROOT / "tools" / "release.sh"), "--worktree", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=900, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def wheel(release: Path) -> Path:
    (built,) = release.glob("gpubook-*.whl")
    return built


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory, wheel: Path) -> Iterator[Path]:
    """A fresh venv from Debian's Python, outside the checkout, with the base install."""
    folder = tmp_path_factory.mktemp("venv")
    assert not folder.is_relative_to(ROOT)
    subprocess.run(["/usr/bin/python3", "-m", "venv", str(folder)], check=True, timeout=300)
    _pip(folder, "install", "-c", str(ROOT / "constraints-runtime.txt"), str(wheel))
    assert (folder / "bin" / "gpubook").is_file(), "pip installed no gpubook command"
    yield folder


@pytest.mark.install
def test_the_wheel_carries_the_license_and_everything_the_daemon_reads_at_run_time(wheel: Path) -> None:
    assert wheel.name == f"gpubook-{__version__}-py3-none-any.whl"
    names = set(zipfile.ZipFile(wheel).namelist())
    assert f"gpubook-{__version__}.dist-info/licenses/LICENSE" in names
    shipped = ["gpubook/config/gpubook.example.toml", "gpubook/systemd/gpubook.service",
               "gpubook/runtime/booking/overlay/entrypoint.sh", "gpubook/runtime/booking/overlay/gpubook-booking",
               *(f"gpubook/templates/{p.name}" for p in (ROOT / "gpubook" / "templates").glob("*.toml")),
               *(str(p.relative_to(ROOT)) for p in (ROOT / "gpubook/scheduler/outbox/web").glob("*/*.*")
                 if p.parent.name != "__pycache__")]  # the page's files (its bytecode is made where it runs)
    assert len(shipped) > 10
    assert [name for name in shipped if name not in names] == []
    assert not [name for name in names if name.startswith(("tests/", "bench/", "docs/"))]


def _locked(name: str) -> dict[str, str]:
    lines = (ROOT / name).read_text().splitlines()
    return {_name(line): line.split("==", 1)[1] for line in lines if "==" in line and not line.startswith("#")}


def test_the_runtime_lock_is_the_test_locks_versions_without_the_developers_tools() -> None:
    runtime, test = _locked("constraints-runtime.txt"), _locked("constraints.txt")
    assert runtime and {name: test.get(name) for name in runtime} == runtime
    tools = {_name(r) for group in ("lint", "browser", "docs") for r in PYPROJECT_FILE["dependency-groups"][group]}
    assert tools == {"ruff", "mypy", "import-linter", "selenium", "argparse-manpage"}
    assert tools <= set(test) and not tools & set(runtime)
    assert not {"pytest", "hypothesis", "xandikos"} & set(runtime)
    # The developers' tools are groups, never extras a lab could install.
    assert not tools & {_name(r) for extra in PYPROJECT["optional-dependencies"].values() for r in extra}


@pytest.mark.install
def test_one_command_makes_the_sdist_the_wheel_and_the_lock_with_their_sums(release: Path) -> None:
    names = sorted(path.name for path in release.iterdir())
    assert names == sorted([f"gpubook-{__version__}.tar.gz", f"gpubook-{__version__}-py3-none-any.whl",
                            f"gpubook-{__version__}-constraints.txt", "SHA256SUMS"])
    checked = subprocess.run(["sha256sum", "--check", "SHA256SUMS"], cwd=release, capture_output=True, text=True,
                             timeout=60, check=False)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert (release / f"gpubook-{__version__}-constraints.txt").read_text() == \
        (ROOT / "constraints-runtime.txt").read_text()
    with tarfile.open(release / f"gpubook-{__version__}.tar.gz") as sdist:
        members = {name.split("/", 1)[1] for name in sdist.getnames() if "/" in name}
        info = sdist.extractfile(f"gpubook-{__version__}/PKG-INFO")
        assert info is not None
        metadata = info.read().decode()
    assert {"pyproject.toml", "LICENSE", "CHANGES.md", "constraints-runtime.txt", "docs/guides/install.md",
            "gpubook/shell/gpubook.1", "gpubook/runtime/booking/overlay/entrypoint.sh"} <= members
    assert not [name for name in members if name.startswith("tests/") or "__pycache__" in name]
    assert "Classifier: Operating System :: POSIX :: Linux" in metadata
    requires = [line for line in metadata.splitlines() if line.startswith("Requires-Dist: ")]
    assert requires and not [line for line in requires if re.search(r"\b(ruff|mypy|selenium|import-linter)\b", line)]


@pytest.mark.install
def test_the_base_install_is_the_daemon_and_works_from_any_directory(venv: Path) -> None:
    version = _run(venv, "gpubook", "--version")
    assert (version.returncode, version.stdout.strip()) == (0, f"gpubook {__version__}")
    listing = _run(venv, "gpubook", "templates", "list")
    assert listing.returncode == 0, listing.stderr
    for template in (ROOT / "gpubook" / "templates").glob("*.toml"):
        assert template.stem in listing.stdout
    # The man page and the completions, under the venv's share/ (pyproject's data-files).
    for shared in ("man/man1/gpubook.1", "bash-completion/completions/gpubook", "zsh/site-functions/_gpubook"):
        assert (venv / "share" / shared).read_text() == (ROOT / "gpubook" / "shell" / Path(shared).name).read_text()
    completion = _run(venv, "gpubook", "completion", "bash")
    assert completion.returncode == 0 and completion.stdout == (venv / "share" / "bash-completion" / "completions"
                                                                / "gpubook").read_text(), completion.stderr
    installed = _distributions(venv)
    assert {"caldav", "niquests", "paramiko", "prometheus-client", "shtab"} <= installed
    # (bcrypt is [web]'s and paramiko's: it is in the base install through paramiko.)
    assert installed.isdisjoint({"matplotlib", "flask", "waitress", "radicale", "requests", "pytest"})
    locked = {_name(line) for line in (ROOT / "constraints-runtime.txt").read_text().splitlines() if "==" in line}
    assert installed - {"gpubook", "pip", "setuptools"} <= locked, "every installed distribution is in the runtime lock"
    for argv, extra in ((["web", "--config", "/nonexistent.toml"], "web"), (["demo", "--plan-only"], "demo")):
        done = _run(venv, "gpubook", *argv)
        assert (done.returncode, done.stderr) == (1, f"gpubook: {extras.EXTRAS[extra][0]} needs gpubook[{extra}]: "
                                                     f"pip install 'gpubook[{extra}]'\n")


@pytest.mark.install
def test_the_demo_extra_runs_the_demo_from_any_directory(venv: Path, wheel: Path) -> None:
    _pip(venv, "install", "-c", str(ROOT / "constraints.txt"), f"gpubook[demo] @ {wheel.as_uri()}")
    assert "radicale" in _distributions(venv)
    done = _run(venv, "gpubook", "demo", "--plan-only")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "2 accepted, 3 rejected." in done.stdout
    assert "Traceback" not in done.stdout + done.stderr
