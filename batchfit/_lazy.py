"""Package surfaces that import a name on first use (PEP 562), and names that moved off a surface.

`batchfit` itself, `batchfit.backends`, `batchfit.probe`, `batchfit.estimation` and
`batchfit.testing` are lazy: batchfit is also a pytest plugin and a CLI, and neither `pytest`
start-up, `batchfit --help` nor `batchfit devices` (NVML only) should pay for importing torch.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable, Mapping
from typing import Any


def lazy_surface(
    package: str, namespace: dict[str, Any], exports: Mapping[str, str], moved: Mapping[str, str] | None = None
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """`__getattr__` and `__dir__` for `package`.

    Args:
        package: the package's `__name__`.
        namespace: the package's globals, where a name is kept once imported.
        exports: each public name and the module that defines it.
        moved: names the surface no longer exports and the module to import them from; they
            still import, with a `DeprecationWarning` naming that module.
    """
    moved = moved or {}

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None and name in moved:
            module = moved[name]
            warnings.warn(f"{package}.{name} is deprecated: import it from {module}", DeprecationWarning, stacklevel=2)
            return getattr(importlib.import_module(module), name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted([*namespace, *exports])

    return __getattr__, __dir__
