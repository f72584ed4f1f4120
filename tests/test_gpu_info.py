"""batchfit.gpu_info against the real NVML of this machine, and how its report is shown."""

from __future__ import annotations

import os

import pytest

from batchfit.gpu_info import DevicesReport, Gpu, GpuProcess, query_devices
from batchfit.view import devices_lines


def _nvml_usable() -> bool:
    pynvml = pytest.importorskip("pynvml")
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return False
    pynvml.nvmlShutdown()
    return True


def test_report_matches_what_nvml_can_do_here() -> None:
    report = query_devices()

    assert report.cuda_visible_devices == os.environ.get("CUDA_VISIBLE_DEVICES")
    if _nvml_usable():
        for gpu in report.gpus:
            assert gpu.name and gpu.total_bytes and gpu.total_bytes > 0
            assert gpu.used_bytes is not None and gpu.free_bytes is not None
            assert gpu.used_bytes + gpu.free_bytes <= gpu.total_bytes
    else:
        assert report.gpus == ()
        assert report.unavailable and "\n" not in report.unavailable
        assert report.unavailable.startswith(("no NVIDIA GPU", "cannot list GPUs"))
        assert devices_lines(report) == [report.unavailable]


def test_nvml_is_shut_down_afterwards() -> None:
    """Every nvmlInit is matched by an nvmlShutdown: after a query, NVML's reference count is
    back to where it was, so one more shutdown finds it uninitialised."""
    if not _nvml_usable():
        pytest.skip("NVML cannot start on this machine")
    import pynvml

    query_devices()
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        pynvml.nvmlShutdown()


def test_lines_show_memory_utilisation_and_processes() -> None:
    report = DevicesReport(
        gpus=(
            Gpu(
                index=0,
                name="NVIDIA H100 80GB HBM3",
                uuid="GPU-1",
                total_bytes=80 * 2**30,
                used_bytes=20 * 2**30,
                free_bytes=60 * 2**30,
                gpu_utilization=97,
                memory_utilization=40,
                temperature_c=60,
                power_w=500.0,
                processes=(GpuProcess(pid=4242, name="python", used_bytes=19 * 2**30, kind="compute"),),
            ),
            Gpu(1, "NVIDIA H100 80GB HBM3", None, 80 * 2**30, 2**20, 80 * 2**30 - 2**20, None, None, None, None, ()),
        ),
        driver_version="550.54",
        cuda_version="12.4",
        cuda_visible_devices="1,0",
    )

    lines = devices_lines(report)

    assert lines[0] == "NVIDIA driver 550.54, CUDA 12.4, 2 GPU(s)"
    assert "CUDA_VISIBLE_DEVICES=1,0" in lines[1]
    assert "GPU 0: NVIDIA H100 80GB HBM3  memory 20.00 GiB used / 60.00 GiB free / 80.00 GiB total" in lines[2]
    assert lines[2].endswith("utilisation 97%")
    assert "pid 4242" in lines[3] and "19.00 GiB" in lines[3] and lines[3].endswith("python")
    assert lines[4].endswith("utilisation -") and lines[5].strip() == "no processes hold memory"


@pytest.mark.cuda
def test_lists_every_gpu_torch_sees() -> None:
    import torch

    report = query_devices()
    assert report.unavailable is None
    if report.cuda_visible_devices is None:
        assert len(report.gpus) == torch.cuda.device_count()
    assert report.driver_version and report.cuda_version
