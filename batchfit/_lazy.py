"""Lazy package surfaces (PEP 562): a name is imported from its module on first use.

Three packages need it: ``batchfit`` itself, ``batchfit.backends`` and ``batchfit.testing``.
batchfit is also a pytest plugin and a CLI, and neither ``pytest`` start-up, ``batchfit
--help`` nor ``batchfit devices`` (NVML only) should pay for importing torch.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_surface(
    package: str, namespace: dict[str, Any], exports: Mapping[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``__getattr__`` and ``__dir__`` for ``package``, whose public ``name`` lives in the module
    ``exports[name]``. A name, once imported, is kept in ``namespace`` (the package's globals)."""

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted([*namespace, *exports])

    return __getattr__, __dir__
