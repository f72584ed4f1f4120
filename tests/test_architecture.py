"""The house rules, checked from the code's own imports and against CONTRIBUTING.md.

CONTRIBUTING.md states the layers (lowest first) and the map of every module with its one job;
these tests hold the code to both, so neither the document nor the code can drift:

* nothing imports upward: a unit (a subpackage, or a top-level module) imports only units
  listed before it in the layer table;
* no circles: no module imports itself through others (imports under ``if TYPE_CHECKING:``
  excepted: they never run);
* across units a subpackage is imported through its surface (its ``__init__``), and only names
  that surface exports; inside a subpackage, siblings are imported directly, never through the
  package's own surface; no ``_private`` name is imported from another module;
* the foundation, the pure search and report, and the views never import torch, and neither do
  ``batchfit``, ``batchfit --help``, the pytest plugin, ``batchfit.Options`` or planning from a
  result (fresh interpreter);
* no module is longer than :data:`MAX_LINES`;
* the map lists every module and subpackage, and nothing that is not there.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

import batchfit

PACKAGE = Path(batchfit.__file__).parent
ROOT = PACKAGE.parent
CONTRIBUTING = ROOT / "CONTRIBUTING.md"

#: The hard limit on a module's length (CONTRIBUTING asks for about 400: a room with one job).
MAX_LINES = 450


# Reading the code ---------------------------------------------------------------------------------
def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


@cache
def packages() -> frozenset[str]:
    return frozenset(name for name, path in modules().items() if path.name == "__init__.py")


@dataclass(frozen=True)
class Import:
    importer: str
    target: str  # a module of batchfit
    names: tuple[str, ...]  # for `from target import names`; () for `import target`
    line: int
    type_only: bool  # under `if TYPE_CHECKING:`


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _walk(node: ast.AST, type_only: bool = False) -> Iterator[tuple[ast.AST, bool]]:
    for child in ast.iter_child_nodes(node):
        inside = type_only or (isinstance(child, ast.If) and _type_checking(child))
        yield child, inside
        yield from _walk(child, inside)


@cache
def imports() -> tuple[Import, ...]:
    """Every import of a batchfit module by a batchfit module, at any depth (a function's lazy
    import counts as much as a module-level one)."""
    found: list[Import] = []
    for importer, path in modules().items():
        for node, type_only in _walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] == "batchfit":
                        found.append(Import(importer, alias.name, (), node.lineno, type_only))
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                if node.module.split(".")[0] == "batchfit":
                    names = tuple(alias.name for alias in node.names)
                    found.append(Import(importer, node.module, names, node.lineno, type_only))
    return tuple(found)


def imported_modules(imp: Import) -> list[str]:
    """The modules an import runs: the target, a submodule named in ``from pkg import sub``, and
    the target's enclosing packages that do not enclose the importer (their ``__init__`` runs
    first)."""
    targets = [imp.target] + [f"{imp.target}.{name}" for name in imp.names if f"{imp.target}.{name}" in modules()]
    found = []
    for target in targets:
        parts = target.split(".")
        for depth in range(1, len(parts) + 1):
            enclosing = ".".join(parts[:depth])
            if enclosing in modules() and not (
                enclosing in packages() and (imp.importer + ".").startswith(enclosing + ".")
            ):
                found.append(enclosing)
    return found


@cache
def surface(package: str) -> frozenset[str]:
    """What a subpackage's ``__init__`` exports: its ``__all__`` or its lazy ``_EXPORTS``."""
    tree = ast.parse(modules()[package].read_text())
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            if node.targets[0].id == "__all__" and isinstance(node.value, ast.List):
                names |= {elt.value for elt in node.value.elts if isinstance(elt, ast.Constant)}
            if node.targets[0].id == "_EXPORTS" and isinstance(node.value, ast.Dict):
                names |= {key.value for key in node.value.keys if isinstance(key, ast.Constant)}
    return frozenset(names)


# Reading CONTRIBUTING.md -----------------------------------------------------------------------------
def _section(title: str) -> str:
    text = CONTRIBUTING.read_text()
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert match, f"CONTRIBUTING.md has no '## {title}' section"
    return match.group(1)


def _table_rows(section: str) -> list[list[str]]:
    rows = []
    for line in section.splitlines():
        if line.startswith("|") and not re.match(r"^\|\s*-", line):
            rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return rows[1:]  # the header


@cache
def layers() -> tuple[tuple[str, tuple[str, ...]], ...]:
    """``(layer, units in order)`` from CONTRIBUTING's layer table, lowest first."""
    return tuple(
        (row[0], tuple(re.findall(r"`(batchfit[\w.]*)`", row[1]))) for row in _table_rows(_section("Layers"))
    )


@cache
def order() -> tuple[str, ...]:
    return tuple(unit for _, units in layers() for unit in units)


def unit_of(module: str) -> str:
    """The unit a module belongs to: the longest unit of the layer table that contains it."""
    candidates = [unit for unit in order() if module == unit or module.startswith(unit + ".")]
    assert candidates, f"{module} belongs to no unit of CONTRIBUTING's layer table"
    return max(candidates, key=len)


# The rules ---------------------------------------------------------------------------------------------
def test_the_layer_table_names_each_unit_once_and_every_unit_exists() -> None:
    assert len(layers()) >= 5
    assert len(order()) == len(set(order())), "a unit is listed twice"
    for unit in order():
        assert unit in modules(), f"CONTRIBUTING's layer table names {unit}, which does not exist"
    subpackages = {name for name in packages() if name != "batchfit"}
    assert len(subpackages) >= 5
    top_level = {name for name in modules() if name.count(".") == 1 and name not in packages()}
    missing = sorted((subpackages | top_level | {"batchfit"}) - set(order()))
    assert not missing, f"not in CONTRIBUTING's layer table: {missing}"


def test_nothing_imports_upward() -> None:
    rank = {unit: i for i, unit in enumerate(order())}
    upward = []
    for imp in imports():
        mine = unit_of(imp.importer)
        for target in imported_modules(imp):
            theirs = unit_of(target)
            if theirs != mine and rank[theirs] > rank[mine]:
                upward.append(f"{imp.importer}:{imp.line} imports {target} ({theirs} is above {mine})")
    assert not upward, "\n".join(upward)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module, or with a self-loop (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1 or node in graph.get(node, ()):
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_module_imports_itself_through_others() -> None:
    graph: dict[str, set[str]] = {name: set() for name in modules()}
    for imp in imports():
        if not imp.type_only:
            graph[imp.importer] |= {t for t in imported_modules(imp) if t != imp.importer}
    assert not _cycles(graph), f"import circles: {_cycles(graph)}"


def test_the_cycle_finder_finds_a_cycle() -> None:
    """The rule above must be able to fail: two modules that import each other are a circle."""
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_subpackages_are_entered_through_their_surface() -> None:
    wrong = []
    for imp in imports():
        mine = unit_of(imp.importer)
        theirs = unit_of(imp.target)
        for name in imp.names:
            private = name.startswith("_") and not (name.startswith("__") and name.endswith("__"))
            if private and f"{imp.target}.{name}" not in modules():
                wrong.append(f"{imp.importer}:{imp.line} imports the private {imp.target}.{name}")
        if theirs == mine:
            if imp.target == mine and mine in packages() and mine != "batchfit":
                wrong.append(f"{imp.importer}:{imp.line} imports its own package's surface {mine}")
            continue
        if theirs in packages() and imp.target != theirs:
            wrong.append(f"{imp.importer}:{imp.line} reaches into {imp.target}: import from {theirs}")
        elif theirs in packages():
            hidden = [name for name in imp.names if name not in surface(theirs)]
            if hidden:
                wrong.append(f"{imp.importer}:{imp.line} imports {hidden} that {theirs} does not export")
    assert not wrong, "\n".join(wrong)


def test_every_exported_name_exists() -> None:
    """A surface is a promise: every name a package (or ``batchfit`` itself) exports imports."""
    import importlib

    for package in sorted(packages()):
        module = importlib.import_module(package)
        for name in sorted(surface(package)):
            assert getattr(module, name, None) is not None, f"{package}.{name}"
        if hasattr(module, "__all__"):
            assert set(module.__all__) == set(surface(package)) | ({"__version__"} if package == "batchfit" else set())


TORCH_FREE_UNITS = ("batchfit.version", "batchfit._lazy", "batchfit.units", "batchfit.errors", "batchfit.interrupts",
                    "batchfit.search", "batchfit.report", "batchfit.view")  # fmt: skip


def test_the_pure_units_never_import_torch() -> None:
    """Read from their code: no import of torch at any depth (not even a lazy one)."""
    offenders = []
    for name, path in modules().items():
        if unit_of(name) not in TORCH_FREE_UNITS:
            continue
        for node, _ in _walk(ast.parse(path.read_text())):
            roots = []
            if isinstance(node, ast.Import):
                roots = [alias.name.split(".")[0] for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                roots = [node.module.split(".")[0]]
            if "torch" in roots:
                offenders.append(f"{name}:{node.lineno}")
    assert not offenders, offenders


def test_the_light_entry_points_load_no_torch() -> None:
    """In a fresh interpreter: what pytest start-up, ``batchfit --help``, ``batchfit devices`` and
    reading a result touch must not pay for torch."""
    code = (
        "import sys, contextlib, io\n"
        "import batchfit, batchfit.testing, batchfit.testing.pytest_plugin, batchfit.backends, batchfit.view\n"
        "import batchfit.search, batchfit.report, batchfit.probe, batchfit.estimation\n"
        "from batchfit.probe import Options, DEFAULT_MAX_BATCH\n"
        "from batchfit.estimation import plan_for, Plan\n"
        "from batchfit.backends import query_devices\n"
        "from batchfit.cli import main\n"
        "Options(memory_limit='1GiB')\n"
        "with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
        "    main(['--help'])\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out


def test_no_room_is_over_the_limit() -> None:
    long = {name: n for name, path in modules().items() if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines (split them along their jobs): {long}"


# The map ---------------------------------------------------------------------------------------------------
@cache
def mapped() -> dict[str, str]:
    """``{path: job}`` from CONTRIBUTING's layout table: ``batchfit/x.py`` and ``batchfit/pkg/``."""
    rows = _table_rows(_section("Layout"))
    found: dict[str, str] = {}
    for row in rows:
        for path in re.findall(r"`(batchfit/[\w/.]*)`", row[0]):
            assert path not in found, f"{path} is listed twice"
            found[path] = row[1]
    return found


def test_the_map_lists_every_module_with_its_job_and_nothing_else() -> None:
    in_tree = set()
    for path in modules().values():
        relative = path.relative_to(ROOT).as_posix()
        subpackage = path.name == "__init__.py" and path.parent != PACKAGE
        in_tree.add(relative[: -len("__init__.py")] if subpackage else relative)
    listed = set(mapped())
    assert not sorted(in_tree - listed), f"not in CONTRIBUTING's layout: {sorted(in_tree - listed)}"
    assert not sorted(listed - in_tree), f"in CONTRIBUTING's layout but not in the tree: {sorted(listed - in_tree)}"
    for path, job in mapped().items():
        assert len(job.split()) >= 3, f"{path}: say its job ({job!r})"


@pytest.mark.parametrize("kind", ["layers", "layout"])
def test_contributing_states_the_rules_it_is_held_to(kind: str) -> None:
    if kind == "layers":
        assert "imports upward" in _section("Layers") and "tests/test_architecture.py" in _section("Layers")
    else:
        assert "tests/test_architecture.py" in _section("Layout")
