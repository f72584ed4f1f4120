from __future__ import annotations

import pytest

import batchfit
from batchfit.backends.alloc_conf import ENV_VARIABLES, ROUNDUP_INTERVALS, AllocatorConfig
from batchfit.backends.simulated import SimulatedCudaMeter
from batchfit.examples import gpt

MIB = 2**20


# reading the settings as torch reads them -------------------------------------------------------------
def test_nothing_set_is_the_defaults() -> None:
    config = AllocatorConfig.from_environ({})
    assert config == AllocatorConfig()
    assert (config.backend, config.expandable_segments, config.max_split_size_bytes) == ("native", False, None)
    assert config.divisions_by_interval == (0,) * ROUNDUP_INTERVALS
    assert config.changes() == ()
    assert config.describe() == "the caching allocator's defaults"


def test_every_setting_that_changes_what_is_reserved() -> None:
    config = AllocatorConfig.parse(
        "expandable_segments:True, max_split_size_mb:128,max_non_split_rounding_mb:64,"
        "garbage_collection_threshold:0.6,large_segment_size_mb:32,per_process_memory_fraction:0.5"
    )
    assert config.expandable_segments is True
    assert config.max_split_size_bytes == 128 * MIB
    assert config.max_non_split_rounding_bytes == config.max_non_split_rounding == 64 * MIB
    assert config.garbage_collection_threshold == 0.6
    assert config.large_segment_bytes == 32 * MIB
    assert config.per_process_memory_fraction == 0.5
    assert (config.variable, config.other, config.unrecognized) == ("PYTORCH_CUDA_ALLOC_CONF", (), ())
    said = " | ".join(config.changes())
    for words in ("expandable segments", "max_split_size 128.00 MiB", "garbage_collection_threshold 0.6", "32.00 MiB"):
        assert words in said


def test_the_first_variable_set_wins_whole_even_when_empty() -> None:
    assert ENV_VARIABLES == ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
    both = {"PYTORCH_ALLOC_CONF": "expandable_segments:True", "PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:64"}
    config = AllocatorConfig.from_environ(both)
    assert (config.variable, config.expandable_segments, config.max_split_size_bytes) == (
        "PYTORCH_CUDA_ALLOC_CONF",
        False,
        64 * MIB,
    )
    empty = {"PYTORCH_CUDA_ALLOC_CONF": "", "PYTORCH_ALLOC_CONF": "expandable_segments:True"}
    shadowed = AllocatorConfig.from_environ(empty)
    assert (shadowed.variable, shadowed.expandable_segments) == ("PYTORCH_CUDA_ALLOC_CONF", False)
    alone = AllocatorConfig.from_environ({"PYTORCH_ALLOC_CONF": "expandable_segments:True"})
    assert (alone.variable, alone.expandable_segments) == ("PYTORCH_ALLOC_CONF", True)


def test_roundup_power2_divisions_forms() -> None:
    assert AllocatorConfig.parse("roundup_power2_divisions:4").divisions_by_interval == (4,) * ROUNDUP_INTERVALS
    assert AllocatorConfig(roundup_power2_divisions=2).divisions_by_interval == (2,) * ROUNDUP_INTERVALS
    # torch's fill: the first bound also sets every interval below it, '>' every one after the last.
    listed = AllocatorConfig.parse("roundup_power2_divisions:[256:1,512:2,1024:4,>:8]")
    assert listed.divisions_by_interval == (1,) * 9 + (2, 4) + (8,) * 5
    assert (listed.divisions(100), listed.divisions(300 * MIB), listed.divisions(600 * MIB)) == (1, 1, 2)
    assert (listed.divisions(1536 * MIB), listed.divisions(3 * 2**30), listed.divisions(2**40)) == (4, 8, 8)
    assert "steps between powers of two" in listed.describe()


def test_later_entries_win_and_whitespace_is_dropped() -> None:
    config = AllocatorConfig.parse(" expandable_segments : True ,expandable_segments:False ")
    assert config.expandable_segments is False


def test_known_keys_that_change_nothing_reserved_are_kept_and_unknown_ones_listed() -> None:
    config = AllocatorConfig.parse("pinned_use_background_threads:True,release_lock_on_cudamalloc:True,foo:[1,2],bar:3")
    assert config.other == (("pinned_use_background_threads", "True"), ("release_lock_on_cudamalloc", "True"))
    assert config.unrecognized == ("foo", "bar")
    assert "foo, bar" in config.describe()


def test_the_async_backend() -> None:
    config = AllocatorConfig.parse("backend:cudaMallocAsync", "PYTORCH_ALLOC_CONF")
    assert config.backend == "cudaMallocAsync"
    assert config.describe().startswith("PYTORCH_ALLOC_CONF='backend:cudaMallocAsync': backend cudaMallocAsync")
    assert AllocatorConfig.parse("backend:hipMallocAsync").backend == "cudaMallocAsync"


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("expandable_segments:true", "True or False"),
        ("expandable_segments", "key:value"),
        ("expandable_segments:", "value is missing"),
        ("max_split_size_mb:19", "at least the large segment size, 20"),
        ("large_segment_size_mb:40,max_split_size_mb:30", "at least the large segment size, 40"),
        ("max_split_size_mb:big", "not a whole number"),
        ("max_split_size_mb:[1]", "not a list"),
        ("large_segment_size_mb:10", "more than 10"),
        ("garbage_collection_threshold:1.0", "(0.0, 1.0)"),
        ("per_process_memory_fraction:1.5", "[0.0, 1.0]"),
        ("roundup_power2_divisions:3", "power of 2"),
        ("roundup_power2_divisions:[3:4]", "powers of 2"),
        ("roundup_power2_divisions:[256:3]", "0 or a power of 2"),
        ("roundup_power2_divisions:[256:1", "closing ']'"),
        ("backend:other", "native or cudaMallocAsync"),
        ("expandable_segments:True max_split_size_mb:64", "separated by ','"),
    ],
)
def test_malformed_settings_name_the_variable_and_the_entry(text: str, words: str) -> None:
    with pytest.raises(ValueError) as raised:
        AllocatorConfig.from_environ({"PYTORCH_ALLOC_CONF": text})
    message = str(raised.value)
    assert message.startswith("PYTORCH_ALLOC_CONF: ")
    assert words in message
    assert "(in the entry '" in message


@pytest.mark.parametrize(
    "fields",
    [
        {"backend": "other"},
        {"roundup_power2_divisions": 3},
        {"roundup_power2_divisions": (1, 2)},
        {"max_split_size_bytes": 10 * MIB},
        {"large_segment_bytes": 10 * MIB},
        {"garbage_collection_threshold": 0.0},
        {"per_process_memory_fraction": -0.1},
    ],
)
def test_bad_fields_are_refused(fields: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        AllocatorConfig(**fields)  # type: ignore[arg-type]


# the estimate honours them --------------------------------------------------------------------------
def test_the_meter_reads_the_environment_and_says_what_it_assumed(monkeypatch: pytest.MonkeyPatch) -> None:
    for variable in ENV_VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    assert SimulatedCudaMeter(None).assumptions() == (
        "the caching allocator at its default settings (PYTORCH_CUDA_ALLOC_CONF unset)",
    )
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    meter = SimulatedCudaMeter(None)
    assert meter.config.expandable_segments and meter.allocator.config.expandable_segments
    (said,) = meter.assumptions()
    assert said.startswith("PYTORCH_CUDA_ALLOC_CONF='expandable_segments:True': expandable segments")
    assert not SimulatedCudaMeter(None, config=AllocatorConfig()).allocator.config.expandable_segments


def test_the_meter_refuses_the_async_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="native caching allocator only"):
        SimulatedCudaMeter(None, config=AllocatorConfig(backend="cudaMallocAsync"))
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "backend:cudaMallocAsync")
    with pytest.raises(ValueError, match="PYTORCH_CUDA_ALLOC_CONF sets backend:cudaMallocAsync"):
        SimulatedCudaMeter(None)


def _at_the_answer(result: batchfit.Result) -> tuple[int, int]:
    """(allocated, reserved) peaks of the fitting trial at the largest batch."""
    trial = [t for t in result.trials if t.fits and t.batch_size == result.max_batch][-1]
    assert trial.peak_bytes is not None and trial.reserved_peak_bytes is not None
    return trial.peak_bytes, trial.reserved_peak_bytes


@pytest.mark.slow
def test_expandable_segments_bring_the_estimates_reserved_peak_to_allocated(monkeypatch: pytest.MonkeyPatch) -> None:
    for variable in ENV_VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    model, sample = gpt()
    # The logits kept through backward (loss_fn), the workload this case was measured on: freed
    # before backward (the model's own loss, issue 32) the default's segments happen to fit the
    # answer's peak within 4 MiB, and the comparison below would measure that luck, not the pools.
    kept = {"loss_fn": lambda output, batch: output["loss"]}
    default = batchfit.estimate(model, sample, memory_limit="1GiB", reserve=0, device="cuda", **kept)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    expandable = batchfit.estimate(model, sample, memory_limit="1GiB", reserve=0, device="cuda", **kept)
    allocated, reserved = _at_the_answer(default)
    expandable_allocated, expandable_reserved = _at_the_answer(expandable)
    # The default reserves segments per request size; expandable segments map pages as needed, so
    # at its peak reserved is within a page per pool (2 MiB small, 20 MiB large) of allocated.
    assert expandable_reserved - expandable_allocated < reserved - allocated
    assert expandable_reserved - expandable_allocated <= 22 * MIB
    assert expandable.max_batch >= default.max_batch
