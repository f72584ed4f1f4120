"""Result: JSON round trip, readable text, and the memory equation."""

from __future__ import annotations

import dataclasses
import json
import statistics
import typing

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import batchfit
from batchfit import examples
from batchfit.report import DeviceInfo, MemoryModel, Throughput, Trial
from batchfit.report.memory import ON_LINE
from batchfit.report.records import DEVICE_TYPES, PHASES
from batchfit.report.result import SCHEMA


@pytest.fixture(scope="module")
def result() -> batchfit.Result:
    model, sample = examples.mlp(in_features=4096, hidden=32, depth=1)
    return batchfit.find(model, sample, memory_limit="3.9MB", steps_per_trial=2)


def test_json_round_trip_is_exact(result: batchfit.Result) -> None:
    text = result.to_json()
    data = json.loads(text)
    assert data["schema"] == SCHEMA
    assert data["max_batch"] == result.max_batch
    assert batchfit.Result.from_json(text) == result


def test_from_json_rejects_other_documents() -> None:
    with pytest.raises(ValueError, match="not a batchfit result"):
        batchfit.Result.from_json('{"schema": "something/else"}')


def test_text_summary_names_the_answers(result: batchfit.Result) -> None:
    text = str(result)
    assert f"max batch          {result.max_batch}" in text
    assert f"safe batch         {result.safe_batch}" in text
    assert "memory equation" in text
    assert text.count("\n") >= len(result.trials) + 6
    assert "OOM (" in text


def test_result_is_frozen(result: batchfit.Result) -> None:
    with pytest.raises(AttributeError):
        result.max_batch = 1  # type: ignore[misc]


def _trial(size: int, peaks: dict[str, int]) -> Trial:
    return Trial(batch_size=size, fits=True, peak_bytes=max(peaks.values()), phase_peaks=tuple(peaks.items()))


def test_memory_model_takes_the_max_of_phase_lines() -> None:
    # The optimizer step is flat at 1000 bytes; backward grows 100 bytes per sample from 200.
    trials = [_trial(b, {"backward": 200 + 100 * b, "step": 1000}) for b in (1, 2, 4, 8, 16)]
    model = MemoryModel.fit(trials)
    assert model is not None
    assert model.phase == "backward"
    assert model.fixed_bytes == 200 and model.per_sample_bytes == pytest.approx(100)
    assert model.predict(2) == 1000  # the flat step phase is the peak at small batches
    assert model.predict(30) == 3200
    assert model.largest_batch_within(3200, ceiling=1000) == 30
    assert model.largest_batch_within(999, ceiling=1000) == 0
    assert model.largest_batch_within(10**9, ceiling=64) == 64


def test_memory_model_needs_two_sizes() -> None:
    assert MemoryModel.fit([_trial(4, {"forward": 10})]) is None
    assert MemoryModel.fit([Trial(batch_size=4, fits=False, phase="forward")]) is None


# Reading documents back: every corrupt one is one ValueError that says what and where -----------------
def _set(path: str, value: object):
    """A change to a result document: ``path`` like ``trials.2.peak_bytes``, the last key set."""

    def change(document: dict) -> None:
        *parents, last = path.split(".")
        for key in parents:
            document = document[int(key) if key.isdigit() else key]
        document[int(last) if last.isdigit() else last] = value

    return change


def _drop(path: str):
    def change(document: dict) -> None:
        *parents, last = path.split(".")
        for key in parents:
            document = document[int(key) if key.isdigit() else key]
        del document[last]

    return change


CORRUPT_DOCUMENTS = {
    "a list": ("[]", "the document is a list, not an object"),
    "null": ("null", "the document is null, not an object"),
    "a string": ('"result"', "the document is a string, not an object"),
    "not JSON": ("{'max_batch': 17}", "invalid JSON"),
    "empty text": ("", "invalid JSON"),
    "no schema": (_drop("schema"), "schema is None"),
    "another schema": (_set("schema", "batchfit.result/2"), "schema is 'batchfit.result/2'"),
    "missing field": (_drop("device"), "missing field 'device'"),
    "unknown field": (_set("foo", 1), "unknown field 'foo'"),
    "trials a string": (_set("trials", "abc"), "field 'trials' must be a list, got str 'abc'"),
    "max_batch a string": (_set("max_batch", "17"), "field 'max_batch' must be an int, got str '17'"),
    "max_batch a float": (_set("max_batch", 17.0), "field 'max_batch' must be an int, got float 17.0"),
    "max_batch a bool": (_set("max_batch", True), "field 'max_batch' must be an int, got bool True"),
    "max_batch null": (_set("max_batch", None), "field 'max_batch' must be an int, got null"),
    "elapsed NaN": (_set("elapsed_s", float("nan")), "field 'elapsed_s' must be a finite number, got float nan"),
    "budget infinite": (
        _set("budget_bytes", float("inf")),
        "field 'budget_bytes' must be an int or null, got float inf",
    ),
    "verified a string": (_set("safe_verified", "yes"), "field 'safe_verified' must be true or false, got str 'yes'"),
    "stop reason": (
        _set("stop_reason", "done"),
        "field 'stop_reason' must be one of 'boundary', 'max_batch', 'stopped'",
    ),
    "budget_counts null": (_set("budget_counts", None), "field 'budget_counts' must be one of 'allocated', 'reserved'"),
    "notes a string": (_set("notes", "abc"), "field 'notes' must be a list, got str 'abc'"),
    "a note a number": (_set("notes", [1]), "field 'notes[0]' must be a string, got int 1"),
    "trial peak a string": (_set("trials.2.peak_bytes", "17"), "field 'trials[2].peak_bytes' must be an int or null"),
    "trial not an object": (_set("trials.1", 5), "field 'trials[1]' must be an object, got int 5"),
    "trial missing size": (_drop("trials.0.batch_size"), "missing field 'trials[0].batch_size'"),
    "trial unknown field": (_set("trials.0.oom", True), "unknown field 'trials[0].oom'"),
    "trial fits null": (_set("trials.0.fits", None), "field 'trials[0].fits' must be true or false, got null"),
    "trial kind": (_set("trials.0.kind", "warmup"), "field 'trials[0].kind' must be one of 'search', 'verify', 'gate'"),
    "trial phase": (_set("trials.0.phase", "loss"), "field 'trials[0].phase' must be one of 'batch', 'forward'"),
    "phase peak not a pair": (
        _set("trials.0.phase_peaks", [["forward"]]),
        "'trials[0].phase_peaks[0]' must be a list of 2",
    ),
    "phase peak a float": (
        _set("trials.0.phase_peaks", [["forward", 1.5]]),
        "field 'trials[0].phase_peaks[0][1]' must be an int, got float 1.5",
    ),
    "step time NaN": (
        _set("trials.0.step_time_s", float("nan")),
        "field 'trials[0].step_time_s' must be a finite number",
    ),
    "memory a list": (_set("memory", []), "field 'memory' must be an object or null, got list []"),
    "memory empty": (_set("memory", {}), "missing field 'memory.fixed_bytes'"),
    "memory unit": (_set("memory.unit", "bytes"), "field 'memory.unit' must be one of 'allocated', 'reserved'"),
    "memory line NaN": (
        _set("memory.lines.0.fixed_bytes", float("nan")),
        "field 'memory.lines[0].fixed_bytes' must be a finite number, got float nan",
    ),
    "device config": (_set("device.config", [["threads"]]), "field 'device.config[0]' must be a list of 2 items"),
    "device type missing": (_drop("device.type"), "missing field 'device.type'"),
    "settings unknown": (_set("settings.batch", 4), "unknown field 'settings.batch'"),
    "headroom a string": (_set("settings.headroom", "0.1"), "field 'settings.headroom' must be a finite number"),
}


@pytest.mark.parametrize("case", sorted(CORRUPT_DOCUMENTS))
def test_a_corrupt_document_is_one_value_error_naming_what_and_where(result: batchfit.Result, case: str) -> None:
    corruption, fragment = CORRUPT_DOCUMENTS[case]
    if isinstance(corruption, str):
        text = corruption
    else:
        document = json.loads(result.to_json())
        corruption(document)
        text = json.dumps(document)
    with pytest.raises(ValueError) as raised:
        batchfit.Result.from_json(text)
    assert str(raised.value).startswith("not a batchfit result: ")
    assert fragment in str(raised.value)
    if not isinstance(corruption, str):  # the same from the parsed document
        with pytest.raises(ValueError, match="not a batchfit result: "):
            batchfit.Result.from_dict(json.loads(text))


# Out-of-range and unknown values (issue 19, item 10): each is one ValueError naming the field ---------
def _corrupted(result: batchfit.Result, *changes: tuple[str, object]) -> str:
    document = json.loads(result.to_json())
    for path, value in changes:
        _set(path, value)(document)
    return json.dumps(document)


def _refused(text: str, *fragments: str) -> str:
    with pytest.raises(ValueError) as raised:
        batchfit.Result.from_json(text)
    message = str(raised.value)
    assert message.startswith("not a batchfit result: "), message
    for fragment in fragments:
        assert fragment in message, message
    return message


def test_a_negative_batch_is_refused(result: batchfit.Result) -> None:
    batches = {
        "max_batch": "max_batch",
        "safe_batch": "safe_batch",
        "best_throughput_batch": "best_throughput_batch",
        "world_size": "world_size",
        "trials.3.batch_size": "trials[3].batch_size",
        "settings.init_batch": "settings.init_batch",
        "settings.max_batch": "settings.max_batch",
        "settings.multiple_of": "settings.multiple_of",
        "throughput.best_batch": "throughput.best_batch",
        "throughput.knee_batch": "throughput.knee_batch",
    }
    for path, field in batches.items():
        for value in (-3, 0):
            fragment = f"field {field!r} must be an int in [1, 2**63), got int {value}"
            _refused(_corrupted(result, (path, value)), fragment)


def test_a_headroom_of_one_and_a_half_is_refused(result: batchfit.Result) -> None:
    for value in (1.5, 1, -0.1):
        _refused(
            _corrupted(result, ("settings.headroom", value)),
            f"field 'settings.headroom' must be a number in [0, 1), got {type(value).__name__} {value}",
        )


def test_an_unknown_mode_is_refused(result: batchfit.Result) -> None:
    _refused(
        _corrupted(result, ("settings.mode", "serve")),
        "field 'settings.mode' must be one of 'train', 'inference', 'eval', 'generate', got str 'serve'",
    )
    _refused(
        _corrupted(result, ("settings.amp", "fp8")),
        "field 'settings.amp' must be one of 'bf16', 'fp16' or null, got str 'fp8'",
    )


def test_an_unknown_phase_is_refused(result: batchfit.Result) -> None:
    phases = "'batch', 'forward', 'backward', 'step'"
    _refused(
        _corrupted(result, ("trials.0.phase_peaks.1", ["loss", 5])),
        f"field 'trials[0].phase_peaks[1][0]' must be one of {phases}, got str 'loss'",
    )
    _refused(
        _corrupted(result, ("trials.2.phase_reserved_peaks.0", ["", 5])),
        f"field 'trials[2].phase_reserved_peaks[0][0]' must be one of {phases}, got str ''",
    )
    _refused(
        _corrupted(result, ("memory.lines.1.phase", "loss")),
        f"field 'memory.lines[1].phase' must be one of {phases}, got str 'loss'",
    )


def test_an_unknown_device_type_is_refused(result: batchfit.Result) -> None:
    _refused(_corrupted(result, ("device.type", "tpu")), "field 'device.type' must be one of 'cpu', 'cuda', 'xpu'")
    _refused(_corrupted(result, ("device.type", "tpu")), "got str 'tpu'")


def test_a_budget_of_ten_to_the_four_hundred_bytes_is_refused(result: batchfit.Result) -> None:
    message = _refused(
        _corrupted(result, ("budget_bytes", 10**400)),
        "field 'budget_bytes' must be an int in [0, 2**63) or null, got int 1000",
    )
    assert len(message) < 200  # the value is shown cut short
    _refused(_corrupted(result, ("budget_bytes", 2**63)), "field 'budget_bytes' must be an int in [0, 2**63)")
    _refused(
        _corrupted(result, ("trials.1.peak_bytes", -1)), "field 'trials[1].peak_bytes' must be an int in [0, 2**63)"
    )
    # A Python int too long even to print (more digits than int-to-str allows) is refused as well.
    document = json.loads(result.to_json())
    document["budget_bytes"] = 10**5000
    with pytest.raises(ValueError) as raised:
        batchfit.Result.from_dict(document)
    assert str(raised.value).startswith("not a batchfit result: field 'budget_bytes' must be an int in [0, 2**63)")


def _nested(depth: int) -> list:
    inner: list = []
    for _ in range(depth):
        inner = [inner]
    return inner


def test_a_deeply_nested_document_is_refused(result: batchfit.Result) -> None:
    for text in ("[" * 100_000, '{"schema": "batchfit.result/1", "notes": ' + "[" * 100_000 + "]" * 100_000 + "}"):
        _refused(text, "nested too deeply")
    # The same from a parsed document: the field it sits in is named.
    document = json.loads(result.to_json())
    document["notes"] = _nested(100_000)
    with pytest.raises(ValueError) as raised:
        batchfit.Result.from_dict(document)
    assert str(raised.value).startswith("not a batchfit result: field 'notes[0]' must be a string, got list [[[")


def test_a_safe_batch_above_the_max_batch_is_refused(result: batchfit.Result) -> None:
    """The code never writes one (the safe batch is picked at or below the largest fit): such a record
    says nothing. The same for a knee above the best size and an init_batch above max_batch."""
    _refused(
        _corrupted(result, ("safe_batch", result.max_batch + 1)),
        f"field 'safe_batch' must not exceed 'max_batch' ({result.max_batch}), got {result.max_batch + 1}",
    )
    assert result.throughput is not None
    _refused(
        _corrupted(result, ("throughput.knee_batch", result.throughput.best_batch + 1)),
        "field 'throughput.knee_batch' must not exceed 'throughput.best_batch'",
    )
    _refused(
        _corrupted(result, ("settings.init_batch", 64), ("settings.max_batch", 32)),
        "field 'settings.init_batch' must not exceed 'settings.max_batch' (32), got 64",
    )
    # Equal is fine, and so is the smallest safe batch.
    assert (
        batchfit.Result.from_json(_corrupted(result, ("safe_batch", result.max_batch))).safe_batch == result.max_batch
    )


def test_the_vocabularies_are_the_ones_the_code_writes() -> None:
    from batchfit.backends.select import SUPPORTED
    from batchfit.backends.simulated import ESTIMATE_TARGETS
    from batchfit.probe.options import AMPS, MODES
    from batchfit.report.records import Amp, Mode
    from batchfit.search.strategies import STRATEGIES

    assert set(SUPPORTED) | set(ESTIMATE_TARGETS) <= set(DEVICE_TYPES)
    assert typing.get_args(Mode) == MODES and typing.get_args(Amp) == AMPS
    assert PHASES == typing.get_args(batchfit.report.Phase)
    assert batchfit.report.Settings().strategy in STRATEGIES  # any name loads: a custom strategy has its own


def _leaves(node: object, path: tuple = ()) -> list[tuple]:
    """The paths of a document's scalar values (and empty lists)."""
    if isinstance(node, dict):
        return [leaf for key, value in node.items() for leaf in _leaves(value, (*path, key))]
    if isinstance(node, list) and node:
        return [leaf for i, value in enumerate(node) for leaf in _leaves(value, (*path, i))]
    return [path]


def _get(document: dict, path: tuple) -> object:
    for key in path:
        document = document[key]
    return document


def _put(document: dict, path: tuple, value: object) -> None:
    _get(document, path[:-1])[path[-1]] = value  # type: ignore[index]


INTS = st.one_of(
    st.integers(min_value=1, max_value=64),
    st.integers(min_value=-2, max_value=2**64),
    st.integers(min_value=2**63 - 2, max_value=10**400),
    st.sampled_from([0, -1, 2**63 - 1, 2**63, -(2**63), 10**400]),
)
FLOATS = st.one_of(
    st.floats(min_value=0, max_value=1, exclude_max=True),
    st.floats(),
    st.sampled_from([0.0, -0.0, 1e308, -1e308, 5e-324, 0.9999999, 1.0]),
)
KNOWN = st.sampled_from([*PHASES, *DEVICE_TYPES, "train", "inference", "bf16", "fp16", "reserved", "binary"])
WORDS = st.one_of(KNOWN, KNOWN, KNOWN, st.text(max_size=4), st.sampled_from(["tpu", "loss", "eval", "fp8"]))
ANYTHING = st.one_of(st.none(), st.booleans(), INTS, FLOATS, WORDS, st.lists(st.integers(), max_size=2))


def _like(value: object) -> st.SearchStrategy:
    """Values of the leaf's own type, in range or not."""
    if isinstance(value, bool):
        return st.booleans()
    if isinstance(value, int):
        return INTS
    if isinstance(value, float):
        return st.one_of(FLOATS, INTS)
    if isinstance(value, str):
        return WORDS
    return ANYTHING


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_whatever_loads_prints_and_round_trips(result: batchfit.Result, data: st.DataObject) -> None:
    """Any change to a real document: refused with one ValueError, or loaded; then str() works and
    the round trip is exact."""
    document = json.loads(result.to_json())
    paths = _leaves(document)
    records = [path for path in paths if "trials" not in path]  # not only the many trials' fields
    for _ in range(data.draw(st.integers(1, 4))):
        path = data.draw(st.sampled_from(records) | st.sampled_from(paths))
        anything = data.draw(st.integers(0, 9)) == 0  # mostly the leaf's own type, so that many load
        _put(document, path, data.draw(ANYTHING if anything else _like(_get(document, path))))
    text = json.dumps(document)
    try:
        loaded = batchfit.Result.from_json(text)
    except ValueError as refused:
        assert str(refused).startswith("not a batchfit result: ")
        return
    assert str(loaded)
    assert batchfit.Result.from_json(loaded.to_json()) == loaded


def test_the_largest_values_allowed_everywhere_load_and_print(result: batchfit.Result) -> None:
    """Every int at 2**63 - 1, every float at 1e308 (the headroom just below 1): the bounds together
    leave a record str() can print."""
    document = json.loads(result.to_json())
    for path in _leaves(document):
        value = _get(document, path)
        if isinstance(value, float):
            _put(document, path, 0.99 if path == ("settings", "headroom") else 1e308)
        elif isinstance(value, int) and not isinstance(value, bool):
            _put(document, path, 2**63 - 1)
    for path in (
        ("memory", "per_sample_bytes"),
        *(("memory", "lines", i, k) for i in range(4) for k in ("fixed_bytes", "per_sample_bytes")),
    ):
        _put(document, path, float(2**62))  # a memory line's bytes are bounded too
    loaded = batchfit.Result.from_json(json.dumps(document))
    assert loaded.budget_bytes == 2**63 - 1 and "max batch          9223372036854775807" in str(loaded)
    assert batchfit.Result.from_json(loaded.to_json()) == loaded
    for path, value in ((("memory", "per_sample_bytes"), 1e308), (("memory", "lines", 0, "fixed_bytes"), -1e300)):
        _put(document, path, value)
        _refused(json.dumps(document), "must be a number in [-2**63, 2**63)")
        _put(document, path, 0.0)


def test_documents_without_the_fields_added_later_still_load(result: batchfit.Result) -> None:
    document = json.loads(result.to_json())
    del document["budget_counts"], document["settings"]["reserve_bytes"]
    del document["device"]["config"], document["device"]["nvml_total_bytes"]
    for trial in document["trials"]:
        del trial["reserved_peak_bytes"], trial["phase_reserved_peaks"], trial["skipped_steps"]
    loaded = batchfit.Result.from_json(json.dumps(document))
    assert loaded.budget_counts == "allocated" and loaded.settings.reserve_bytes == 0
    assert loaded.device.config == () and loaded.device.nvml_total_bytes is None
    assert all(t.reserved_peak_bytes is None and t.skipped_steps == 0 for t in loaded.trials)
    assert [t.phase_peaks for t in loaded.trials] == [t.phase_peaks for t in result.trials]
    assert loaded.max_batch == result.max_batch and loaded.memory == result.memory


def test_trial_and_device_records_are_checked_too(result: batchfit.Result) -> None:
    """The CI gate's report (batchfit.testing.GateReport) reads its trial and device with these."""
    trial = dataclasses.asdict(result.trials[0])
    assert Trial.from_dict(json.loads(json.dumps(trial))) == result.trials[0]
    assert DeviceInfo.from_dict(json.loads(json.dumps(dataclasses.asdict(result.device)))) == result.device
    with pytest.raises(ValueError, match=r"^not a batchfit trial: field 'batch_size' must be an int, got str '2'$"):
        Trial.from_dict({**trial, "batch_size": "2"})
    with pytest.raises(ValueError, match=r"^not a batchfit trial: missing field 'fits'$"):
        Trial.from_dict({"batch_size": 2})
    with pytest.raises(ValueError, match=r"^not a batchfit trial: the document is a list, not an object$"):
        Trial.from_dict([])  # type: ignore[arg-type]
    with pytest.raises(
        ValueError, match=r"^not a batchfit device: field 'index' must be an int or null, got float 0.5$"
    ):
        DeviceInfo.from_dict({"type": "cpu", "index": 0.5})


# The memory equation: lines over the part of each phase that grows ----------------------------------
FLAT_STEP = 1_000_003


def _backward(b: int) -> int:
    """Flat while a fixed buffer is the peak, then 50,021 bytes a sample (the line 400,009 + 50,021 b)."""
    return max(1_200_007, 400_009 + 50_021 * b)


def _forward(b: int) -> int:
    """Grows faster than backward, but below it up to ~70 samples."""
    return 50_021 + 55_001 * b


def _phased_trials(sizes) -> list[Trial]:
    return [_trial(b, {"forward": _forward(b), "backward": _backward(b), "step": FLAT_STEP}) for b in sizes]


def test_each_phase_line_is_exact_on_the_part_that_grows() -> None:
    sizes = (1, 2, 4, 8, 16, 32, 64)
    model = MemoryModel.fit(_phased_trials(sizes))
    assert model is not None
    lines = {}
    for line in model.lines:
        lines.setdefault(line.phase, line)  # a phase's own line comes first, then its chords
    backward = lines["backward"]
    assert backward.fixed_bytes == pytest.approx(400_009) and backward.per_sample_bytes == pytest.approx(50_021)
    assert lines["step"].fixed_bytes == pytest.approx(FLAT_STEP) and lines["step"].per_sample_bytes == 0
    for b in (16, 32, 64, 100, 1000):  # on the growing part, and beyond it
        assert model.predict(b) == max(_forward(b), _backward(b), FLAT_STEP)
    # Below the growing part the chords between measured sizes never promise less than is needed.
    for b in range(1, 65):
        truth = max(_forward(b), _backward(b), FLAT_STEP)
        assert model.predict(b) >= truth
        if b in sizes:
            assert model.predict(b) == truth


def test_the_equation_is_the_phase_that_decides_the_boundary() -> None:
    """forward grows faster (55,001 > 50,021 bytes a sample), but at the largest fitting size, 64,
    backward is the peak: a batch just above runs out of memory in backward."""
    model = MemoryModel.fit(_phased_trials((1, 2, 4, 8, 16, 32, 64)))
    assert model is not None
    assert model.phase == "backward"
    assert (model.fixed_bytes, model.per_sample_bytes) == (400_009, pytest.approx(50_021))
    assert model.largest_batch_within(_backward(64), ceiling=10**6) == 64
    # With sizes up to 128 forward has overtaken backward: it decides there.
    later = MemoryModel.fit(_phased_trials((1, 2, 4, 8, 16, 32, 64, 128)))
    assert later is not None and later.phase == "forward"


def test_a_growing_phase_is_fitted_on_the_sizes_near_the_boundary_only() -> None:
    """A kink: 3,112 bytes a sample up to 64, then 15,440 (the built-in MLP's backward phase). The
    line is the upper piece's; the chord from 4 to 500 keeps the prediction above the truth."""

    def need(b: int) -> int:
        return max(10_596_520 + 3_112 * b, 7_968_936 + 15_440 * b)

    model = MemoryModel.fit([_trial(b, {"backward": need(b)}) for b in (2, 4, 500, 520, 530, 531)])
    assert model is not None
    assert model.fixed_bytes == 7_968_936 and model.per_sample_bytes == pytest.approx(15_440)
    assert all(model.predict(b) == need(b) for b in (2, 4, 500, 531, 600))
    assert all(model.predict(b) >= need(b) for b in range(1, 600))
    target = need(455)
    assert model.largest_batch_within(target, ceiling=531) <= 455  # never more than fits


def test_the_equation_of_a_real_run_is_exact_where_memory_grows_and_safe_below() -> None:
    """The built-in MLP at 16 MiB: its backward peak grows 3,112 bytes a sample at small batches
    and, in kinks, 15,440 near the boundary (570), where the search's trials are. The equation is
    the backward line (the boundary fails in backward), exact on the trials near the boundary,
    and never below a peak measured anywhere under them."""
    model, sample = examples.mlp()
    result = batchfit.find(model, sample, memory_limit="16MiB")
    memory, unit = result.memory, result.budget_counts
    assert memory is not None and result.boundary_reached
    assert memory.phase == result.trial(result.max_batch + 1).phase == "backward"
    fitted = [t for t in result.search_trials if t.fits]
    near = [t for t in fitted if t.batch_size >= 0.9 * result.max_batch]
    assert len(near) >= 2 and any(t.batch_size < 0.5 * result.max_batch for t in fitted)
    for trial in near:  # the growing part: within ON_LINE (0.2%), where the CPU meter is exact
        assert abs(memory.predict(trial.batch_size) - trial.peak_in(unit)) <= ON_LINE * trial.peak_in(unit)
    for trial in fitted:
        assert memory.predict(trial.batch_size) >= trial.peak_in(unit) * (1 - ON_LINE)
    # Between the small sizes and the boundary nothing was tried: measure a few sizes there.
    with batchfit.Prober(model, sample, memory_limit="16MiB") as prober:
        for size in (100, 300, 455, 500):
            measured = prober.trial(size).peak_in(unit)
            assert measured is not None and memory.predict(size) >= measured * (1 - ON_LINE), size
    verification = [t for t in result.trials if t.kind == "verify"][-1]
    assert result.safe_verified and verification.peak_in(unit) <= 0.9 * result.budget_bytes


# Throughput ---------------------------------------------------------------------------------------
def _timed(batch: int, *times: float, kind: str = "search") -> Trial:
    median = statistics.median(times)
    return Trial(
        batch_size=batch, fits=True, kind=kind, step_time_s=median, samples_per_s=batch / median, step_times_s=times
    )


def test_throughput_knee_is_the_smallest_size_within_five_percent_of_the_best() -> None:
    trials = [_timed(8, 0.1), _timed(64, 0.5), _timed(128, 0.96), _timed(120, 0.9, 1.0, 0.95, kind="verify")]
    throughput = Throughput.of(trials)
    assert throughput is not None
    assert throughput.best_batch == 128  # 133.3 samples/s
    assert throughput.knee_batch == 64  # 128 samples/s >= 95% of 133.3; batch 8 has 80
    assert throughput.spread == pytest.approx((1.0 - 0.9) / 0.95)
    assert throughput.within_noise  # 128 vs 133.3: 4% apart, under the 10.5% spread
    assert throughput.single_step_best


def test_throughput_prefers_the_best_timed_trial_of_a_size_and_needs_one() -> None:
    assert Throughput.of([Trial(batch_size=4, fits=False)]) is None
    throughput = Throughput.of([_timed(50, 1.0), _timed(50, 0.5, 0.5, kind="verify")])
    assert throughput is not None
    assert throughput.best_samples_per_s == pytest.approx(100.0)
    assert throughput.spread == 0.0 and not throughput.within_noise and not throughput.single_step_best


def test_print_of_sized_on_reads_as_its_summary() -> None:
    # README: `print(result.sized_on)` shows which batch was sized on, not a dataclass's fields.
    from batchfit.report import SizedOn

    sized = SizedOn(
        source="loader scan", batches_scanned=64, total_batches=75, leaf="sample['input_ids']", dim=1, length=257,
        first_length=8, batch_number=64,
    )  # fmt: skip
    assert str(sized) == sized.summary() and "\n" not in str(sized)
    assert str(sized).startswith("length 257 (dim 1 of sample['input_ids'])")
    assert "SizedOn(" not in str(sized) and repr(sized).startswith("SizedOn(")


@pytest.mark.parametrize(
    ("low", "high", "shown"),
    [(0.89, 1.0, "0.89-1.00"), (1.5, 12.0, "1.5-12.0"), (150.0, 240.0, "150-240"), (0.012, 0.3, "0.012-0.300")],
)
def test_a_noise_interval_shows_both_ends_alike(low: float, high: float, shown: str) -> None:
    from batchfit.report import NoiseScale

    noise = NoiseScale(
        b_simple=low, low=low, high=high, gradient_sq=1.0, trace_sigma=1.0, small_batch=4, big_batch=32, windows=4,
        passes=128, samples=512, elapsed_s=1.0,
    )  # fmt: skip
    assert noise.interval_text() == f"90% {shown}"
    assert f"90% interval {shown};" in noise.summary()


def test_the_readmes_first_snippet_sets_up_without_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    # The README promises a machine without a GPU: its first snippet must not move the model to one.
    # (Its find() under the CPU's default limit of 1 GiB takes a minute: the set-up is what differed.)
    import re
    from pathlib import Path

    import torch

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    snippet = re.search(r"## In Python\n\n```python\n(.*?)```", readme, re.S)
    assert snippet is not None
    set_up = snippet.group(1).split("result = batchfit.find")[0]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # as on a machine without one
    names = {"MyModel": lambda: torch.nn.Linear(4, 4), "ids": torch.zeros(4, 8, dtype=torch.long)}
    exec(compile(set_up, "README.md", "exec"), names)
    assert next(names["model"].parameters()).device.type == "cpu"
