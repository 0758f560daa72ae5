"""`python -m launch.lm_eval checkpoint=DIR [tasks=[cloze,choice]] [key=value ...]`: an
exported GPT's scores.

The keys are `launch.lm_eval.config.LmEvalConfig`'s (`--help` lists them). DIR is an export of
`launch.export`: ours (scored through `OurLM`) or format=hf (through lm-eval's `HFLM`, which
loads it with `transformers` and its fast tokenizer). The tasks are built from the held-out split
of the dataset the model was trained on (`launch.lm_eval.tasks`); everything is checked before
the model is loaded. The results go to `out` (lm-eval's results, with `metrics` flattened as
lm_eval/TASK/METRIC and what was scored), the console (lm-eval's table) and W&B (`wandb.*`).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from common.atomic import atomic_write
from common.configure import UserError, config_to_dict, parse_cli
from common.hashing import file_sha256
from launch.lm_eval.config import LmEvalConfig
from launch.lm_eval.tasks import check_tasks, held_out_texts

USAGE = """usage: python -m launch.lm_eval [CONFIG.yaml] checkpoint=DIR [tasks=[cloze,choice]] \
[format=auto|ours|hf] [key.sub=value ...]

An exported GPT scored by lm-evaluation-harness on tasks built from its dataset's held-out split."""
FORMATS = ("auto", "ours", "hf")


def main(argv: list[str] | None = None) -> int:
    cfg = parse_cli(
        LmEvalConfig, sys.argv[1:] if argv is None else argv, usage=USAGE, config_optional=True
    )
    lm_eval_scores(cfg)
    return 0


def lm_eval_scores(cfg: LmEvalConfig) -> dict:
    """Check the inputs, score, write `out`, print the table, log to W&B; the results written."""
    from launch.preconditions import check_writable_dir
    from launch.tracking import Tracker, new_run_id, wandb_settings

    names = check_tasks(cfg.tasks)
    if cfg.split not in ("valid", "test"):
        raise UserError(f"split: {cfg.split!r} is not valid or test (the held-out splits)")
    if cfg.limit < 0 or cfg.micro_batch_size < 1:
        raise UserError(
            "limit: must be 0 (all) or positive"
            if cfg.limit < 0
            else "micro_batch_size: must be positive"
        )
    wandb_settings(cfg.wandb)  # a mode W&B does not know: one line, now
    directory = Path(cfg.checkpoint)
    fmt, meta = export_format(directory, cfg.format)
    data_dir = cfg.data_dir or (meta.get("dataset") or {}).get("data_dir") or ""
    if not data_dir:
        raise UserError(
            f"data_dir: {directory} does not say which dataset it was trained on; name one"
        )
    out = Path(cfg.out or directory / f"lm_eval-{cfg.split}.json")
    check_writable_dir(out.absolute().parent, "out")
    texts = held_out_texts(data_dir, cfg.split, export_tokenizer_sha256(directory, data_dir))

    import torch  # after the checks: --help and bad input answer without torch's import

    lm = load_lm(
        directory,
        fmt,
        cfg.micro_batch_size,
        cfg.device or ("cuda" if torch.cuda.is_available() else "cpu"),
    )
    from launch.lm_eval.score import flat_metrics, score, table

    print(
        f"lm_eval: {directory} ({fmt}) on {data_dir} {cfg.split}: {len(texts)} "
        f"documents, tasks {', '.join(names)}",
        file=sys.stderr,
    )
    results = score(
        lm, names, texts, limit=cfg.limit, seed=cfg.seed, bootstrap_iters=cfg.bootstrap_iters
    )
    metrics = flat_metrics(results)
    record = {
        "metrics": metrics,
        "checkpoint": str(directory.resolve()),
        "format": fmt,
        "data_dir": str(data_dir),
        "split": cfg.split,
        "limit": cfg.limit,
        "seed": cfg.seed,
        "step": meta.get("step"),
        **{
            key: results[key]
            for key in ("results", "versions", "n-shot", "higher_is_better", "n-samples")
        },
    }
    atomic_write(out, json.dumps(record, indent=1, default=str) + "\n")
    print(table(results), flush=True)
    tracker = Tracker(
        enabled=True,
        settings=cfg.wandb,
        run_dir=out.absolute().parent,
        run_id=new_run_id(),
        config=config_to_dict(cfg),
        summary={"checkpoint": record["checkpoint"], "format": fmt},
    )
    tracker.log(metrics, step=int(meta.get("step") or 0))
    tracker.finish(metrics)
    print(f"scores in {out}", file=sys.stderr)
    return record


def export_tokenizer_sha256(directory: Path, data_dir: str) -> str:
    """The sha256 the export's tokenizer counts as: the dataset's when it is the dataset's
    tokenizer, by its file or by the ids it gives (`pipeline.format.dataset_tokenizer_difference`);
    else that of its copy of the dataset's tokenizer file (its tokenizer.model or tokenizer.json,
    whichever the dataset's manifest names), or "missing"."""
    from pipeline.format import dataset_tokenizer_difference, read_manifest, tokenizer_files

    manifest = read_manifest(data_dir)
    if dataset_tokenizer_difference(directory, data_dir, manifest) is None:
        return manifest["tokenizer"]["sha256"]
    mine = directory / tokenizer_files(manifest)[0]
    return file_sha256(mine) if mine.is_file() else "missing"


def export_format(directory: Path, fmt: str) -> tuple[str, dict]:
    """(ours | hf, the export's provenance) for an exported GPT directory; UserError, one line,
    for anything else: no export, a BERT or translation model, a format that is
    not the directory's."""
    if fmt not in FORMATS:
        raise UserError(f"format: {fmt!r} is not one of {', '.join(FORMATS)}")
    from launch.model_dir import CONFIG, PROVENANCE, read_json
    from pipeline.tokenizer import tokenizer_file_in

    config_file = directory / CONFIG
    if not config_file.is_file() or not tokenizer_file_in(directory).is_file():
        raise UserError(
            f"{directory} is not an exported model directory with its tokenizer (run launch.export)"
        )
    config = read_json(config_file)
    found = "ours" if isinstance(config.get("model"), dict) else "hf"
    if fmt != "auto" and fmt != found:
        what = (
            "in our format (format=ours)" if found == "ours" else "a Hugging Face one (format=hf)"
        )
        raise UserError(f"format={fmt}: the export in {directory} is {what}")
    arch = config["model"].get("arch") if found == "ours" else config.get("model_type")
    from model.hf_decoders import FAMILIES

    if arch not in ("gpt", "gpt2", *FAMILIES):
        raise UserError(
            f"{directory} holds a {arch} model; lm_eval scores a GPT (a causal language model)"
        )
    meta = read_json(directory / PROVENANCE) if (directory / PROVENANCE).is_file() else {}
    return found, meta


def load_lm(directory: Path, fmt: str, batch_size: int, device: str):
    """Our `OurLM` over our export, lm-eval's `HFLM` over a Hugging Face one, both on `device` in
    float32 and conditioning an empty context on the token a document follows in training
    (`Specials.document_prefix`: ours </s>). HFLM's logits cache
    is off: it shares one forward among requests whose context + continuation[:-1] are the same
    tokens, and lm-eval 0.4.13 then reads a shorter continuation's scores at the longer one's
    positions (lm-eval#2984 fixed the greedy flag only). Our cloze and choice requests of one
    document are such pairs: the cache gave the cloze target wrong log-likelihoods."""
    from pipeline.tokenizer import load_tokenizer

    if fmt == "ours":
        from launch.lm_eval.ours import OurLM

        return OurLM.from_export(directory, batch_size=batch_size, device=device)
    from lm_eval.models.huggingface import HFLM

    from common.weights import load_failure

    try:
        return HFLM(
            pretrained=str(directory),
            backend="causal",
            device=device,
            dtype="float32",
            batch_size=batch_size,
            prefix_token_id=load_tokenizer(directory).specials.document_prefix,
            logits_cache=False,
        )
    # a truncated model.safetensors, a pytorch_model.bin the weights-only load refuses, ...
    except Exception as err:
        raise UserError(f"{directory}: the model cannot be loaded: {load_failure(err)}") from err
