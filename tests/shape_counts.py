"""Counts of the code's shape, read from the source with `ast`: what `tests/test_architecture.py`
holds to a bound and `benchmarks/code_shape.py` reports before and after a change (issue 49).

Every function takes the package folder (``batchfit/`` of any checkout) and returns the places it
counts (``"path:line what"``), so a failing bound names them; the count is their number. Nothing
here imports the package it reads.
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

#: The options issue 49 asked to be named in at most four files: declared once, read where they act.
CONCENTRATED_OPTIONS = ("timed_steps", "scan_batches", "rank_timeout")
#: The types issue 49 found answering "which batch to train with".
ANSWER_TYPES = ("Plan", "Recommendation", "UnevenSplit", "UnevenShare", "WorkerBatch", "Autosized")
#: Fields a record declares when it states how to train itself, rather than carrying a `Recommendation`.
BATCH_FIELDS = ("micro_batch", "batch_size", "accumulation", "accumulation_steps", "global_batch", "passes")
#: The fields of the boundary a probe finds.
BOUNDARY_FIELDS = ("max_batch", "safe_batch", "safe_verified", "boundary_reached")
#: The parameters of a trial, each restated by a runner that takes them one by one.
TRIAL_PARAMETERS = ("batch_size", "steps", "kind", "fresh_optimizer", "cap_bytes")
#: Functions that split a global batch into micro-batch x passes x ranks.
SPLITTER_NAMES = ("plan_for", "split_global", "split_target", "choose_split")


def modules(package: Path) -> Iterator[tuple[str, ast.Module]]:
    for path in sorted(package.rglob("*.py")):
        yield str(path.relative_to(package.parent)), ast.parse(path.read_text())


def _enclosing_functions(tree: ast.Module) -> dict[int, ast.AST]:
    """Each node's id mapped to the function it sits in (if any)."""
    inside: dict[int, ast.AST] = {}

    def visit(node: ast.AST, function: ast.AST | None) -> None:
        for child in ast.iter_child_nodes(node):
            if function is not None:
                inside[id(child)] = function
            visit(child, child if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else function)

    visit(tree, None)
    return inside


def _imports_batchfit(node: ast.AST) -> bool:
    if isinstance(node, ast.ImportFrom):
        return node.level == 0 and (node.module or "").split(".")[0] == "batchfit"
    if isinstance(node, ast.Import):
        return any(alias.name.split(".")[0] == "batchfit" for alias in node.names)
    return False


def function_level_imports(package: Path) -> list[str]:
    """Imports of batchfit's own modules inside a function: each hides a step of the data flow."""
    found = []
    for path, tree in modules(package):
        inside = _enclosing_functions(tree)
        for node in ast.walk(tree):
            if _imports_batchfit(node) and id(node) in inside:
                module = node.module if isinstance(node, ast.ImportFrom) else node.names[0].name
                found.append(f"{path}:{node.lineno} {module}")
    return found


def uncommented_function_level_imports(package: Path) -> list[str]:
    """Function-level imports with no comment on their line or the line above (the reason they stay)."""
    found = []
    for place in function_level_imports(package):
        path, rest = place.split(":", 1)
        line = int(rest.split()[0])
        text = (package.parent / path).read_text().splitlines()
        if "#" not in text[line - 1] and not text[line - 2].strip().startswith("#"):
            found.append(place)
    return found


def root_package_imports(package: Path) -> list[str]:
    """``import batchfit`` / ``from batchfit import ...`` inside the package: the facade is for users."""
    found = []
    for path, tree in modules(package):
        if path == "batchfit/__init__.py":
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module == "batchfit":
                found.append(f"{path}:{node.lineno}")
            elif isinstance(node, ast.Import) and any(alias.name == "batchfit" for alias in node.names):
                found.append(f"{path}:{node.lineno}")
    return found


def cpu_comparisons(package: Path) -> list[str]:
    """Comparisons with ``"cpu"`` outside ``backends/``: a device branch outside the device seam."""
    found = []
    for path, tree in modules(package):
        if path.startswith("batchfit/backends/"):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Compare):
                operands = [node.left, *node.comparators]
                if any(isinstance(o, ast.Constant) and o.value == "cpu" for o in operands):
                    found.append(f"{path}:{node.lineno}")
    return found


def shared_stems(package: Path) -> dict[str, list[str]]:
    """Module file names (``__init__`` aside) that more than one module has."""
    stems: dict[str, list[str]] = defaultdict(list)
    for path in sorted(package.rglob("*.py")):
        if path.stem != "__init__":
            stems[path.stem].append(str(path.relative_to(package.parent)))
    return {stem: paths for stem, paths in stems.items() if len(paths) > 1}


def hidden_flags(package: Path) -> list[str]:
    """Command-line flags whose help is ``argparse.SUPPRESS``: a flag for the library, not for users."""
    found = []
    for path, tree in modules(package):
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
                help_ = next((k.value for k in node.keywords if k.arg == "help"), None)
                if isinstance(help_, ast.Attribute) and help_.attr == "SUPPRESS":
                    flag = node.args[0].value if node.args and isinstance(node.args[0], ast.Constant) else "?"
                    found.append(f"{path}:{node.lineno} {flag}")
    return found


def command_line_starts(package: Path, module: str = "batchfit") -> list[str]:
    """Places outside ``cli/`` whose argv runs ``-m <module>`` (the command line, by default)."""
    found = []
    for path, tree in modules(package):
        if path.startswith("batchfit/cli/"):
            continue
        for node in ast.walk(tree):
            items = getattr(node, "elts", None) if isinstance(node, (ast.List, ast.Tuple)) else None
            if not items:
                continue
            values = [item.value if isinstance(item, ast.Constant) else None for item in items]
            if any(a == "-m" and b == module for a, b in zip(values, values[1:])):
                found.append(f"{path}:{node.lineno}")
    return found


def options_serialisers(package: Path) -> list[str]:
    """Functions that turn `Options` into what crosses a process: argv (``worker_args``), the wire
    (``to_wire``), or a filter that keeps an option's plain values (``isinstance(v, (str, int, float))``)."""
    found = []
    for path, tree in modules(package):
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            named = node.name in ("worker_args", "to_wire")
            filters = any(
                isinstance(call, ast.Call)
                and getattr(call.func, "id", None) == "isinstance"
                and len(call.args) == 2
                and isinstance(call.args[1], ast.Tuple)
                and {getattr(e, "id", None) for e in call.args[1].elts} == {"str", "int", "float"}
                for call in ast.walk(node)
            )
            if named or filters:
                found.append(f"{path}:{node.lineno} {node.name}")
    return found


def _fields(node: ast.ClassDef) -> list[str]:
    return [s.target.id for s in node.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)]


def _classes(package: Path) -> Iterator[tuple[str, ast.ClassDef]]:
    for path, tree in modules(package):
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                yield path, node


def _holds_a_recommendation(node: ast.ClassDef) -> bool:
    return any(
        isinstance(s, ast.AnnAssign) and "Recommendation" in ast.unparse(s.annotation) for s in node.body
    )


def answer_types(package: Path) -> list[str]:
    """Of the types issue 49 named, those still declaring how to train themselves (a batch field of
    their own); one that holds a `Recommendation` (its batch fields then say what was done with
    it), or an alias of it, answers through it."""
    return [
        f"{path}:{node.lineno} {node.name}"
        for path, node in _classes(package)
        if node.name in ANSWER_TYPES and set(_fields(node)) & set(BATCH_FIELDS) and not _holds_a_recommendation(node)
    ]


def boundary_restatements(package: Path) -> list[str]:
    """Records that declare the boundary's fields themselves (two or more of `BOUNDARY_FIELDS`)."""
    return [
        f"{path}:{node.lineno} {node.name}"
        for path, node in _classes(package)
        if len(set(_fields(node)) & set(BOUNDARY_FIELDS)) >= 2
    ]


def trial_restatements(package: Path) -> list[str]:
    """Classes with a method taking a trial's parameters one by one (`TRIAL_PARAMETERS`)."""
    found = []
    for path, node in _classes(package):
        for method in node.body:
            if isinstance(method, ast.FunctionDef):
                names = {a.arg for a in [*method.args.args, *method.args.kwonlyargs]}
                if set(TRIAL_PARAMETERS) <= names:
                    found.append(f"{path}:{method.lineno} {node.name}.{method.name}")
    return found


def runner_members(package: Path) -> list[str]:
    """The members of the protocol the search asks of a runner (`Runner`, formerly `ProbesTrials`)."""
    for path, node in _classes(package):
        if node.name in ("Runner", "ProbesTrials") and any(getattr(b, "id", None) == "Protocol" for b in node.bases):
            return [f"{path}:{m.lineno} {m.name}" for m in node.body if isinstance(m, ast.FunctionDef)]
    return []


def splitters(package: Path) -> list[str]:
    """Functions that split a global batch themselves: one that calls another splitter (or
    ``recommend``, which splits through one) delegates, and is not counted."""
    found = []
    for path, tree in modules(package):
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and node.name in SPLITTER_NAMES:
                called = {
                    getattr(call.func, "id", None) or getattr(call.func, "attr", None)
                    for call in ast.walk(node)
                    if isinstance(call, ast.Call)
                }
                if not called & ({*SPLITTER_NAMES, "recommend"} - {node.name}):
                    found.append(f"{path}:{node.lineno} {node.name}")
    return found


def files_naming(package: Path, name: str) -> list[str]:
    """Files in the package whose text names ``name`` as a word."""
    word = re.compile(rf"\b{re.escape(name)}\b")
    return [str(p.relative_to(package.parent)) for p in sorted(package.rglob("*.py")) if word.search(p.read_text())]
