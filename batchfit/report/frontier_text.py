"""Plain text of a frontier (``str(frontier)``): a row per length, the longest length, the surface.

Pure Python (no torch, no rich): the same text goes to a log, a terminal and a notebook; the
terminal's chart (``batchfit.view``) and the image (`batchfit.report.frontier_plot`) draw the
same numbers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from batchfit.report.text import device_text
from batchfit.units import format_bytes

if TYPE_CHECKING:
    from batchfit.report.frontier import Frontier, FrontierPoint, Surface

#: The table's columns: (title, width); numbers right-aligned, the safe batch's word left of them.
_COLUMNS = (("seq_len", 7), ("max batch", 9), ("safe batch", 17), ("tokens (max)", 12), ("tokens/s (safe)", 15))


def render_frontier(frontier: Frontier) -> str:
    """The frontier as plain text: a headline, one row per length, then what the rows add up to."""
    return "\n".join(frontier_lines(frontier))


def frontier_lines(frontier: Frontier) -> list[str]:
    """`render_frontier`'s lines (a view wraps them to its width)."""
    lines = headline_lines(frontier)
    lines.append("")
    lines.append(_row(list(TABLE_TITLES)))
    for point in frontier.points:
        lines.append(_row(point_cells(point, frontier.estimated)))
    unreached = [point for point in frontier.points if not point.result.boundary_reached]
    for point in unreached:
        lines.append(f"  + seq_len {point.seq_len:,}: boundary not reached ({point.result.stop_reason})")
    lines.append("")
    lines.extend(f"{label:<20}{value}".rstrip() for label, value in summary_rows(frontier, notes=False))
    lines.extend(f"note: {note}" for note in frontier.notes)
    lines.extend(f"assumes: {assumption}" for assumption in frontier.assumptions)
    return lines


#: The table's column titles.
TABLE_TITLES = (*(title for title, _ in _COLUMNS), "trials")


def headline_lines(frontier: Frontier) -> list[str]:
    """What was measured, where, under which budget (an estimate says so first)."""
    lines = []
    if frontier.estimated:
        lines.append("ESTIMATE: no step ran on a device (batchfit.estimate with seq_lens); see the assumptions below")
    lines.append(_headline(frontier))
    said = [_limit_source(frontier)] + (["counts reserved bytes"] if frontier.budget_counts == "reserved" else [])
    said = [part for part in said if part]
    budget = format_bytes(frontier.budget_bytes) + (f" ({'; '.join(said)})" if said else "")
    lines.append(f"{'memory budget':<20}{budget}")
    return lines


def point_cells(point: FrontierPoint, estimated: bool = False) -> list[str]:
    """One length as the table's cells: seq_len, max batch, safe batch, tokens, tokens/s, trials.
    A ``+`` after the max batch: the search stopped before the boundary (a floor, not the limit)."""
    result = point.result
    if not result.safe_verified:
        checked = "NOT verified"
    elif estimated or result.estimated:
        checked = "fake steps"
    else:
        checked = "verified"
    return [
        f"{point.seq_len:,}",
        f"{point.max_batch:,}" + ("" if result.boundary_reached else "+"),
        f"{point.safe_batch:,} {checked}",
        f"{point.tokens:,}",
        format_rate(point.tokens_per_s),
        str(point.trials),
    ]


def format_rate(tokens_per_s: float | None) -> str:
    """``12,345`` tokens/s; ``-`` when not timed (an estimate, ``verify_steps=0``)."""
    return "-" if not tokens_per_s else f"{tokens_per_s:,.0f}"


def compact_rate(tokens_per_s: float | None) -> str:
    """``12.3k``, ``1.25M``: tokens/s in a few characters, for a chart's labels; ``-`` when not timed."""
    if not tokens_per_s:
        return "-"
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if tokens_per_s >= scale:
            value = tokens_per_s / scale
            return f"{value:.3g}{suffix}" if value < 100 else f"{value:.0f}{suffix}"
    return f"{tokens_per_s:.3g}"


def small_bytes(nbytes: float) -> str:
    """Bytes as `format_bytes` says them, with three digits below a KiB
    (``0.348 B``: a per-squared-token term is often a fraction of a byte)."""
    return format_bytes(nbytes) if abs(nbytes) >= 1024 else f"{nbytes:.3g} B"


def surface_equation(surface: Surface) -> str:
    """``294.22 KiB + b x (4.24 KiB x s + 12 B x s^2)``: the fitted surface in readable units."""
    return (
        f"{format_bytes(surface.fixed_bytes)} + b x ({small_bytes(surface.per_token_bytes)} x s"
        f" + {small_bytes(surface.per_token_squared_bytes)} x s^2)"
    )


def longest_text(frontier: Frontier) -> str:
    """The longest length at batch 1 and what ended its search."""
    longest = frontier.longest_at_batch_1
    if longest is None:
        return "not searched"
    why = {
        "memory": f"length {longest + 1:,} ran out of memory at batch 1",
        "positions": "the model takes no longer sequence (its position embeddings)",
        "max_seq_len": "the max_seq_len asked for; longer may fit",
    }.get(frontier.longest_limited_by or "", "")
    trials = f"{frontier.longest_trials} trial{'s' * (frontier.longest_trials != 1)}"
    return f"{longest:,}" + (
        f"  (limited by {frontier.longest_limited_by}: {why}; {trials})" if why else f"  ({trials})"
    )


def summary_rows(frontier: Frontier, *, notes: bool = True) -> list[tuple[str, str]]:
    """Label/value rows under the table: the longest length, the token budget, the surface, the
    fastest length, the trials, how the answer was obtained (and the notes and assumptions)."""
    rows = [("longest at batch 1", longest_text(frontier))]
    new = frontier.new_tokens
    if new:
        rows.append(
            (
                "generation",
                f"seq_len is the prompt; every row generates {new:,} new tokens (stopping disabled), so it holds "
                f"seq_len + {new:,} tokens in its KV cache; tokens/s counts new tokens",
            )
        )
    if frontier.points:
        counted = f"batch x (seq_len + {new:,}), the KV budget" if new else "batch x seq_len"
        rows.append(
            (
                "token budget",
                f"{frontier.token_budget:,} tokens per batch fit at every length measured (the smallest max "
                f"{counted}); {frontier.safe_token_budget:,} at the safe batches",
            )
        )
    surface = frontier.surface
    if surface is None:
        rows.append(("memory surface", "not fitted: no length gave a memory line"))
    else:
        length = f"s the context, seq_len + {new:,}" if new else "s seq_len"
        rows.append(("memory surface", f"{surface_equation(surface)}  ({surface.unit} bytes, b batch, {length})"))
        rows.append(("", surface.meaning()))
    fastest = frontier.fastest
    if fastest is not None:
        rows.append(
            (
                "fastest",
                f"seq_len {fastest.seq_len:,} at batch {fastest.safe_batch:,}: "
                f"{format_rate(fastest.tokens_per_s)} tokens/s",
            )
        )
    elif frontier.estimated:
        rows.append(("fastest", "not measured: an estimate times nothing"))
    else:
        rows.append(("fastest", "not measured: no safe batch was timed (verify_steps=0?)"))
    rows.append(("trials", f"{frontier.trials} in {frontier.elapsed_s:.1f} s"))
    rows.append(("measured", "estimated on fake tensors, no step ran" if frontier.estimated else "real steps"))
    if notes:
        rows.extend(("note", note) for note in frontier.notes)
        rows.extend(("assumes", assumption) for assumption in frontier.assumptions)
    return rows


def _headline(frontier: Frontier) -> str:
    first = frontier.points[0].result if frontier.points else None
    lengths = len(frontier.points)
    where = device_text(frontier.device)
    if first is None:
        return f"batchfit frontier on {where}: no length measured"
    settings = first.settings
    mode = settings.mode + (f", amp {settings.amp}" if settings.amp else "")
    return (
        f"batchfit {first.batchfit_version} frontier on {where} (torch {first.torch_version}, {mode}): "
        f"{lengths} length{'s' * (lengths != 1)}"
    )


def _limit_source(frontier: Frontier) -> str:
    return frontier.points[0].result.settings.limit_source if frontier.points else ""


def _row(cells: list[str]) -> str:
    widths = [width for _, width in _COLUMNS] + [6]
    return "  ".join(cell.rjust(width) for cell, width in zip(cells, widths)).rstrip()
