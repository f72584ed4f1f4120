"""Is this exception an out-of-memory? And is the device still usable after it?

Classification is by type first (``torch.OutOfMemoryError``, which ``torch.cuda.OutOfMemoryError``
aliases), then by the messages the backends use when they raise a plain ``RuntimeError``.
Two entries are "OOM in disguise" (cuDNN NOT_SUPPORTED, oneDNN "could not create a primitive"):
they can also mean an unsupported configuration, which then fails at every size, so the
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
    "would exceed allowed memory",  # backend:cudaMallocAsync under a memory fraction (no size)
    "HIP out of memory",  # ROCm
    "MPS backend out of memory",  # Apple
    "XPU out of memory",  # Intel
    "DefaultCPUAllocator: can't allocate memory",  # CPU allocator
    "CUBLAS_STATUS_ALLOC_FAILED",  # cuBLAS workspace allocation
    "CUDNN_STATUS_NOT_SUPPORTED",  # cuDNN: usually an OOM in disguise for big batches
    "CUDNN_STATUS_ALLOC_FAILED",
    # cuDNN v9 frontend: no engine whose workspace fits what is left, an OOM in disguise too.
    "unable to find an engine",
    "cuFFT error: CUFFT_ALLOC_FAILED",
    # oneDNN (CPU matmul/conv): primitive creation fails when its scratchpad cannot be
    # allocated; seen under RLIMIT_AS right at the boundary (tests/test_real_oom.py).
    "could not create a primitive",
)

#: cudaError codes that leave a context unusable (``torch.AcceleratorError.error_code``):
#: illegal address 700, launch timeout 702, hardware stack error 714, illegal instruction 715,
#: misaligned address 716, invalid address space 717, invalid PC 718, launch failure 719, and
#: device-side assert 710.
STICKY_CODES = frozenset({700, 702, 710, 714, 715, 716, 717, 718, 719})
#: cudaErrorMemoryAllocation: an out-of-memory, not a failure of the context.
OOM_CODES = frozenset({2})

#: Errors that leave a CUDA context unusable: every later call fails too (the messages are the
#: fallback for torch versions without ``AcceleratorError`` and for errors raised as text).
STICKY_MESSAGES: tuple[str, ...] = (
    "illegal memory access",
    "device-side assert triggered",
    "unspecified launch failure",
    "misaligned address",
    "an illegal instruction was encountered",
)


def _error_code(exc: BaseException) -> int | None:
    """The runtime's error code of a ``torch.AcceleratorError`` (torch >= 2.8), if it has one."""
    accelerator_error = getattr(torch, "AcceleratorError", None)
    if accelerator_error is None or not isinstance(exc, accelerator_error):
        return None
    code = getattr(exc, "error_code", None)
    return code if isinstance(code, int) else None


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
