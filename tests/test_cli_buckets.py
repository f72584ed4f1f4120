"""``batchfit probe TARGET --buckets LENGTHS`` (issue 50): `batchfit.buckets` from the command line.

In-process through ``main()`` on the built-in tiny GPT under a small CPU limit: what is checked is
the command (the lengths it reads, the target's batches it finds, what it refuses before any
trial, what it prints, its JSON and its exit codes); `batchfit.buckets` itself is tested with the API.
"""

from __future__ import annotations

import io
import json
from dataclasses import replace
from pathlib import Path

import pytest

import batchfit
from batchfit.cli import main
from batchfit.cli.buckets_command import DEFAULT_MAX_BUCKETS, BucketsView, verdict
from batchfit.cli.lengths_arguments import DATASET, read_lengths
from batchfit.cli.output import UsageError
from batchfit.cli.parser import build_parser

TARGET = """
import torch
from torch.utils.data import DataLoader, Dataset

from batchfit import examples


def model():
    return examples.gpt(vocab_size=64, seq_len=64, d_model=16, n_layers=1, n_heads=2)[0]


def make_batch(batch_size, seq_len):
    ids = torch.randint(0, 64, (batch_size, seq_len), generator=torch.Generator().manual_seed(seq_len))
    return {"input_ids": ids, "labels": ids}


def build():
    return {"model": model(), "make_batch": make_batch}


def one_batch():
    return model(), make_batch(2, 8)


class Rows(Dataset):
    def __init__(self):
        self.lengths = [8] * 6 + [16] * 3 + [48]
        generator = torch.Generator().manual_seed(0)
        self.rows = [torch.randint(0, 64, (n,), generator=generator) for n in self.lengths]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def collate(items):
    longest = max(len(item["input_ids"]) for item in items)
    padded = [torch.nn.functional.pad(item["input_ids"], (0, longest - len(item["input_ids"]))) for item in items]
    ids = torch.stack(padded)
    return {"input_ids": ids, "labels": ids}


def loader():
    return model(), DataLoader(Rows(), batch_size=4, collate_fn=collate)
"""

#: Small and quick: the tiny GPT under 2 MiB, sizes up to 16, no verification steps.
FAST = ["--device", "cpu", "--memory-limit", "2MiB", "--max-batch", "16", "--verify-steps", "0"]


@pytest.fixture
def target(tmp_path: Path) -> Path:
    path = tmp_path / "varlen_gpt.py"
    path.write_text(TARGET)
    return path


@pytest.fixture
def lengths(tmp_path: Path) -> Path:
    path = tmp_path / "lengths.json"
    path.write_text(json.dumps([8, 8, 8, 8, 16, 16, 48]))
    return path


# What LENGTHS reads ------------------------------------------------------------------------------
def test_lengths_are_read_from_a_json_list_an_object_lines_and_stdin(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    listed, histogram, lines = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "c.txt"
    listed.write_text("[8, 16, 16]")
    histogram.write_text('{"8": 900, "512": 40}')
    lines.write_text("# lengths\n8\n\n16  # a comment\n16\n")
    assert read_lengths(str(listed)) == [8, 16, 16]
    assert read_lengths(str(histogram)) == {8: 900, 512: 40}
    assert read_lengths(str(lines)) == [8, 16, 16]
    monkeypatch.setattr("sys.stdin", io.StringIO("32\n64\n"))
    assert read_lengths("-") == [32, 64]
    assert read_lengths("dataset") is DATASET


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("8\nabc\n", "line 2: 'abc' is not a length"),
        ("[8, 3.5]", "[1] must be an integer, got 3.5"),
        ('{"long": 3}', "the key 'long' is not a length"),
        ("[8, 0]", "must be a length of at least 1 token, got 0"),
        ("[8, ", "is not valid JSON"),
        ("\n", "holds no lengths"),
    ],
)
def test_a_bad_lengths_file_is_a_usage_error_naming_it(tmp_path: Path, text: str, said: str) -> None:
    path = tmp_path / "bad.txt"
    path.write_text(text)
    with pytest.raises(UsageError, match="--buckets") as caught:
        read_lengths(str(path))
    assert said in str(caught.value)


def test_a_missing_lengths_file_exits_2_before_the_target_loads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["probe", str(tmp_path / "no_target.py:build"), "--buckets", str(tmp_path / "nope.json")])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "batchfit: error: --buckets" in err and "no such file" in err


# Refused before any trial ------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (["--pack-length", "64"], "--pack-length goes with --buckets LENGTHS"),
        (["--token-budget"], "--token-budget goes with --buckets LENGTHS"),
        (["--buckets", "{lengths}", "--require-batch", "4"], "--require-batch is not an option of --buckets"),
        (["--buckets", "{lengths}", "--seq-len", "8"], "--seq-len is not an option of --buckets"),
        (["--buckets", "{lengths}", "--token-budget", "--no-token-budget"], "give one"),
        (["--buckets", "{lengths}", "--soak-steps", "3"], "--soak-steps goes with --soak"),
    ],
)
def test_flags_that_do_not_go_together_exit_2(
    target: Path, lengths: Path, flags: list[str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    given = [flag.format(lengths=lengths) for flag in flags]
    code = main(["probe", f"{target}:build", *given, *FAST])
    err = capsys.readouterr().err
    assert code == 2, err
    assert said in err


@pytest.mark.parametrize(
    ("factory", "buckets", "said"),
    [
        ("one_batch", "{lengths}", "gave no make_batch(batch_size, seq_len) and a dict as its sample"),
        ("one_batch", "dataset", "--buckets dataset reads the lengths a DataLoader's dataset declares"),
    ],
)
def test_a_target_without_batches_of_every_length_exits_2(
    target: Path, lengths: Path, factory: str, buckets: str, said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["probe", f"{target}:{factory}", "--buckets", buckets.format(lengths=lengths), *FAST])
    err = capsys.readouterr().err
    assert code == 2, err
    assert said in err


def test_lengths_past_the_models_positions_exit_2_before_any_trial(
    target: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "long.txt"
    path.write_text("8\n100\n")
    code = main(["probe", f"{target}:build", "--buckets", str(path), *FAST, "-q"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "100" in err and "64 positions" in err


def test_packing_a_model_without_position_ids_exits_2(
    target: Path, lengths: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["probe", f"{target}:build", "--buckets", str(lengths), "--pack-length", "64", *FAST, "-q"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "packing needs a model whose forward takes position_ids" in err


def test_the_help_names_the_flags_and_the_default_it_says() -> None:
    text = build_parser()._subparsers._group_actions[0].choices["probe"].format_help()  # type: ignore[union-attr]
    for name in ("--buckets LENGTHS", "--token-budget", "--no-token-budget", "--max-buckets N", "--pack-length N"):
        assert name in text
    assert "--soak" in text and "--soak-steps N" in text
    assert f"(default {DEFAULT_MAX_BUCKETS};" in " ".join(text.split())


def test_the_live_view_starts_on_a_terminal_and_counts_the_candidate_lengths() -> None:
    view = BucketsView(io.StringIO(), quiet=False, pack_length=64, plain=False)  # as on a terminal
    try:
        view.start(["header"], (8, 16))
        assert view.current_length() == "length 1 of 2"
    finally:
        view.stop()
    assert view.after == "the token budget's compositions; packed rows"  # the trials after the lengths


# Real runs ---------------------------------------------------------------------------------------
@pytest.mark.slow  # ~10 s: a frontier over the candidate lengths, the budget's compositions, two soaks
def test_buckets_print_the_plan_and_write_json_that_round_trips(
    target: Path, lengths: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "plan.json"

    code = main(["probe", f"{target}:build", "--buckets", str(lengths), *FAST, "--soak", "--json", str(out)])

    printed = capsys.readouterr()
    assert code == 0, printed.err
    assert "buckets for" in printed.out and "7 rows of 8-48 tokens" in printed.out  # the header
    assert "bucket" in printed.out and "token budget: max_tokens=" in printed.out  # str(plan)
    assert "soak (buckets):" in printed.out and "knobs:" in printed.out
    document = json.loads(out.read_text())
    assert document["schema"] == "batchfit.lengths/1" and "knobs" in document
    plan = batchfit.LengthPlan.from_json(out.read_text())
    assert plan.longest == 48 and plan.boundaries[-1] == 48
    assert plan.token_budget is not None and len(plan.soaks) == 2
    assert all(soak.oom == 0 for soak in plan.soaks)

    # A soak step out of memory fails as the gate does: exit 3, said on stderr.
    worst = replace(plan.soaks[0], oom=2)
    assert verdict(replace(plan, soaks=(worst,)), budget_asked=False) == 3
    assert "ran out of memory at 2 of" in capsys.readouterr().err
    # --token-budget asked, and no padded budget holds the longest row: does not fit either.
    assert verdict(replace(plan, token_budget=None), budget_asked=True) == 3
    assert verdict(replace(plan, token_budget=None), budget_asked=False) == 0
    assert "batchfit: error: no token budget" in capsys.readouterr().err


@pytest.mark.slow  # a few seconds: a frontier over the dataset's lengths
def test_dataset_lengths_with_quiet_and_json_on_stdout(target: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["probe", f"{target}:loader", "--buckets", "dataset", *FAST, "--token-budget", "-q", "--json", "-"])

    printed = capsys.readouterr()
    assert code == 0, printed.err
    plan = batchfit.LengthPlan.from_json(printed.out)  # stdout is the JSON alone
    assert (plan.rows, plan.shortest, plan.longest) == (10, 8, 48)
    quiet = [line for line in printed.err.splitlines() if line.startswith("max_tokens=")]
    assert len(quiet) == 1 and " boundaries=" in quiet[0] and " batch_sizes=" in quiet[0]
