"""The CPU's GEMM peak, the denominator of a CPU run's MFU: measured once per CPU type, torch
version, dtype and thread count, then read back (launch.metrics.cpu_gemm_peak)."""

import json

import pytest
import torch

from launch import metrics


@pytest.fixture
def measurements(monkeypatch):
    """The dtypes and thread counts measured, each through the real measurement."""
    done = []
    real = metrics.measure_gemm_flops

    def measure(dtype, *args, **kwargs):
        done.append((dtype, torch.get_num_threads()))
        return real(dtype, *args, **kwargs)

    monkeypatch.setattr(metrics, "measure_gemm_flops", measure)
    return done


def test_measured_once_then_read_back_per_dtype_and_thread_count(tmp_path, measurements):
    path = tmp_path / "cache" / "cpu_gemm_peak.json"
    first, source = metrics.cpu_gemm_peak(torch.float32, path)
    assert (
        first > 1e8
        and source == f"measured: CPU torch.float32 GEMM, {torch.get_num_threads()} threads"
    )
    again, source = metrics.cpu_gemm_peak(torch.float32, path)
    assert again == first and source.endswith(f", kept in {path}")
    assert len(measurements) == 1
    metrics.cpu_gemm_peak(torch.bfloat16, path)  # another dtype: its own measurement
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        metrics.cpu_gemm_peak(torch.float32, path)  # another thread count: its own
    finally:
        torch.set_num_threads(threads)
    assert measurements == [
        (torch.float32, threads),
        (torch.bfloat16, threads),
        (torch.float32, threads + 1),
    ]
    table = json.loads(path.read_text())
    assert len(table) == 3 and all(row["flops"] > 0 for row in table.values())
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no partial file left


def test_a_damaged_or_unwritable_cache_only_means_measuring(tmp_path, measurements):
    path = tmp_path / "cpu_gemm_peak.json"
    path.write_text("{not json")
    flops, source = metrics.cpu_gemm_peak(torch.float32, path)
    assert flops > 0 and "kept in" not in source and len(measurements) == 1
    assert metrics.cpu_gemm_peak(torch.float32, path)[0] == flops  # rewritten whole
    blocked = tmp_path / "a-file" / "cpu_gemm_peak.json"
    blocked.parent.write_text("not a directory")
    assert metrics.cpu_gemm_peak(torch.float32, blocked)[0] > 0
    assert metrics.cpu_gemm_peak(torch.float32, blocked)[0] > 0
    assert len(measurements) == 3


@pytest.mark.parametrize("bf16, fp32, chosen", [(0.4e9, 42e9, "fp32"), (300e9, 45e9, "bf16")])
def test_auto_precision_is_the_faster_gemm_of_this_cpu(monkeypatch, bf16, fp32, chosen, capsys):
    """`deepspeed.precision: auto` on a CPU: bf16 where its GEMMs are at least as fast as fp32's
    (an AMX Xeon), fp32 where not (an AVX2 EPYC: 0.4 against 42 GFLOP/s); said once on stderr.
    The CPU's figures stand in for the measurement; the real one is tested above."""
    from launch import run_config
    from launch.config import TrainConfig

    peaks = {torch.bfloat16: bf16, torch.float32: fp32}
    monkeypatch.setattr(metrics, "cpu_gemm_peak", lambda dtype: (peaks[dtype], "test"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = TrainConfig()
    cfg.deepspeed.precision = "auto"
    assert run_config.with_precision_chosen(cfg).deepspeed.precision == chosen
    assert f"deepspeed.precision: auto -> {chosen} (this CPU's GEMMs" in capsys.readouterr().err
    cfg.deepspeed.precision = "bf16"  # a value given is kept, whatever the machine
    assert run_config.with_precision_chosen(cfg).deepspeed.precision == "bf16"
