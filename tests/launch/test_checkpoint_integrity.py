"""Checkpoint integrity and loading without unpickling code (issue 16, items 4 and 8).

The checkpoints are real: a single-process DeepSpeed engine (ZeRO-0 and ZeRO-2, a tiny GPT)
trains and saves two of them with the trainer's client state (its numpy RNG state included),
in a subprocess that this file runs as a script (`make`), so that pytest's own process neither
joins a process group nor imports DeepSpeed for it. The agreement of the ranks runs under
torchrun with 2 processes (`agree`) and no DeepSpeed: each rank hashes its share of the files.

    python tests/launch/test_checkpoint_integrity.py make OUT
    python -m torch.distributed.run --nproc_per_node 2 tests/launch/test_checkpoint_integrity.py agree RUN_DIR OUT
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # conftest, shardtools
sys.path.insert(0, str(Path(__file__).resolve().parent))

import pytest  # noqa: E402
import torch  # noqa: E402
from errorlines import assert_one_line_error  # noqa: E402
from madecheckpoints import TAGS, run_copy  # noqa: E402

from common.configure import UserError, run_main  # noqa: E402
from common.hashing import file_sha256  # noqa: E402
from launch import checkpoint as ckpt  # noqa: E402
from launch.main.plan import torchrun  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
STAGES = (0, 2)
MODEL_STATES = "mp_rank_00_model_states.pt"
OPTIM_STATES = "zero_pp_rank_0_mp_rank_00_optim_states.pt"  # ZeRO-2's one rank


# ----------------------------------------------------------------------------- the worker


def make(out: Path) -> None:
    """OUT/stage{0,2}/: a run directory as launch.train leaves it (config.yaml, tokenizer.model,
    checkpoints/step_1 and step_2 with client_state.json, the pointer on step_2) but without
    integrity.json, which the tests add as the trainer would; reference_step_2.pt: the module's
    weights at step 2."""
    from common.configure import config_to_dict, save_config
    from launch import distributed
    from launch.checkpoint.state import CheckpointState, rng_state
    from launch.config import BatchPlan, TrainConfig
    from launch.deepspeed.config import DeepSpeedConfig, deepspeed_config
    from launch.deepspeed.engine import Engine
    from launch.optim import build_optimizer, build_scheduler
    from launch.optim_config import OptimConfig, ScheduleConfig
    from model import ModelConfig, build_model
    from pipeline.load.config import LoaderConfig

    torch.set_num_threads(1)
    distributed.init_process_group(distributed.read_env(), timeout_s=120)
    model_cfg = ModelConfig(
        arch="gpt", vocab_size=64, d_model=32, n_layers=2, n_heads=2, max_seq_len=16, dropout=0.0
    )
    for stage in STAGES:
        run_dir = out / f"stage{stage}"
        root = ckpt.checkpoint_root(run_dir)
        root.mkdir(parents=True)
        cfg = TrainConfig(
            max_steps=10,
            model=model_cfg,
            data=LoaderConfig(micro_batch_size=2),
            run_dir=str(run_dir),
            optim=OptimConfig(lr=1e-2),
            schedule=ScheduleConfig(warmup_steps=1),
            deepspeed=DeepSpeedConfig(zero_stage=stage),
        )
        save_config(cfg, run_dir / "config.yaml")
        (run_dir / "tokenizer.model").write_bytes(b"a stand-in for a SentencePiece model")
        torch.manual_seed(0)
        model = build_model(model_cfg)
        optimizer = build_optimizer(model, cfg.optim)
        engine = Engine(
            model,
            optimizer,
            build_scheduler(optimizer, cfg.schedule, cfg.max_steps),
            deepspeed_config(cfg, BatchPlan(2, 1, 1)),
        )
        tokens = torch.randint(
            0,
            model_cfg.vocab_size,
            (2, model_cfg.max_seq_len + 1),
            generator=torch.Generator().manual_seed(1),
        )
        for step, tag in enumerate(TAGS, start=1):
            output = engine(input_ids=tokens[:, :-1], labels=tokens[:, 1:])
            engine.backward(output.loss)
            engine.step()
            state = CheckpointState(
                step=step,
                tokens_seen=32 * step,
                loader={"version": 3, "epoch": 0, "samples_consumed": 2 * step},
                rng=[rng_state()],
                config=config_to_dict(cfg),
                tokenizer_sha256=file_sha256(run_dir / "tokenizer.model"),
                wandb_run_id="abc",
                world_size=1,
                global_batch_size=2,
                micro_batch_size=2,
                grad_accum=1,
            )
            # as launch.checkpoint.save's save_checkpoint, but integrity.json (the tests add it)
            engine.save(root, tag, state.client_state())
            (root / tag / "client_state.json").write_text(json.dumps(state.listing()) + "\n")
            ckpt.move_pointer(root, tag)
        weights = {
            name: tensor.detach().clone() for name, tensor in engine.module.state_dict().items()
        }
        torch.save(weights, run_dir / "reference_step_2.pt")


def agree(run_dir: Path, out: Path) -> None:
    """Each of 2 ranks hashes its share of each candidate; the verdicts are all-gathered."""
    from launch import distributed

    denv = distributed.read_env()
    distributed.init_process_group(denv, timeout_s=120)
    candidates = ckpt.resume_candidates("auto", run_dir)
    chosen = ckpt.choose_resume(
        "auto",
        candidates,
        lambda candidate: ckpt.resume_verdict(candidate, denv.rank, denv.world_size),
        distributed.all_gather_object,
        report=denv.is_main,
    )
    (out / f"rank{denv.rank}.json").write_text(json.dumps(chosen[1] if chosen else None))
    distributed.destroy()


# ----------------------------------------------------------------------------- fixtures and helpers


@pytest.fixture
def made(made_checkpoints) -> Path:
    """The run directories `make` writes (conftest's session fixture, shared with the export tests)."""
    return made_checkpoints


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def scribble(path: Path) -> None:
    """Garbage of the file's own size: only its checksum can tell."""
    path.write_bytes(bytes((i * 7 + 3) % 251 for i in range(path.stat().st_size)))


def no_reports(verdict):
    return [verdict]  # a world of one: this rank's verdict is all there is


def choose(resume: str, run_dir: Path):
    return ckpt.choose_resume(
        resume,
        ckpt.resume_candidates(resume, run_dir),
        ckpt.resume_verdict,
        no_reports,
        report=True,
    )


def run_export(checkpoint: Path, out: Path) -> subprocess.CompletedProcess:
    """`python -m launch.export checkpoint=... out=...` run in this process, as its `__main__` runs
    it (`run_main(main)`): the exit status and stderr of the command, without a Python start per
    call (about 3 s here, a dozen calls in this file). The `-m` wiring itself is test_cli's."""
    from launch.export import main

    argv = [f"checkpoint={checkpoint}", f"out={out}"]
    stdout, stderr = io.StringIO(), io.StringIO()
    with (
        contextlib.redirect_stdout(stdout),
        contextlib.redirect_stderr(stderr),
        pytest.raises(SystemExit) as exited,
    ):
        run_main(lambda: main(argv))
    return subprocess.CompletedProcess(
        ["launch.export", *argv], exited.value.code, stdout.getvalue(), stderr.getvalue()
    )


class Planted:
    """A pickled object whose unpickling writes a marker file (`open(marker, "w")`)."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


# ----------------------------------------------------------------------------- integrity.json and
# verify


def test_checkpoint_module_stays_free_of_deepspeed_and_torch_distributed():
    code = (
        "import sys, launch.checkpoint; bad = [m for m in ('deepspeed', 'torch.distributed') if m in sys.modules]; "
        "assert not bad, bad"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]


def test_integrity_records_every_file_with_its_size_and_sha256(made, tmp_path):
    run_dir = run_copy(made, 2, tmp_path)
    tag_dir = ckpt.checkpoint_root(run_dir) / TAGS[1]
    record = json.loads((tag_dir / ckpt.INTEGRITY).read_text())["files"]
    on_disk = sorted(
        str(p.relative_to(tag_dir))
        for p in tag_dir.rglob("*")
        if p.is_file() and p.name != ckpt.INTEGRITY
    )
    assert sorted(record) == on_disk and {MODEL_STATES, OPTIM_STATES, "client_state.json"} <= set(
        record
    )
    for name, entry in record.items():
        assert entry == {
            "size": (tag_dir / name).stat().st_size,
            "sha256": file_sha256(tag_dir / name),
        }
    assert not list(tag_dir.glob("*.partial"))
    assert ckpt.verify(tag_dir) is None


def test_verify_says_in_one_line_what_is_wrong(made, tmp_path):
    run_dir = run_copy(made, 2, tmp_path)
    root = ckpt.checkpoint_root(run_dir)
    tag_dir = root / TAGS[1]

    truncate(tag_dir / MODEL_STATES)
    reason = ckpt.verify(tag_dir)
    assert MODEL_STATES in reason and "bytes" in reason and "\n" not in reason
    # Limited to other files, the sizes are still checked: a stat is cheap, a hash is not.
    assert MODEL_STATES in ckpt.verify(tag_dir, files=[OPTIM_STATES])

    tag_dir = root / TAGS[0]
    scribble(tag_dir / OPTIM_STATES)
    assert OPTIM_STATES in ckpt.verify(tag_dir) and "sha256" in ckpt.verify(tag_dir)
    assert ckpt.verify(tag_dir, files=[MODEL_STATES]) is None  # this rank's share does not hold it
    (tag_dir / MODEL_STATES).unlink()
    assert MODEL_STATES in ckpt.verify(tag_dir) and "missing" in ckpt.verify(tag_dir)
    (tag_dir / ckpt.INTEGRITY).write_text("{not json")
    assert ckpt.INTEGRITY in ckpt.verify(tag_dir)
    (tag_dir / ckpt.INTEGRITY).unlink()
    assert ckpt.INTEGRITY in ckpt.verify(tag_dir)
    assert "not found" in ckpt.verify(root / "step_00000009")


def test_the_ranks_shares_cover_every_file_once(made, tmp_path):
    run_dir = run_copy(made, 2, tmp_path)
    tag_dir = ckpt.checkpoint_root(run_dir) / TAGS[1]
    recorded = sorted(json.loads((tag_dir / ckpt.INTEGRITY).read_text())["files"])
    for world_size in (1, 2, 3, 8):
        shares = [ckpt.files_for_rank(tag_dir, rank, world_size) for rank in range(world_size)]
        assert sorted(name for share in shares for name in share) == recorded
    # The two big files go to different ranks.
    assert {MODEL_STATES, OPTIM_STATES} & set(ckpt.files_for_rank(tag_dir, 0, 2)) not in (
        set(),
        {MODEL_STATES, OPTIM_STATES},
    )


# ----------------------------------------------------------------------------- resume


def test_a_truncated_model_file_in_the_latest_checkpoint_resumes_from_the_previous(
    made, tmp_path, capsys
):
    run_dir = run_copy(made, 0, tmp_path)
    root = ckpt.checkpoint_root(run_dir)
    truncate(root / TAGS[1] / MODEL_STATES)
    assert choose("auto", run_dir) == (root, TAGS[0])
    err = capsys.readouterr().err
    assert f"skipping checkpoint {root / TAGS[1]}" in err and MODEL_STATES in err, err


def test_garbage_in_a_ranks_optimizer_file_is_detected(made, tmp_path, capsys):
    run_dir = run_copy(made, 2, tmp_path)
    root = ckpt.checkpoint_root(run_dir)
    scribble(root / TAGS[1] / OPTIM_STATES)
    assert OPTIM_STATES in ckpt.resume_verdict((root, TAGS[1]))
    assert choose("auto", run_dir) == (root, TAGS[0])
    err = capsys.readouterr().err
    assert (
        f"skipping checkpoint {root / TAGS[1]}" in err and OPTIM_STATES in err and "sha256" in err
    ), err


def test_the_ranks_agree_when_only_one_of_them_sees_the_damage(made, tmp_path):
    run_dir = run_copy(made, 2, tmp_path)
    root = ckpt.checkpoint_root(run_dir)
    tag_dir = root / TAGS[1]
    only_rank_1 = sorted(
        ckpt.files_for_rank(tag_dir, 1, 2), key=lambda name: -(tag_dir / name).stat().st_size
    )[0]
    assert only_rank_1 not in ckpt.files_for_rank(tag_dir, 0, 2)
    scribble(tag_dir / only_rank_1)  # the same size: rank 0 cannot see it, rank 1 hashes it
    out = tmp_path / "verdicts"
    out.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [
            *torchrun(2),
            __file__,
            "agree",
            str(run_dir),
            str(out),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert [json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1)] == [
        TAGS[0],
        TAGS[0],
    ]
    reports = [line for line in result.stderr.splitlines() if "skipping checkpoint" in line]
    # said once, by rank 0
    assert len(reports) == 1 and only_rank_1 in reports[0], result.stderr[-3000:]


def test_checkpoints_without_integrity_json_are_trusted_with_a_warning(made, tmp_path, capsys):
    run_dir = run_copy(made, 2, tmp_path, integrity=False)
    root = ckpt.checkpoint_root(run_dir)
    assert choose("auto", run_dir) == (root, TAGS[1])
    err = capsys.readouterr().err
    assert f"{root / TAGS[1]} has no {ckpt.INTEGRITY}" in err, err
    # What can be checked without it is: every torch file must be a whole archive.
    truncate(root / TAGS[1] / OPTIM_STATES)
    assert choose("auto", run_dir) == (root, TAGS[0])
    err = capsys.readouterr().err
    assert f"skipping checkpoint {root / TAGS[1]}" in err and OPTIM_STATES in err, err


def test_a_checkpoint_without_integrity_json_newer_than_one_with_it_is_a_save_that_did_not_complete(
    made, tmp_path, capsys
):
    run_dir = run_copy(made, 2, tmp_path, integrity=False)
    root = ckpt.checkpoint_root(run_dir)
    # written by this code; step 2's save died before its integrity.json
    ckpt.write_integrity(root / TAGS[0])
    assert choose("auto", run_dir) == (root, TAGS[0])
    err = capsys.readouterr().err
    assert (
        f"skipping checkpoint {root / TAGS[1]}: no {ckpt.INTEGRITY}" in err
        and "did not complete" in err
    ), err


def test_an_explicit_checkpoint_that_fails_verification_is_an_error(made, tmp_path):
    run_dir = run_copy(made, 0, tmp_path)
    root = ckpt.checkpoint_root(run_dir)
    truncate(root / TAGS[1] / MODEL_STATES)
    with pytest.raises(UserError) as failure:
        choose(str(root / TAGS[1]), run_dir)
    assert (
        str(root / TAGS[1]) in str(failure.value)
        and MODEL_STATES in str(failure.value)
        and "\n" not in str(failure.value)
    )
    assert choose(str(root / TAGS[0]), run_dir) == (root, TAGS[0])
    # resume=auto with nothing intact left stops rather than starting afresh over the run.
    truncate(root / TAGS[0] / MODEL_STATES)
    with pytest.raises(UserError, match="no intact checkpoint"):
        choose("auto", run_dir)


def test_candidates_are_the_complete_checkpoints_newest_first(made, tmp_path):
    run_dir = run_copy(made, 0, tmp_path)
    root = ckpt.checkpoint_root(run_dir)
    assert ckpt.resume_candidates("auto", run_dir) == [(root, TAGS[1]), (root, TAGS[0])]
    assert ckpt.resume_candidates(str(root), run_dir) == [(root, TAGS[1]), (root, TAGS[0])]
    assert ckpt.resume_candidates(str(root / TAGS[0]), run_dir) == [(root, TAGS[0])]
    ckpt.move_pointer(root, TAGS[0])  # step 2 as a save that never completed leaves it
    assert ckpt.resume_candidates("auto", run_dir) == [(root, TAGS[0])]
    with pytest.raises(UserError, match="already holds checkpoints"):
        ckpt.resume_candidates("none", run_dir)
    assert ckpt.resume_candidates("auto", tmp_path / "fresh") == []
    # A pointer naming a checkpoint that is gone: the older ones are still candidates.
    ckpt.move_pointer(root, ckpt.tag_for(3))
    assert choose("auto", run_dir) == (root, TAGS[1])


def test_discard_removes_a_checkpoint_and_its_universal_copy(tmp_path):
    for tag in (
        TAGS[0],
        ckpt.universal_tag_for(TAGS[0]),
        f".{ckpt.universal_tag_for(TAGS[0])}.partial",
        TAGS[1],
    ):
        (tmp_path / tag).mkdir()
    ckpt.discard(tmp_path, TAGS[0])
    assert sorted(p.name for p in tmp_path.iterdir()) == [TAGS[1]]


# ----------------------------------------------------------------------------- export


@pytest.mark.parametrize("integrity", [True, False], ids=["verified", "legacy"])
@pytest.mark.parametrize("stage", STAGES)
def test_export_of_a_truncated_checkpoint_is_one_line_and_exit_2(made, tmp_path, stage, integrity):
    run_dir = run_copy(made, stage, tmp_path, integrity=integrity)
    damaged = OPTIM_STATES if stage else MODEL_STATES
    truncate(ckpt.checkpoint_root(run_dir) / TAGS[1] / damaged)
    line = assert_one_line_error(run_export(run_dir, tmp_path / "out"), damaged, TAGS[1])
    assert TAGS[0] in line  # the way out: an older checkpoint
    assert not (tmp_path / "out").exists()


def test_export_of_a_partial_checkpoint_directory_is_one_line_and_exit_2(made, tmp_path):
    run_dir = run_copy(made, 2, tmp_path, integrity=False)
    partial = ckpt.checkpoint_root(run_dir) / TAGS[1]
    (partial / MODEL_STATES).unlink()  # a save that never got that far
    assert_one_line_error(run_export(partial, tmp_path / "out"), str(partial), "model-states")
    empty = ckpt.checkpoint_root(run_dir) / ckpt.tag_for(3)
    empty.mkdir()
    assert_one_line_error(run_export(empty, tmp_path / "out"), str(empty))


@pytest.mark.parametrize("stage", STAGES)
def test_export_reads_the_engine_weights(made, tmp_path, stage):
    from launch.model_dir import load_model_dir

    run_dir = run_copy(made, stage, tmp_path)
    result = run_export(run_dir, tmp_path / "out")
    assert result.returncode == 0, result.stderr[-3000:]
    model, meta = load_model_dir(tmp_path / "out")
    reference = torch.load(run_dir / "reference_step_2.pt", weights_only=True)
    assert meta["step"] == 2
    assert all(torch.equal(model.state_dict()[name], reference[name].float()) for name in reference)


def test_export_refuses_a_universal_copy(made, tmp_path):
    from launch.deepspeed.universal import to_universal

    run_dir = run_copy(made, 2, tmp_path)
    root, universal = to_universal(ckpt.checkpoint_root(run_dir), TAGS[1])
    assert universal == ckpt.universal_tag_for(TAGS[1])
    assert_one_line_error(run_export(root / universal, tmp_path / "out"), "universal")


def test_a_universal_copy_is_verified_and_rebuilt_when_damaged(made, tmp_path):
    from launch.deepspeed.universal import to_universal

    run_dir = run_copy(made, 2, tmp_path)
    root = ckpt.checkpoint_root(run_dir)
    _, universal = to_universal(root, TAGS[1])
    copy = root / universal
    assert ckpt.verify(copy) is None
    weights = sorted(copy.glob("zero/*/fp32.pt"))[0]
    truncate(weights)
    assert to_universal(root, TAGS[1]) == (root, universal)
    assert ckpt.verify(copy) is None  # converted again
    # The checkpoint rewritten since (a save into its tag): the copy of the old contents is not
    # reused.
    (root / TAGS[1] / "client_state.json").write_text(
        json.dumps({"step": 2, "world_size": 1, "rewritten": True})
    )
    ckpt.write_integrity(root / TAGS[1])
    assert to_universal(root, TAGS[1]) == (root, universal)
    assert json.loads((copy / "client_state.json").read_text())["rewritten"] is True


@pytest.mark.parametrize("integrity", [True, False], ids=["verified", "legacy"])
@pytest.mark.parametrize(
    "stage,planted_in", [(0, MODEL_STATES), (2, MODEL_STATES), (2, OPTIM_STATES)]
)
def test_export_refuses_a_planted_pickle_payload(made, tmp_path, stage, planted_in, integrity):
    run_dir = run_copy(made, stage, tmp_path, integrity=False)
    tag_dir = ckpt.checkpoint_root(run_dir) / TAGS[1]
    marker = tmp_path / "payload-ran"
    # our own file, before the plant
    state = torch.load(tag_dir / planted_in, map_location="cpu", weights_only=False)
    state["planted"] = Planted(marker)
    torch.save(state, tag_dir / planted_in)
    if integrity:  # whoever can plant a payload can record its checksum too
        ckpt.write_integrity(tag_dir)
    assert_one_line_error(run_export(run_dir, tmp_path / "out"), planted_in)
    assert not marker.exists()
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("stage,planted_in", [(0, MODEL_STATES), (2, OPTIM_STATES)])
def test_the_weights_only_load_itself_refuses_a_payload(
    made, tmp_path, monkeypatch, stage, planted_in
):
    """Past the pre-scan (one that parses a pickle differently, say), the load is the guard:
    ours, and DeepSpeed's own torch.load(weights_only=False) in its ZeRO consolidation."""
    from launch.deepspeed import safe_load

    run_dir = run_copy(made, stage, tmp_path, integrity=False)
    root = ckpt.checkpoint_root(run_dir)
    marker = tmp_path / "payload-ran"
    state = torch.load(root / TAGS[1] / planted_in, map_location="cpu", weights_only=False)
    state["planted"] = Planted(marker)
    torch.save(state, root / TAGS[1] / planted_in)
    monkeypatch.setattr(safe_load, "_refuse_code_in", lambda tag_dir: None)
    monkeypatch.delenv("TORCH_FORCE_WEIGHTS_ONLY_LOAD", raising=False)
    with pytest.raises(UserError, match="refused") as failure:
        safe_load.consolidated_state_dict(root, TAGS[1])
    assert "\n" not in str(failure.value) and not marker.exists()
    # the process's environment is given back
    assert "TORCH_FORCE_WEIGHTS_ONLY_LOAD" not in os.environ


# ----------------------------------------------------------------------------- exported directories


def test_exported_directories_are_read_without_unpickling(tmp_path, monkeypatch):
    """evaluate and translate (launch.decoding) and warm start (launch.model_dir.load_model_dir) read
    model.safetensors and config.json only."""
    import pickle

    from launch import decoding
    from launch.model_dir import load_model_dir, save_model_dir
    from model import ModelConfig, build_model

    tokenizer = tmp_path / "tokenizer.model"
    tokenizer.write_bytes(b"a stand-in for a SentencePiece model")
    configs = {
        "gpt": ModelConfig(
            arch="gpt", vocab_size=64, d_model=32, n_layers=1, n_heads=2, max_seq_len=16
        ),
        "seq2seq": ModelConfig(
            arch="seq2seq", vocab_size=64, d_model=32, n_layers=1, n_heads=2, max_seq_len=16
        ),
    }
    for arch, model_cfg in configs.items():
        save_model_dir(
            tmp_path / arch,
            build_model(model_cfg).state_dict(),
            model_cfg,
            tokenizer,
            {"task": arch, "step": 1},
        )

    def refuse(*args, **kwargs):
        raise AssertionError("an exported directory was unpickled")

    monkeypatch.setattr(torch, "load", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(pickle, "Unpickler", refuse)
    model, meta = load_model_dir(tmp_path / "gpt")  # what init.encoder / init.decoder read
    assert meta["model_config"] == configs["gpt"]
    translation = decoding.load_model(decoding.inspect_checkpoint(tmp_path / "seq2seq"))
    assert sum(p.numel() for p in translation.parameters()) > 0
    for broken in ("{not json", "[]", '{"task": "causal_lm"}'):
        (tmp_path / "gpt" / "config.json").write_text(broken)
        with pytest.raises(UserError, match="config.json") as failure:
            load_model_dir(tmp_path / "gpt")
        assert "\n" not in str(failure.value)


# ----------------------------------------------------------------------------- as a script


if __name__ == "__main__":
    from launch.distributed import run_rank

    # run_rank ends the process with os._exit, so no rank can abort in gloo's teardown.
    run_rank(
        {
            "make": lambda: make(Path(sys.argv[2])),
            "agree": lambda: agree(Path(sys.argv[2]), Path(sys.argv[3])),
        }[sys.argv[1]]
    )
