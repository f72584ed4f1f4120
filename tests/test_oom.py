"""OOM classification: by type, then by each backend's message; nothing else is an OOM."""

from __future__ import annotations

import pytest
import torch

from batchfit.backends import is_oom, is_sticky_device_error, requested_bytes


def _coded(code: int, text: str) -> BaseException:
    """An AcceleratorError as torch raises it from C++, with the runtime's error code."""
    error = torch.AcceleratorError(text)
    error.error_code = code  # type: ignore[attr-defined]
    return error


@pytest.mark.parametrize(
    "exc",
    [
        torch.OutOfMemoryError("anything"),
        torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
        RuntimeError("CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 15.78 GiB total capacity)"),
        RuntimeError("HIP out of memory. Tried to allocate 1.00 GiB"),
        RuntimeError("MPS backend out of memory (MPS allocated: 1.2 GB, other allocations: 3 GB)"),
        RuntimeError("XPU out of memory. Tried to allocate 512.00 MiB"),
        RuntimeError(
            "[enforce fail at alloc_cpu.cpp:127] data. DefaultCPUAllocator: can't allocate memory: "
            "you tried to allocate 4398046511104 bytes. Error code 12 (Cannot allocate memory)"
        ),
        RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"),
        RuntimeError(
            "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear if you passed in a non-contiguous input."
        ),
        torch.AcceleratorError("CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported"),
        _coded(2, "CUDA error: unnamed"),  # cudaErrorMemoryAllocation by its code
        torch.OutOfMemoryError("Allocation on device would exceed allowed memory. (out of memory)"),
        RuntimeError("Allocation on device 0 would exceed allowed memory. (out of memory)"),  # cudaMallocAsync
        RuntimeError(
            "cuDNN Frontend error: [cudnn_frontend] Error: No execution plans support the graph. "
            "unable to find an engine to execute this computation"
        ),
    ],
    ids=lambda e: str(e)[:24],
)
def test_out_of_memory_is_recognised(exc: BaseException) -> None:
    assert is_oom(exc)
    assert not is_sticky_device_error(exc)


@pytest.mark.parametrize(
    "exc",
    [
        RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x3 and 4x5)"),
        RuntimeError("CUDA error: invalid configuration argument"),  # > 65535 rows: not memory
        RuntimeError("Expected all tensors to be on the same device, but found cuda:0 and cpu"),
        ValueError("out of memory"),  # a ValueError is the user's own error, whatever it says
        MemoryError(),  # Python's own: not the device's allocator
        KeyboardInterrupt(),
    ],
    ids=lambda e: f"{type(e).__name__}:{str(e)[:20]}",
)
def test_other_errors_are_not_out_of_memory(exc: BaseException) -> None:
    assert not is_oom(exc)


def test_sticky_cuda_errors_are_recognised() -> None:
    assert is_sticky_device_error(RuntimeError("CUDA error: an illegal memory access was encountered"))
    assert is_sticky_device_error(RuntimeError("CUDA error: device-side assert triggered"))
    assert is_sticky_device_error(_coded(700, "CUDA error: something new"))  # by code, whatever the text
    assert not is_sticky_device_error(_coded(2, "CUDA error: out of memory"))
    assert not is_sticky_device_error(RuntimeError("shape mismatch"))


def test_the_size_in_a_cuda_oom_is_the_rounded_segment_a_reserved_bound() -> None:
    """A 3 MiB request is reported as the 20 MiB segment the allocator tried to reserve: the
    meter adds it to reserved bytes, never to allocated ones (see AllocatorMeter.failure_bytes)."""
    message = "CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of 79.19 GiB"
    assert requested_bytes(message) == 20 * 2**20


def test_a_real_cpu_allocator_failure_is_recognised() -> None:
    with pytest.raises(RuntimeError) as info:
        torch.empty(1 << 50, dtype=torch.uint8)
    assert is_oom(info.value)
    assert requested_bytes(str(info.value)) == 1 << 50


def test_requested_bytes_reads_cuda_messages() -> None:
    assert requested_bytes("CUDA out of memory. Tried to allocate 2.50 GiB (GPU 0)") == int(2.5 * 2**30)
    assert requested_bytes("no size here") is None
