"""`python -m launch.evaluate [CONFIG.yaml] checkpoint=DIR [key=value ...]`: BLEU and chrF of
a translation model.

The keys are `launch.config.EvaluateConfig`'s (`--help` lists them). The checkpoint is an
exported model directory (`launch.export`) or a training run (run directory, `checkpoints/`
or a `step_*` checkpoint; consolidated on the fly). The split's pairs are read
from the dataset's translation shards in manifest order, every shard checked against its
sha256; sources and references are the SentencePiece decoding of the stored ids. Hypotheses
come from batched beam search (`launch.decoding`); BLEU and chrF are sacrebleu's corpus
scores (Post 2018, "A Call for Clarity in Reporting BLEU Scores"), printed with their
signatures. Rank 0 writes, under `out` (default CHECKPOINT/eval-SPLIT):

    hypotheses.txt  one line per pair, in split order
    references.txt  sources.txt
    scores.json     {bleu, chrf, signature_bleu, signature_chrf, n, beam, split, checkpoint, ...}

The same command runs under torchrun, the deepspeed launcher or srun (`launch.distributed`).
The batches are made from the source lengths alone and dealt round-robin to the ranks, so
each batch holds the same sentences, padded alike, whatever the world size; rank 0 gathers
the hypotheses and puts them back in order: any world size gives the scores of one rank.
Under ZeRO-3 (`deepspeed.zero_stage=3`) every forward gathers parameters from every rank, so a rank
that stops early hangs the others (transformers#20130): each rank then runs the same number of
batches (a short rank decodes a one-token dummy batch) and every batch exactly `max_len`
decoder steps (`generate(synced=True)`). Stages 1 and 2 partition only optimizer states and
gradients, which evaluation has none of: there, as at stage 0, each rank holds the whole model.
"""

from __future__ import annotations

import json
import sys
import tarfile
import time
import warnings
from pathlib import Path
from typing import Mapping, TextIO

import numpy as np
import torch

from common.configure import UserError, parse_cli, strip_launcher_args
from common.hashing import file_sha256
from common.progress import meter
from launch import distributed as dist
from launch import launcher
from launch.config import EvaluateConfig
from launch.decoding import (
    Checkpoint,
    check_decoding,
    detokenize,
    inspect_checkpoint,
    length_sorted_batches,
    load_model,
    results_only_on_stdout,
    source_ids,
    translate_ids,
)
from launch.deepspeed.config import zero_stage_problem
from launch.preconditions import check_writable_dir
from pipeline import remote
from pipeline.format import (
    FIELDS,
    SPLITS,
    dataset_tokenizer_difference,
    decode_array,
    read_manifest,
    shard_entries,
    tokenizer_record,
)
from pipeline.load.shards import decode_sample
from pipeline.tokenizer import load_tokenizer

USAGE = """usage: python -m launch.evaluate [CONFIG.yaml] checkpoint=DIR [key.sub=value ...]

Corpus BLEU and chrF of a translation model on one split; also under torchrun or the deepspeed \
launcher."""


def read_pairs(
    data_dir: str | Path,
    split: str,
    limit: int = 0,
    fetch: remote.FetchConfig | None = None,
    vocab_size: int | Mapping[str, int] | None = None,
) -> list[tuple[np.ndarray, np.ndarray]]:
    """(source ids, target ids) of a split's translation shards, in manifest order, then tar order.
    With `vocab_size` (one, or each field's), a sample whose ids fall outside it (which training
    skips and counts) is a UserError naming the shard and the sample: the model's embedding would
    fail on it."""
    # a URL: read through the shard cache
    data_dir = data_dir if remote.is_url(data_dir) else Path(data_dir)
    fields = FIELDS["translation"]
    pairs: list[tuple[np.ndarray, np.ndarray]] = []
    for entry in shard_entries(read_manifest(data_dir, fetch), "translation", split):
        if limit and len(pairs) >= limit:
            break
        path = Path(
            remote.local_file(
                remote.join(data_dir, entry["path"]),
                fetch,
                size=entry.get("bytes"),
                sha256=entry.get("sha256"),
            )
        )
        if not path.is_file() or (entry.get("sha256") and file_sha256(path) != entry["sha256"]):
            raise UserError(
                f"{path}: missing or not the shard the manifest lists (sha256 differs); "
                "an evaluation needs every pair"
            )
        samples: dict[str, dict[str, bytes]] = {}
        with tarfile.open(path) as tar:
            for member in tar:
                if member.isfile():
                    key, _, suffix = member.name.partition(".")
                    samples.setdefault(key, {})[suffix] = tar.extractfile(member).read()
        if len(samples) != int(entry["samples"]):
            raise UserError(f"{path}: {len(samples)} samples, the manifest says {entry['samples']}")
        for key, members in samples.items():  # insertion order: the tar's
            if vocab_size is None:
                pairs.append(tuple(decode_array(members[f"{name}.npy"]) for name in fields))
                continue
            raw = {name: members.get(f"{name}.npy") for name in fields}
            try:
                pairs.append(tuple(decode_sample(raw, fields, vocab_size)))
            except ValueError as err:
                raise UserError(
                    f"{remote.join(data_dir, entry['path'])}: sample {key}: {err}; an evaluation "
                    "needs every pair (pipeline.validate lists every such sample)"
                ) from err
    if not pairs:
        raise UserError(f"{data_dir}: the {split} split has no translation pairs")
    return pairs[:limit] if limit else pairs


def check_tokenizer(ckpt: Checkpoint, data_dir: str | Path) -> dict:
    """The dataset's manifest, once each side's tokenizer is known to be the checkpoint's: the same
    file (sha256), or one that gives the same ids (`format.dataset_tokenizer_difference`)."""
    manifest = read_manifest(data_dir)
    data_sha = (manifest.get("tokenizer") or {}).get("sha256")
    if data_sha != ckpt.tokenizer_sha256 and (
        differs := dataset_tokenizer_difference(ckpt.tokenizer_path, data_dir, manifest)
    ):
        raise UserError(
            f"tokenizer mismatch: {ckpt.path} was trained with tokenizer "
            f"{ckpt.tokenizer_sha256[:12]}, {data_dir} was prepared with {str(data_sha)[:12]} "
            f"({differs}); evaluate on data prepared with the model's tokenizer"
        )
    # The target side's tokenizer on either side: its own (under target/), else the source side's.
    theirs = tokenizer_record(manifest, "target")["sha256"]
    ours = file_sha256(ckpt.target_path)
    if theirs != ours and (
        differs := dataset_tokenizer_difference(ckpt.target_path, data_dir, manifest, "target")
    ):
        raise UserError(
            f"tokenizer mismatch: {ckpt.path}'s target side was trained with "
            f"{ours[:12]}, {data_dir}'s targets were encoded with {theirs[:12]} ({differs}); "
            "evaluate on data prepared with the model's tokenizers"
        )
    return manifest


def rank_batches(batches: list[list[int]], rank: int, world_size: int) -> list[list[int]]:
    """Batches j with j % world_size == rank: long and short batches spread over the ranks."""
    return batches[rank::world_size]


def score(hypotheses: list[str], references: list[str]) -> dict:
    from sacrebleu.metrics import BLEU, CHRF

    bleu, chrf = BLEU(), CHRF()
    bleu_score = bleu.corpus_score(hypotheses, [references])
    chrf_score = chrf.corpus_score(hypotheses, [references])
    return {
        "bleu": bleu_score.score,
        "chrf": chrf_score.score,
        "signature_bleu": str(bleu.get_signature()),
        "signature_chrf": str(chrf.get_signature()),
        "bleu_detail": str(bleu_score),
        "chrf_detail": str(chrf_score),
    }


def _write_lines(path: Path, lines: list[str]) -> None:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")


def evaluate(cfg: EvaluateConfig, stdout: TextIO | None = None) -> dict | None:
    """Scores on rank 0 (None on the others), printed to `stdout` (default sys.stdout)."""
    if cfg.split not in SPLITS:
        raise UserError(f"split: {cfg.split!r} is not one of {', '.join(SPLITS)}")
    if problem := zero_stage_problem(cfg.deepspeed.zero_stage):
        raise UserError(problem)
    ckpt = inspect_checkpoint(cfg.checkpoint)
    data_dir = cfg.data_dir or ckpt.data_dir
    if not data_dir:
        raise UserError(
            f"data_dir: {cfg.checkpoint} does not say which dataset it was trained on; name one"
        )
    check_tokenizer(ckpt, data_dir)  # before any compute
    max_len = check_decoding(ckpt.model_cfg, cfg.beam, cfg.max_len, cfg.micro_batch_size)
    if cfg.limit < 0:
        raise UserError(f"limit={cfg.limit}: must be 0 (all) or more")
    user_ds = {}
    if cfg.deepspeed.config_file:
        path = Path(cfg.deepspeed.config_file)
        try:
            user_ds = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise UserError(f"deepspeed.config_file: {path}: {err}") from err
    out = Path(cfg.out or Path(cfg.checkpoint) / f"eval-{cfg.split}")
    check_writable_dir(out, "out")  # before the model is loaded and the split decoded

    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed.*")
    denv = dist.read_env()
    dist.set_threads(cfg.threads_per_rank, denv)
    zero3 = cfg.deepspeed.zero_stage == 3
    if denv.world_size > 1 or zero3:
        dist.init_process_group(denv, cfg.dist_timeout_s)
    try:
        return _evaluate(
            cfg, ckpt, data_dir, max_len, user_ds, out, denv, zero3, stdout or sys.stdout
        )
    finally:
        dist.destroy()


def _evaluate(
    cfg: EvaluateConfig,
    ckpt: Checkpoint,
    data_dir,
    max_len: int,
    user_ds: dict,
    out: Path,
    denv: dist.DistEnv,
    zero3: bool,
    stdout: TextIO,
) -> dict | None:
    vocab = {
        name: ckpt.model_cfg.for_stack(stack).vocab_size
        for name, stack in (("src_ids", "encoder"), ("tgt_ids", "decoder"))
    }
    pairs = read_pairs(data_dir, cfg.split, cfg.limit, vocab_size=vocab)
    sources, truncated = zip(
        *(source_ids(src, ckpt.max_source_tokens, ckpt.specials) for src, _ in pairs)
    )
    model = load_model(ckpt)
    if zero3:
        from launch.deepspeed.config import inference_config
        from launch.deepspeed.engine import Engine

        engine = Engine(
            model, None, None, inference_config(cfg.micro_batch_size, denv.world_size, user_ds)
        )
        model, device = engine.module, engine.device
        if denv.is_main:
            split, total = engine.partitioned()
            print(
                f"ZeRO-3: {split} of {total} parameter tensors partitioned "
                f"over {denv.world_size} ranks",
                file=sys.stderr,
            )
    else:
        device = (
            torch.device(f"cuda:{denv.local_rank}")
            if torch.cuda.is_available()
            else torch.device("cpu")
        )
        model = model.to(device)
    if denv.is_main:
        print(
            f"evaluating {ckpt.path} on {data_dir} {cfg.split}: {len(pairs)} pairs, beam "
            f"{cfg.beam}, max_len {max_len}, world {denv.world_size}, "
            f"ZeRO-{cfg.deepspeed.zero_stage}",
            file=sys.stderr,
        )
        if any(truncated):
            print(
                f"warning: {sum(truncated)} sources longer than the model's limit "
                f"({ckpt.max_source_tokens} tokens + the source frame) were truncated",
                file=sys.stderr,
            )

    batches = length_sorted_batches([len(s) for s in sources], cfg.micro_batch_size)
    mine = rank_batches(batches, denv.rank, denv.world_size)
    rounds = -(-len(batches) // denv.world_size)  # the most batches any rank has
    synced = zero3 and denv.world_size > 1
    start = time.perf_counter()
    hypotheses: dict[int, list[int]] = {}
    # Rank 0's share of the sentences: the ranks' batches are dealt alike, so its ETA is the job's.
    desc = f"evaluate {cfg.split}" + (
        f" (rank 0 of {denv.world_size})" if denv.world_size > 1 else ""
    )
    with meter(sum(map(len, mine)), desc, "sentence", enabled=denv.is_main) as shown:
        for round_index in range(rounds if synced else len(mine)):
            indices = mine[round_index] if round_index < len(mine) else []
            # a dummy row keeps this rank in every forward
            batch = [sources[i] for i in indices] or [[ckpt.model_cfg.eos_id]]
            outputs = translate_ids(
                model,
                batch,
                beam=cfg.beam,
                max_len=max_len,
                length_penalty=cfg.length_penalty,
                synced=synced,
                device=device,
                max_len_a=cfg.max_len_a,
                max_len_b=cfg.max_len_b,
            )
            hypotheses.update(zip(indices, outputs))
            shown.update(len(indices))
    gathered = dist.all_gather_object(hypotheses)
    elapsed = time.perf_counter() - start
    if not denv.is_main:
        return None

    merged = {index: ids for part in gathered for index, ids in part.items()}
    if sorted(merged) != list(range(len(pairs))):
        raise RuntimeError(f"{len(merged)} hypotheses gathered for {len(pairs)} pairs")
    tokenizer, target = load_tokenizer(ckpt.tokenizer_path), load_tokenizer(ckpt.target_path)
    hyp_text = [detokenize(target, merged[i]) for i in range(len(pairs))]
    ref_text = [detokenize(target, tgt) for _, tgt in pairs]
    src_text = [detokenize(tokenizer, src) for src, _ in pairs]
    result = {
        **score(hyp_text, ref_text),
        "n": len(pairs),
        "beam": cfg.beam,
        "split": cfg.split,
        "checkpoint": str(Path(cfg.checkpoint).resolve()),
        "data": data_dir if remote.is_url(data_dir) else str(Path(data_dir).resolve()),
        "max_len": max_len,
        "max_len_a": cfg.max_len_a,
        "max_len_b": cfg.max_len_b,
        "length_penalty": cfg.length_penalty,
        "truncated_sources": sum(truncated),
        "world_size": denv.world_size,
        "zero_stage": cfg.deepspeed.zero_stage,
        "decode_seconds": round(elapsed, 3),
    }
    out.mkdir(parents=True, exist_ok=True)
    _write_lines(out / "hypotheses.txt", hyp_text)
    _write_lines(out / "references.txt", ref_text)
    _write_lines(out / "sources.txt", src_text)
    (out / "scores.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"{result['bleu_detail']} | {result['signature_bleu']}", file=stdout)
    print(f"{result['chrf_detail']} | {result['signature_chrf']}", file=stdout, flush=True)
    print(
        f"{len(pairs)} pairs decoded in {elapsed:.1f} s; hypotheses and scores in {out}",
        file=sys.stderr,
    )
    return result


def main(argv: list[str] | None = None) -> int:
    # Under the deepspeed launcher every rank also gets --local_rank=N; the rank comes from the
    # environment.
    argv = strip_launcher_args(sys.argv[1:] if argv is None else argv)
    cfg = parse_cli(EvaluateConfig, argv, usage=USAGE, config_optional=True)
    with results_only_on_stdout() as stdout:
        evaluate(cfg, stdout)
    return 0


if __name__ == "__main__":
    launcher.die_with_parent()
    dist.run_rank(main)  # ends with os._exit: see run_rank
