"""Every option declared once, reaching every entry point that takes it; one projection of the settings.

The keywords are named, typed and documented in `batchfit.probe.keywords`; their defaults, checks
and part in the answer are `Options`' fields. Nothing here lists the options by hand: the tests
read them from those two declarations, so a new option is held to all of this the moment it is
declared (and a test fails until it is declared in both, documented, and reaches every entry point).
"""

from __future__ import annotations

import inspect
from dataclasses import MISSING, fields, replace
from typing import Any, get_args

import pytest
import torch
from torch import nn

import batchfit
from batchfit.probe import keywords
from batchfit.probe.keywords import (
    EstimateOptions,
    FindKeywords,
    FindOptions,
    FrontierKeywords,
    FrontierOptions,
    Hooks,
    NoiseOptions,
    keywords_of,
)
from batchfit.probe.options import Options

OPTIONS = {option.name: option for option in fields(Options)}


def _annotation(value: Any) -> str:
    return getattr(value, "__forward_arg__", value)


# Declared once -------------------------------------------------------------------------------------
def test_every_keyword_is_one_option_of_the_same_type() -> None:
    declared = {name: _annotation(kind) for name, kind in FindOptions.__annotations__.items()}
    assert sorted(declared) == sorted(OPTIONS)
    for name, option in OPTIONS.items():
        assert declared[name] == option.type, f"{name}: keywords say {declared[name]}, Options says {option.type}"


def test_every_keyword_is_documented_once_with_its_default() -> None:
    docs = keywords.keyword_docs()  # read from the source, as the docs site and the CLI help read it
    assert set(keywords.HOOK_DEFAULTS) == set(keywords_of(Hooks))
    for name in [*OPTIONS, *keywords_of(Hooks)]:
        assert docs.get(name), f"{name} has no docstring in batchfit.probe.keywords"
    for name, option in OPTIONS.items():
        assert option.default is not MISSING
        said = docs[name]
        if option.default is not None:
            assert f"Default: {option.default}" in said.replace("`", "").replace('"', ""), (name, said)


def test_no_entry_point_restates_an_option_in_its_signature() -> None:
    from batchfit.estimation import estimate
    from batchfit.lightning import BatchFit
    from batchfit.ray import worker_batch
    from batchfit.testing import check_fits
    from batchfit.transformers import autosize

    # estimate's memory_limit and reserve describe the card it estimates for (for_device), not where it
    # runs; its device= is for_device's old name (it warns); frontier's make_batch is its positional
    # (batch_size, seq_len) builder, not find's option.
    own = {
        estimate: {"device", "memory_limit", "reserve"},
        BatchFit.__init__: {"memory_limit"},
        batchfit.frontier: {"make_batch"},
    }
    entries = (batchfit.find, batchfit.frontier, batchfit.noise_scale, estimate, check_fits, batchfit.Prober.__init__,
               batchfit.find_sharded)  # fmt: skip
    for entry in (*entries, BatchFit.__init__, autosize, worker_batch):
        parameters = inspect.signature(entry).parameters
        restated = {name for name in parameters if name in OPTIONS} - own.get(entry, set())
        assert not restated, f"{entry.__qualname__} restates {sorted(restated)}"
        assert any(p.kind is p.VAR_KEYWORD and "Unpack[" in str(p.annotation) for p in parameters.values())
    positional = inspect.signature(BatchFit.__init__).parameters["memory_limit"]
    assert positional.kind is positional.POSITIONAL_ONLY  # so it cannot clash with the keyword


# Every option reaches every entry point ------------------------------------------------------------
class _Poison:
    """A value no option accepts: the error it raises names the option, which proves the keyword
    reached the one validation (`Options`) through that entry point."""

    def __repr__(self) -> str:
        return "<poison>"


def _model() -> nn.Module:
    return nn.Linear(4, 2)


def _entries() -> dict[str, tuple[type, Any]]:
    from batchfit.estimation import estimate
    from batchfit.ray import worker_batch
    from batchfit.testing import check_fits

    sample = torch.randn(2, 4)
    return {
        "find": (FindKeywords, lambda **kw: batchfit.find(_model(), sample, **kw)),
        "frontier": (FrontierKeywords, lambda **kw: batchfit.frontier(_model(), None, seq_lens=[8], **kw)),
        "noise_scale": (NoiseOptions, lambda **kw: batchfit.noise_scale(_model(), [sample, sample], **kw)),
        "estimate": (EstimateOptions, lambda **kw: estimate(_model(), sample, memory_limit="1GiB", **kw)),
        "check_fits": (FindOptions, lambda **kw: check_fits(_model(), sample, batch_size=2, **kw)),
        "Prober": (FindOptions, lambda **kw: batchfit.Prober(_model(), sample, **kw)),
        "worker_batch": (FindKeywords, lambda **kw: worker_batch(_model(), sample, **kw)),
        "find_sharded": (FindKeywords, lambda **kw: batchfit.find_sharded("mymodels:build", 2, estimate=False, **kw)),
    }


def _cases() -> list[tuple[str, str]]:
    return [(entry, name) for entry, (group, _) in _entries().items() for name in keywords_of(group)]


@pytest.mark.parametrize(("entry", "name"), _cases())
def test_every_option_reaches_the_validation_of_every_entry_point_that_takes_it(entry: str, name: str) -> None:
    group, call = _entries()[entry]
    with pytest.raises((TypeError, ValueError), match=name):
        call(**{name: _Poison()})


def test_every_option_reaches_the_integrations() -> None:
    pytest.importorskip("lightning")
    pytest.importorskip("transformers")
    from batchfit.accelerate import find_executable_batch_size
    from batchfit.lightning import BatchFit
    from batchfit.transformers import autosize

    for name in keywords_of(FindKeywords):
        with pytest.raises((TypeError, ValueError), match=name):
            BatchFit(**{name: _Poison()})  # what it sets from the trainer itself is refused by name
        with pytest.raises((TypeError, ValueError), match=name):
            autosize(None, **{name: _Poison()})  # before the trainer is looked at
    # Accelerate's decorator keeps Accelerate's names and its margin of 0 (a fraction of samples, not
    # find's headroom of bytes); of ours it takes multiple_of.
    for name in ("margin", "multiple_of"):
        with pytest.raises((TypeError, ValueError), match=name):
            find_executable_batch_size(lambda batch_size: None, **{name: _Poison()})


def test_the_command_line_passes_every_option_it_has_a_flag_for() -> None:
    from batchfit.cli.arguments import find_kwargs, option_keywords
    from batchfit.cli.parser import build_parser
    from batchfit.targets import EXTRA_KEYS

    parser = build_parser()
    commands = parser._subparsers._group_actions[0].choices  # argparse keeps them there
    for command, group in (("probe", FindOptions), ("frontier", FrontierOptions), ("estimate", EstimateOptions)):
        flags = {action.dest for action in commands[command]._actions}
        for name in keywords_of(group):
            # an option without a flag comes from the target file, or is one a command line has no use for
            assert name in flags or name in EXTRA_KEYS or name in ("restore_rng", "distributed", "rank_timeout"), (
                command,
                name,
            )
    args = parser.parse_args(
        ["probe", "model.py", "--headroom", "0.2", "--init-batch", "4", "--scan-batches", "all", "--timed-steps", "0"]
    )
    given = find_kwargs(args, None, "cpu", "1GiB")
    assert given["headroom"] == 0.2 and given["init_batch"] == 4 and given["timed_steps"] == 0
    assert given["scan_batches"] is None  # "all"
    assert Options(**given).answer_settings()["headroom"] == 0.2
    assert option_keywords(args, NoiseOptions).keys() <= set(keywords_of(NoiseOptions))


# One projection of the settings ---------------------------------------------------------------------
def _changed(name: str, default: Any) -> Any:
    """A valid value of option `name` other than its default, read off its declared type."""
    if isinstance(default, bool):
        return not default
    if isinstance(default, int):
        return default * 2
    if isinstance(default, float):
        return default / 2
    kind = OPTIONS[name].type
    if name == "mode":
        return next(choice for choice in get_args(keywords.Mode) if choice != default)
    if name == "amp":
        return get_args(keywords.Amp)[0]
    if name == "strategy":
        return "binary"
    if name == "cache":
        return "some/directory"
    if name == "device":
        return "cpu"
    if kind.startswith("Callable") or name == "optimizer":
        return lambda *args: torch.optim.SGD(args[0], lr=0.1) if name == "optimizer" else None
    if "bool" in kind:
        return False
    if "int" in kind:
        return 4
    if "float" in kind:
        return 1.5
    if "str" in kind:
        return "1GiB" if name == "memory_limit" else "64MiB"
    raise AssertionError(f"no other value known for {name} ({kind})")


#: What an option belongs with: generation's options need mode="generate", eval_step an evaluation.
COMPANIONS: dict[str, dict[str, Any]] = {
    "max_new_tokens": {"mode": "generate", "max_new_tokens": 8},
    "generate_fn": {"mode": "generate", "max_new_tokens": 8},
    "eval_step": {"eval": True},
}


def _key(options: Options) -> str:
    from batchfit.probe.keys import cache_key
    from batchfit.report import DeviceInfo

    device = DeviceInfo(type="cpu", name="cpu", total_bytes=2**30)
    key = cache_key(_model(), torch.zeros(2, 4), options, device, 2**20, 0, torch_version="t", batchfit_version="b")
    return key.hex


@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_an_option_that_can_change_the_answer_is_keyed_or_says_why_not(name: str) -> None:
    option = OPTIONS[name]
    said = option.metadata
    assert ("section" in said) != ("unchanged" in said), f"{name}: say whether it changes the answer, and why not"
    base = Options(**COMPANIONS.get(name, {}))
    other = replace(base, **{name: _changed(name, option.default)})
    if "unchanged" in said:
        assert said["unchanged"]  # the reason, in words
        assert _key(other) == _key(base)
        assert other.answer_settings() == base.answer_settings()
    elif said["how"] == "value":
        assert _key(other) != _key(base), f"{name} changes the answer but the cache key does not hold it"
        assert other.answer_settings() != base.answer_settings(), f"the ranks would not agree on {name}"
    elif said["how"] == "code":
        from batchfit.probe.keys import CODE

        assert name in CODE
        assert _key(other) != _key(base)
    else:  # resolved by the probe: the device as DeviceInfo, the limit in bytes, the reserve
        assert said["how"] == "resolved"
        assert name in ("device", "memory_limit", "reserve")


def test_the_result_records_the_settings_the_ranks_agree_on() -> None:
    given = {"headroom": 0.2, "init_batch": 4, "time_budget": 30, "verify_steps": 1, "max_batch": 8, "timed_steps": 0}
    result = batchfit.find(_model(), torch.randn(2, 4), memory_limit="64MiB", **given)
    answer = Options(**given).answer_settings()
    recorded = {name: getattr(result.settings, name) for name in answer if hasattr(result.settings, name)}
    assert recorded == {name: answer[name] for name in recorded}
    assert len(recorded) >= 9  # all but the length, the scan and the timing, which the result records elsewhere
    assert result.settings.time_budget_s == answer["time_budget"] == 30.0
