"""batchfit.backends.nvml and .gpus against the real NVML of this machine, and how ``batchfit devices``
shows its report.

Without an NVIDIA driver (a CPU CI runner) the unavailable path runs for real; the GPU tests carry
``@pytest.mark.cuda``. The formatting tests build reports by hand, since a MIG instance, an
unreadable GPU or a CUDA order that differs from NVML's cannot be produced on demand.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from dataclasses import FrozenInstanceError, asdict
from pathlib import Path

import pytest

from batchfit.backends import DevicesReport, Gpu, MigDevice, query_devices
from batchfit.backends.gpus import GpuProcess
from batchfit.backends.nvml import nvml_device_by_uuid
from batchfit.cli import main
from batchfit.cli.devices import devices_lines

REPO = Path(__file__).resolve().parents[1]
GiB = 2**30


def _nvml_start_error() -> BaseException | None:
    """Why NVML cannot start here (the exception ``nvmlInit`` raises), or ``None`` when it can."""
    pynvml = pytest.importorskip("pynvml")
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        return exc
    pynvml.nvmlShutdown()
    return None


def _nvml_gpu_count() -> int:
    pynvml = pytest.importorskip("pynvml")
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return 0
    try:
        return int(pynvml.nvmlDeviceGetCount())
    finally:
        pynvml.nvmlShutdown()


def _python(code: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)


needs_no_nvml = pytest.mark.skipif(
    _nvml_start_error() is None, reason="NVML starts on this machine: the unavailable path cannot run for real"
)


# Without NVML: the unavailable path, for real ------------------------------------------------
@needs_no_nvml
def test_without_nvml_the_report_says_why_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    import pynvml

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,0")
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    error = _nvml_start_error()

    report = query_devices()

    assert report.gpus == () and report.driver_version is None and report.cuda_device_count is None
    assert report.cuda_visible_devices == "1,0" and report.cuda_device_order == "PCI_BUS_ID"
    assert report.unavailable and "\n" not in report.unavailable
    if isinstance(error, pynvml.NVMLError_LibraryNotFound):
        assert report.unavailable.startswith("no NVIDIA GPU: the NVIDIA driver is not installed")
    else:
        assert report.unavailable.startswith(("no NVIDIA GPU", "cannot list GPUs"))
    assert devices_lines(report) == [report.unavailable]


@needs_no_nvml
def test_devices_command_prints_the_reason_and_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["devices"]) == 0

    out, err = capsys.readouterr()
    assert out == query_devices().unavailable + "\n"
    assert err == ""


@needs_no_nvml
def test_devices_json_carries_the_reason_and_the_cuda_environment(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "FASTEST_FIRST")

    assert main(["devices", "--json", "-"]) == 0

    out, err = capsys.readouterr()
    report = json.loads(out)
    assert report["gpus"] == [] and report["unavailable"] == err.strip()
    assert report["cuda_visible_devices"] is None and report["cuda_device_order"] == "FASTEST_FIRST"
    assert report["cuda_device_count"] is None


@pytest.mark.skipif(_nvml_gpu_count() > 0, reason="NVML lists a GPU here, and then torch is asked for CUDA indexes")
def test_no_gpu_means_torch_is_never_imported() -> None:
    """``batchfit devices`` must stay fast where there is nothing to match against torch."""
    proc = _python(
        "import sys\n"
        "from batchfit.backends import query_devices\n"
        "report = query_devices()\n"
        "assert report.gpus == () and report.unavailable, report\n"
        "assert 'torch' not in sys.modules, 'query_devices imported torch'\n"
        "from batchfit.cli import main\n"
        "assert main(['devices']) == 0\n"
        "assert 'torch' not in sys.modules, 'batchfit devices imported torch'\n"
    )

    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() and "\n" not in proc.stdout.strip()  # the one-line reason


def test_importing_the_module_does_not_import_torch() -> None:
    proc = _python("import sys, batchfit.backends.nvml, batchfit.backends.gpus\nassert 'torch' not in sys.modules\n")

    assert proc.returncode == 0, proc.stderr


def test_nvml_device_by_uuid_is_none_for_no_uuid_and_for_a_uuid_no_device_has() -> None:
    assert nvml_device_by_uuid("") is None
    assert nvml_device_by_uuid(str(uuid.uuid4())) is None
    assert nvml_device_by_uuid("GPU-" + str(uuid.uuid4())) is None
    assert nvml_device_by_uuid("MIG-" + str(uuid.uuid4())) is None


# With NVML --------------------------------------------------------------------------------------
def test_nvml_is_shut_down_afterwards() -> None:
    """Every nvmlInit is matched by an nvmlShutdown: after a query, NVML's reference count is
    back to where it was, so one more shutdown finds it uninitialised."""
    if _nvml_start_error() is not None:
        pytest.skip("NVML cannot start on this machine")
    import pynvml

    query_devices()
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        pynvml.nvmlShutdown()
    nvml_device_by_uuid(str(uuid.uuid4()))
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        pynvml.nvmlShutdown()


@pytest.mark.cuda
def test_every_torch_device_is_listed_once_with_its_cuda_index() -> None:
    import torch

    report = query_devices()

    assert report.unavailable is None and report.driver_version and report.cuda_version
    assert report.cuda_device_count == torch.cuda.device_count()
    assert report.cuda_device_order == os.environ.get("CUDA_DEVICE_ORDER")
    for gpu in report.gpus:
        assert gpu.unreadable is None, gpu
        assert gpu.name and gpu.total_bytes and gpu.total_bytes > 0
        assert gpu.used_bytes is not None and gpu.free_bytes is not None
        assert gpu.used_bytes + gpu.free_bytes <= gpu.total_bytes
    by_cuda = {}
    for gpu in report.gpus:
        for item in (gpu, *gpu.mig_devices):
            if item.cuda_index is not None:
                by_cuda[item.cuda_index] = item.uuid
    assert sorted(by_cuda) == list(range(torch.cuda.device_count()))
    for index, nvml_uuid in by_cuda.items():
        assert nvml_uuid and nvml_uuid[4:].lower() == str(torch.cuda.get_device_properties(index).uuid).lower()


@pytest.mark.cuda
def test_nvml_device_by_uuid_names_each_torch_device() -> None:
    import torch

    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        identity = nvml_device_by_uuid(str(props.uuid))

        assert identity is not None
        assert identity.uuid[4:].lower() == str(props.uuid).lower()
        assert identity.name and identity.total_bytes >= props.total_memory  # NVML's total includes the driver's
        assert nvml_device_by_uuid(identity.uuid) == identity  # NVML's own spelling works too


# How the report is shown --------------------------------------------------------------------------
def _gpu(index: int, **fields: object) -> Gpu:
    values: dict[str, object] = {
        "index": index,
        "name": "NVIDIA H100 80GB HBM3",
        "uuid": f"GPU-0000000{index}-0000-0000-0000-000000000000",
        "total_bytes": 80 * GiB,
        "used_bytes": 20 * GiB,
        "free_bytes": 60 * GiB,
        "gpu_utilization": 97,
        "memory_utilization": 40,
        "temperature_c": 60,
        "power_w": 500.0,
        "processes": (),
    }
    values.update(fields)
    return Gpu(**values)  # type: ignore[arg-type]


def test_unavailable_is_the_only_line() -> None:
    report = DevicesReport(unavailable="no NVIDIA GPU: the NVIDIA driver is not installed", cuda_visible_devices="0")

    assert devices_lines(report) == ["no NVIDIA GPU: the NVIDIA driver is not installed"]


def test_lines_show_memory_utilisation_and_processes() -> None:
    report = DevicesReport(
        gpus=(
            _gpu(0, processes=(GpuProcess(pid=4242, name="python", used_bytes=19 * GiB, kind="compute"),)),
            _gpu(1, uuid=None, used_bytes=2**20, free_bytes=80 * GiB - 2**20, gpu_utilization=None),
        ),
        driver_version="550.54",
        cuda_version="12.4",
    )

    lines = devices_lines(report)

    assert lines[0] == "NVIDIA driver 550.54, CUDA 12.4, 2 GPU(s)"
    assert "unknown here" in lines[1] and "NVML's index" in lines[1]  # torch was not asked
    assert lines[2] == (
        "GPU 0: NVIDIA H100 80GB HBM3  memory 20.00 GiB used / 60.00 GiB free / 80.00 GiB total  utilisation 97%"
    )
    assert "pid 4242" in lines[3] and "19.00 GiB" in lines[3] and lines[3].endswith("python")
    assert lines[4].startswith("GPU 1: ") and lines[4].endswith("utilisation -")
    assert lines[5].strip() == "no processes hold memory"
    assert len(lines) == 6


def test_cuda_index_shown_beside_nvml_index_when_the_orders_differ() -> None:
    report = DevicesReport(
        gpus=(_gpu(0, cuda_index=1), _gpu(1, cuda_index=0), _gpu(2, cuda_index=None)),
        driver_version="550.54",
        cuda_version="12.4",
        cuda_visible_devices="1,0",
        cuda_device_order="FASTEST_FIRST",
        cuda_device_count=2,
    )

    lines = devices_lines(report)

    assert lines[1] == "CUDA_VISIBLE_DEVICES=1,0  CUDA_DEVICE_ORDER=FASTEST_FIRST"
    assert "cuda:n is torch's" in lines[2]
    gpu_lines = [line for line in lines if line[:5] in ("GPU 0", "GPU 1", "GPU 2")]
    assert gpu_lines[0].startswith("GPU 0 (cuda:1): NVIDIA H100")
    assert gpu_lines[1].startswith("GPU 1 (cuda:0): NVIDIA H100")
    assert gpu_lines[2].startswith("GPU 2 (not visible to torch): NVIDIA H100")


def test_same_order_shows_the_cuda_index_without_the_note() -> None:
    report = DevicesReport(gpus=(_gpu(0, cuda_index=0), _gpu(1, cuda_index=1)), cuda_device_count=2)

    lines = devices_lines(report)

    assert lines[0] == "NVIDIA driver ?, CUDA ?, 2 GPU(s)"
    assert lines[1].startswith("GPU 0 (cuda:0): ") and lines[3].startswith("GPU 1 (cuda:1): ")


def test_mig_instances_are_indented_under_their_gpu() -> None:
    mig_uuid = "MIG-11111111-2222-3333-4444-555555555555"
    gpu = _gpu(
        0,
        name="NVIDIA A100-SXM4-40GB",
        gpu_utilization=None,
        mig_enabled=True,
        mig_devices=(
            MigDevice(
                index=0,
                uuid=mig_uuid,
                name="NVIDIA A100-SXM4-40GB MIG 1g.5gb",
                total_bytes=5 * GiB,
                used_bytes=GiB,
                free_bytes=4 * GiB,
                gpu_instance_id=7,
                compute_instance_id=0,
                cuda_index=0,
            ),
            MigDevice(3, None, None, None, None, None, unreadable="NVML cannot open it (Unknown Error)"),
        ),
    )
    report = DevicesReport(gpus=(gpu, _gpu(1, mig_enabled=True)), cuda_device_count=1)

    lines = devices_lines(report)

    assert lines[1].startswith("GPU 0: NVIDIA A100-SXM4-40GB  memory") and lines[1].endswith("MIG on, 2 instance(s)")
    assert lines[2] == (
        "    MIG 0 (cuda:0): NVIDIA A100-SXM4-40GB MIG 1g.5gb  GI 7 CI 0  "
        f"memory 1.00 GiB used / 4.00 GiB free / 5.00 GiB total  {mig_uuid}"
    )
    assert lines[3] == "    MIG 3: cannot be read: NVML cannot open it (Unknown Error)"
    assert lines[4] == "    no processes hold memory"
    assert lines[5].startswith("GPU 1: ") and lines[5].endswith("MIG on, 0 instance(s)")
    assert lines[6] == "    no MIG instances created"


def test_a_gpu_nvml_cannot_open_is_listed_with_the_reason() -> None:
    unreadable = Gpu(
        1, None, None, None, None, None, None, None, None, None, (), unreadable="NVML cannot open (GPU lost)"
    )
    report = DevicesReport(gpus=(_gpu(0), unreadable, _gpu(2)), driver_version="550.54", cuda_version="12.4")

    lines = devices_lines(report)

    assert "GPU 1: cannot be read: NVML cannot open (GPU lost)" in lines
    after = lines[lines.index("GPU 1: cannot be read: NVML cannot open (GPU lost)") + 1]
    assert after.startswith("GPU 2: ")  # nothing else is claimed about the GPU that could not be read


def test_a_report_is_frozen_and_becomes_json_as_the_cli_writes_it() -> None:
    mig = MigDevice(0, "MIG-1", "slice", GiB, 0, GiB)
    report = DevicesReport(gpus=(_gpu(0, mig_enabled=True, mig_devices=(mig,)),), cuda_device_order="PCI_BUS_ID")

    with pytest.raises(FrozenInstanceError):
        report.gpus[0].cuda_index = 3  # type: ignore[misc]
    data = json.loads(json.dumps(asdict(report)))
    assert data["gpus"][0]["mig_devices"][0]["uuid"] == "MIG-1"
    assert data["gpus"][0]["cuda_index"] is None and data["cuda_device_order"] == "PCI_BUS_ID"
