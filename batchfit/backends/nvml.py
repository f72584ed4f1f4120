"""What batchfit asks NVML (the NVIDIA driver's management library), and how it asks.

* `nvml_device_by_uuid`, for describing a torch CUDA device: NVML's name and NVML's total
  memory (which, unlike CUDA's ``totalGlobalMem``, includes what the driver reserves), matched by
  UUID because NVML's order (PCI bus) and CUDA's (fastest first, then ``CUDA_VISIBLE_DEVICES``)
  need not agree;
* the helpers every NVML question shares (`optional`, `shutdown`, ...); the report
  behind ``batchfit devices`` is `batchfit.backends.gpus`.

Nothing here raises for a missing ``nvidia-ml-py``, a missing or unloaded driver, or an NVML call
that fails (any ``pynvml.NVMLError``): no GPU is an answer, not an error, and one GPU NVML cannot
read must not hide the others. NVML is always shut down again after a successful ``nvmlInit``,
whatever happens in between. No torch import: ``batchfit devices`` must start fast.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")

_UUID_PREFIXES = ("GPU-", "MIG-")


@dataclass(frozen=True)
class NvmlIdentity:
    """What NVML says about one CUDA device, found by UUID. Frozen: a value, not a handle.

    ``total_bytes`` is NVML's total (``nvmlDeviceGetMemoryInfo(handle).total``), which includes
    memory the driver reserves, so it is larger than torch's ``total_memory``; ``uuid`` is NVML's
    spelling, with its ``GPU-`` or ``MIG-`` prefix."""

    uuid: str
    name: str
    total_bytes: int


# One device by UUID ----------------------------------------------------------------------------
def nvml_device_by_uuid(uuid: str) -> NvmlIdentity | None:
    """NVML's name and total memory for the CUDA device with this UUID, or ``None``.

    ``uuid`` is torch's (``str(torch.cuda.get_device_properties(i).uuid)``, no prefix) or NVML's
    (``GPU-...`` / ``MIG-...``); case does not matter. A MIG instance is found by its own UUID.
    ``None`` when nvidia-ml-py or the driver is missing, no device has this UUID, or any NVML
    call fails. NVML is shut down again before returning."""
    key = uuid_key(uuid)
    if not key:
        return None
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return None
    try:
        handle = _handle_by_uuid(pynvml, uuid, key)
        if handle is None:
            return None
        memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
        return NvmlIdentity(
            uuid=text(pynvml.nvmlDeviceGetUUID(handle)),
            name=text(pynvml.nvmlDeviceGetName(handle)),
            total_bytes=int(memory.total),
        )
    except pynvml.NVMLError:
        return None
    finally:
        shutdown(pynvml)


def _handle_by_uuid(pynvml: Any, uuid: str, key: str) -> Any | None:
    """The handle whose UUID matches ``key``: NVML's own lookup first (``GPU-`` then ``MIG-``), then
    every GPU and MIG instance in turn, for drivers whose lookup does not accept MIG UUIDs."""
    spelled = uuid.strip()
    if spelled.upper().startswith(_UUID_PREFIXES):
        candidates = [spelled]
    else:
        candidates = [prefix + spelled for prefix in _UUID_PREFIXES]
    for candidate in candidates:
        handle = optional(pynvml, lambda c=candidate: pynvml.nvmlDeviceGetHandleByUUID(c))  # type: ignore[misc]
        if handle is not None:
            return handle
    for handle in _every_handle(pynvml):
        if uuid_key(optional(pynvml, lambda h=handle: text(pynvml.nvmlDeviceGetUUID(h)))) == key:  # type: ignore[misc]
            return handle
    return None


def _every_handle(pynvml: Any) -> Iterator[Any]:
    """Every GPU handle NVML can open, each followed by its MIG instances' handles."""
    for index in range(optional(pynvml, lambda: int(pynvml.nvmlDeviceGetCount())) or 0):
        gpu = optional(pynvml, lambda i=index: pynvml.nvmlDeviceGetHandleByIndex(i))  # type: ignore[misc]
        if gpu is None:
            continue
        yield gpu
        for _, mig in mig_handles(pynvml, gpu):
            if not isinstance(mig, pynvml.NVMLError):
                yield mig


def mig_handles(pynvml: Any, handle: Any) -> Iterator[tuple[int, Any]]:
    """``(slot, handle)`` for each populated MIG slot of a GPU, or ``(slot, error)`` for one NVML
    lists but cannot open. Empty slots (``NVMLError_NotFound``) are skipped; a GPU without MIG
    yields nothing."""
    slots = optional(pynvml, lambda: int(pynvml.nvmlDeviceGetMaxMigDeviceCount(handle))) or 0
    for slot in range(slots):
        try:
            yield slot, pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, slot)
        except pynvml.NVMLError_NotFound:
            continue
        except pynvml.NVMLError as exc:
            yield slot, exc


# Helpers ---------------------------------------------------------------------------------------
def uuid_key(uuid: str | None) -> str:
    """A UUID as torch and NVML can both be compared by: no ``GPU-``/``MIG-`` prefix, lower case."""
    if not uuid:
        return ""
    spelled = uuid.strip()
    if spelled.upper().startswith(_UUID_PREFIXES):
        spelled = spelled[4:]
    return spelled.lower()


def shutdown(pynvml: Any) -> None:
    """Undo one ``nvmlInit``. A failing shutdown is not worth a traceback in a report."""
    try:
        pynvml.nvmlShutdown()
    except pynvml.NVMLError:
        pass


def optional(pynvml: Any, query: Callable[[], T]) -> T | None:
    """``query()``, or ``None`` where NVML says the device does not support it (MIG, vGPU, old
    boards), the call is not permitted, or it fails in any other NVML way."""
    try:
        return query()
    except pynvml.NVMLError:
        return None


def reason(exc: Exception) -> str:
    """An NVML error as a short phrase (pynvml's text, else its class name)."""
    return str(exc).strip() or type(exc).__name__


def text(value: str | bytes) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)
