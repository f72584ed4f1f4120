"""The shape of the code, measured: what issues 33 and 49 asked to shrink, so that it can be said before and after.

Run from the repository root (or with ``--root`` on another checkout, a ``git worktree`` of an older
commit for a before/after)::

    python benchmarks/code_shape.py                      # this tree
    python benchmarks/code_shape.py --root /tmp/before   # another checkout, its own batchfit
    python benchmarks/code_shape.py --site site          # also count raw reST roles in a built site

It reports:

* **lines** in ``batchfit/`` (all, and of the subpackage surfaces with ``_lazy.py``);
* **exported names per surface**: each subpackage's ``__all__`` (or its public ``dir()``), and those
  beyond ``batchfit.__all__``;
* **keyword declarations per option**: for every field of ``Options``, the function parameters and
  annotated class attributes of that name in ``batchfit/`` (each is a place that restates it);
* **frames from find to forward**: a real ``batchfit.find`` on a tiny model whose ``forward`` reads
  the stack; the frames in between whose file is in the package, ``find`` and the forward counted;
* **raw reST roles** (``:class:``, ``:func:``, ...) as text in a built site's HTML, with ``--site``;
* **issue 49's counts** (``tests/shape_counts.py``, read from the source with ``ast``; each lists the
  places it counts in the JSON): the runner protocol's members, methods that take a trial's
  parameters one by one, hidden command-line flags, places outside ``cli/`` that start
  ``python -m batchfit``, serialisers of ``Options``, types that declare how to train themselves,
  global-batch splitters, records that declare the boundary's fields, module files sharing a name,
  imports of batchfit's own modules inside functions (and those without a comment saying why),
  ``import batchfit`` inside the package, ``"cpu"`` comparisons outside ``backends/``, the files
  naming ``timed_steps``/``scan_batches``/``rank_timeout``, and the surface with the facade;
* **targets where `plan` and `recommend` split differently**: the built-in GPT found at 64 MiB
  (``batchfit.examples.gpt``, timed, so its rates have a knee), then every target from 8 to 128 in
  steps of 4 split by ``batchfit.plan(result, ...)`` and by ``result.recommend(...)``.

Not a timing: the numbers are counts, the same on every machine. Output: a table on stdout and a
JSON file under ``benchmarks/results/``.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import json
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"

FRAMES_PROBE = r"""
import inspect, json, sys
import torch
from torch import nn
import batchfit

package = batchfit.__file__.rsplit("/", 1)[0]
seen = []

class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(4, 2)
    def forward(self, x):
        if not seen:
            seen.append([(f.filename, f.function) for f in inspect.stack()])
        return self.layer(x)

batchfit.find(Tiny(), torch.randn(2, 4), memory_limit="64MiB", max_batch=4, verify_steps=0, timed_steps=0)
stack = list(reversed(seen[0]))  # outermost first
start = next(i for i, (_, function) in enumerate(stack) if function == "find")
path = [stack[start]] + [frame for frame in stack[start + 1 :] if frame[0].startswith(package)]
path.append(stack[-1])  # the model's forward
named = [(file[len(package) + 1 :] if file.startswith(package) else "model", function) for file, function in path]
print(json.dumps([f"{file}:{function}" for file, function in named]))
"""


SPLITS_PROBE = r"""
import json
import batchfit
from batchfit.examples import gpt

model, sample = gpt()
result = batchfit.find(model, sample, memory_limit="64MiB")


def split(answer):
    micro = getattr(answer, "micro_batch", None) or answer.batch_size
    passes = getattr(answer, "accumulation_steps", None) or answer.accumulation
    return [micro, passes]


rows = []
for target in range(8, 129, 4):
    try:
        planned = split(batchfit.plan(result, target_batch=target))
    except ValueError as exc:
        planned = str(exc).splitlines()[0]
    rows.append({"target": target, "plan": planned, "recommend": split(result.recommend(target_batch=target))})
print(json.dumps({"max_batch": result.max_batch, "safe_batch": result.safe_batch, "rows": rows}))
"""


def issue49(root: Path) -> dict[str, object]:
    """Issue 49's counts, each with the places it counts (``tests/shape_counts.py``)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    import shape_counts as counts

    package = root / "batchfit"
    places = {
        "runner protocol members": counts.runner_members(package),
        "methods taking a trial's parameters one by one": counts.trial_restatements(package),
        "hidden command-line flags": counts.hidden_flags(package),
        "places outside cli/ that start python -m batchfit": counts.command_line_starts(package),
        "serialisers of Options": counts.options_serialisers(package),
        "types that declare how to train themselves": counts.answer_types(package),
        "global-batch splitters": counts.splitters(package),
        "records that declare the boundary's fields": counts.boundary_restatements(package),
        "module files sharing a name": [p for paths in counts.shared_stems(package).values() for p in paths],
        "imports of batchfit's own modules inside functions": counts.function_level_imports(package),
        "  of those, without a comment saying why": counts.uncommented_function_level_imports(package),
        "import batchfit inside the package": counts.root_package_imports(package),
        "'cpu' comparisons outside backends/": counts.cpu_comparisons(package),
        **{f"files naming {name}": counts.files_naming(package, name) for name in counts.CONCENTRATED_OPTIONS},
    }
    return {name: {"count": len(found), "places": found} for name, found in places.items()}


def surface_with_facade(root: Path) -> int:
    """The names every surface exports together, the facade's (and ``__version__``) included."""
    code = (
        "import importlib, json, pkgutil, batchfit\n"
        "names = set(batchfit.__all__)\n"
        "for info in pkgutil.iter_modules(batchfit.__path__):\n"
        "    if info.ispkg:\n"
        "        names |= set(getattr(importlib.import_module('batchfit.' + info.name), '__all__', ()))\n"
        "print(len(names))\n"
    )
    return int(_python(root, code).strip())


def splits(root: Path) -> dict[str, object]:
    """The built-in GPT's splits by `plan` and by `recommend`, and the targets where they differ."""
    found = json.loads(_python(root, SPLITS_PROBE).strip().splitlines()[-1])
    found["differ"] = [row["target"] for row in found["rows"] if row["plan"] != row["recommend"]]
    return found


def lines(root: Path) -> dict[str, int]:
    package = root / "batchfit"
    files = sorted(package.rglob("*.py"))
    surfaces = [path for path in files if path.name == "__init__.py" and path.parent != package]
    return {
        "batchfit": sum(len(path.read_text().splitlines()) for path in files),
        "modules": len(files),
        "surfaces_and_lazy": sum(len(path.read_text().splitlines()) for path in [*surfaces, package / "_lazy.py"]),
    }


def exported(root: Path) -> dict[str, int]:
    """Names each subpackage surface exports, read in a fresh interpreter on ``root``'s batchfit."""
    code = (
        "import importlib, json, pkgutil, batchfit\n"
        "out = {}\n"
        "for info in pkgutil.iter_modules(batchfit.__path__):\n"
        "    if not info.ispkg: continue\n"
        "    module = importlib.import_module('batchfit.' + info.name)\n"
        "    names = getattr(module, '__all__', None) or [n for n in dir(module) if not n.startswith('_')]\n"
        "    out[info.name] = sorted(set(names) - {'annotations', 'TYPE_CHECKING', 'lazy_surface'})\n"
        "out['batchfit'] = sorted(batchfit.__all__)\n"
        "print(json.dumps(out))\n"
    )
    names = json.loads(_python(root, code))
    public = set(names.pop("batchfit"))
    counts = {surface: len(set(listed) - public) for surface, listed in sorted(names.items())}
    counts["beyond batchfit.__all__"] = len(set().union(*map(set, names.values())) - public)
    counts["batchfit.__all__"] = len(public)
    return counts


def declarations(root: Path) -> dict[str, dict[str, int]]:
    """Per option: parameters and annotated class attributes of that name across ``batchfit/``
    (``all``), and those that also give it a value (``defaulted``: each restates a default)."""
    options_source = (root / "batchfit" / "probe" / "options.py").read_text()
    tree = ast.parse(options_source)
    options_class = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Options")
    names = [n.target.id for n in options_class.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)]
    counts = {name: {"all": 0, "defaulted": 0} for name in names}
    for path in (root / "batchfit").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                arguments = node.args
                positional = [*arguments.posonlyargs, *arguments.args]
                defaults = [None] * (len(positional) - len(arguments.defaults)) + list(arguments.defaults)
                pairs = [*zip(positional, defaults), *zip(arguments.kwonlyargs, arguments.kw_defaults)]
                for argument, default in pairs:
                    if argument.arg in counts:
                        counts[argument.arg]["all"] += 1
                        counts[argument.arg]["defaulted"] += default is not None
            elif isinstance(node, ast.ClassDef):
                for statement in node.body:
                    if isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name):
                        if statement.target.id in counts:
                            counts[statement.target.id]["all"] += 1
                            counts[statement.target.id]["defaulted"] += statement.value is not None
    return counts


def frames(root: Path) -> list[str]:
    return json.loads(_python(root, FRAMES_PROBE).strip().splitlines()[-1])


def roles(site: Path) -> int:
    """Raw reST roles in the visible text of a built site's pages, read as `tests/test_docs_site.py`
    reads them (its `RAW_ROLE` and `visible_text`: the test asserts 0, this counts)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from test_docs_site import RAW_ROLE, visible_text

    return sum(len(RAW_ROLE.findall(visible_text(page))) for page in site.rglob("*.html"))


def _python(root: Path, code: str) -> str:
    return subprocess.run(
        [sys.executable, "-c", code], cwd=root, env=_env(root), capture_output=True, text=True, check=True
    ).stdout


def _env(root: Path) -> dict[str, str]:
    import os

    return {**os.environ, "PYTHONPATH": str(root)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=Path.cwd(), help="the checkout to measure (default: here)")
    parser.add_argument("--site", type=Path, help="a built docs site (mkdocs build) to count raw roles in")
    parser.add_argument("--label", default="", help="a word for the JSON file's name (before, after)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="directory for the JSON file")
    args = parser.parse_args(argv)
    root = args.root.resolve()
    importlib.invalidate_caches()
    shape = {
        "root": str(root),
        "commit": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True
        ).stdout.strip(),
        "lines": lines(root),
        "exported": exported(root),
        "declarations": declarations(root),
        "frames": frames(root),
        "issue49": issue49(root),
        "surface_with_facade": surface_with_facade(root),
        "splits": splits(root),
    }
    if args.site is not None:
        shape["raw_roles"] = roles(args.site)
    declared = {name: count["defaulted"] for name, count in shape["declarations"].items()}
    print(f"code shape of {root} ({shape['commit']})")
    print(
        f"  lines in batchfit/: {shape['lines']['batchfit']:,} in {shape['lines']['modules']} modules; "
        f"surfaces and _lazy: {shape['lines']['surfaces_and_lazy']}"
    )
    print("  exported names: " + ", ".join(f"{k} {v}" for k, v in shape["exported"].items()))
    print(
        f"  declarations with a default per option: max {max(declared.values())}, "
        f"mean {sum(declared.values()) / len(declared):.1f}; "
        + ", ".join(f"{k} {v}" for k, v in sorted(declared.items(), key=lambda kv: -kv[1]))
    )
    print(f"  frames from find to forward: {len(shape['frames'])}: " + " -> ".join(shape["frames"]))
    for name, found in shape["issue49"].items():
        print(f"  {name}: {found['count']}")
    print(f"  surface with the facade: {shape['surface_with_facade']} names")
    split = shape["splits"]
    print(
        f"  built-in GPT at 64 MiB (max {split['max_batch']}, safe {split['safe_batch']}): targets 8..128 where "
        f"plan and recommend split differently: {len(split['differ'])} {split['differ']}"
    )
    if "raw_roles" in shape:
        print(f"  raw reST roles in the built site: {shape['raw_roles']}")
    args.out.mkdir(parents=True, exist_ok=True)
    label = f"-{args.label}" if args.label else ""
    path = args.out / f"code-shape{label}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(shape, indent=2) + "\n")
    print(f"  written to {path}")


if __name__ == "__main__":
    main()
