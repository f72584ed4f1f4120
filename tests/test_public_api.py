"""Every name the README and the docs show is real: it imports, and resolves to what they call.

The house moved (``batchfit.finder`` became ``batchfit.probe`` and ``batchfit.api``, ...), and the
public API must not have moved with it. These tests read README.md and every page under docs/
and import every batchfit name they show: ``import``/``from`` lines in code blocks, dotted names
such as ``batchfit.testing.check_fits`` anywhere in the text, CLI targets such as
``batchfit.examples:gpt``, and mkdocstrings' ``::: batchfit.x`` directives.
"""

from __future__ import annotations

import ast
import importlib
import re
from functools import cache
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: The names a user of batchfit writes, whatever the pages say: the top level and the modules
#: users import. Unchanged by the move of the house (issue 18).
PUBLIC = {
    "batchfit": [
        "find", "find_sharded", "estimate", "plan", "what_if", "Prober", "Options", "Result", "Trial", "MemoryModel",
        "PhaseLine", "Throughput", "DeviceInfo", "Settings", "Plan", "WhatIf", "BatchfitError",
        "NothingFitsError", "DeviceFailedError", "LimitError", "NoOptimizerStepError", "__version__",
    ],
    "batchfit.testing": ["check_fits", "assert_fits", "GateReport"],
    "batchfit.lightning": ["BatchFit"],
    "batchfit.transformers": ["autosize", "Autosized"],
    "batchfit.accelerate": ["find_executable_batch_size"],
    "batchfit.ray": ["worker_batch", "WorkerBatch"],
    "batchfit.examples": ["mlp", "cnn", "gpt"],
    "batchfit.errors": ["RankFailedError", "RanksTimeoutError"],
    "batchfit.cli": ["main"],
    "batchfit.search": ["Strategy", "search", "Grid"],
}  # fmt: skip


@cache
def pages() -> tuple[Path, ...]:
    found = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    return tuple(path for path in found if path.exists())


def _code_blocks(text: str) -> list[str]:
    return re.findall(r"^```[^\n]*\n(.*?)^```", text, re.S | re.M)


def shown_imports() -> list[tuple[str, str, str]]:
    """``(page, module, name)`` for every ``from batchfit... import name`` / ``import batchfit...``
    in the pages' code blocks (``name`` is ``""`` for ``import module``)."""
    found = []
    for page in pages():
        for block in _code_blocks(page.read_text()):
            for line in block.splitlines():
                stripped = line.strip()
                if not re.match(r"(from\s+batchfit\b|import\s.*\bbatchfit\b)", stripped):
                    continue
                try:
                    tree = ast.parse(stripped.rstrip("\\").rstrip(",").rstrip("("))
                except SyntaxError:
                    continue  # a multi-line import: its names are still checked as dotted names
                for node in tree.body:
                    if isinstance(node, ast.ImportFrom) and node.module:
                        found += [(page.name, node.module, alias.name) for alias in node.names]
                    elif isinstance(node, ast.Import):
                        found += [(page.name, a.name, "") for a in node.names if a.name.split(".")[0] == "batchfit"]
    return found


def shown_dotted_names() -> list[tuple[str, str]]:
    """``(page, name)`` for every ``batchfit.a.b`` the pages mention (``batchfit.examples:gpt``
    becomes ``batchfit.examples.gpt``). File paths (``batchfit/probe/trial.py``) are not names."""
    found = []
    for page in pages():
        text = page.read_text()
        for match in re.finditer(r"(?<![\w/.-])batchfit(?:\.[A-Za-z_]\w*)+(?::[A-Za-z_]\w*)?", text):
            name = match.group(0).replace(":", ".")
            after = text[match.end() :]
            if after.startswith(("/", "-")) or re.match(r"\.(py|md|json|yml|toml)\b", after):
                continue
            found.append((page.name, name))
    return found


def resolve(dotted: str) -> Any:
    """Import the longest importable module prefix of ``dotted``, then walk the attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            value = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attr in parts[cut:]:
            value = getattr(value, attr)
        return value
    raise ModuleNotFoundError(dotted)


@pytest.mark.parametrize("module", sorted(PUBLIC))
def test_the_public_names_users_write_still_import(module: str) -> None:
    imported = importlib.import_module(module)
    for name in PUBLIC[module]:
        assert getattr(imported, name, None) is not None, f"{module}.{name}"


def test_the_pages_show_names_at_all() -> None:
    """The scans below must have something to check, or they would pass on empty pages."""
    assert len(shown_imports()) >= 3
    assert len(shown_dotted_names()) >= 20


def test_every_import_the_pages_show_works() -> None:
    broken = []
    for page, module, name in shown_imports():
        try:
            imported = importlib.import_module(module)
            if name and not hasattr(imported, name):
                importlib.import_module(f"{module}.{name}")
        except Exception as exc:  # noqa: BLE001 (reported with the page)
            broken.append(f"{page}: from {module} import {name or '*'}: {exc}")
    assert not broken, "\n".join(broken)


def test_every_dotted_name_the_pages_show_resolves() -> None:
    broken = []
    for page, name in sorted(set(shown_dotted_names())):
        try:
            resolve(name)
        except Exception as exc:  # noqa: BLE001 (reported with the page)
            broken.append(f"{page}: {name}: {type(exc).__name__}: {exc}")
    assert not broken, "\n".join(broken)


def test_the_resolver_rejects_a_name_that_does_not_exist() -> None:
    """The checks above can fail: an old module path is not a name any more."""
    with pytest.raises(AttributeError):
        resolve("batchfit.finder.find_with")
    with pytest.raises(AttributeError):
        resolve("batchfit.find.nothing")
    assert resolve("batchfit.probe.find_with") is resolve("batchfit.probe.finder.find_with")


def test_the_readme_fits_a_newcomer_and_keeps_the_test_command() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) < 250
    assert "python -m pytest -q" in readme  # what CI runs (.ci/run)


MOVED_FROM = ["batchfit.estimation", "batchfit.probe", "batchfit.report", "batchfit.search", "batchfit.view"]


@pytest.mark.parametrize("package", MOVED_FROM)
def test_a_name_moved_off_a_surface_still_imports_with_a_warning(package: str) -> None:
    """Issue 33 took the internals off the subpackage surfaces; the ones the changelog had shown
    there still import from the old place (a `DeprecationWarning` names the new one)."""
    imported = importlib.import_module(package)
    moved = imported._MOVED
    assert moved
    for name, module in moved.items():
        assert name not in imported.__all__
        with pytest.warns(DeprecationWarning, match=module):
            old = getattr(imported, name)
        assert old is getattr(importlib.import_module(module), name), f"{package}.{name}"
    with pytest.raises(AttributeError):
        imported.no_such_name  # noqa: B018 (the attribute access is the test)
