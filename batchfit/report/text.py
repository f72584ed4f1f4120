"""Plain text of a result (``str(result)``) and of a device, for logs and reports."""

from __future__ import annotations

from typing import TYPE_CHECKING

from batchfit.units import format_bytes, format_duration

if TYPE_CHECKING:
    from batchfit.report.records import DeviceInfo
    from batchfit.report.result import Result


def render_text(result: Result) -> str:
    """A plain-text summary: headline numbers, the memory equation, one row per trial."""
    device = result.device
    lines = [
        *(
            ["ESTIMATE: no step ran on a device (batchfit.estimate); see the assumptions below"]
            if result.estimated
            else []
        ),
        f"batchfit {result.batchfit_version} on {device.name or device.type}"
        f" (torch {result.torch_version}, {result.settings.mode}"
        f"{', amp ' + result.settings.amp if result.settings.amp else ''})",
        f"memory budget      {format_bytes(result.budget_bytes)} ({result.settings.limit_source}"
        + ("; counts reserved bytes)" if result.budget_counts == "reserved" else ")"),
        f"max batch          {result.max_batch}"
        + ("" if result.boundary_reached else f"  (boundary not reached: {result.stop_reason})"),
        f"safe batch         {result.safe_batch}  ({result.settings.headroom:.0%} headroom, "
        + (("checked on fake steps" if result.estimated else "verified") if result.safe_verified else "NOT verified")
        + ")",
        f"best throughput    {'not measured (estimate)' if result.estimated else result.best_throughput_batch}",
    ]
    if result.world_size > 1:
        lines.append(
            f"ranks              {result.world_size}: batch sizes per rank; "
            f"global max batch {result.global_max_batch}, global safe batch {result.global_safe_batch}"
        )
    for answer in result.per_rank:
        lines.append(
            f"{f'rank {answer.rank}':<18} max batch {answer.max_batch}, safe batch {answer.safe_batch} "
            f"({'verified' if answer.safe_verified else 'NOT verified'}) on {format_bytes(answer.budget_bytes)}"
        )
    if result.throughput is not None:
        lines.append(f"throughput knee    {result.throughput.knee_batch}")
    lines += [f"{label:<18} {value}" for label, value in evaluation_rows(result) + generation_rows(result)]
    if result.memory is not None:
        mem = result.memory
        lines.append(
            f"memory equation    {format_bytes(mem.fixed_bytes)} + "
            f"{format_bytes(mem.per_sample_bytes)} x batch  ({mem.phase} peak, {mem.unit}; weights "
            f"{format_bytes(mem.weights_bytes)}, grads {format_bytes(mem.gradient_bytes)}, "
            f"optimizer state {format_bytes(mem.optimizer_state_bytes)})"
        )
    if result.sized_on is not None:
        lines.append(f"sized on           {result.sized_on.summary()}")
    hit = result.from_cache
    if hit is not None:
        lines.append(
            f"from the cache     {hit.path}, written {hit.written_at} on {hit.world_size} rank"
            f"{'s' if hit.world_size != 1 else ''} in {hit.elapsed_s:.1f} s; no search ran now"
        )
    lines.append(f"trials             {len(result.trials)} in {result.elapsed_s:.1f} s")
    lines.append("")
    lines.append(f"{'batch':>8}  {'kind':<6}  {'outcome':<14}  {'peak':>12}  {'step':>10}  {'samples/s':>11}")
    for trial in result.trials:
        outcome = "fits" if trial.fits else f"OOM ({trial.phase})"
        step = "-" if trial.step_time_s is None else format_duration(trial.step_time_s)
        rate = f"{trial.samples_per_s:,.1f}" if trial.samples_per_s is not None else "-"
        peak = format_bytes(trial.peak_in(result.budget_counts))
        if not trial.fits and trial.peak_in(result.budget_counts) is not None:
            peak = ">=" + peak  # what was held when it failed: a lower bound of what the size needs
        lines.append(f"{trial.batch_size:>8}  {trial.kind:<6}  {outcome:<14}  {peak:>12}  {step:>10}  {rate:>11}")
    for note in result.notes:
        lines.append(f"note: {note}")
    for assumption in result.assumptions:
        lines.append(f"assumes: {assumption}")
    return "\n".join(lines)


def evaluation_rows(result: Result) -> list[tuple[str, str]]:
    """The evaluation step's answer beside training's (``find(eval=True)``), as label/value rows
    (the text's and the command line's summary)."""
    evaluation = result.evaluation
    if evaluation is None:
        return []
    knee = f", knee {evaluation.throughput.knee_batch}" if evaluation.throughput is not None else ""
    unreached = "" if evaluation.boundary_reached else "  (boundary not reached)"
    return [
        ("eval max batch", f"{evaluation.max_batch}{unreached}"),
        (
            "eval safe batch",
            f"{evaluation.safe_batch}  ({'verified' if evaluation.safe_verified else 'NOT verified'}{knee}; "
            "training state live)",
        ),
    ]


def generation_rows(result: Result) -> list[tuple[str, str]]:
    """What a generation probe measured (the context, tokens/s, the KV cache per token), as label/value rows."""
    generation = result.generation
    if generation is None:
        return []
    context = (
        f"{generation.prompt_tokens} prompt + {generation.new_tokens} new tokens"
        if generation.prompt_tokens is not None
        else f"{generation.new_tokens} new tokens"
    )
    rows = [("generation", f"{context} per row, stopping disabled")]
    if generation.best_tokens_per_s is not None and generation.knee_tokens_per_s is not None:
        best, knee = generation.best_tokens_per_s, generation.knee_tokens_per_s
        rows.append(("tokens/s", f"{best:,.0f} best, {knee:,.0f} at the knee (new tokens)"))
    kv, fixed, other = generation.kv_bytes_per_token, generation.fixed_bytes, generation.other_bytes_per_sample
    if kv is not None:
        rows.append(("KV cache", f"{format_bytes(kv)} per token per row"))
    if kv is not None and fixed is not None and other is not None:
        rows.append(
            (
                "(batch, context)",
                f"{format_bytes(fixed)} + batch x ({format_bytes(other)} + {format_bytes(kv)} x context tokens)"
                f"  (the rest of a row measured at context {generation.context_tokens})",
            )
        )
    return rows


def device_text(device: DeviceInfo) -> str:
    """``"NVIDIA H100 80GB HBM3 (cuda:0)"``, ``"CPU: ... (cpu)"``."""
    where = device.type if device.index is None else f"{device.type}:{device.index}"
    return f"{device.name} ({where})" if device.name else where
