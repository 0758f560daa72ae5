"""The order in which `make test` deals test files to its workers (conftest applies it)."""

from pathlib import Path

from repo import ROOT

# The costliest test files, run first: `make test` deals whole files to the xdist workers in
# collection order (--no-loadscope-reorder; xdist's own order puts the files with the most tests
# first, which left the SLURM, main-job and training files, few tests each, for the end, where one
# worker ran them alone). Longest first keeps the last files short, so the workers end together.
# A file not listed runs after these in its usual order; the list only orders, it selects nothing.
# Seconds of one worker (setup + call + teardown) in `make test` less the SLURM file at aef99cf
# on the 2-core EPYC, while another suite and benchmarks shared the cores (load ~6): about 3x
# what CI's own run takes; the order is what counts. A shared fixture's build (tiny_dataset,
# hf_layout_data) is counted in the file that asked first.
COSTLIEST_FIRST = [
    "slurm/test_slurm.py",  # 223 at bbd1fb5, mostly waiting on SLURM: the others have the cores
    "launch/test_main.py",  # 776
    "pipeline/test_prepare.py",  # 654
    "launch/test_elastic.py",  # 652
    "launch/test_reliability.py",  # 469
    "launch/test_train.py",  # 365
    "launch/test_gpu_path.py",  # 315
    "launch/test_bad_inputs.py",  # 305
    "launch/test_compile.py",  # 279
    # 84 alone at load ~7 (not measured in `make test`): four tiny runs and a resume
    "launch/test_stop_signals.py",
    "pipeline/test_progress.py",  # 259
    "test_cli.py",  # 238
    "launch/test_checkpoint_save.py",  # 226
    "launch/test_translation.py",  # 213
    "pipeline/test_remote.py",  # 211
    "launch/test_hf_layouts.py",  # 199
    "launch/test_hf_init.py",  # 195
    "benchmarks/test_gpu.py",  # 187 (its CPU tests)
    "launch/test_offload.py",  # 186
    "launch/test_llama_train.py",  # 136
    # 49 alone at load ~1 with four families (not measured in `make test`): now seven 20-step
    # runs, fourteen exports
    "launch/test_decoder_families.py",
    # not measured: two 8-step runs on 2 ranks
    "launch/test_moe_train.py",
    # 33 alone at load ~1 (not measured in `make test`): a prepare and a tiny run without
    # transformers
    "launch/test_optional_packages.py",
    "launch/test_preflight.py",  # 123
    "test_out_of_space.py",  # about 90, alone, on a loaded machine (not in the aef99cf measurement)
    "pipeline/test_tokenizer_kinds.py",  # 99
    # 56 alone at load ~2 (not measured in `make test`): three prepares and two stopped ones
    "pipeline/test_curation.py",
    "test_web_example.py",  # 89
]


def in_cost_order(items) -> list:
    """`items` with the files of COSTLIEST_FIRST first, in its order; tests keep their order in a file."""
    rank = {name: i for i, name in enumerate(COSTLIEST_FIRST)}

    def key(item):
        path = Path(str(item.path)).resolve()
        try:
            name = path.relative_to(ROOT / "tests").as_posix()
        except ValueError:
            return len(rank)
        return rank.get(name, len(rank))

    return sorted(items, key=key)  # stable
