"""torch.profiler over a stretch of training steps, summed up where an MFU gap can be placed:
device time by kernel family and the longest kernels, against the stretch's wall time (the
difference is time the GPU waited on the host), and the host operators with the most CPU time
of their own. Used by the trainer (`profile_start` / `profile_steps`, which also write a Chrome
trace) and by benchmarks/bench_gpu.py --profile-step."""

from __future__ import annotations

import time
from pathlib import Path

import torch

# Kernel families by name fragment (first match wins).
KERNEL_FAMILIES = (
    ("attention", ("flash", "fmha", "attention", "cudnn", "sdpa")),
    (
        "GEMM",
        (
            "gemm",
            "sm90_xmma",
            "cutlass",
            "nvjet",
            "ampere_",
            "sm80_",
            "cublas",
            "matmul",
            "mm_",
            "::mm",
            "addmm",
            "bmm",
            "linear",
        ),
    ),
    ("optimizer", ("adam", "foreach", "multi_tensor", "_amp_", "clip")),
    ("communication", ("nccl", "allreduce", "all_gather", "reduce_scatter")),
    ("copy", ("memcpy", "memset", "copy_", "cat", "fill")),
    ("reduction", ("reduce", "norm", "softmax", "sum")),
    ("elementwise", ("elementwise", "vectorized", "triton", "unrolled", "pointwise")),
)


def kernel_family(name: str) -> str:
    low = name.lower()
    return next(
        (family for family, parts in KERNEL_FAMILIES if any(part in low for part in parts)), "other"
    )


class Profiled:
    """`with Profiled(cuda) as p: ...` profiles the block (waiting for the device at its end);
    `p.summary(what)` is the table, `p.export(path)` the Chrome trace."""

    def __init__(self, cuda: bool):
        from torch.profiler import ProfilerActivity, profile

        self.cuda = cuda
        self.prof = profile(
            activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        )

    def __enter__(self) -> "Profiled":
        self.prof.__enter__()
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        if self.cuda:
            torch.cuda.synchronize()
        self.wall = time.perf_counter() - self.start
        self.prof.__exit__(*exc)

    def summary(self, what: str, kernels: int = 25, host_ops: int = 0) -> str:
        averages = self.prof.key_averages()
        if self.cuda:  # the kernels: events that ran on the device
            events = [
                e
                for e in averages
                if getattr(getattr(e, "device_type", None), "name", "") == "CUDA"
            ]
            attr = (
                "self_device_time_total"
                if hasattr(averages[0], "self_device_time_total")
                else "self_cuda_time_total"
            )
        else:  # the operators' own CPU time stands in: the path kept alive, not a GPU figure
            events, attr = list(averages), "self_cpu_time_total"
        total = sum(getattr(e, attr, 0) for e in events) or 1
        families: dict[str, float] = {}
        for e in events:
            families[kernel_family(e.key)] = families.get(kernel_family(e.key), 0) + getattr(
                e, attr, 0
            )
        lines = [
            f"profile of {what}: wall {1e3 * self.wall:.1f} ms (profiled), "
            f"{'kernel' if self.cuda else 'CPU self'} time {total / 1e3:.1f} ms"
        ]
        lines += [
            f"  {family:<14} {us / 1e3:9.2f} ms  {100 * us / total:5.1f}%"
            for family, us in sorted(families.items(), key=lambda kv: -kv[1])
        ]
        lines += [
            f"  {getattr(e, attr, 0) / 1e3:9.2f} ms {100 * getattr(e, attr, 0) / total:5.1f}% "
            f"x{e.count:<5} [{kernel_family(e.key)}] {e.key[:110]}"
            for e in sorted(events, key=lambda e: -getattr(e, attr, 0))[:kernels]
        ]
        if host_ops:
            host = [
                e
                for e in averages
                if getattr(getattr(e, "device_type", None), "name", "CPU") == "CPU"
            ]
            lines.append(
                "host operators by CPU time of their own (the host's share of "
                f"the {1e3 * self.wall:.1f} ms):"
            )
            lines += [
                f"  {e.self_cpu_time_total / 1e3:9.2f} ms x{e.count:<6} {e.key[:100]}"
                for e in sorted(host, key=lambda e: -e.self_cpu_time_total)[:host_ops]
            ]
        return "\n".join(lines)

    def export(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.prof.export_chrome_trace(str(path))
