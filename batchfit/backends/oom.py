"""Is this exception an out-of-memory? And is the device still usable after it?

Classification is by type first (``torch.OutOfMemoryError``, which ``torch.cuda.OutOfMemoryError``
aliases), then by the messages the backends use when they raise a plain ``RuntimeError`` (NCCL's
``torch.distributed.DistBackendError`` is one). Some entries are "OOMs in disguise" (cuDNN
NOT_SUPPORTED and INTERNAL_ERROR, cuBLAS NOT_INITIALIZED, NCCL's failed calloc, oneDNN "could not
create a primitive"): the library reports a failed allocation as its own status, which can also
mean an unsupported configuration or a broken setup. Those fail at every size, so the
``NothingFitsError`` that follows quotes the original message rather than hiding it.
Everything else is *not* an OOM and must propagate: a finder that swallows a real bug as
"too big" reports a wrong batch size and hides the bug.
"""

from __future__ import annotations

import torch

#: Substrings of messages that mean "the allocator could not satisfy a request".
OOM_MESSAGES: tuple[str, ...] = (
    "CUDA out of memory",  # CUDA caching allocator (older torch raised RuntimeError)
    # cudaErrorMemoryAllocation outside the caching allocator: lazy module loading, handle and
    # context creation. torch raises it as AcceleratorError (a RuntimeError) with this text.
    "CUDA error: out of memory",
    "would exceed allowed memory",  # backend:cudaMallocAsync (its size is on a "Requested" line)
    "HIP out of memory",  # ROCm
    "MPS backend out of memory",  # Apple
    "XPU out of memory",  # Intel
    "DefaultCPUAllocator: can't allocate memory",  # CPU allocator
    "CUBLAS_STATUS_ALLOC_FAILED",  # cuBLAS workspace allocation
    # cublasCreate() fails with NOT_INITIALIZED, not ALLOC_FAILED, when the device has no memory
    # left for the handle (torch: "CUDA error: CUBLAS_STATUS_NOT_INITIALIZED when calling
    # `cublasCreate(handle)`", aten/src/ATen/cuda/CublasHandlePool.cpp). In disguise.
    "CUBLAS_STATUS_NOT_INITIALIZED",
    "CUDNN_STATUS_NOT_SUPPORTED",  # cuDNN: usually an OOM in disguise for big batches
    # cuDNN's status when its own workspace or plan allocation fails (cuDNN 9 spells out
    # ..._HOST_ALLOCATION_FAILED / ..._DEVICE_ALLOCATION_FAILED after it). In disguise.
    "CUDNN_STATUS_INTERNAL_ERROR",
    "CUDNN_STATUS_ALLOC_FAILED",
    # cuDNN v9 frontend: no engine whose workspace fits what is left, an OOM in disguise too.
    "unable to find an engine",
    "cuFFT error: CUFFT_ALLOC_FAILED",
    # oneDNN (CPU matmul/conv): primitive creation fails when its scratchpad cannot be
    # allocated; seen under RLIMIT_AS right at the boundary (tests/test_real_oom.py).
    "could not create a primitive",
    # NCCL, raised by ProcessGroupNCCL as DistBackendError: "NCCL error in: ..., unhandled cuda
    # error (run with NCCL_DEBUG=INFO for details), NCCL version ...\nncclUnhandledCudaError: Call
    # to CUDA function failed.\nLast error:\n" and NCCL's last warning, which for its own buffers is
    "Cuda failure 'out of memory'",  # CUDACHECK, runtime API (src/include/checks.h)
    "Cuda failure 2 'out of memory'",  # CUCHECK, driver API: CUDA_ERROR_OUT_OF_MEMORY (cudawrap.h)
    # ncclCudaCalloc(Async) warns this last, after the "Cuda failure" of cuMemCreate/cudaMalloc,
    # whose text it hides (src/include/alloc.h). In disguise: the call that failed is not named.
    "Failed to CUDA calloc",
)

#: ``torch.AcceleratorError.error_code`` values (cudaError_t) that leave a context unusable. The
#: CUDA runtime documents each of these as "leaves the process in an inconsistent state and any
#: further CUDA work will return the same error" or "the process must be terminated and relaunched",
#: except the hardware faults and 999, which are listed because nothing after them can be trusted.
STICKY_CODES = frozenset(
    {
        214,  # cudaErrorECCUncorrectable: uncorrectable ECC error in device memory (hardware)
        220,  # cudaErrorNvlinkUncorrectable: uncorrectable NVLink error (hardware)
        226,  # cudaErrorContained: an error contained by the GPU (CUDA 12.8)
        700,  # cudaErrorIllegalAddress
        702,  # cudaErrorLaunchTimeout
        710,  # cudaErrorAssert: device-side assert
        714,  # cudaErrorHardwareStackError
        715,  # cudaErrorIllegalInstruction
        716,  # cudaErrorMisalignedAddress
        717,  # cudaErrorInvalidAddressSpace
        718,  # cudaErrorInvalidPc
        719,  # cudaErrorLaunchFailure
        721,  # cudaErrorTensorMemoryLeak: a kernel exited holding tensor memory (CUDA 12.8)
        810,  # cudaErrorMpsClientTerminated
        911,  # cudaErrorExternalDevice: an async error of a device outside CUDA
        999,  # cudaErrorUnknown: an Xid the runtime cannot name; in practice the context is gone
    }
)
# Not sticky, so not listed: 701 (too many resources for a launch), 720 (cooperative launch too
# large), 46 (devices busy or unavailable), 100 (no device), 101 (invalid device ordinal): each
# refuses one call and leaves the context as it was.

#: cudaErrorMemoryAllocation: an out-of-memory, not a failure of the context.
OOM_CODES = frozenset({2})

#: Errors that leave a CUDA context unusable: every later call fails too (the messages are the
#: fallback for torch versions without ``AcceleratorError`` and for errors raised as text). They
#: are cudaGetErrorString's texts of the codes above.
STICKY_MESSAGES: tuple[str, ...] = (
    "illegal memory access",  # 700
    "the launch timed out and was terminated",  # 702
    "device-side assert triggered",  # 710
    "hardware stack error",  # 714
    "an illegal instruction was encountered",  # 715
    "misaligned address",  # 716
    "operation not supported on global/shared address space",  # 717
    "invalid program counter",  # 718
    "unspecified launch failure",  # 719
    "uncorrectable ECC error encountered",  # 214
    "uncorrectable NVLink error detected",  # 220
    "the MPS client has been terminated by the server",  # 810
    # 999: "unknown error" alone is any library's wording; only CUDA's own means the device.
    "CUDA error: unknown error",
)

#: How torch words an error of the device's runtime (``C10_CUDA_CHECK``); before torch 2.8 it
#: raised these as a plain ``RuntimeError``, without ``AcceleratorError`` and its code.
_RUNTIME_ERROR_PREFIXES = ("CUDA error: ", "HIP error: ")


def _error_code(exc: BaseException) -> int | None:
    """The runtime's error code of a ``torch.AcceleratorError`` (torch >= 2.8), if it has one."""
    accelerator_error = getattr(torch, "AcceleratorError", None)
    if accelerator_error is None or not isinstance(exc, accelerator_error):
        return None
    code = getattr(exc, "error_code", None)
    return code if isinstance(code, int) else None


def _is_accelerator_error(exc: BaseException) -> bool:
    accelerator_error = getattr(torch, "AcceleratorError", None)
    return accelerator_error is not None and isinstance(exc, accelerator_error)


def is_oom(exc: BaseException) -> bool:
    """True when ``exc`` means the device ran out of memory."""
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    if not isinstance(exc, RuntimeError):
        return False
    if _error_code(exc) in OOM_CODES:
        return True
    message = str(exc)
    return any(pattern in message for pattern in OOM_MESSAGES)


def is_sticky_device_error(exc: BaseException) -> bool:
    """True for errors that poison the device's context (later trials would all fail or lie):
    by ``AcceleratorError`` code where torch gives one, else by message."""
    if not isinstance(exc, RuntimeError) or isinstance(exc, torch.OutOfMemoryError):
        return False
    if _error_code(exc) in STICKY_CODES:
        return True
    message = str(exc)
    return any(pattern in message for pattern in STICKY_MESSAGES)


def is_device_failure(exc: BaseException) -> bool:
    """True when ``exc``, raised while batchfit released memory after a trial, means the device failed.

    Why a rule of its own: CUDA reports a kernel's fault at the next call that waits for the
    device, and ``empty_cache`` (``cudaFree``) is one, so an asynchronous error of the trial can
    first surface there, after the trial's own ``except``. No model code runs in that release, so
    any error of the device's runtime there is the device's, whatever its code: sticky errors, any
    ``AcceleratorError`` but an out-of-memory, and (torch < 2.8) a ``RuntimeError`` worded as one.
    The caller raises ``DeviceFailedError``, so that the restore does not touch the device.
    """
    if not isinstance(exc, RuntimeError) or is_oom(exc):
        return False
    if is_sticky_device_error(exc) or _is_accelerator_error(exc):
        return True
    return str(exc).startswith(_RUNTIME_ERROR_PREFIXES)
