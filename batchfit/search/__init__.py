"""The search for the largest batch size that fits: pure logic over an oracle, never torch.

The search asks an *oracle* "does batch size ``b`` fit?" and decides which size to ask next, so
it is tested exhaustively against synthetic thresholds (``tests/test_search.py``). Its modules:

* [`batchfit.search.core`][batchfit.search.core]: the types, the loop ([`search`][batchfit.search.core.search]),
  the plain strategy ([`Doubling`][batchfit.search.core.Doubling]: grow x2, then bisect) and its proven trial bound
  ([`max_trials`][batchfit.search.core.max_trials]);
* `batchfit.search.interpolate`: the interpolating strategy, built on the core's types;
* `batchfit.search.strategies`: the names users pass (``"binary"``, ``"interpolate"``);
* `batchfit.search.near`: the exact search from a predicted boundary (`search_near`), the
  frontier's search at each length after the first (and on the length axis).
"""

from batchfit._lazy import lazy_surface
from batchfit.search.core import (
    Attempt,
    Bracket,
    Doubling,
    Grid,
    SearchReport,
    Strategy,
    is_non_monotone,
    search,
)
from batchfit.search.near import search_near
from batchfit.search.scratch import confirm_from_scratch
from batchfit.search.strategies import make_strategy

__all__ = [
    "Attempt",
    "Bracket",
    "Doubling",
    "Grid",
    "SearchReport",
    "Strategy",
    "confirm_from_scratch",
    "is_non_monotone",
    "make_strategy",
    "search",
    "search_near",
]

#: Names this surface exported before issue 33 that are internals: they still import, with a warning.
_MOVED = {"Interpolating": "batchfit.search.interpolate", "StopReason": "batchfit.search.core"}

__getattr__, _ = lazy_surface(__name__, globals(), {}, _MOVED)
