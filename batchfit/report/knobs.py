"""The settings each framework takes for a [`LengthPlan`][batchfit.LengthPlan], by their own names.

Why here: the plan's numbers are batchfit's (a bucket's batch, a padded token budget, a packed
row's length); each framework counts its budget its own way, so the mapping is stated once and
is what ``batchfit probe --buckets`` prints and the JSON carries:

* **padded** budgets (``rows x longest row <= max_tokens``): batchfit's `TokenBudgetBatchSampler`;
* **packed** budgets (the sum of the rows' lengths, padding removed): verl's
  ``ppo_max_token_len_per_gpu`` with ``use_remove_padding``, slime's ``--max-tokens-per-gpu``,
  a flattening collator's one row; these come from the packed row measured
  (``Packing.longest_packed_row``), never from a padded budget, which does not bound them;
* **per-batch** sizes: torchtune's ``batch_size`` with ``max_seq_len``, transformers'
  ``per_device_train_batch_size``.

Generation-shaped plans (``(prompt, response)`` lengths) get batchfit's entry alone: the
training frameworks' settings do not describe a generation. A framework whose budget this plan
did not measure gets its entry's ``"note"`` saying what to measure instead, not a number that
does not hold.
"""

from __future__ import annotations

from typing import Any, Protocol

__all__ = ["knobs_for"]


class _Bucket(Protocol):
    longest: int
    batch_size: int
    new_tokens: int


class _Budget(Protocol):
    max_tokens: int


class _Packing(Protocol):
    pack_length: int
    batch_size: int
    longest_packed_row: int | None


class _Plan(Protocol):
    """What the mapping reads of a plan (`batchfit.report.varlen.LengthPlan`)."""

    @property
    def buckets(self) -> tuple[_Bucket, ...]: ...
    @property
    def token_budget(self) -> _Budget | None: ...
    @property
    def packing(self) -> _Packing | None: ...
    @property
    def longest(self) -> int: ...


UNPACKED = (
    "measure packing (pack_length=, --pack-length): this budget counts the rows' summed lengths, "
    "which a padded budget does not bound"
)


def knobs_for(plan: _Plan) -> dict[str, dict[str, Any]]:
    """``{framework: {setting: value, ..., "note": why}}`` for the plan (see the module)."""
    longest_bucket = plan.buckets[-1] if plan.buckets else None
    packed_row = None if plan.packing is None else plan.packing.longest_packed_row
    knobs: dict[str, dict[str, Any]] = {}
    if longest_bucket is not None:
        knobs["batchfit"] = {
            "BucketBatchSampler.boundaries": [bucket.longest for bucket in plan.buckets],
            "BucketBatchSampler.batch_sizes": [bucket.batch_size for bucket in plan.buckets],
        }
    if plan.token_budget is not None:
        knobs.setdefault("batchfit", {})["TokenBudgetBatchSampler.max_tokens"] = plan.token_budget.max_tokens
    if longest_bucket is not None and longest_bucket.new_tokens:
        knobs["batchfit"]["max_new_tokens"] = [bucket.new_tokens for bucket in plan.buckets]
        knobs["batchfit"]["note"] = "generation: each bucket's rows generate its max_new_tokens at its batch"
        return knobs  # the training frameworks' settings do not describe a generation
    if packed_row is not None:
        knobs["verl"] = {
            "actor_rollout_ref.actor.use_dynamic_bsz": True,
            "actor_rollout_ref.model.use_remove_padding": True,
            "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": packed_row,
            "note": "the longest packed row that trained (padding removed, as use_remove_padding packs)",
        }
        knobs["slime"] = {
            "--use-dynamic-batch-size": True,
            "--max-tokens-per-gpu": packed_row,
            "note": "the longest packed row that trained (slime packs a micro-batch's rows end to end)",
        }
    else:
        knobs["verl"] = {"note": UNPACKED}
        knobs["slime"] = {"note": UNPACKED}
    if plan.packing is not None:
        knobs["torchtune"] = {
            "dataset.packed": True,
            "tokenizer.max_seq_len": plan.packing.pack_length,
            "batch_size": plan.packing.batch_size,
            "note": "packed rows of max_seq_len tokens, batch_size of them a step",
        }
    elif longest_bucket is not None:
        knobs["torchtune"] = {
            "dataset.packed": False,
            "tokenizer.max_seq_len": plan.longest,
            "batch_size": longest_bucket.batch_size,
            "note": "one batch size for every step, so the one that fits the longest rows",
        }
    transformers: dict[str, Any] = {}
    if longest_bucket is not None:
        transformers = {
            "per_device_train_batch_size": longest_bucket.batch_size,
            "group_by_length": True,
            "note": "padded batches: the batch that fits the longest rows (per-bucket sizes: batchfit's sampler)",
        }
    if packed_row is not None:
        transformers = {
            "data_collator": "DataCollatorWithFlattening()",
            "per_device_train_batch_size": max(1, packed_row // plan.longest),
            "note": f"the collator flattens a batch into one row; {packed_row:,} tokens trained as one packed row, "
            f"so this many rows of the longest length ({plan.longest:,}) always fit",
        }
    if transformers:
        knobs["transformers"] = transformers
    if plan.token_budget is not None:
        knobs["lhotse"] = {
            "DynamicBucketingSampler.max_duration": plan.token_budget.max_tokens,
            "DynamicBucketingSampler.num_buckets": max(1, len(plan.buckets)),
            "note": "in the unit the lengths were given in (frames: divide by the frame rate for seconds); lhotse "
            "sums durations where padding makes a batch rows x longest: its buckets keep the two close, not equal",
        }
    return knobs
