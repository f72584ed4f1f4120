"""``batchfit devices``: NVIDIA GPUs as NVML sees them, before a run. Never imports torch itself."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

from batchfit.backends import DevicesReport, Gpu, MigDevice, query_devices
from batchfit.cli.output import EXIT_OK, check_json_path, write_json
from batchfit.units import format_bytes

# devices ------------------------------------------------------------------------------------------


def devices_command(args: argparse.Namespace) -> int:
    check_json_path(args.json)
    report = query_devices()
    human = sys.stderr if args.json == "-" else sys.stdout
    for line in devices_lines(report):
        print(line, file=human)
    if args.json:
        write_json(args.json, json.dumps(asdict(report), indent=2, sort_keys=True))
    return EXIT_OK


# devices ----------------------------------------------------------------------------------------
def devices_lines(report: DevicesReport) -> list[str]:
    """``batchfit devices`` as plain lines: what nvidia-smi would tell before a run.

    ``GPU n`` is NVML's index (PCI bus order, as nvidia-smi numbers them); ``cuda:n`` beside it is
    the index torch uses for the same GPU, matched by UUID, which can differ even without
    ``CUDA_VISIBLE_DEVICES`` (CUDA orders fastest first by default). MIG instances are indented
    under their GPU with the UUID that ``CUDA_VISIBLE_DEVICES`` takes; a GPU NVML cannot open is
    listed with the reason."""
    if report.unavailable:
        return [report.unavailable]
    torch_knows = report.cuda_device_count is not None

    def memory(used: int | None, free: int | None, total: int | None) -> str:
        return f"memory {format_bytes(used)} used / {format_bytes(free)} free / {format_bytes(total)} total"

    def torch_index(cuda_index: int | None) -> str:
        if cuda_index is not None:
            return f" (cuda:{cuda_index})"
        return " (not visible to torch)" if torch_knows else ""

    def gpu_lines(gpu: Gpu) -> list[str]:
        if gpu.unreadable:
            return [f"GPU {gpu.index}: cannot be read: {gpu.unreadable}"]
        util = "-" if gpu.gpu_utilization is None else f"{gpu.gpu_utilization}%"
        # in MIG mode torch sees the instances, never the GPU itself: say nothing rather than "not visible"
        index = "" if gpu.mig_enabled and gpu.cuda_index is None else torch_index(gpu.cuda_index)
        mig = f"  MIG on, {len(gpu.mig_devices)} instance(s)" if gpu.mig_enabled else ""
        out = [
            f"GPU {gpu.index}{index}: {gpu.name or '?'}  {memory(gpu.used_bytes, gpu.free_bytes, gpu.total_bytes)}"
            f"  utilisation {util}{mig}"
        ]
        out.extend(mig_line(instance) for instance in gpu.mig_devices)
        if gpu.mig_enabled and not gpu.mig_devices:
            out.append("    no MIG instances created")
        if not gpu.processes:
            out.append("    no processes hold memory")
        for proc in gpu.processes:
            out.append(f"    pid {proc.pid:<8} {format_bytes(proc.used_bytes):>11}  {proc.kind:<8} {proc.name}")
        return out

    def mig_line(instance: MigDevice) -> str:
        if instance.unreadable:
            return f"    MIG {instance.index}: cannot be read: {instance.unreadable}"
        ids = ""
        if instance.gpu_instance_id is not None and instance.compute_instance_id is not None:
            ids = f"  GI {instance.gpu_instance_id} CI {instance.compute_instance_id}"
        used, free, total = instance.used_bytes, instance.free_bytes, instance.total_bytes
        return (
            f"    MIG {instance.index}{torch_index(instance.cuda_index)}: {instance.name or '?'}{ids}  "
            f"{memory(used, free, total)}  {instance.uuid or 'uuid ?'}"
        )

    lines = [
        f"NVIDIA driver {report.driver_version or '?'}, CUDA {report.cuda_version or '?'}, {len(report.gpus)} GPU(s)"
    ]
    env = [
        f"{name}={value}"
        for name, value in (
            ("CUDA_VISIBLE_DEVICES", report.cuda_visible_devices),
            ("CUDA_DEVICE_ORDER", report.cuda_device_order),
        )
        if value is not None
    ]
    if env:
        lines.append("  ".join(env))
    if not torch_knows and (len(report.gpus) > 1 or report.cuda_visible_devices is not None):
        lines.append("GPU n below is NVML's index; torch's cuda:n is unknown here (no torch or no CUDA) and may differ")
    elif torch_knows and any(gpu.cuda_index != gpu.index for gpu in report.gpus if not gpu.mig_enabled):
        lines.append("GPU n is NVML's index (PCI bus order, as nvidia-smi); cuda:n is torch's for the same GPU")
    for gpu in report.gpus:
        lines.extend(gpu_lines(gpu))
    return lines
