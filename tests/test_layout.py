"""The tests' own layout (issue 23): helpers live in tests/kits and are imported one way,
`from tests.kits...`; fixtures live in the plugins of tests/plugins (registered in tests/conftest.py)
or in a conftest.py; no test module is imported as a library, and a kit imports no test module.
Read from the source, so a broken layout is named by file and line."""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TESTS = REPO / "tests"
KITS = TESTS / "kits"
PLUGINS = TESTS / "plugins"
# Every Python file of the tests, and bench/ (which borrows the kits).
SOURCES = sorted([*TESTS.rglob("*.py"), *(REPO / "bench").rglob("*.py")])
# The names a plain `import NAME` would find only because pytest put a tests folder on sys.path.
LOOSE_NAMES = {path.stem for folder in (TESTS, TESTS / "gpu", KITS, PLUGINS) for path in folder.glob("*.py")}


def imports(path: Path) -> Iterator[tuple[int, str]]:
    """(line, module) of each absolute import in the file, the `from` module with each name it takes."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from ((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.lineno, node.module
            yield from ((node.lineno, f"{node.module}.{alias.name}") for alias in node.names)


def is_test_module(module: str) -> bool:
    return any(part.startswith("test_") or part == "conftest" for part in module.split("."))


def offending(paths: list[Path], wrong: Callable[[str], bool]) -> list[str]:
    """"FILE:LINE imports MODULE" for each import line of `paths` taking a module that is `wrong`."""
    found: dict[str, str] = {}
    for path in paths:
        for line, module in imports(path):
            if wrong(module):
                found.setdefault(f"{path.relative_to(REPO)}:{line}", module)
    return [f"{place} imports {module}" for place, module in found.items()]


@pytest.mark.slow  # a second or more: out of the fast lane
def test_no_module_imports_a_test_module_or_a_conftest() -> None:
    found = offending(SOURCES, is_test_module)
    assert found == [], "a test module is not a library: move what is shared into tests/kits\n" + "\n".join(found)


@pytest.mark.slow  # a second or more: out of the fast lane
def test_kits_are_imported_through_the_tests_kits_package_only() -> None:
    tests = [path for path in SOURCES if TESTS in path.parents]  # bench/ puts a kit on sys.path itself
    found = offending(tests, lambda module: module.split(".")[0] in LOOSE_NAMES)
    assert found == [], "import a kit as `from tests.kits.NAME import ...`\n" + "\n".join(found)


@pytest.mark.slow  # a second or more: out of the fast lane
def test_kits_import_no_plugin_and_plugins_are_imported_by_no_one() -> None:
    others = [path for path in SOURCES if PLUGINS not in path.parents]
    found = offending(others, lambda module: module.startswith("tests.plugins"))
    assert found == [], "fixtures are asked for by name; tests/conftest.py registers the plugins\n" + "\n".join(found)


def test_kits_define_no_fixture() -> None:
    found = [f"{path.relative_to(REPO)}:{node.lineno} defines the fixture {node.name}"
             for path in sorted(KITS.glob("*.py")) for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, ast.FunctionDef)
             and any("fixture" in ast.unparse(decorator) for decorator in node.decorator_list)]
    assert found == [], "a fixture belongs in a plugin of tests/plugins (or a conftest.py)\n" + "\n".join(found)


def test_every_plugin_is_registered_once() -> None:
    conftest = ast.parse((TESTS / "conftest.py").read_text())
    registered = next(ast.literal_eval(node.value) for node in conftest.body if isinstance(node, ast.Assign)
                      and any(isinstance(t, ast.Name) and t.id == "pytest_plugins" for t in node.targets))
    plugins = sorted(f"tests.plugins.{path.stem}" for path in PLUGINS.glob("*.py") if path.stem != "__init__")
    assert sorted(registered) == plugins and len(set(registered)) == len(registered), registered


@pytest.mark.slow  # imports every module bench/ names: out of the fast lane
def test_every_name_bench_takes_from_gpubook_or_the_kits_exists() -> None:
    """bench/ is run by hand and by bench/compare.py, not by the suite: a kit's helper renamed (as
    free_port was, for lane_port) broke four benches unseen. Each `from gpubook… / tests.kits… import
    NAME` of bench/, at any depth of the file, must find NAME."""
    import importlib

    missing = []
    # bench/results/ keeps the scripts of past runs beside their output, as they were run.
    for path in sorted(path for path in (REPO / "bench").rglob("*.py") if "results" not in path.parts):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not (isinstance(node, ast.ImportFrom) and node.module and node.level == 0
                    and node.module.split(".")[0] in ("gpubook", "tests")):
                continue
            module = importlib.import_module(node.module)
            for alias in node.names:
                if not hasattr(module, alias.name):
                    try:
                        importlib.import_module(f"{node.module}.{alias.name}")
                    except ModuleNotFoundError:
                        missing.append(f"{path.relative_to(REPO)}:{node.lineno} takes {alias.name} from {node.module}")
    assert missing == [], "bench/ takes names that are gone:\n" + "\n".join(missing)
