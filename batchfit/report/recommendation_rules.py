"""The rules of `batchfit.report.recommendation`, the arithmetic and words they share, and what
they read of a result (`Measured`).

The record and `recommend` (what users call) are there; the rules that pick the batch are here,
below both the record and `Result`: they read a result as `Measured`, so `Result.recommend` can
call them without a circle. Pure Python, no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol

from batchfit.report.boundary import Bounded
from batchfit.report.global_split import choose_split
from batchfit.report.throughput import KNEE_FRACTION, best_timed

if TYPE_CHECKING:
    from batchfit.report.noise import NoiseScale
    from batchfit.report.records import Settings, SizedOn, Trial
    from batchfit.report.throughput import Throughput

__all__ = [
    "DECIDERS",
    "WIDE",
    "Choice",
    "Decider",
    "Facts",
    "Measured",
    "by_noise",
    "by_speed",
    "by_target",
    "caveats_for",
    "off_text",
    "split_text",
]

#: An interval wider than this ratio (``high / low``) asks for more passes.
WIDE = 2.0
#: The bound that decided a recommendation.
Decider = Literal["target", "noise scale", "throughput knee", "memory"]
DECIDERS: tuple[str, ...] = ("target", "noise scale", "throughput knee", "memory")


class Measured(Bounded, Protocol):
    """What the rules read of a probe's answer: a `batchfit.Result`, or one read back from JSON
    (its boundary, `Bounded`, and what follows)."""

    @property
    def best_throughput_batch(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    @property
    def estimated(self) -> bool: ...

    @property
    def settings(self) -> Settings: ...

    @property
    def throughput(self) -> Throughput | None: ...

    @property
    def noise_scale(self) -> NoiseScale | None: ...

    @property
    def sized_on(self) -> SizedOn | None: ...

    @property
    def trials(self) -> tuple[Trial, ...]: ...


@dataclass(frozen=True)
class Facts:
    """What the rules read from a result: per rank, on the grid of ``multiple_of``."""

    safe: int  # the largest micro-batch allowed: the safe batch, down to a multiple of multiple_of
    ranks: int  # the ranks to train on: the probe's, or another world size (an elastic re-plan)
    step: int  # multiple_of, or 1 when the safe batch is below it
    knee: int | None
    best: int
    rates: dict[int, float]
    noise: NoiseScale | None
    result: Measured
    measured: dict[int, float]  # samples/s per size from its best-timed trial: what a target's split is chosen on

    @classmethod
    def of(cls, result: Measured, world_size: int | None = None) -> Facts:
        """The facts of ``result`` for training on ``world_size`` ranks (default: the ranks that
        probed). Per-rank sizes hold for any number of ranks of the same device kind: a rank's
        memory does not depend on how many others there are (DDP's buckets are per rank)."""
        multiple = max(1, result.settings.multiple_of)
        step = multiple if multiple <= result.safe_batch else 1
        throughput = result.throughput
        rates: dict[int, float] = {}
        if throughput is not None:
            rates = {throughput.knee_batch: throughput.knee_samples_per_s}
            rates[throughput.best_batch] = throughput.best_samples_per_s
            rates.update(dict(throughput.rates))
        return cls(
            safe=result.safe_batch // step * step,
            ranks=result.world_size if world_size is None else world_size,
            step=step,
            knee=None if throughput is None else throughput.knee_batch,
            best=result.best_throughput_batch if throughput is None else throughput.best_batch,
            rates=rates,
            noise=result.noise_scale,
            result=result,
            measured={size: t.samples_per_s or 0.0 for size, t in best_timed(getattr(result, "trials", ())).items()},
        )

    def rate(self, size: int) -> float | None:
        return self.rates.get(size)

    def faster(self, size: int, than: int) -> str:
        """``"only 2% faster per sample"``: how ``size`` measured against ``than``."""
        mine, theirs = self.rate(size), self.rate(than)
        if mine is None or theirs is None or theirs <= 0:
            return "not timed"
        gain = mine / theirs - 1
        if gain < 0.005:  # a gain that rounds to 0% reads as none
            return f"{-gain:.0%} slower per sample" if gain < -0.005 else "no faster per sample"
        return (
            f"only {gain:.0%} faster per sample"
            if gain < 1 - KNEE_FRACTION + 0.005
            else f"{gain:.0%} faster per sample"
        )

    def headroom(self) -> str:
        settings = self.result.settings
        verified = "estimated" if self.result.estimated else "verified" if self.result.safe_verified else "NOT verified"
        return f"the safe batch {self.result.safe_batch} ({settings.headroom:.0%} of the budget left free, {verified})"


#: What a rule decides: micro-batch, accumulation steps, the bound that decided, the reason, caveats.
Choice = tuple[int, int, Decider, str, list[str]]


def by_target(facts: Facts, target: int, about: tuple[str, ...] = ()) -> Choice:
    """Rule 1: reach the target, exactly where the ranks share it (`choose_split`); ``about``: how
    the target was read (tokens rounded to whole sequences, the length), said first."""
    multiple = max(1, facts.result.settings.multiple_of)
    micro, steps, said = choose_split(target, facts.result.safe_batch, facts.ranks, multiple, facts.measured)
    reached = micro * steps * facts.ranks
    asked = f"the target global batch {target}"
    caveats: list[str] = []
    if reached == target:
        if facts.ranks != facts.result.world_size and micro in facts.measured:
            said.append(f"the rates were measured with {facts.result.world_size} rank(s), not {facts.ranks}")
        reason = "; ".join([*about, f"{asked}, exactly: {said[0]}", *said[1:]])
    else:
        bound = f"micro-batches up to the safe batch {facts.safe}" + (
            f" in multiples of {facts.step}" if facts.step > 1 else ""
        )
        why = f"no split into {bound}" + (f" over {facts.ranks} ranks" if facts.ranks > 1 else "") + " reaches it"
        reason = "; ".join([*about, f"{asked} becomes {reached}, {off_text(reached - target)} it, because {why}"])
    noise = facts.noise
    if noise is not None:
        scale = _noise_text(noise)
        if noise.b_simple is not None and noise.high is not None and reached > noise.high:
            caveats.append(
                f"the global batch {reached} is above the noise scale ({scale}): past it, extra samples per step "
                "buy few steps; a smaller batch (the learning rate tuned for it) would need fewer samples"
            )
        elif reached < noise.low:
            caveats.append(
                f"the global batch {reached} is below the noise scale ({scale}): a larger batch would still cut "
                "the optimizer steps nearly in proportion"
            )
    if facts.knee is not None and micro < facts.knee <= facts.safe:  # a knee above the safe batch is out of reach
        caveats.append(f"micro-batch {micro} is below the throughput knee {facts.knee}: {_slower(facts, micro)}")
    return micro, steps, "target", reason, caveats


def by_noise(facts: Facts, noise: NoiseScale) -> Choice:
    """Rule 2: the noise scale against what fits and the knee."""
    safe, ranks, scale = facts.safe, facts.ranks, _noise_text(noise)
    fits = safe * ranks
    knee = None if facts.knee is None else min(facts.knee, safe)
    past = "" if noise.high is None else f"; beyond ~{noise.plain(noise.high)} the extra samples buy little"
    if noise.b_simple is None:
        if noise.low > fits:
            steps = max(1, -(-math.ceil(noise.low) // fits))
            reason = (
                f"the noise scale is large ({scale}), above the "
                f"{fits} that fits{_per(ranks)}, so accumulate to at least that"
            )
            return safe, steps, "noise scale", reason, []
        reason = (
            f"the noise scale is large ({scale}), so a larger batch still "
            f"buys fewer steps, and {facts.headroom()} is the largest that fits"
        )
        return safe, 1, "memory", reason, []
    scale_b = noise.b_simple
    if scale_b > fits:
        steps = max(1, math.floor(scale_b / fits + 0.5))
        if steps == 1:
            reason = (
                f"the noise scale ({scale}) is just above the {fits} that "
                f"fits{_per(ranks)}; accumulating 2 steps would double that to {2 * fits}{past}"
            )
            return safe, 1, "noise scale", reason, []
        reason = f"the noise scale ({scale}) is above the {fits} that fits{_per(ranks)}, so accumulate{past}"
        return safe, steps, "noise scale", reason, []
    if knee is not None and scale_b < knee * ranks:
        if facts.knee is not None and facts.knee > safe:
            reason = (
                f"{facts.headroom()}; the throughput knee {facts.knee} is "
                f"above it, and below the knee the device idles, though samples past the noise scale ({scale}) buy "
                "few steps"
            )
            return safe, 1, "memory", reason, []
        above = f"; {safe} fits but is {facts.faster(safe, knee)}" if safe > knee else ""
        reason = (
            f"the throughput knee{above}, and the noise scale ({scale}) is "
            "below it: below the knee the device idles, above it samples past the noise scale buy few steps"
        )
        return knee, 1, "throughput knee", reason, []
    floor = knee if knee is not None else facts.step
    micro = min(safe, max(floor, math.floor(scale_b / ranks / facts.step + 0.5) * facts.step))
    where = f"between the throughput knee {knee} and" if knee is not None else "within"
    reason = (
        f"the noise scale ({scale}), {where} the {fits} that "
        f"fits{_per(ranks)}: the most samples a step uses well, at full speed{past}"
    )
    return micro, 1, "noise scale", reason, []


def by_speed(facts: Facts) -> Choice:
    """Rules 3 and 4: the knee where something was timed, else the safe batch."""
    safe = facts.safe
    if facts.knee is None:
        why = "the estimate timed no step" if facts.result.estimated else "no step was timed"
        reason = f"{facts.headroom()}; {why}, so there is no throughput knee"
        return safe, 1, "memory", reason, []
    if facts.knee >= safe:
        knee = "is also the throughput knee" if facts.knee == safe else f"is below the throughput knee {facts.knee}"
        reason = f"{facts.headroom()}, which {knee}"
        return safe, 1, "memory", reason, []
    compared = safe if facts.rate(safe) is not None else facts.best
    which = f"{safe} fits but" if compared == safe else f"the fastest measured, {compared},"
    reason = (
        f"the throughput knee, the smallest batch within "
        f"{1 - KNEE_FRACTION:.0%} of the best rate; {which} is {facts.faster(compared, facts.knee)}"
    )
    return facts.knee, 1, "throughput knee", reason, []


def caveats_for(result: Measured, facts: Facts, micro: int) -> list[str]:
    """What holds whichever rule decided: a re-plan for another world size, the noise scale's limits
    (or how to get one), the probe's own."""
    caveats: list[str] = []
    cached = getattr(result, "from_cache", None)  # a cache hit on other ranks keeps the ranks that measured
    probed = result.world_size if cached is None else cached.world_size
    if facts.ranks != probed:
        measured = f"{probed} rank{'s' * (probed != 1)}"
        caveats.append(
            f"re-planned for {facts.ranks} rank{'s' * (facts.ranks != 1)} from a probe on {measured}, without a new "
            f"probe: a rank's batch sizes and memory hold on the same device kind; the samples/s are those {measured} "
            "measured"
        )
    noise = facts.noise
    if noise is None:
        caveats.append(
            "no noise scale was measured, so nothing says whether a larger batch still buys fewer steps: "
            "find(..., noise_scale=True) or batchfit probe --noise-scale measures it from real batches"
        )
    else:
        caveats.append(
            "the noise scale is derived for SGD: with Adam (or another adaptive optimizer) treat it as a guide"
        )
        caveats.append(
            "it is near zero at initialisation and grows as the loss falls: measure it again later in training"
        )
        if noise.high is None or noise.low <= 0 or noise.high / noise.low > WIDE:
            caveats.append(
                f"its interval is wide ({noise.interval_text()}): measure with more passes "
                f"(noise_passes={2 * noise.passes}, --noise-passes {2 * noise.passes})"
            )
    throughput = result.throughput
    if throughput is not None and throughput.within_noise and micro < facts.best:
        caveats.append(
            f"the rates differ by less than the repeated steps' spread ({throughput.spread or 0:.0%}): the knee is "
            "approximate"
        )
    if not result.safe_verified:
        caveats.append(f"the safe batch {result.safe_batch} was not verified: see the result's notes")
    if result.settings.multiple_of > result.safe_batch:
        caveats.append(
            f"no multiple of {result.settings.multiple_of} (multiple_of) fits within the safe batch "
            f"{result.safe_batch}, so it is ignored"
        )
    return caveats


# Words -----------------------------------------------------------------------------------------------
def split_text(micro: int, steps: int, ranks: int) -> str:
    """``48``, ``48 x 4 accumulation``, ``48 per rank x 4 accumulation x 2 ranks``."""
    text = f"{micro}" + (" per rank" if ranks > 1 else "")
    if steps > 1:
        text += f" x {steps} accumulation"
    return text + (f" x {ranks} ranks" if ranks > 1 else "")


def _per(ranks: int) -> str:
    return f" over {ranks} ranks" if ranks > 1 else ""


def off_text(change: int, unit: str = "") -> str:
    """``"3 over"``, ``"3 short of"``, ``"exactly"``; tokens (``unit``) with thousands separated."""
    size = f"{abs(change):,}{unit}" if unit else f"{abs(change)}"
    if change > 0:
        return f"{size} over"
    return f"{size} short of" if change < 0 else "exactly"


def _noise_text(noise: NoiseScale) -> str:
    """``~190, 90% 150-240 samples``, or for a drowned signal ``90% at least ~150 samples``."""
    if noise.b_simple is None:
        at_least = f"{noise.confidence:.0%} at least ~{noise.plain(noise.low)}"
        return f"the gradient signal drowned in its noise; {at_least} samples"
    return f"~{noise.plain(noise.b_simple)}, {noise.interval_text()} samples"


def _slower(facts: Facts, micro: int) -> str:
    knee = facts.knee
    assert knee is not None
    mine, theirs = facts.rate(micro), facts.rate(knee)
    if mine is None or theirs is None or theirs <= 0:
        return "each pass uses the device less well"
    return f"it measured {1 - mine / theirs:.0%} slower per sample"
