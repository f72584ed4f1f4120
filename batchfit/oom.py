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
    "HIP out of memory",  # ROCm
    "MPS backend out of memory",  # Apple
    "XPU out of memory",  # Intel
    "DefaultCPUAllocator: can't allocate memory",  # CPU allocator
    "CUBLAS_STATUS_ALLOC_FAILED",  # cuBLAS workspace allocation
    "CUDNN_STATUS_NOT_SUPPORTED",  # cuDNN: usually an OOM in disguise for big batches
    "CUDNN_STATUS_ALLOC_FAILED",
    "cuFFT error: CUFFT_ALLOC_FAILED",
    # oneDNN (CPU matmul/conv): primitive creation fails when its scratchpad cannot be
    # allocated; seen under RLIMIT_AS right at the boundary (tests/test_real_oom.py).
    "could not create a primitive",
)

#: Errors that leave a CUDA context unusable: every later call fails too.
STICKY_MESSAGES: tuple[str, ...] = (
    "illegal memory access",
    "device-side assert triggered",
    "unspecified launch failure",
    "misaligned address",
    "an illegal instruction was encountered",
)


def is_oom(exc: BaseException) -> bool:
    """True when ``exc`` means the device ran out of memory."""
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    if not isinstance(exc, RuntimeError):
        return False
    message = str(exc)
    return any(pattern in message for pattern in OOM_MESSAGES)


def is_sticky_device_error(exc: BaseException) -> bool:
    """True for errors that poison the CUDA context (later trials would all fail or lie)."""
    if not isinstance(exc, RuntimeError) or isinstance(exc, torch.OutOfMemoryError):
        return False
    message = str(exc)
    return any(pattern in message for pattern in STICKY_MESSAGES)


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message, for a trial record."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def annotate(exc: BaseException, note: str) -> None:
    """Attach ``note`` to ``exc`` so it shows under its traceback, keeping type and args."""
    if hasattr(exc, "add_note"):
        exc.add_note(note)
    else:  # Python 3.10: store it the same way 3.11 does
        notes = list(getattr(exc, "__notes__", []))
        notes.append(note)
        exc.__notes__ = notes  # type: ignore[attr-defined]
