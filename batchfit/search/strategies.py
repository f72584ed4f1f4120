"""The search strategies by name: ``"binary"`` and ``"interpolate"``.

The registry needs both strategy modules, so it sits apart from them: `batchfit.search.interpolate`
builds on `batchfit.search`, and [`batchfit.search.search`][batchfit.search.core.search] takes a strategy object,
never a name, so search needs neither the registry nor the interpolating strategy and the two
modules do not import each other. Callers that accept names (``find()``, the CLI) turn them into
objects here. Like the two modules, this one never imports torch.
"""

from __future__ import annotations

from collections.abc import Callable

from batchfit.search.core import Doubling, Strategy
from batchfit.search.interpolate import Interpolating

__all__ = ["STRATEGIES", "make_strategy"]

#: The strategies a name selects; each is built with no arguments.
STRATEGIES: dict[str, Callable[[], Strategy]] = {"binary": Doubling, "interpolate": Interpolating}


def make_strategy(name_or_strategy: str | Strategy) -> Strategy:
    """Look up a strategy by name, or accept an object that has ``propose``."""
    if isinstance(name_or_strategy, str):
        try:
            return STRATEGIES[name_or_strategy]()
        except KeyError:
            known = ", ".join(sorted(STRATEGIES))
            raise ValueError(f"unknown search strategy {name_or_strategy!r}; known: {known}") from None
    if not callable(getattr(name_or_strategy, "propose", None)):
        raise TypeError("strategy must be a name or an object with a propose(bracket) method")
    return name_or_strategy
