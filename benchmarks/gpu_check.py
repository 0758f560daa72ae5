"""The Python stages of benchmarks/gpu_check.sh (docs/gpu.md): `python benchmarks/gpu_check.py STAGE [ARGS]`.

Each stage prints what it found and returns the exit status the script records: torch (the
node's own torch, recent enough), install (offline, from the wheelhouse, of what the environment
lacks), cuda (a kernel runs on the GPU, or one line why not: status 3), probes (what a GPU run
depends on and a CPU run cannot show), data (the bundle's dataset), compare (the training run's
throughput against the benchmark's row). The script passes its folders in GPU_CHECK_ROOT, _OUT
and _WORK."""

import importlib
import json
import os
import re
import statistics
import subprocess
import sys
import time
import warnings
from importlib import metadata
from pathlib import Path

ROOT, OUT, WORK = (
    Path(os.environ[k]) for k in ("GPU_CHECK_ROOT", "GPU_CHECK_OUT", "GPU_CHECK_WORK")
)


def version_tuple(text):
    return tuple(int(x) for x in re.findall(r"\d+", text.split("+")[0])[:3])


def canonical(name):
    return re.sub(r"[-_.]+", "-", name).lower()


def stage_torch():
    """The node's torch, as it is: present and recent enough for this project."""
    print(f"python {sys.version.split()[0]} at {sys.executable} (prefix {sys.prefix})")
    found = re.search(r'"torch\s*>=\s*([0-9.]+)', (ROOT / "pyproject.toml").read_text())
    minimum = found.group(1) if found else "0"
    try:
        import torch
    except ImportError as err:
        print(
            f"torch: STOP: this Python has no usable torch ({err}); the check uses the node's own torch "
            f"(>= {minimum}) and never installs one"
        )
        return 2
    cuda = f"built for CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
    print(f"torch {torch.__version__} ({cuda}) at {Path(torch.__file__).parent}")
    if version_tuple(torch.__version__) < version_tuple(minimum):
        print(
            f"torch: STOP: torch {torch.__version__} is older than this project's minimum, torch>={minimum} "
            f"(pyproject.toml); the check does not replace the node's torch"
        )
        return 2
    print(
        f"torch: OK, {torch.__version__} >= {minimum} (pyproject.toml's minimum); used as the node has it"
    )
    return 0


def stage_install(bundle):
    """pip install, offline, from the wheelhouse, of what this environment lacks."""
    wheels = Path(bundle) / "wheels"
    requirements = wheels / "requirements.txt"
    if not requirements.is_file():
        print(f"install: {requirements} is missing: not a wheelhouse made by `make gpu-wheelhouse`")
        return 2
    info = wheels / "bundle.txt"
    built = (
        dict(line.split("=", 1) for line in info.read_text().splitlines() if "=" in line)
        if info.is_file()
        else {}
    )
    here = f"{sys.version_info[0]}.{sys.version_info[1]}"
    print(
        f"wheelhouse {wheels}: {len(list(wheels.glob('*.whl')))} wheels, built for Python {built.get('python', '?')}"
        f" (this is {here}), skipped: {built.get('skipped', '?')}"
    )
    if built.get("python", here) != here:
        print(
            f"WARNING: the wheelhouse's compiled wheels are for Python {built['python']}, not {here}: "
            f"pip can take only what this environment lacks among its pure-Python wheels"
        )

    def installed():
        return {
            canonical(d.metadata["Name"]): d.version
            for d in metadata.distributions()
            if d.metadata["Name"]
        }

    before = installed()
    # The CUDA stack stays as the node has it: a constraint pins each of its packages, so a
    # requirement that would need another torch fails here instead of replacing it.
    pinned = {
        n: v
        for n, v in before.items()
        if n in ("torch", "triton") or n.startswith(("nvidia-", "cuda-"))
    }
    constraints = WORK / "constraints.txt"
    constraints.write_text("".join(f"{n}=={v}\n" for n, v in sorted(pinned.items())))
    command = [
        sys.executable,
        "-m",
        "pip",
        "--isolated",
        "install",
        "-q",
        "--no-index",
        "--find-links",
        str(wheels),
        "--only-binary=:all:",
        "--no-input",
        "--disable-pip-version-check",
        "--progress-bar",
        "off",
        "-c",
        str(constraints),
        "-r",
        str(requirements),
    ]
    print("$ PIP_CONFIG_FILE=/dev/null " + " ".join(command), flush=True)
    # No configuration file either (a pip.conf's index or find-links): the wheelhouse is the only
    # source.
    # Nor PYTHONPATH: pip would count the checkout's own metadata (an egg-info) as an installed
    # package.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    rc = subprocess.run(command, env={**env, "PIP_CONFIG_FILE": os.devnull}).returncode
    after = installed()
    added = sorted(f"{n} {v}" for n, v in after.items() if n not in before)
    changed = sorted(
        f"{n} {before[n]} -> {v}" for n, v in after.items() if n in before and before[n] != v
    )
    print(
        f"pip exit status {rc}; installed from the wheelhouse: {', '.join(added) or 'nothing'}"
        + (f"; replaced: {', '.join(changed)}" if changed else "")
    )
    touched = [n for n in pinned if after.get(n) != pinned[n]]
    if touched:
        print(f"install: ERROR: pip changed the CUDA stack: {', '.join(touched)}")
        rc = rc or 1
    (OUT / "pip_freeze.txt").write_text("".join(f"{n}=={v}\n" for n, v in sorted(after.items())))
    failed = []
    for module in (
        "deepspeed",
        "webdataset",
        "omegaconf",
        "polib",
        "sentencepiece",
        "tokenizers",  # the data's byte-level BPE
        "transformers",  # ours against Hugging Face (hf-bench)
        "pytest",
        "launch.train",
    ):
        started = time.time()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                imported = importlib.import_module(module)
            version = getattr(imported, "__version__", "")
            print(f"import {module}: OK {version} ({time.time() - started:.1f} s)")
        # any: a missing package, a binary that does not load, a version clash
        except Exception as err:
            failed.append(module)
            print(
                f"import {module}: FAILED: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
            )
    for optional, why in (
        ("wandb", "launch.train runs with wandb.mode=disabled"),
        ("ray", "only pipeline.prepare needs it, and the bundle's data is prepared"),
        ("zstandard", "only pipeline.prepare reads .zst sources"),
    ):
        try:
            print(f"{optional}: {metadata.version(optional)} installed (optional)")
        except metadata.PackageNotFoundError:
            print(f"{optional}: not installed (optional: {why})")
    if failed:
        print(f"install: FAILED: cannot import {', '.join(failed)}")
        return rc or 1
    return rc


def stage_cuda():
    """torch can run a kernel on the GPU, or one line that says why not (exit 3)."""
    import torch

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        available = torch.cuda.is_available()
    if available:
        try:
            x = torch.ones(1024, device="cuda")
            value = float((x * 2).sum())
            torch.cuda.synchronize()
            assert value == 2048.0, value
        except Exception as err:
            return stop(
                f"torch sees {torch.cuda.get_device_name()} but cannot run a kernel on it: "
                f"{type(err).__name__}: {str(err).splitlines()[0]}"
            )
        props = torch.cuda.get_device_properties(0)
        print(
            f"CUDA probe: OK: {torch.cuda.device_count()} GPU(s), {props.name}, compute capability "
            f"{props.major}.{props.minor}, {props.total_memory / 2**30:.0f} GiB; torch {torch.__version__} for CUDA "
            f"{torch.version.cuda}, driver CUDA {driver_cuda() or '?'}; bf16: {torch.cuda.is_bf16_supported()}"
        )
        return 0
    return stop(f"torch cannot use CUDA: {why_no_cuda(torch, caught)}")


def stop(why):
    """The CUDA probe's one line, also left in WORK for the verdict."""
    print(f"CUDA probe: STOP: {why}")
    (WORK / "cuda_stop.txt").write_text(why + "\n")
    return 3


def driver_cuda():
    """The CUDA version the installed driver supports ('12.8'), or '' without a driver."""
    import ctypes

    try:
        version = ctypes.c_int(0)
        if ctypes.CDLL("libcuda.so.1").cuDriverGetVersion(ctypes.byref(version)) == 0:
            return f"{version.value // 1000}.{version.value % 1000 // 10}"
    except (OSError, AttributeError):
        pass
    return ""


def why_no_cuda(torch, caught):
    if not torch.version.cuda:
        hip = (
            f" (a ROCm build, HIP {torch.version.hip})"
            if getattr(torch.version, "hip", None)
            else ""
        )
        return (
            f"torch {torch.__version__} is a CPU-only build{hip}: torch.version.cuda is None; "
            f"this node needs a CUDA build of torch"
        )
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return f"CUDA_VISIBLE_DEVICES={visible!r} hides every GPU"
    told = "; ".join(
        str(w.message).strip().splitlines()[0] for w in caught if str(w.message).strip()
    )
    driver = driver_cuda()
    if not driver:
        return (
            f"no NVIDIA driver: libcuda.so.1 cannot be loaded (torch {torch.__version__} is built for CUDA "
            f"{torch.version.cuda}; no GPU, or the container was started without one)"
            + (f"; torch says: {told}" if told else "")
        )
    if version_tuple(driver)[:1] < version_tuple(torch.version.cuda)[:1]:
        return (
            f"the driver is too old for this torch: it supports CUDA {driver}, torch {torch.__version__} is "
            f"built for CUDA {torch.version.cuda}" + (f"; torch says: {told}" if told else "")
        )
    try:
        count = torch.cuda.device_count()
    except Exception as err:
        count, told = 0, told or str(err).splitlines()[0]
    if count == 0 and not told:
        return f"the driver (CUDA {driver}) sees no GPU (nvidia-smi -L)"
    return f"driver CUDA {driver}, torch for CUDA {torch.version.cuda}, {count} GPU(s) counted: {told or 'no reason given'}"


def stage_probes():
    """What the GPU run depends on and a CPU run cannot show; each probe runs whatever the others did."""
    import shutil
    import sysconfig

    import torch

    problems = []

    def probe(what, fn):
        started = time.time()
        try:
            fn()
        except Exception as err:
            text = str(err).strip()
            error = f"{type(err).__name__}: {text.splitlines()[0][:300] if text else ''}"
            problems.append(f"{what}: {error}")
            print(f"{what}: FAILED after {time.time() - started:.0f} s: {error}")

    def deepspeed_accelerator():
        started = time.time()
        from launch.deepspeed.engine import deepspeed_accelerator

        version, name = deepspeed_accelerator()
        print(
            f"deepspeed {version}: accelerator {name!r} ({time.time() - started:.0f} s to import)"
        )
        if name != "cuda":
            problems.append(f"deepspeed's accelerator is {name!r}, not 'cuda'")

    def toolchain():
        try:
            import triton

            triton_version = triton.__version__
        except Exception as err:
            triton_version = f"not importable ({type(err).__name__})"
        header = Path(sysconfig.get_paths()["include"]) / "Python.h"
        compiler = shutil.which(os.environ.get("CC", "gcc")) or shutil.which("cc")
        print(
            f"triton {triton_version}; C compiler {compiler or 'NONE'}; Python.h {'present' if header.exists() else 'MISSING'} "
            f"({header}): Triton, so torch.compile and FlexAttention, builds its launcher with both"
        )
        print(
            f"nvcc {shutil.which('nvcc') or 'none'}, CUDA_HOME {os.environ.get('CUDA_HOME', 'unset')}: only DeepSpeed's "
            f"JIT CUDA ops would need them, and the check's runs use none"
        )
        if not compiler or not header.exists():
            problems.append("Triton cannot build its launcher (no C compiler or no Python.h)")

    def gemm_mode():
        from model import loss

        mode = loss._out_dtype_gemms(torch.device("cuda"))
        print(
            f"fused loss GEMM mode on CUDA: {mode!r} ('addmm' or 'mm': 16-bit GEMMs into float32; '': the "
            f"float32 fallback, slow)"
        )
        if not mode:
            problems.append(
                "the fused loss has no 16-bit GEMM with float32 output here (its float32 fallback runs)"
            )

    def tf32_getters():
        from launch.metrics import set_fp32_matmul

        print(
            f"launch.metrics.set_fp32_matmul(True) -> {set_fp32_matmul(True)} (whether TF32 is in use); then each getter:"
        )
        getters = {
            "torch.backends.cuda.matmul.allow_tf32": lambda: torch.backends.cuda.matmul.allow_tf32,
            "torch.backends.cuda.matmul.fp32_precision": lambda: (
                torch.backends.cuda.matmul.fp32_precision
            ),
            "torch.get_float32_matmul_precision()": torch.get_float32_matmul_precision,
            "torch._C._get_cublas_allow_tf32()": lambda: torch._C._get_cublas_allow_tf32(),
            "torch.backends.cudnn.allow_tf32": lambda: torch.backends.cudnn.allow_tf32,
        }
        for name, get in getters.items():
            try:
                print(f"  {name} = {get()!r}")
            except AttributeError as err:
                print(f"  {name}: not in this torch ({err})")
            except Exception as err:  # "mix of the legacy and new APIs"
                print(f"  {name}: RAISES {type(err).__name__}: {str(err).splitlines()[0][:200]}")
                problems.append(f"{name} raises after set_fp32_matmul(True)")

    def compile_on_cuda():
        started = time.time()
        compiled = torch.compile(lambda x: torch.nn.functional.gelu(x @ x).sum(dim=-1))
        x = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)
        got, want = compiled(x).float(), torch.nn.functional.gelu(x @ x).sum(dim=-1).float()
        torch.cuda.synchronize()
        error = float((got - want).abs().max() / want.abs().max())
        print(
            f"torch.compile on CUDA after set_fp32_matmul(True): OK in {time.time() - started:.0f} s (max "
            f"difference to eager {error:.1e} of the largest value)"
        )

    probe("deepspeed", deepspeed_accelerator)
    probe("toolchain", toolchain)
    probe("fused loss GEMM mode", gemm_mode)
    probe("TF32 getters", tf32_getters)
    probe(
        "torch.compile on CUDA (what compile=true and the document mask's FlexAttention need)",
        compile_on_cuda,
    )
    for problem in problems:
        print(f"probes: PROBLEM: {problem}")
    return 1 if problems else 0


def stage_data(bundle):
    """Prints the prepared dataset's vocabulary (bench_gpu.py measures the same one), or 0."""
    manifest = Path(bundle) / "data" / "manifest.json"
    try:
        m = json.loads(manifest.read_text())
        seq_len, tasks = m["config"]["seq_len"], m["config"]["tasks"]
        vocab = m["tokenizer"]["vocab_size"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        print(
            f"data: {manifest}: not a dataset of pipeline.prepare ({type(err).__name__}: {err})",
            file=sys.stderr,
        )
        print(0)
        return 1
    print(
        f"data: {manifest.parent}: seq_len {seq_len}, vocabulary {vocab}, tasks {tasks}",
        file=sys.stderr,
    )
    if seq_len != 1024 or "causal_lm" not in tasks:
        print("data: configs/gpt2_small.yaml needs seq_len 1024 and causal_lm", file=sys.stderr)
        print(0)
        return 1
    print(vocab)
    return 0


def busy_clocks(csv_path: Path) -> tuple[float, float, float, float] | None:
    """(median, min, max SM clock in MHz, median power in W) of the nvidia-smi samples taken while
    the GPU was at least half busy: a sustained run draws more power and is clocked lower than a
    short burst, which a long training run and a seconds-long benchmark see differently."""
    try:
        lines = csv_path.read_text().splitlines()[1:]
    except OSError:
        return None
    clocks, power = [], []
    for line in lines:
        fields = [f.strip() for f in line.split(",")]
        try:
            if len(fields) >= 6 and float(fields[1].rstrip(" %")) >= 50:
                clocks.append(float(fields[5].split()[0]))
                power.append(float(fields[3].split()[0]))
        except ValueError:
            continue
    if not clocks:
        return None
    return statistics.median(clocks), min(clocks), max(clocks), statistics.median(power)


def steady_state(metrics_path):
    """(windows logged with throughput, the steady ones' medians of tokens/s and both MFUs): the
    first windows, which hold compilation and the warm-up, are left out."""
    rows = []
    for line in Path(metrics_path).read_text().splitlines() if Path(metrics_path).is_file() else []:
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    perf = [r for r in rows if "perf/tokens_per_s" in r]
    steady = perf[2:] if len(perf) >= 5 else perf[1:] or perf
    med = {
        k: statistics.median(r.get(k, float("nan")) for r in steady) if steady else float("nan")
        for k in ("perf/tokens_per_s", "perf/mfu", "perf/mfu_llmc")
    }
    return perf, steady, med


def stage_train_1b(metrics_path, dry_run_json):
    """The Llama-shaped 1 B run: its steady-state throughput and MFU, and its peak GPU memory
    against what its dry run expected (model states by DeepSpeed's estimator plus our count of
    the activations)."""
    perf, steady, med = steady_state(metrics_path)
    if not perf:
        print(f"train-1b: no throughput logged in {metrics_path}")
        return 1
    last = perf[-1]
    peak = last.get("memory/gpu_max_allocated_mb", float("nan")) * 2**20
    print(
        f"train-1b: {len(perf)} windows to step {last['step']}, loss {perf[0].get('train/loss', float('nan')):.3f}"
        f" -> {last.get('train/loss', float('nan')):.3f}; steady state (median of {len(steady)} windows): "
        f"{med['perf/tokens_per_s']:,.0f} tokens/s, MFU {100 * med['perf/mfu']:.1f}% (ours), "
        f"{100 * med['perf/mfu_llmc']:.1f}% (llm.c)"
    )
    try:
        dry = json.loads(Path(dry_run_json).read_text())
        figures = dry.get("figures", dry)
        expected = figures["memory_bytes_per_gpu"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        print(f"train-1b: no dry-run estimate in {dry_run_json} ({type(err).__name__}: {err})")
        return 1
    print(
        f"train-1b: GPU peak {peak / 2**30:.2f} GiB (torch.cuda.max_memory_allocated) against the dry run's "
        f"{expected / 2**30:.2f} GiB (model states {figures.get('model_state_bytes_per_gpu', float('nan')) / 2**30:.2f}"
        f" + activations {figures.get('activation_bytes_per_gpu', float('nan')) / 2**30:.2f}): "
        f"measured / estimated {peak / expected:.2f}"
    )
    return 0


def stage_compare(metrics_path, bench_path, vocab, zero_stage):
    """The run's steady-state throughput against bench_gpu.py's row of the same vocabulary and stage."""
    perf, steady, med = steady_state(metrics_path)
    if not perf:
        print(f"train: no throughput logged in {metrics_path}")
        return 1
    last = perf[-1]
    print(
        f"train: {len(perf)} windows of {perf[1]['step'] - perf[0]['step'] if len(perf) > 1 else '?'} steps to step "
        f"{last['step']}, loss {perf[0].get('train/loss', float('nan')):.3f} -> {last.get('train/loss', float('nan')):.3f}, "
        f"GPU peak {last.get('memory/gpu_max_allocated_mb', float('nan')):,.0f} MB"
    )
    print(
        f"train: steady state (median of {len(steady)} windows): {med['perf/tokens_per_s']:,.0f} tokens/s, MFU "
        f"{100 * med['perf/mfu']:.1f}% (ours), {100 * med['perf/mfu_llmc']:.1f}% (llm.c)"
    )
    try:
        bench = json.loads(Path(bench_path).read_text())
    except (OSError, ValueError):
        print(f"train-vs-bench: no {bench_path} to compare with")
        return 1
    match = [
        r
        for r in bench
        if r.get("vocab_size") == int(vocab) and r.get("zero_stage") == int(zero_stage)
    ]
    if not match:
        print(
            f"train-vs-bench: bench_gpu.json has no row for vocabulary {vocab} and ZeRO-{zero_stage}"
        )
        return 1
    b = match[0]
    clocks = busy_clocks(OUT / "nvidia_smi.csv")
    if clocks:
        print(
            f"clocks: while the GPU was busy (nvidia_smi.csv samples at >= 50% utilisation, nearly all of them "
            f"the train stage's): SM clock median {clocks[0]:.0f} MHz (min {clocks[1]:.0f}, max {clocks[2]:.0f}), "
            f"power median {clocks[3]:.0f} W; the bench's timed steps last about a second, at the clock of a GPU "
            f"that has just started working"
        )
    ratio = med["perf/tokens_per_s"] / b["tokens_per_s"]
    within = abs(ratio - 1) <= 0.10
    print(
        f"train-vs-bench: V={int(vocab):,} ZeRO-{zero_stage}: train {med['perf/tokens_per_s']:,.0f} tokens/s "
        f"(MFU {100 * med['perf/mfu']:.1f}% / {100 * med['perf/mfu_llmc']:.1f}%), bench {b['tokens_per_s']:,.0f} "
        f"tokens/s (MFU {100 * b['mfu']:.1f}% / {100 * b['mfu_llmc']:.1f}%): ratio {ratio:.3f}, "
        f"{'within' if within else 'NOT within'} 10%"
    )
    return 0 if within else 1


if __name__ == "__main__":
    stage, *args = sys.argv[1:]
    sys.exit(globals()[f"stage_{stage.replace('-', '_')}"](*args))
