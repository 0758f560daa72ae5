"""Throughput, model FLOPs utilisation and memory for the training log.

MFU = FLOPs per token (`model.flops`) x tokens/s / peak FLOP/s (Chowdhery et al. 2022,
PaLM appendix B). The peak comes from a table of dense tensor-core (or FP32) figures of known
accelerators, from the vendors' data sheets; on an unknown GPU it is measured with a square
GEMM at the start of the run, and on a CPU measured once per CPU type, torch version, dtype and
thread count and kept (`cpu_gemm_peak`). The log says which.
"""

from __future__ import annotations

import datetime
import json
import os
import resource
import time
from pathlib import Path

import torch

from common.machine import cpu_key, read_cpuinfo

# Dense peak FLOP/s per device (no sparsity), by a substring of torch.cuda.get_device_name().
# "tf32": the dense TF32 tensor-core figure, the peak of fp32 runs with `tf32: true`; a device
# without one here (A10G) has its TF32 GEMM measured instead.
PEAK_FLOPS = {
    "H200": {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12, "tf32": 495e12},
    "H100 PCIe": {"bf16": 756e12, "fp16": 756e12, "fp32": 51e12, "tf32": 378e12},
    "H100": {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12, "tf32": 495e12},
    "A100": {"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12, "tf32": 156e12},
    "A10G": {"bf16": 70e12, "fp16": 70e12, "fp32": 31.2e12},
    "L40S": {"bf16": 362e12, "fp16": 362e12, "fp32": 91.6e12, "tf32": 183e12},
    "L4": {"bf16": 121e12, "fp16": 121e12, "fp32": 30.3e12, "tf32": 60e12},
    "V100": {"bf16": 0.0, "fp16": 125e12, "fp32": 15.7e12},
    "RTX 4090": {"bf16": 165e12, "fp16": 165e12, "fp32": 82.6e12, "tf32": 82.6e12},
}


def set_fp32_matmul(tf32: bool) -> bool:
    """The `tf32` setting: on CUDA, float32 GEMMs on TF32 tensor cores, or in IEEE float32.
    Returns whether TF32 is in use: asked for, and a GPU that has it (compute capability 8.0,
    Ampere, or newer).

    Set through the legacy flag (`torch.backends.cuda.matmul.allow_tf32`), which torch keeps in
    step with the new one (`fp32_precision` then reads "tf32" or "ieee"): after setting only
    the new one, every legacy reader raises ("mix of the legacy and new APIs"), and torch's own
    compile stack is such a reader (dynamo's graph region tracker, inductor's GEMM templates).
    Set on every machine, so that a CPU run takes the same path: the flag governs cuBLAS only,
    and a CPU's float32 GEMMs (`torch.backends.mkldnn`) are left as they were."""
    torch.backends.cuda.matmul.allow_tf32 = bool(tf32)
    return bool(tf32) and torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 0)


def table_peak(device_name: str, precision: str, tf32: bool = False) -> float:
    """The table's peak for a device (by a substring of its name) and precision, TF32's for fp32
    under `tf32`; 0.0 when the table has none."""
    key = "tf32" if precision == "fp32" and tf32 else precision
    for name, peaks in PEAK_FLOPS.items():
        if name in device_name:
            return peaks.get(key, 0.0)
    return 0.0


def measure_gemm_flops(
    dtype: torch.dtype = torch.float32, size: int = 1024, seconds: float = 0.5, device: str = "cpu"
) -> float:
    """Achieved FLOP/s of repeated (size x size) @ (size x size) products on this rank's threads."""
    # Its own generator: the global one drives dropout and must be the same after a resume.
    generator = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(size, size, generator=generator, device=device).to(dtype)
    b = torch.randn(size, size, generator=generator, device=device).to(dtype)
    torch.mm(a, b)  # warm-up: thread pool, kernels
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds or count < 3:
        torch.mm(a, b)
        count += 1
    if device != "cpu":
        torch.cuda.synchronize()
    return 2 * size**3 * count / (time.perf_counter() - start)


def peak_flops(precision: str, tf32: bool = False) -> tuple[float, str]:
    """(peak FLOP/s of one rank's device, where the figure comes from). `tf32`: TF32 is in use
    (`set_fp32_matmul`), so an fp32 run's peak is the TF32 one (measured: the GEMM runs as set)."""
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        label = f"{precision} (TF32)" if precision == "fp32" and tf32 else precision
        peak = table_peak(name, precision, tf32)
        if peak:
            return peak, f"table: {name} {label}"
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision, torch.float32)
        return measure_gemm_flops(dtype, 4096, device="cuda"), f"measured: {name} {label} GEMM"
    return cpu_gemm_peak(torch.bfloat16 if precision == "bf16" else torch.float32)


def cpu_gemm_peak_file() -> Path:
    return Path(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"),
        "pretrain-pipeline",
        "cpu_gemm_peak.json",
    )


def cpu_gemm_peak(dtype: torch.dtype, path: Path | None = None) -> tuple[float, str]:
    """(this CPU's GEMM FLOP/s in `dtype` on this rank's threads, where the figure comes from),
    measured (`measure_gemm_flops`, 0.5 s) the first time for this CPU type, torch version, dtype
    and thread count, and read from `path` (default `cpu_gemm_peak_file()`) afterwards: every
    run's MFU on one machine is then against the same peak, and a job's start does not spend the
    half second again. Delete the file to measure anew. An unwritable cache only means measuring
    each time."""
    path = path or cpu_gemm_peak_file()
    threads = torch.get_num_threads()
    label = f"CPU {dtype} GEMM, {threads} threads"
    key = f"{cpu_key(read_cpuinfo())} torch-{torch.__version__} {dtype} {threads}-threads"
    try:
        table = json.loads(path.read_text())
    except (OSError, ValueError):
        table = {}
    entry = table.get(key) if isinstance(table, dict) else None
    if (
        isinstance(entry, dict)
        and isinstance(entry.get("flops"), (int, float))
        and entry["flops"] > 0
    ):
        return float(entry["flops"]), f"measured: {label}, {entry.get('date', '?')}, kept in {path}"
    flops = measure_gemm_flops(dtype)
    table = table if isinstance(table, dict) else {}
    table[key] = {"flops": flops, "date": datetime.date.today().isoformat()}
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
        os.replace(partial, path)  # whole or not at all, also when two jobs start together
    except OSError:
        if partial.parent.is_dir():
            partial.unlink(missing_ok=True)
    return flops, f"measured: {label}"


def memory_mb() -> dict:
    if torch.cuda.is_available():
        return {"memory/gpu_max_allocated_mb": torch.cuda.max_memory_allocated() / 2**20}
    return {"memory/max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
