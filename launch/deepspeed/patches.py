"""DeepSpeed's start-up, patched: what this project changes inside DeepSpeed, in one place, behind
one entry (`patch_deepspeed`) that checks each patch still finds what it changes.

Each patch saves start-up time or keeps a build correct and changes no result: the JIT-built ops
cached per CPU type, the shared-memory all-reduce op left unbuilt, Muon's compile wrappers made at
first call, CPU Adam built without `-g`, py-cpuinfo asked once. Written against DeepSpeed 0.16 to
0.19 (`PATCHED_FOR`); on a DeepSpeed whose internals moved, a patch that no longer applies is
skipped with a one-line warning and the run goes on as DeepSpeed does unpatched."""

from __future__ import annotations

import functools
import os
import sys

import torch

from common.machine import cpu_key, read_cpuinfo

PATCHED_FOR = "deepspeed >= 0.16, <= 0.19"
_warned: set[str] = set()


def patch_deepspeed(cpu_adam: bool = False) -> None:
    """Every start-up patch, before DeepSpeed initialises (and, with `cpu_adam`, before its CPU
    Adam op is built or loaded). Idempotent."""
    use_cpu_keyed_jit_cache()  # not a patch of DeepSpeed's code: an environment variable
    patches = [leave_shm_comm_op_unbuilt, load_muon_compiling_on_first_call]
    if cpu_adam:
        patches += [ask_cpuinfo_once, build_cpu_adam_without_debug_info]
    for patch in patches:
        try:
            patch()
        except (ImportError, AttributeError) as err:
            if patch.__name__ not in _warned:
                _warned.add(patch.__name__)
                import deepspeed

                print(
                    f"warning: DeepSpeed {deepspeed.__version__}: start-up patch "
                    f"{patch.__name__} does not apply ({type(err).__name__}: {err}; written for "
                    f"{PATCHED_FOR}); running without it",
                    file=sys.stderr,
                )


MUON_MODULE = "deepspeed.runtime.zero.muon.original_muon"
SHM_COMM_OP = "deepspeed_shm_comm"


def leave_shm_comm_op_unbuilt() -> None:
    """Tell DeepSpeed its shared-memory all-reduce op is unavailable, before it initialises its
    communication. On a CPU accelerator DeepSpeed builds and loads that C++ op at every
    `init_distributed`, for `inference_all_reduce` (tensor-parallel inference) alone; training's
    collectives go through torch.distributed either way. Its JIT build costs the first job of
    every fresh install (and of each new venv path) tens of seconds of a core, for a code path
    this project never takes. DeepSpeed then keeps `shm_comm_op` None and its inference all-reduce
    falls back to torch.distributed's."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__[SHM_COMM_OP] = False


def load_muon_compiling_on_first_call() -> None:
    """Import DeepSpeed's Muon module with its `torch.compile` wrappers made at each function's
    first call rather than at import. DeepSpeed imports the module in every ZeRO engine (its
    optimizer check, and ZeRO-1/2's gradient reduce, to test `isinstance(optimizer, Muon)`), and
    those wrappers import inductor's compiler, a share of every rank's start
    (docs/design.md#a-ranks-start), for an optimizer this project never passes. A Muon user sees no
    difference: torch.compile compiles at the first call anyway. No-op where the module is loaded
    already."""
    if MUON_MODULE in sys.modules:
        return
    import importlib

    from deepspeed.runtime import compiler

    def compile_on_first_call():
        def wrap(fn):
            compiled = None

            @functools.wraps(fn)
            def call(*args, **kwargs):
                nonlocal compiled
                if compiled is None:
                    compiled = torch.compile(fn)
                return compiled(*args, **kwargs)

            return call

        return wrap

    deepspeeds, compiler.compile = compiler.compile, compile_on_first_call
    try:
        importlib.import_module(MUON_MODULE)
    finally:
        compiler.compile = deepspeeds


def build_cpu_adam_without_debug_info() -> None:
    """Have DeepSpeed compile its CPU Adam op without `-g`. Its flags ask for debug information
    beside -O3; gcc's code is the same either way, but the objects (which include torch's
    headers) are many times larger and slower to compile, and the first offloading job of a
    fresh install waits for that build (docs/design.md#jit-built-ops-per-cpu-type). Idempotent."""
    from deepspeed.ops.adam import cpu_adam as deepspeed_cpu_adam

    builder = deepspeed_cpu_adam.CPUAdamBuilder
    if hasattr(builder.cxx_args, "deepspeeds"):
        return
    deepspeeds = builder.cxx_args

    def cxx_args(self):
        return [arg for arg in deepspeeds(self) if arg != "-g"]

    cxx_args.deepspeeds = deepspeeds
    builder.cxx_args = cxx_args


def ask_cpuinfo_once() -> None:
    """Keep py-cpuinfo's answer for the rest of the process. Its `get_cpu_info` starts a Python
    subprocess at every call, and DeepSpeed asks it four times to build and construct CPU Adam
    (the AMD check, `-march`, the SIMD width, again for the load), each a Python start of an
    offloading rank's. The CPU does not change while a process runs. Idempotent."""
    import cpuinfo

    if not hasattr(cpuinfo.get_cpu_info, "cache_info"):
        cpuinfo.get_cpu_info = functools.cache(cpuinfo.get_cpu_info)


def use_cpu_keyed_jit_cache(environ: dict | None = None, cpuinfo: str | None = None) -> str:
    """Point TORCH_EXTENSIONS_DIR, where DeepSpeed's JIT-built ops (CPU Adam) are cached, at a
    folder of this CPU type: they are compiled with `-march=native`, and a home directory shared
    by a cluster's node types would otherwise hand an op built on one to another, which dies of
    an illegal instruction. The folder is `{py}_{accelerator}_{cpu_key}` under the user's
    TORCH_EXTENSIONS_DIR or torch's default root (whose own `{py}_{accelerator}` folder a set
    TORCH_EXTENSIONS_DIR replaces). Idempotent; returns the folder. Why not a portable build:
    docs/design.md#jit-built-ops-per-cpu-type."""
    from torch.utils.cpp_extension import get_default_build_root

    environ = os.environ if environ is None else environ
    if cpuinfo is None:
        cpuinfo = read_cpuinfo()
    accelerator = f"cu{torch.version.cuda.replace('.', '')}" if torch.version.cuda else "cpu"
    leaf = f"py{sys.version_info.major}{sys.version_info.minor}_{accelerator}_{cpu_key(cpuinfo)}"
    current = environ.get("TORCH_EXTENSIONS_DIR", "")
    if os.path.basename(os.path.normpath(current)) != leaf:
        environ["TORCH_EXTENSIONS_DIR"] = os.path.join(current or get_default_build_root(), leaf)
    return environ["TORCH_EXTENSIONS_DIR"]
