"""Throughput, model FLOPs utilisation and memory for the training log.

MFU = FLOPs per token (`model.flops`) x tokens/s / peak FLOP/s (Chowdhery et al. 2022,
PaLM appendix B). The peak comes from a table of dense tensor-core (or FP32) figures of known
accelerators, from the vendors' data sheets; on a CPU, or an unknown device, it is measured
with a square GEMM at the start of the run. The log says which.
"""

from __future__ import annotations

import resource
import time

import torch

# Dense peak FLOP/s per device (no sparsity), by a substring of torch.cuda.get_device_name().
PEAK_FLOPS = {
    "H200": {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12},
    "H100 PCIe": {"bf16": 756e12, "fp16": 756e12, "fp32": 51e12},
    "H100": {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12},
    "A100": {"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12},
    "A10G": {"bf16": 70e12, "fp16": 70e12, "fp32": 31.2e12},
    "L40S": {"bf16": 362e12, "fp16": 362e12, "fp32": 91.6e12},
    "L4": {"bf16": 121e12, "fp16": 121e12, "fp32": 30.3e12},
    "V100": {"bf16": 0.0, "fp16": 125e12, "fp32": 15.7e12},
    "RTX 4090": {"bf16": 165e12, "fp16": 165e12, "fp32": 82.6e12},
}


def measure_gemm_flops(dtype: torch.dtype = torch.float32, size: int = 1024, seconds: float = 0.5, device: str = "cpu") -> float:
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


def peak_flops(precision: str) -> tuple[float, str]:
    """(peak FLOP/s of one rank's device, where the figure comes from)."""
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        for key, peaks in PEAK_FLOPS.items():
            if key in name and peaks.get(precision):
                return peaks[precision], f"table: {name} {precision}"
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision, torch.float32)
        return measure_gemm_flops(dtype, 4096, device="cuda"), f"measured: {name} {precision} GEMM"
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    return measure_gemm_flops(dtype), f"measured: CPU {dtype} GEMM, {torch.get_num_threads()} threads"


def memory_mb() -> dict:
    if torch.cuda.is_available():
        return {"memory/gpu_max_allocated_mb": torch.cuda.max_memory_allocated() / 2**20}
    return {"memory/max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
