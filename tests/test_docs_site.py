"""The built docs site: no raw reST role as text, and no internal member in the API reference.

The site is built once with `mkdocs build --strict` (so a cross-reference to a target the docs do
not render fails the build). The API reference's objects are read from the site's `objects.inv`,
the inventory mkdocstrings writes of every object it rendered, and each documented class or module
may show only the members of its public contract, `PUBLIC` below: a new public member is added
there on purpose, and an internal one (a `Prober` helper, an `Options` method) fails the test.
"""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
import zlib
from html.parser import HTMLParser
from pathlib import Path
from typing import is_typeddict

import pytest

pytest.importorskip("mkdocs")
pytest.importorskip("mkdocstrings")
pytest.importorskip("mkdocstrings_handlers.python")

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]

#: A Sphinx role left in a docstring renders as its own text (`:class:` before the code).
RAW_ROLE = re.compile(r":(?:py:)?(?:class|func|mod|meth|attr|exc|data|obj|const|ref|doc|term):(?=\S)")

#: Every object the reference documents, and the members it may show. Keys of a `TypedDict` (the
#: keyword groups) are its contract and need no listing.
PUBLIC: dict[str, tuple[str, ...]] = {
    "batchfit.accelerate.find_executable_batch_size": (),
    "batchfit.distributed.uneven_share.UnevenShare": ("accumulation", "micro_batch", "part", "pass_batch", "weight"),
    "batchfit.distributed.uneven_share.uneven_split": (),
    "batchfit.api.find": (),
    "batchfit.api.fit": (),
    "batchfit.api.frontier": (),
    "batchfit.api_varlen.buckets": (),
    "batchfit.api_varlen.soak": (),
    "batchfit.api_schedule.schedule": (),
    "batchfit.probe.batch_schedule.BatchSchedule": (
        "accumulation", "begin_step", "changes", "close", "end_step", "global_batch", "load_state_dict",
        "micro_batches", "rule", "state_dict", "step",
    ),
    "batchfit.report.schedule.ScheduleState": (
        "after_step", "b_simple", "check_resumable", "global_batch", "megatron", "meters", "olmo_core", "plot",
        "start", "steps", "summary",
    ),
    "batchfit.report.schedule_rule.ScheduleRule": ("global_batch", "rows_per_accumulation"),
    "batchfit.report.schedule.ScheduleChange": (),
    "batchfit.lightning.BatchScheduler": ("changes", "megatron", "olmo_core", "schedule"),
    "batchfit.transformers.BatchSchedulerCallback": ("changes", "megatron", "of", "olmo_core", "schedule_state"),
    "batchfit.samplers.BucketBatchSampler": ("load_state_dict", "set_epoch", "state_dict", "steps"),
    "batchfit.samplers.TokenBudgetBatchSampler": ("load_state_dict", "set_epoch", "state_dict", "steps"),
    "batchfit.report.varlen.LengthPlan": (
        "batch_sizes", "best_layout", "boundaries", "epoch_steps", "from_dict", "from_json", "knobs", "padding",
        "plot", "to_dict", "to_json", "tokens_per_s", "with_soak",
    ),
    "batchfit.report.varlen.Bucket": ("padded_tokens", "padding", "seconds", "steps", "tokens_per_s"),
    "batchfit.report.varlen.TokenBudget": (),
    "batchfit.report.varlen.Composition": (),
    "batchfit.report.varlen.Packing": (),
    "batchfit.report.varlen.Soak": ("from_dict", "from_json", "to_dict", "to_json"),
    "batchfit.api.noise_scale": (),
    "batchfit.api.plan": (),
    "batchfit.api_jobs.find_sharded": (),
    "batchfit.errors": (
        "BatchfitError",
        "DeviceFailedError",
        "EstimateTimeoutError",
        "LimitError",
        "NoOptimizerStepError",
        "NothingFitsError",
        "RankFailedError",
        "RanksTimeoutError",
    ),
    "batchfit.estimation.estimator.estimate": (),
    "batchfit.estimation.rank_estimate.estimate_sharded": (),
    "batchfit.estimation.planning.Plan": (),
    "batchfit.estimation.planning.plan_for": (),
    "batchfit.estimation.whatif.WhatIf": ("row",),
    "batchfit.estimation.whatif.WhatIfRow": (),
    "batchfit.estimation.whatif.what_if": (),
    "batchfit.lightning.BatchFit": ("on_fit_start", "plan", "setup"),
    "batchfit.probe.options.Options": (),
    "batchfit.probe.prober.Prober": ("trial",),
    "batchfit.ray.WorkerBatch": (
        "accumulation_steps",
        "exact",
        "global_batch",
        "metrics",
        "micro_batch",
        "reason",
        "remainder",
        "summary",
        "target_batch",
        "world_size",
    ),
    "batchfit.ray.worker_batch": (),
    "batchfit.report.checkpointing.Fit": ("plot", "policy", "row", "to_dict", "to_json"),
    "batchfit.report.checkpointing.Policy": ("k", "label"),
    "batchfit.report.checkpointing.PolicyRow": (),
    "batchfit.report.frontier.Frontier": (
        "fastest",
        "from_dict",
        "new_tokens",
        "plot",
        "point",
        "safe_token_budget",
        "to_json",
        "token_budget",
        "trials",
    ),
    "batchfit.report.boundary.Boundary": ("of",),
    "batchfit.report.evaluation.Evaluation": ("of",),
    "batchfit.report.frontier.FrontierPoint": (
        "boundary_reached", "context_tokens", "max_batch", "new_tokens", "safe_batch", "safe_verified", "tokens",
        "trials",
    ),
    "batchfit.report.generation.Generation": ("context_tokens", "of", "predict_bytes"),
    "batchfit.report.frontier.Surface": (
        "fit",
        "largest_batch",
        "longest_length",
        "meaning",
        "per_sample_bytes",
        "predict",
        "quadratic",
        "quadratic_share",
    ),
    "batchfit.report.memory.MemoryModel": ("fit", "largest_batch_within", "predict"),
    "batchfit.report.memory.PhaseLine": (),
    "batchfit.report.noise.NoiseScale": ("from_dict", "interval_text", "plain", "summary"),
    "batchfit.report.recommendation.Recommendation": (
        "accumulation_steps", "decision", "exact", "from_dict", "lines", "metrics", "micro_batch", "remainder", "split",
        "summary", "target_batch",
    ),
    "batchfit.report.recommendation.recommend": (),
    "batchfit.report.records.AllocatorFacts": (),
    "batchfit.report.records.CacheHit": (),
    "batchfit.report.records.DeviceInfo": ("from_dict",),
    "batchfit.report.records.Settings": (),
    "batchfit.report.records.Trial": (
        "capped_peak_bytes",
        "from_dict",
        "peak_in",
        "phase_peaks_in",
        "refused_for_retry",
    ),
    "batchfit.report.result.Result": (
        "from_dict",
        "eval_max_batch",
        "eval_safe_batch",
        "from_json",
        "global_max_batch",
        "global_safe_batch",
        "recommend",
        "recommendation",
        "to_dict",
        "to_json",
        "trial",
    ),
    "batchfit.report.throughput.Throughput": ("of", "rate_of"),
    "batchfit.report.uneven.RankBatch": (),
    "batchfit.report.uneven.UnevenSplit": ("offsets", "pass_batch", "share", "text", "weights_text", "world_size"),
    # The pure search, for people writing a strategy: the helpers strategies build on are theirs too.
    "batchfit.search.core": (
        "Attempt",
        "Bracket",
        "Doubling",
        "Grid",
        "SearchReport",
        "Strategy",
        "Verdict",
        "affordable",
        "clamp",
        "is_non_monotone",
        "max_trials",
        "midpoint",
        "search",
    ),
    "batchfit.search.core.Grid": ("floor", "top"),
    "batchfit.search.core.Strategy": ("propose",),
    "batchfit.search.interpolate.Interpolating": (),
    "batchfit.search.strategies.make_strategy": (),
    "batchfit.testing.gate": ("GateReport", "assert_fits", "check_fits"),
    "batchfit.testing.gate.GateReport": ("explain", "from_dict", "from_json", "largest_trial"),
    "batchfit.testing.pytest_plugin": (),
    "batchfit.transformers.Autosized": ("global_batch", "plan"),
    "batchfit.transformers.autosize": (),
}


class _Text(HTMLParser):
    """The visible text of a page: what a reader sees, not the markup or the scripts.
    `benchmarks/code_shape.py` counts the roles of a site with it too (`visible_text`)."""

    def __init__(self) -> None:
        super().__init__()
        self.parts: list[str] = []
        self._hidden = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self._hidden += tag in ("script", "style")

    def handle_endtag(self, tag: str) -> None:
        self._hidden -= tag in ("script", "style")

    def handle_data(self, data: str) -> None:
        if not self._hidden:
            self.parts.append(data)


def visible_text(page: Path) -> str:
    """What a reader of `page` (a built HTML page) sees."""
    text = _Text()
    text.feed(page.read_text(encoding="utf-8", errors="replace"))
    return "".join(text.parts)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    built = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert built.returncode == 0, f"mkdocs build --strict failed:\n{built.stdout[-3000:]}\n{built.stderr[-6000:]}"
    return out


def rendered(site: Path) -> set[str]:
    """The objects the reference rendered: the inventory's own entries, not their aliases."""
    lines = (site / "objects.inv").read_bytes().split(b"\n", 4)
    names = set()
    for line in zlib.decompress(lines[4]).decode().splitlines():
        name, _domain, _priority, uri = line.split(" ", 4)[:4]
        if uri.rpartition("#")[2] in (name, "$"):
            names.add(name)
    return names


def typeddict_keys(path: str) -> set[str]:
    module, _, name = path.rpartition(".")
    try:
        obj = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return set()
    return set(obj.__annotations__) if is_typeddict(obj) else set()


def test_no_raw_rest_role_in_the_site(site: Path) -> None:
    found = []
    for page in sorted(site.rglob("*.html")):
        visible = visible_text(page)
        for match in RAW_ROLE.finditer(visible):
            near = visible[max(0, match.start() - 40) : match.end() + 40].replace("\n", " ")
            found.append(f"{page.relative_to(site)}: ...{near}...")
    assert not found, f"{len(found)} raw reST roles in the built site:\n" + "\n".join(found[:40])


def test_the_reference_shows_no_internal_member(site: Path) -> None:
    names = rendered(site)
    assert "batchfit.api.find" in names, "the API reference rendered nothing"
    private = sorted(n for n in names if any(part.startswith("_") for part in n.split(".")))
    assert not private, f"private names in the reference: {private}"
    documented = {n for n in names if n.rpartition(".")[0] not in names or n in PUBLIC}
    unlisted = sorted(n for n in documented if n not in PUBLIC and not n.startswith("batchfit.probe.keywords."))
    assert not unlisted, f"documented objects with no public contract in PUBLIC: {unlisted}"
    internal = []
    for name in sorted(names):
        owner, _, member = name.rpartition(".")
        if owner in names and member not in PUBLIC.get(owner, ()):
            if member not in typeddict_keys(owner):
                internal.append(name)
    assert not internal, f"members outside their class's public contract (PUBLIC) in the reference: {internal}"


def test_the_prober_shows_only_its_contract(site: Path) -> None:
    # The internals the issue found in the table of contents (issue 33).
    names = rendered(site)
    for member in ("layout_carries", "model_for_key", "verdict_steps", "warm_steps", "workload"):
        assert f"batchfit.probe.prober.Prober.{member}" not in names
    assert "batchfit.probe.prober.Prober.trial" in names


def test_every_docs_anchor_a_message_names_exists(site: Path) -> None:
    # Messages say one sentence and point to the docs for the rest: "see docs/how-to/real-data.md#...".
    pointer = re.compile(r"docs/([\w/.-]+?)\.md(?:#([\w-]+))?")
    missing = []
    for source in sorted((ROOT / "batchfit").rglob("*.py")):
        for page, anchor in pointer.findall(source.read_text(encoding="utf-8")):
            html = site / ("index.html" if page == "index" else f"{page}/index.html")
            if not html.exists() or (anchor and f'id="{anchor}"' not in html.read_text(encoding="utf-8")):
                missing.append(f"{source.relative_to(ROOT)}: docs/{page}.md#{anchor}")
    assert not missing, f"links to docs pages or anchors that do not exist: {missing}"
