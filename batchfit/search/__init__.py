"""The search for the largest batch size that fits: pure logic over an oracle, never torch.

The search asks an *oracle* "does batch size ``b`` fit?" and decides which size to ask next, so
it is tested exhaustively against synthetic thresholds (``tests/test_search.py``). Its modules:

* :mod:`batchfit.search.core`: the types, the loop (:func:`search`), the plain strategy
  (:class:`Doubling`: grow x2, then bisect) and its proven trial bound (:func:`max_trials`);
* :mod:`batchfit.search.interpolate`: the interpolating strategy, built on the core's types;
* :mod:`batchfit.search.strategies`: the names users pass (``"binary"``, ``"interpolate"``);
* :mod:`batchfit.search.near`: the exact search from a predicted boundary (:func:`search_near`), the
  frontier's search at each length after the first (and on the length axis).
"""

from batchfit.search.core import (
    Attempt,
    Bracket,
    Doubling,
    Grid,
    SearchReport,
    StopReason,
    Strategy,
    Verdict,
    affordable,
    clamp,
    is_non_monotone,
    max_trials,
    midpoint,
    search,
)
from batchfit.search.interpolate import Interpolating
from batchfit.search.near import HEDGE, search_near
from batchfit.search.scratch import confirm_from_scratch
from batchfit.search.strategies import STRATEGIES, make_strategy

__all__ = [
    "HEDGE",
    "STRATEGIES",
    "Attempt",
    "Bracket",
    "Doubling",
    "Grid",
    "Interpolating",
    "SearchReport",
    "StopReason",
    "Strategy",
    "Verdict",
    "affordable",
    "clamp",
    "confirm_from_scratch",
    "is_non_monotone",
    "make_strategy",
    "max_trials",
    "midpoint",
    "search",
    "search_near",
]
