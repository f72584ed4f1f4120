"""OOM classification: by type, then by each backend's message; nothing else is an OOM."""

from __future__ import annotations

import pytest
import torch

from batchfit.backends import is_device_failure, is_oom, is_sticky_device_error
from batchfit.backends.base import requested_bytes


def _coded(code: int, text: str) -> BaseException:
    """An AcceleratorError as torch raises it from C++, with the runtime's error code."""
    error = torch.AcceleratorError(text)
    error.error_code = code  # type: ignore[attr-defined]
    return error


def _nccl(result: str, detail: str, last_error: str) -> BaseException:
    """A DistBackendError as ProcessGroupNCCL raises it (C10D_NCCL_CHECK in NCCLUtils.hpp): the
    call site, ncclGetErrorString's text, getNcclErrorDetailStr's line, then NCCL's last warning."""
    return torch.distributed.DistBackendError(
        "NCCL error in: /pytorch/torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:1970, "
        f"{result} (run with NCCL_DEBUG=INFO for details), NCCL version 2.21.5\n{detail}\nLast error:\n{last_error}"
    )


_UNHANDLED_CUDA = ("unhandled cuda error", "ncclUnhandledCudaError: Call to CUDA function failed.")

#: cudaMallocAsync's message, as c10/cuda/CUDAMallocAsyncAllocator.cpp words it (format_size units).
_MALLOC_ASYNC_OOM = (
    "Allocation on device 0 would exceed allowed memory. (out of memory)\n"
    "Currently allocated     : 7.50 GiB\n"
    "Requested               : 20.00 MiB\n"
    "Device limit            : 79.19 GiB\n"
    "Free (according to CUDA): 512.00 MiB\n"
    "PyTorch limit (set by user-supplied memory fraction)\n"
    "                        : 8.00 GiB"
)


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
        torch.OutOfMemoryError(_MALLOC_ASYNC_OOM),
        # OOMs in disguise: cublasCreate under exhausted memory, cuDNN's internal allocation.
        RuntimeError("CUDA error: CUBLAS_STATUS_NOT_INITIALIZED when calling `cublasCreate(handle)`"),
        RuntimeError("cuDNN error: CUDNN_STATUS_INTERNAL_ERROR"),
        RuntimeError("cuDNN error: CUDNN_STATUS_INTERNAL_ERROR_DEVICE_ALLOCATION_FAILED"),
        # NCCL's own buffers: runtime API, driver API (CUCHECK), and ncclCudaCallocAsync's warning.
        _nccl(*_UNHANDLED_CUDA, "Cuda failure 'out of memory'"),
        _nccl(*_UNHANDLED_CUDA, "Cuda failure 2 'out of memory'"),
        _nccl(*_UNHANDLED_CUDA, "Failed to CUDA calloc async 4 bytes"),
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
        # NCCL errors that are not about memory stay errors (RankFailedError on the other ranks).
        _nccl(
            "unhandled system error",
            "ncclSystemError: System call (e.g. socket, malloc) or external library call failed or device error. ",
            "socketStartConnect: Connect to 10.0.0.2<43385> failed : Software caused connection abort",
        ),
        _nccl(*_UNHANDLED_CUDA, "Cuda failure 'an illegal memory access was encountered'"),
        RuntimeError("CUDA error: CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasSgemm( handle, opa, ...)`"),
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


@pytest.mark.parametrize("code", [214, 220, 226, 702, 714, 717, 718, 721, 810, 911, 999])
def test_hardware_faults_and_unknown_errors_are_sticky_by_code(code: int) -> None:
    assert is_sticky_device_error(_coded(code, "CUDA error: a text this torch does not know"))
    assert not is_oom(_coded(code, "CUDA error: a text this torch does not know"))


@pytest.mark.parametrize("code", [1, 46, 100, 101, 701, 720])
def test_errors_that_refuse_one_call_are_not_sticky(code: int) -> None:
    """Invalid value, devices busy, no device, bad ordinal, too many resources, cooperative launch
    too large: the context is as it was, so they propagate as the user's error."""
    assert not is_sticky_device_error(_coded(code, "CUDA error: a text this torch does not know"))


@pytest.mark.parametrize(
    "text",
    [
        "CUDA error: uncorrectable ECC error encountered",
        "CUDA error: unknown error\nCUDA kernel errors might be asynchronously reported at some other API call",
        "CUDA error: uncorrectable NVLink error detected during the execution",
        "CUDA error: the launch timed out and was terminated",
        "CUDA error: the MPS client has been terminated by the server",
    ],
)
def test_sticky_errors_are_recognised_by_message_without_a_code(text: str) -> None:
    """torch < 2.8 raises them as plain RuntimeError: cudaGetErrorString's text is all there is."""
    assert is_sticky_device_error(RuntimeError(text))


def test_unknown_error_is_sticky_only_as_cuda_words_it() -> None:
    assert not is_sticky_device_error(RuntimeError("Triton Error: unknown error in the autotuner"))
    assert not is_sticky_device_error(RuntimeError("unknown error"))


@pytest.mark.parametrize(
    "exc",
    [
        _coded(719, "CUDA error: unspecified launch failure"),  # sticky
        _coded(1, "CUDA error: invalid argument"),  # not sticky, but the runtime's own error in a release
        _coded(999, "CUDA error: unknown error"),
        RuntimeError("CUDA error: an illegal memory access was encountered"),  # torch < 2.8, no code
        RuntimeError("CUDA error: invalid argument\nCompile with `TORCH_USE_CUDA_DSA`"),
        RuntimeError("HIP error: invalid device pointer"),
    ],
    ids=lambda e: str(e)[:28],
)
def test_a_runtime_error_while_releasing_memory_is_a_device_failure(exc: BaseException) -> None:
    """What empty_cache (cudaFree) raises after a trial: an asynchronous error of the trial that
    surfaced there. No model code runs in a release, so it is the device's, whatever its code."""
    assert is_device_failure(exc)


@pytest.mark.parametrize(
    "exc",
    [
        _coded(2, "CUDA error: out of memory"),
        torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB"),
        RuntimeError("shape mismatch"),
        RuntimeError("an error that mentions CUDA error: somewhere inside"),
        ValueError("CUDA error: invalid argument"),  # not raised by torch's runtime check
        KeyboardInterrupt(),
    ],
    ids=lambda e: f"{type(e).__name__}:{str(e)[:20]}",
)
def test_out_of_memory_and_other_errors_in_a_release_are_no_device_failure(exc: BaseException) -> None:
    assert not is_device_failure(exc)


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


def test_requested_bytes_reads_the_request_line_of_cuda_malloc_async() -> None:
    """Not "Currently allocated" (7.50 GiB) nor the limits: the line named "Requested"."""
    assert requested_bytes(_MALLOC_ASYNC_OOM) == 20 * 2**20
    assert requested_bytes(_MALLOC_ASYNC_OOM.replace("20.00 MiB", "512 bytes")) == 512


@pytest.mark.parametrize(
    ("message", "expected"),
    [
        # format_size: "bytes" up to 1 KiB, then KiB, MiB, GiB with two decimals.
        ("CUDA out of memory. Tried to allocate 1024 bytes. GPU 0 has a total capacity of 79.19 GiB", 1024),
        ("CUDA out of memory. Tried to allocate 1.50 KiB. GPU 0 has a total capacity of 79.19 GiB", 1536),
        ("HIP out of memory. Tried to allocate 3.00 GiB. GPU 0 has a total capacity of 63.98 GiB", 3 * 2**30),
        # MPS before c10's format_size: KB, MB, GB labels, still divided by 1024.
        (
            "MPS backend out of memory (MPS allocated: 17.00 GB, other allocations: 1.02 GB, max allowed: 18.13 GB). "
            "Tried to allocate 256.00 MB on private pool. Use PYTORCH_MPS_HIGH_WATERMARK_RATIO=0.0 to disable",
            256 * 2**20,
        ),
        ("CUDA out of memory. Tried to allocate more than 1EB memory.", None),  # no size stated
    ],
)
def test_requested_bytes_reads_each_allocators_units(message: str, expected: int | None) -> None:
    assert requested_bytes(message) == expected
