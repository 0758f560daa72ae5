"""The dry run (`launch.preflight`, `launch.train ... --dry-run`): a good config passes with its
figures; each kind of bad config is reported with its key, several at once; the batch scripts
run it before any rank. Datasets are tiny shard sets made in the test (`shardtools`)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from dryrun import SEQ_LEN, args, dry_run, make_data
from repo import ROOT
from shardtools import VOCAB_SIZE, save_manifest

from common.configure import load_config
from launch.config import MainConfig, TrainConfig
from launch.deepspeed.estimate import estimate_model_state_memory
from launch.model_dir import save_model_dir
from model import build_model
from pipeline.tokenizer import SENTENCEPIECE_FILE


@pytest.fixture(autouse=True)
def no_launcher(monkeypatch):
    """A world of one unless a test says otherwise, whatever launched pytest."""
    for name in (
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "SLURM_PROCID",
        "SLURM_NTASKS",
    ):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def data(tmp_path) -> Path:
    return make_data(tmp_path / "data")


def export(directory: Path, stack_config, tokenizer: Path) -> Path:
    """An exported model directory (launch.export's layout) of the given config."""
    torch.manual_seed(0)
    save_model_dir(
        directory, build_model(stack_config).state_dict(), stack_config, tokenizer, {"task": "test"}
    )
    return directory


def translation_config(data: Path, tmp_path: Path, *overrides: str) -> TrainConfig:
    cfg = load_config(
        TrainConfig,
        ROOT / "configs" / "tiny_translation.yaml",
        [a for a in args(data, tmp_path, *overrides)[1:]],
    )
    return replace(cfg, model=replace(cfg.model, vocab_size=VOCAB_SIZE))


def test_a_good_config_passes_with_its_figures(data, tmp_path, capsys):
    code, out, problems = dry_run(args(data, tmp_path), capsys)
    assert code == 0, out
    assert problems == []
    assert out.rstrip().splitlines()[-1].startswith("verdict: ready")
    cfg = load_config(TrainConfig, ROOT / "configs" / "tiny_gpt.yaml", args(data, tmp_path)[1:])
    parameters = sum(
        p.numel() for p in build_model(replace(cfg.model, vocab_size=VOCAB_SIZE)).parameters()
    )
    assert f"parameters:           {parameters:,}" in out  # aligned label: value
    assert "global batch:         8 sequences = 4 micro x 2 accumulation x 1 ranks" in out
    assert "steps per epoch:      7 (60 train sequences; 4 left out per epoch)" in out
    assert "tokens per step:      64 " in out
    assert "memory per GPU:" in out and "MiB" in out
    assert "train 2/2 shards, valid 1/1 shards present" in out
    assert f"epochs in max_steps:  {cfg.max_steps / 7:,.2f}" in out


@pytest.mark.parametrize(
    "config",
    [
        "llama_small.yaml",
        "llama_gpu_small.yaml",
        "qwen2_small.yaml",
        "qwen3_small.yaml",
        "mistral_small.yaml",
        "olmo2_small.yaml",
    ],
)
def test_the_decoder_family_configs_pass_with_their_figures(data, tmp_path, capsys, config):
    code, out, problems = dry_run(args(data, tmp_path, config=config), capsys)
    assert code == 0 and problems == [], out
    cfg = load_config(TrainConfig, ROOT / "configs" / config, args(data, tmp_path)[1:])
    model = build_model(replace(cfg.model, vocab_size=VOCAB_SIZE))
    assert model.cfg.positions == "rope" and model.cfg.kv_heads < model.cfg.n_heads
    assert f"parameters:           {sum(p.numel() for p in model.parameters()):,}" in out


def test_json_figures_and_the_world_from_the_environment_or_the_flag(
    data, tmp_path, capsys, monkeypatch
):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    code, out, _ = dry_run([*args(data, tmp_path), "--json"], capsys)
    report = json.loads(out)
    assert code == 0 and report["ok"]
    figures = report["figures"]
    assert (figures["world_size"], figures["ranks_per_node"], figures["nodes"]) == (2, 2, 1)
    assert figures["global_batch_size"] == 16 and figures["steps_per_epoch"] == 60 // 16
    assert figures["tokens_per_step"] == 16 * SEQ_LEN
    assert (
        figures["memory_bytes_per_gpu"]
        == figures["model_state_bytes_per_gpu"] + figures["activation_bytes_per_gpu"]
        > 0
    )
    # The flag plans another world than the environment's, anywhere on the command line.
    code, out, _ = dry_run(["--world-size", "3", *args(data, tmp_path), "--json"], capsys)
    assert json.loads(out)["figures"]["global_batch_size"] == 24


def test_memory_is_deepspeeds_estimate_for_the_zero_stage():
    with torch.device("meta"):
        model = build_model(
            load_config(
                TrainConfig, ROOT / "configs" / "tiny_gpt.yaml", ["model.vocab_size=1000"]
            ).model
        )
    p = sum(t.numel() for t in model.parameters())
    largest = max(sum(t.numel() for t in m.parameters(recurse=False)) for m in model.modules())
    gpus = 8

    def gpu(stage, offload_optimizer=False, offload_params=False, precision="bf16"):
        return estimate_model_state_memory(
            model, stage, offload_optimizer, offload_params, 4, 2, precision
        )["gpu_bytes"]

    # DeepSpeed: 16-bit weights whole, 2 + 4 + 4 + 8 bytes of gradients, masters and moments split.
    assert gpu(2) == 2 * p + int(18 * p / gpus)
    assert gpu(1) == gpu(2) + 2 * p - 2 * p // gpus  # 16-bit gradients whole
    # Stage 0: DeepSpeed's fp16 optimizer on one GPU; fp32 and bf16 (torch's autocast) keep fp32
    # weights, gradients and two moments, no 16-bit copies.
    assert gpu(0, precision="fp16") == 20 * p
    assert gpu(0, precision="bf16") == gpu(0, precision="fp32") == 16 * p
    assert gpu(2, offload_optimizer=True) == 2 * p
    assert gpu(3) == 4 * largest + int(18 * p / gpus)
    assert gpu(3, offload_optimizer=True, offload_params=True) == 4 * largest


def test_activation_estimate_counts_grouped_heads_and_gated_mlps():
    """Per token and block, in bf16: 2 x (9 d + 2 d_ff) plain; 2 x (7 d + 2 d_kv + 4 d_ff) with
    grouped key/value heads (k and v of d_kv) and a gated MLP (gate and value, activated gate,
    product). The rest (embeddings, the LM head's loss) is the same for both."""
    from launch.preflight.figures import activation_bytes
    from launch.tasks import TASKS
    from model import ModelConfig

    d, T, B, L = 64, 128, 2, 2
    plain = ModelConfig(
        arch="gpt",
        vocab_size=1000,
        d_model=d,
        n_layers=L,
        n_heads=4,
        d_ff=4 * d,
        max_seq_len=T,
        dropout=0.0,
    )
    llama = replace(
        plain,
        n_kv_heads=1,
        activation="swiglu",
        d_ff=160,
        positions="rope",
        norm="rmsnorm",
        bias=False,
    )

    def estimate(cfg):
        return activation_bytes(cfg, TASKS["causal_lm"], B, T, 0, 0.15, "bf16")

    assert estimate(llama) - estimate(plain) == B * T * L * 2 * (
        (7 * d + 2 * 16 + 4 * 160) - (9 * d + 2 * 4 * d)
    )


def _drop_shard(data: Path) -> None:
    (data / "packed" / "train" / "0000-0001.tar").unlink()


def _grow_shard(data: Path) -> None:
    with open(data / "packed" / "train" / "0000-0000.tar", "ab") as fh:
        fh.write(b"\0" * 512)


def _drop_tokenizer(data: Path) -> None:
    (data / SENTENCEPIECE_FILE).unlink()


def _other_tokenizer(data: Path) -> None:
    (data / SENTENCEPIECE_FILE).write_bytes(b"another tokenizer")


def _drop_manifest(data: Path) -> None:
    (data / "manifest.json").unlink()


def _edit_shards(data: Path, split: str, change) -> None:
    manifest = json.loads((data / "manifest.json").read_text())
    change(manifest["datasets"]["packed"]["splits"][split]["shards"])
    save_manifest(data, manifest)


def _repeat_shard(data: Path) -> None:
    _edit_shards(data, "train", lambda shards: shards.append(dict(shards[1])))


def _negative_count(data: Path) -> None:
    _edit_shards(data, "train", lambda shards: shards[1].update(samples=-3))


def _empty_valid_shard(data: Path) -> None:
    _edit_shards(data, "valid", lambda shards: shards[0].update(samples=0))


BAD = [
    # (id, overrides ({tmp} is the test's directory), change to the dataset, key, text on the line)
    ("unknown task", ["task=summarize"], None, "task", "'summarize' is not one of"),
    ("arch of another task", ["model.arch=bert"], None, "model.arch", "trains gpt, not bert"),
    ("model config", ["model.n_heads=3"], None, "model.n_heads", "not divisible by n_heads=3"),
    (
        "model shorter than the blocks",
        ["model.max_seq_len=4"],
        None,
        "model.max_seq_len",
        f"need {SEQ_LEN} positions (packed blocks of seq_len {SEQ_LEN})",
    ),
    (
        "vocabulary",
        ["model.vocab_size=1000"],
        None,
        "model.vocab_size",
        f"has a vocabulary of {VOCAB_SIZE} (ids 0 to {VOCAB_SIZE - 1})",
    ),
    ("no dataset", ["data.data_dir={tmp}/nowhere"], None, "data.data_dir", "no manifest.json in"),
    ("no manifest", [], _drop_manifest, "data.data_dir", "no manifest.json"),
    (
        "missing shard",
        [],
        _drop_shard,
        "data.data_dir",
        "packed/train: 1 of 2 shards missing: packed/train/0000-0001.tar",
    ),
    (
        "shard size",
        [],
        _grow_shard,
        "data.data_dir",
        "1 of 2 shards of another size than the manifest's",
    ),
    ("no tokenizer", [], _drop_tokenizer, "data.data_dir", "tokenizer.model: missing"),
    ("tokenizer sha256", [], _other_tokenizer, "data.data_dir", "differs from the manifest's"),
    (
        "shard listed twice",
        [],
        _repeat_shard,
        "data.data_dir",
        "packed/train/0000-0001.tar: listed 2 times",
    ),
    (
        "negative sample count",
        [],
        _negative_count,
        "data.data_dir",
        "packed/train/0000-0001.tar: samples -3",
    ),
    # A valid split too small only costs the evaluation (a warning); a broken one stops the run.
    (
        "valid shard of no samples",
        [],
        _empty_valid_shard,
        "data.data_dir",
        "packed/valid/0000-0000.tar: samples 0",
    ),
    (
        "train split below a global batch",
        ["data.micro_batch_size=31"],
        None,
        "data.micro_batch_size",
        "has 60 sequences, fewer than one global batch of 62",
    ),
    (
        "offload without ZeRO-3",
        ["deepspeed.offload_params=true"],
        None,
        "deepspeed.offload_params",
        "needs zero_stage 3",
    ),
    ("keep_last", ["checkpoint.keep_last=0"], None, "checkpoint.keep_last", "at least 1"),
    ("run_dir under a file", ["run_dir={tmp}/a-file/run"], None, "run_dir", "is not a directory"),
    ("resume from nothing", ["resume={tmp}/no-checkpoint"], None, "resume", "is not auto, none"),
    (
        "deepspeed config file",
        ["deepspeed.config_file={tmp}/ds.json"],
        None,
        "deepspeed.config_file",
        "file not found",
    ),
    (
        "lm-eval task not ours",
        ["lm_eval.every=2", "lm_eval.tasks=[hellaswag]"],
        None,
        "lm_eval.tasks",
        "'hellaswag' is not one of cloze, choice",
    ),
    (
        "mixture of a source the data lacks",
        ["data.mixture.docs=1.0"],
        None,
        "data.mixture",
        "has no source 'docs'",
    ),
]


@pytest.mark.parametrize(
    "overrides, change, key, text", [case[1:] for case in BAD], ids=[case[0] for case in BAD]
)
def test_each_problem_is_reported_with_its_key(
    data, tmp_path, capsys, overrides, change, key, text
):
    (tmp_path / "a-file").write_text("")
    if change:
        change(data)
    code, out, problems = dry_run(
        args(data, tmp_path, *(o.format(tmp=tmp_path) for o in overrides)), capsys
    )
    assert code == 2, out
    assert any(line.startswith(f"{key}: ") and text in line for line in problems), out
    assert out.rstrip().splitlines()[-1].startswith(f"verdict: {len(problems)} problem")


# The problems that the resolution (`launch.resolve.resolve`) finds, before anything is built.
RESOLVED = [
    "unknown task",
    "arch of another task",
    "model config",
    "model shorter than the blocks",
    "vocabulary",
    "no dataset",
    "no manifest",
    "lm-eval task not ours",
]


@pytest.mark.parametrize(
    "overrides, change",
    [case[1:3] for case in BAD if case[0] in RESOLVED],
    ids=[case[0] for case in BAD if case[0] in RESOLVED],
)
def test_the_trainer_stops_at_the_dry_runs_first_problem(data, tmp_path, overrides, change):
    """One route: the trainer's set-up raises, in one line, the first problem the dry run lists
    for the same config, and has made nothing (no run directory)."""
    from common.configure import UserError, parse_cli
    from launch.preflight.checks import preflight
    from launch.train.setup import setup

    if change:
        change(data)
    argv = args(data, tmp_path, *(o.format(tmp=tmp_path) for o in overrides))
    cfg = parse_cli(TrainConfig, argv, usage="")
    report = preflight(cfg, world_size=1)
    assert report.problems
    with pytest.raises(UserError) as raised:
        setup(cfg)
    assert str(raised.value) == report.problems[0].error
    assert not (tmp_path / "run").exists()


def test_every_problem_at_once(data, tmp_path, capsys):
    _drop_shard(data)
    _other_tokenizer(data)
    code, out, problems = dry_run(
        args(
            data,
            tmp_path,
            "model.n_heads=3",
            "checkpoint.keep_last=0",
            "data.micro_batch_size=31",
            "deepspeed.offload_params=true",
            "model.vocab_size=1000",
        ),
        capsys,
    )
    assert code == 2
    keys = [line.split(": ", 1)[0] for line in problems]
    assert {
        "model.n_heads",
        "checkpoint.keep_last",
        "data.micro_batch_size",
        "deepspeed.offload_params",
        "model.vocab_size",
    } <= set(keys), out
    # the shard and the tokenizer, on lines of their own
    assert sum(key == "data.data_dir" for key in keys) == 2
    assert f"problems ({len(problems)}):" in out and len(problems) == 7


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="fp16 is only a warning where there is no CUDA"
)
def test_fp16_on_a_login_node_is_a_warning(data, tmp_path, capsys):
    code, out, problems = dry_run(args(data, tmp_path, "deepspeed.precision=fp16"), capsys)
    assert code == 0 and problems == []
    assert "deepspeed.precision: fp16 runs on GPUs only" in out


def test_a_valid_split_below_a_global_batch_disables_evaluation(tmp_path, capsys):
    data = make_data(tmp_path / "data", valid=(5,))
    code, out, _ = dry_run(args(data, tmp_path), capsys)
    assert code == 0, out
    assert (
        "data.micro_batch_size: the valid split has 5 sequences, fewer than one global batch (8)"
        in out
    )
    assert "without evaluation" in out


def test_warm_start_sources_are_checked(data, tmp_path, capsys):
    cfg = translation_config(data, tmp_path)
    tokenizer = data / SENTENCEPIECE_FILE
    other = tmp_path / "other.model"
    other.write_bytes(b"another tokenizer")
    bert = export(
        tmp_path / "bert", replace(cfg.model.for_stack("encoder"), arch="bert"), tokenizer
    )
    gpt = export(tmp_path / "gpt", replace(cfg.model.for_stack("decoder"), arch="gpt"), tokenizer)
    good = args(
        data,
        tmp_path,
        f"init.encoder={bert}",
        f"init.decoder={gpt}",
        config="tiny_translation.yaml",
    )
    code, out, problems = dry_run(good, capsys)
    assert code == 0, out
    assert "fits the encoder" in out and "fits the decoder" in out
    assert "steps per epoch:      7 (60 train pairs" in out

    foreign = export(
        tmp_path / "foreign", replace(cfg.model.for_stack("encoder"), arch="bert"), other
    )
    narrow = export(
        tmp_path / "narrow",
        replace(cfg.model.for_stack("decoder"), arch="gpt", d_ff=128),
        tokenizer,
    )
    code, out, problems = dry_run(
        args(
            data,
            tmp_path,
            f"init.encoder={foreign}",
            f"init.decoder={narrow}",
            config="tiny_translation.yaml",
        ),
        capsys,
    )
    assert code == 2
    assert any(
        line.startswith("init.encoder: ") and "another tokenizer" in line for line in problems
    ), out
    assert any(
        line.startswith("init.decoder: ") and "d_ff=128" in line and "d_ff=256" in line
        for line in problems
    ), out

    code, out, problems = dry_run(
        args(
            data, tmp_path, f"init.decoder={tmp_path / 'nothing'}", config="tiny_translation.yaml"
        ),
        capsys,
    )
    assert (
        code == 2
        and problems[0].startswith("init.decoder: ")
        and "not an exported model directory" in problems[0]
    )


def test_llama_shaped_warm_start_sources_are_checked(data, tmp_path, capsys):
    """A Llama-style GPT decoder (untied head) and a rotary BERT encoder fit a Seq2Seq of their
    shapes; the decoder's tie_embeddings is checked, the encoder's (which has no LM head) is not."""
    llama = [
        "model.bias=false",
        "model.tie_embeddings=false",
        "model.positions=rope",
        "model.decoder.norm=rmsnorm",
        "model.decoder.activation=swiglu",
        "model.decoder.n_kv_heads=2",
        "model.encoder.norm_position=pre",
        "model.encoder.activation=geglu",
    ]
    cfg = translation_config(data, tmp_path, *llama)
    tokenizer = data / SENTENCEPIECE_FILE
    bert = export(
        tmp_path / "bert",
        replace(cfg.model.for_stack("encoder"), arch="bert", tie_embeddings=True),
        tokenizer,
    )
    gpt = export(tmp_path / "gpt", replace(cfg.model.for_stack("decoder"), arch="gpt"), tokenizer)
    sources = [f"init.encoder={bert}", f"init.decoder={gpt}"]
    code, out, problems = dry_run(
        args(data, tmp_path, *llama, *sources, config="tiny_translation.yaml"), capsys
    )
    assert code == 0, out
    assert "fits the encoder" in out and "fits the decoder" in out
    tied = [*llama[:1], "model.tie_embeddings=true", *llama[2:]]
    code, out, problems = dry_run(
        args(data, tmp_path, *tied, *sources, config="tiny_translation.yaml"), capsys
    )
    assert code == 2 and "fits the encoder" in out
    assert problems == [
        f"init.decoder: {gpt} (gpt) has tie_embeddings=False but the Seq2Seq decoder has "
        "tie_embeddings=True"
    ], out


def test_translation_pairs_longer_than_the_model_are_found_in_the_shards(data, tmp_path, capsys):
    # The pairs' bound (translation.max_tokens) does not fit: the shards tell what the longest pair
    # needs, as the trainer's own check (launch.preconditions) does.
    code, out, problems = dry_run(
        args(data, tmp_path, "model.max_seq_len=6", config="tiny_translation.yaml"), capsys
    )
    assert code == 2, out
    (line,) = [p for p in problems if p.startswith("model.max_seq_len: ")]
    assert "is shorter than the inputs of" in line and "in the train split" in line


# ----------------------------------------------------------------------------- the batch scripts

FAKE_SRUN = """#!/bin/sh
echo "$@" >> "$SRUN_CALLS"
"""
FAKE_SCONTROL = """#!/bin/sh
case "$1 $2" in
    # The pause lets a reader that stops at the first name exit before the second is written
    # (a real scontrol on a large job does the same): that must not end the script.
    "show hostnames") echo node1; sleep 0.3; echo node2 ;;
    "show node") echo "NodeName=$3 NodeAddr=127.0.0.1 State=IDLE" ;;
esac
"""


def run_sbatch_script(
    script: str, argv: list[str], tmp_path: Path, wandb: dict | None = None
) -> tuple[subprocess.CompletedProcess, Path]:
    """Run a batch script as slurmd would on the batch host of a 2-node job with 2 ranks per
    node, with stand-ins for srun (it records its command line) and scontrol. `wandb`: the
    job's WANDB_* variables instead of this environment's."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    calls = tmp_path / "srun-calls.txt"
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "PYTHON": sys.executable,
        "PROJECT_DIR": str(ROOT),
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NAME": script.split(".")[0],
        "SLURM_JOB_NUM_NODES": "2",
        "SLURM_JOB_NODELIST": "node[1-2]",
        "NPROC_PER_NODE": "2",
        "SRUN_CALLS": str(calls),
    }
    if wandb is not None:
        env = {**{k: v for k, v in env.items() if not k.startswith("WANDB_")}, **wandb}
    run = subprocess.run(
        ["bash", str(ROOT / "slurm" / script), *argv],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return run, calls


@pytest.fixture(scope="module")
def pretrain_script_without_wandb(tmp_path_factory) -> tuple[subprocess.CompletedProcess, str]:
    """pretrain.sbatch run once with no WANDB_* variable (its dry run and the srun it calls),
    for the two tests below: what it passes on to W&B, and that the dry run comes before any rank
    (which no W&B variable changes)."""
    top = tmp_path_factory.mktemp("pretrain-script")
    # as no_launcher does for each test: this runs before it
    with pytest.MonkeyPatch.context() as patch:
        for name in (
            "RANK",
            "WORLD_SIZE",
            "LOCAL_RANK",
            "LOCAL_WORLD_SIZE",
            "SLURM_PROCID",
            "SLURM_NTASKS",
        ):
            patch.delenv(name, raising=False)
        run, calls = run_sbatch_script(
            "pretrain.sbatch", args(make_data(top / "data"), top), top, wandb={}
        )
    return run, calls.read_text() if calls.exists() else ""


def test_the_batch_scripts_log_the_w_and_b_settings_they_pass_on_and_run_without_any(
    data, tmp_path, pretrain_script_without_wandb
):
    """No WANDB_* at all (a user who never set one: grep finding nothing must not end a script
    under pipefail), and an online job's: the key's value is never written to the log."""
    run, _ = pretrain_script_without_wandb
    assert run.returncode == 0, run.stderr
    assert (
        "W&B settings passed to the ranks: none (offline, unless the config sets wandb.mode)"
        in run.stderr
    )
    run, _ = run_sbatch_script(
        "pretrain.sbatch",
        args(data, tmp_path),
        tmp_path,
        wandb={"WANDB_MODE": "online", "WANDB_API_KEY": "s3cr3t", "WANDB_PROJECT": "p"},
    )
    assert run.returncode == 0, run.stderr
    assert (
        "W&B settings passed to the ranks: WANDB_API_KEY=(set) WANDB_MODE=online WANDB_PROJECT=p"
        in run.stderr
    )
    assert "s3cr3t" not in run.stderr + run.stdout


def test_the_batch_scripts_run_it_before_any_rank(data, tmp_path, pretrain_script_without_wandb):
    run, srun_calls = pretrain_script_without_wandb
    assert run.returncode == 0, run.stderr
    assert "world size:           4 (--world-size): 2 nodes x 2 ranks" in run.stdout
    assert "global batch:         32 sequences = 4 micro x 2 accumulation x 4 ranks" in run.stdout
    assert "-m launch.train" in srun_calls

    run, calls = run_sbatch_script(
        "finetune.sbatch",
        args(data, tmp_path, "model.n_heads=3", "checkpoint.keep_last=0"),
        tmp_path,
    )
    assert run.returncode == 2
    assert "model.n_heads: " in run.stdout and "checkpoint.keep_last: " in run.stdout
    assert "preflight failed (above): no rank started" in run.stderr
    assert not calls.exists()  # srun was never called


# ----------------------------------------------------------------------------- the configs in
# configs/ compose


def config_kind(path: Path) -> str:
    """What a YAML of configs/ is for, by its name (as tests/common/test_config.py tells them apart):
    prepare_* are pipeline.prepare configs, main*/transfer* launch.main configs, the rest training."""
    if path.name.startswith("prepare"):
        return "prepare"
    return "main" if path.name.startswith(("main", "transfer")) else "train"


CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))


@pytest.fixture
def composed_data(tmp_path) -> Path:
    """A dataset every shipped config can plan against: more train samples than the largest
    global batch of any of them (BERT-base's 128 on one rank, transfer_gpu's on 8), and packed
    train shards of the two sources configs/tiny_gpt_mixture.yaml mixes."""
    data = make_data(tmp_path / "data", train=(700, 700), valid=(70,))
    manifest = json.loads((data / "manifest.json").read_text())
    for record, source in zip(
        manifest["datasets"]["packed"]["splits"]["train"]["shards"], ("gettext", "docs")
    ):
        record["source"] = source
    save_manifest(data, manifest)
    return data


@pytest.mark.parametrize(
    "config", [p for p in CONFIGS if config_kind(p) == "train"], ids=lambda p: p.name
)
def test_every_training_config_passes_a_dry_run(composed_data, tmp_path, capsys, config):
    code, out, problems = dry_run(
        [
            str(config),
            f"data.data_dir={composed_data}",
            f"run_dir={tmp_path / 'run'}",
            "wandb.mode=disabled",
            "model.vocab_size=0",  # the test data's (gpt2_124m.yaml fixes GPT-2's 50,257)
        ],
        capsys,
    )
    assert code == 0 and problems == [], out
    assert "parameters:" in out and "global batch:" in out  # resolved, not skipped


def main_dry_run_of(argv: list[str], capsys) -> tuple[int, str]:
    from launch.main.job import main

    code = main([*argv, "--dry-run"])
    return code, capsys.readouterr().out


@pytest.mark.parametrize(
    "config", [p for p in CONFIGS if config_kind(p) == "main"], ids=lambda p: p.name
)
def test_every_main_config_passes_the_chain_dry_run(composed_data, tmp_path, capsys, config):
    """Each stage's config resolves with the job's overrides, each training run's preflight passes
    on the job's ranks, and every pretrained model fits the stack it warm-starts."""
    code, out = main_dry_run_of(
        [
            str(config),
            f"data_dir={composed_data}",
            f"out_dir={tmp_path / 'out'}",
            "wandb_mode=disabled",
        ],
        capsys,
    )
    assert code == 0, out
    assert out.rstrip().splitlines()[-1].startswith("verdict: ready")
    # the dataset exists: the job would validate it, not prepare
    assert "== prepare: skipped if" in out
    assert not (tmp_path / "out").exists()  # nothing written
    starts = [tuple(start.split("/")) for start in load_config(MainConfig, config).starts]
    for side, index in (("encoder", 0), ("decoder", 1)):
        for name in {start[index] for start in starts} - {"random"}:
            assert f"init.{side} <- {name}:" in out and f"fits the {side}" in out, out


def test_the_chain_dry_run_takes_a_stages_init_model_as_its_training_would(
    composed_data, tmp_path, capsys
):
    """A pretraining stage continued from a directory (`gpt_overrides=[init.model=DIR]`) is
    checked with the directory's model, as `launch.train` builds it: here an export of ours
    narrower than tiny_gpt.yaml, which the translation decoder it warm-starts no longer fits."""
    from common.configure import config_to_dict
    from common.hashing import file_sha256
    from model import ModelConfig
    from pipeline.tokenizer import tokenizer_file_in

    export = tmp_path / "export"
    export.mkdir()
    narrow = ModelConfig(
        arch="gpt", vocab_size=VOCAB_SIZE, d_model=32, n_layers=2, n_heads=4, max_seq_len=128
    )
    (export / "config.json").write_text(
        json.dumps(
            {
                "model": config_to_dict(narrow),
                "tokenizer_sha256": file_sha256(tokenizer_file_in(composed_data)),
            }
        )
    )
    code, out = main_dry_run_of(
        [
            str(ROOT / "configs" / "main.yaml"),
            f"data_dir={composed_data}",
            f"out_dir={tmp_path / 'out'}",
            "wandb_mode=disabled",
            "gpt_config=configs/tiny_gpt.yaml",
            "bert_config=configs/tiny_bert.yaml",
            "translation_config=configs/tiny_translation.yaml",
            f"gpt_overrides=[init.model={export}]",
        ],
        capsys,
    )
    assert code == 2, out
    parameters = sum(p.numel() for p in build_model(narrow).parameters())
    pretrain_gpt = out[out.index("== pretrain gpt") : out.index("== fine-tune")]
    assert f"parameters:           {parameters:,}" in pretrain_gpt, pretrain_gpt
    assert "decoder has d_model=64" in out and "d_model=32" in out, out
    assert not (tmp_path / "out").exists()


def test_a_mismatched_warm_start_pair_is_reported_with_its_key_and_every_other_problem(
    composed_data, tmp_path, capsys
):
    """transfer_gpu.yaml's translation encoder made narrower than BERT-base and its decoder given
    fewer heads than GPT-2 small, and a GPT stage with an unknown key: one dry run names the key of
    each problem it can see, with its stage, and starts nothing. (A GPT that does not resolve
    has no model to check the decoder against: its own problem says why.)"""
    code, out = main_dry_run_of(
        [
            str(ROOT / "configs" / "transfer_gpu.yaml"),
            f"data_dir={composed_data}",
            f"out_dir={tmp_path / 'out'}",
            "wandb_mode=disabled",
            "translation_overrides=[model.encoder.d_ff=2048,model.decoder.n_heads=8]",
            "gpt_overrides=[model.no_such_key=1]",
        ],
        capsys,
    )
    assert code == 2, out
    chain = out[out.index("chain: ") :].splitlines()
    fine_tune = "  fine-tune (random/random, bert/random, random/gpt, bert/gpt): "
    assert chain[:3] == [
        "chain: 2 problems:",
        "  pretrain gpt: command line 'model.no_such_key=1': model.no_such_key: unknown key",
        f"{fine_tune}init.encoder: configs/bert_base.yaml (pretrain bert) (bert) has d_ff=3072 but the Seq2Seq "
        "encoder has d_ff=2048",
    ], out
    assert chain[-1] == "verdict: this job would fail (exit 2)"
    assert not (tmp_path / "out").exists()


def test_the_chain_dry_run_checks_a_warm_start_pair_whose_source_resolves(
    composed_data, tmp_path, capsys
):
    code, out = main_dry_run_of(
        [
            str(ROOT / "configs" / "transfer.yaml"),
            f"data_dir={composed_data}",
            f"out_dir={tmp_path / 'out'}",
            "wandb_mode=disabled",
            "translation_overrides=[model.decoder.n_heads=8]",
        ],
        capsys,
    )
    assert code == 2, out
    assert (
        "  fine-tune (random/random, bert/random, random/gpt, bert/gpt): init.decoder: configs/small_gpt.yaml "
        "(pretrain gpt) (gpt) has n_heads=4 but the Seq2Seq decoder has n_heads=8"
    ) in out.splitlines(), out
    assert "init.encoder <- bert:" in out  # the other side still fits


def test_a_chain_whose_dataset_is_not_made_yet_is_checked_against_its_prepare_config(
    tmp_path, capsys
):
    """No dataset yet: the prepare config (and its sources' files) stands for it: its vocabulary,
    its block length against each pretraining model, the tasks it writes."""
    from corpora import synthetic_pairs, write_tsv

    corpus = write_tsv(tmp_path / "pairs.tsv", synthetic_pairs(20))
    prepare = tmp_path / "prepare.yaml"
    prepare.write_text(
        (ROOT / "configs" / "prepare_gettext_en_de.yaml")
        .read_text()
        .replace("format: gettext", "format: tsv")
        .replace('["/usr/share/locale/${source.target_lang}/LC_MESSAGES/*.mo"]', f"[{corpus}]")
    )
    argv = [
        str(ROOT / "configs" / "transfer.yaml"),
        f"prepare_config={prepare}",
        f"data_dir={tmp_path / 'data'}",
        f"out_dir={tmp_path / 'out'}",
        "wandb_mode=disabled",
    ]
    code, out = main_dry_run_of(argv, capsys)
    assert code == 0, out
    assert "1 source files; tasks causal_lm, mlm, translation; seq_len 128; vocabulary 8000" in out
    assert f"{tmp_path / 'data'}: not there yet; {prepare} will make it: vocabulary 8000" in out
    assert "init.encoder <- bert:" in out and "init.decoder <- gpt:" in out

    code, out = main_dry_run_of([*argv, "bert_overrides=[model.max_seq_len=64]"], capsys)
    assert code == 2
    assert (
        "  pretrain bert: model.max_seq_len: model.max_seq_len=64 is shorter than the packed blocks of seq_len "
        f"128 that {prepare} will make; set model.max_seq_len=128 or more"
    ) in out.splitlines(), out

    corpus.unlink()
    code, out = main_dry_run_of(argv, capsys)
    assert code == 2
    assert (
        f"  prepare: prepare_config: source.paths: file not found: {corpus}" in out.splitlines()
    ), out


def test_a_training_config_stands_for_the_export_it_will_make(data, tmp_path, capsys):
    """launch.train --dry-run with init.* naming the pretraining YAML instead of its export: its
    model is checked against the stack (a warning says the run needs the export)."""
    tiny = args(
        data,
        tmp_path,
        f"init.encoder={ROOT / 'configs' / 'tiny_bert.yaml'}",
        f"init.decoder={ROOT / 'configs' / 'tiny_gpt.yaml'}",
        config="tiny_translation.yaml",
    )
    code, out, problems = dry_run(tiny, capsys)
    assert code == 0 and problems == [], out
    assert "fits the encoder" in out and "fits the decoder" in out
    assert "init.encoder: " in out and "is a training config: its model is checked here" in out
    code, out, problems = dry_run(
        args(
            data,
            tmp_path,
            f"init.encoder={ROOT / 'configs' / 'small_bert.yaml'}",
            config="tiny_translation.yaml",
        ),
        capsys,
    )
    assert code == 2
    assert problems == [
        f"init.encoder: {ROOT / 'configs' / 'small_bert.yaml'} (the model its run will export) (bert) has "
        "d_model=256, n_layers=3, d_ff=1024 but the Seq2Seq encoder has d_model=64, n_layers=2, d_ff=256"
    ], out


@pytest.mark.parametrize(
    "shown, expected",
    [
        ("NodeName=node1 NodeAddr=10.1.2.3 State=IDLE", "10.1.2.3"),
        ("NodeName=node1 State=IDLE", "node1"),
    ],
    ids=["NodeAddr", "none"],
)
def test_the_batch_scripts_take_a_nodes_name_where_slurm_reports_no_node_addr(
    tmp_path, shown, expected
):
    """slurm/common.sh's node_addr, under the scripts' `set -euo pipefail`: a grep that finds no
    NodeAddr ended the script with status 1 and no word; the first node's name stands in."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(f"#!/bin/sh\necho '{shown}'\n")
    (bin_dir / "scontrol").chmod(0o755)
    run = subprocess.run(
        [
            "bash",
            "-c",
            'set -euo pipefail; source slurm/common.sh; addr=$(node_addr node1); echo "[$addr]"',
        ],
        cwd=ROOT,
        env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PROJECT_DIR": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0 and run.stdout == f"[{expected}]\n", run.stderr


def test_a_warmup_as_long_as_the_run_is_a_warning(data, tmp_path, capsys):
    code, out, problems = dry_run(
        args(data, tmp_path, "max_steps=20", "schedule.warmup_steps=20"), capsys
    )
    assert code == 0 and problems == [], out
    assert (
        "  schedule.warmup_steps: 20 but max_steps is 20: the learning rate never reaches optim.lr"
        in out.splitlines()
    )
    code, out, _ = dry_run(args(data, tmp_path, "max_steps=21", "schedule.warmup_steps=20"), capsys)
    assert "schedule.warmup_steps" not in out


@pytest.mark.slow
def test_the_gpu_scale_pair_the_dry_run_passes_loads_into_the_translation_model():
    """What the chain dry run says fits, model.warm_start loads: BERT-base (with transfer_gpu's
    overrides) and GPT-2 small into translation_gpu's Seq2Seq, every tensor accounted for, only
    the position tables resized (truncated to 128 rows). Source weights are zeros: the shapes
    and keys are what is checked here, the copying is tests/model/test_warm_start.py's."""
    from model.warm_start import Pretrained, warm_start

    main = load_config(MainConfig, ROOT / "configs" / "transfer_gpu.yaml")

    def model_config(path: str, overrides: list[str]):
        return replace(
            load_config(
                TrainConfig, ROOT / path, [o for o in overrides if o.startswith("model.")]
            ).model,
            vocab_size=8000,
        )

    def zeros(cfg) -> dict:
        with torch.device("meta"):
            keys = build_model(cfg).state_dict(keep_vars=True)
        made = {}  # tied keys share one tensor, as in the model
        return {
            key: made.setdefault(id(value), torch.zeros(value.shape)) for key, value in keys.items()
        }

    bert = model_config(main.bert_config, main.bert_overrides)
    gpt = model_config(main.gpt_config, main.gpt_overrides)
    translation = model_config(main.translation_config, main.translation_overrides)
    model, report = warm_start(
        translation,
        "sha",
        encoder=Pretrained(zeros(bert), bert, "sha"),
        decoder=Pretrained(zeros(gpt), gpt, "sha"),
    )
    assert sorted(report.keys("resized")) == [
        "decoder.embed.pos.weight",
        "encoder.embed.pos.weight",
    ]
    # New: the decoder's cross-attention and its norm, 10 tensors in each of its 12 blocks; the rest
    # copied.
    assert {re.sub(r"^decoder\.blocks\.\d+\.", "", key) for key in report.keys("new")} == {
        f"cross_attn.{proj}.{kind}"
        for proj in ("q_proj", "k_proj", "v_proj", "out_proj")
        for kind in ("weight", "bias")
    } | {"cross_attn_norm.weight", "cross_attn_norm.bias"}
    assert len(report.keys("new")) == 10 * 12
    assert len(report.tensors) == len(model.state_dict()) == len(report.keys("copied")) + 2 + 120
