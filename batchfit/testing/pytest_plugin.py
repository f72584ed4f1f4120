"""batchfit's pytest plugin (entry point ``pytest11: batchfit``): the ``cuda`` marker.

A test marked ``@pytest.mark.cuda`` is skipped when torch sees no CUDA device, so the same suite
runs on a laptop, a CPU CI runner and a GPU box. ``--require-cuda`` turns that skip into a
failure, for GPU runners where a missing device must not pass silently. torch is imported only
when some collected test carries the marker, so the plugin costs nothing to other test suites.

The marker is about CUDA by name because that is what GPU CI runners have; it asks torch, not
batchfit's backends, so that it stays importable without torch.

Every marked test carries the user property ``batchfit-marker=cuda``, which JUnit XML writes
beside the test: a GPU runner reading the report can then judge the skips of CUDA tests alone,
not those of a module that skipped itself at collection (a missing optional dependency).
"""

from __future__ import annotations

from typing import Any


def pytest_addoption(parser: Any) -> None:
    parser.addoption(
        "--require-cuda",
        action="store_true",
        default=False,
        help="batchfit: fail tests marked 'cuda' when no CUDA device is present, instead of skipping them",
    )


def pytest_configure(config: Any) -> None:
    config.addinivalue_line("markers", "cuda: needs a CUDA device; skipped when torch sees none (batchfit)")


def pytest_collection_modifyitems(config: Any, items: list[Any]) -> None:
    """Skip ``cuda`` tests when torch sees no CUDA device (with ``--require-cuda`` they run and
    fail in setup instead). torch is only imported when some collected test has the marker."""
    marked = [item for item in items if item.get_closest_marker("cuda") is not None]
    for item in marked:
        item.user_properties.append(CUDA_PROPERTY)
    if config.getoption("--require-cuda", default=False):
        return
    if not marked or _cuda_available():
        return
    import pytest

    skip = pytest.mark.skip(reason=_NO_CUDA)
    for item in marked:
        item.add_marker(skip)


def pytest_runtest_setup(item: Any) -> None:
    if item.get_closest_marker("cuda") is None or not item.config.getoption("--require-cuda", default=False):
        return
    if not _cuda_available():
        import pytest

        pytest.fail(f"--require-cuda: {_NO_CUDA}", pytrace=False)


#: The user property every ``cuda`` test carries (JUnit XML: ``<property name=... value=...>``).
CUDA_PROPERTY = ("batchfit-marker", "cuda")
_NO_CUDA = "no CUDA device (torch.cuda.is_available() is False)"


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()
