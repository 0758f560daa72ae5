"""The main job's results: the table of BLEU and chrF by start, and the report directory
(summary.md and .json, the loss curves)."""

from __future__ import annotations

import json
from pathlib import Path

from launch.config import MainConfig
from launch.report import plot_losses, read_metrics


def _last(run_dir: Path, key: str):
    values = [row[key] for row in read_metrics(run_dir) if key in row]
    return values[-1] if values else None


def _final(run_dir: Path) -> dict:
    return json.loads((run_dir / "final.json").read_text())


def summary_table(cfg: MainConfig, pretrained: dict, finetuned: dict) -> str:
    lines = [
        "| pretraining | steps | tokens seen | final train loss | valid loss | valid perplexity |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, run_dir in pretrained.items():
        final = _final(run_dir)
        lines.append(
            f"| {name} | {final['step']} | {final['tokens_seen']:,} | "
            f"{_last(run_dir, 'train/loss'):.3f} | {final.get('eval/loss', float('nan')):.3f} | "
            f"{final.get('eval/perplexity', float('nan')):.1f} |"
        )
    header = " | ".join(f"{split} BLEU | {split} chrF" for split in cfg.eval_splits)
    lines += [
        "",
        "| fine-tuning start (encoder/decoder) | steps | tokens seen | final train loss | valid "
        f"loss | valid perplexity | {header} |",
        "|---|---:|---:|---:|---:|---:|" + "---:|" * (2 * len(cfg.eval_splits)),
    ]
    baseline = finetuned.get("random/random")
    for start, (run_dir, scores) in finetuned.items():
        final = _final(run_dir)
        cells = []
        for split in cfg.eval_splits:
            bleu = scores[split]["bleu"]
            delta = (
                f" ({bleu - baseline[1][split]['bleu']:+.1f})"
                if baseline and start != "random/random"
                else ""
            )
            cells.append(f"{bleu:.1f}{delta} | {scores[split]['chrf']:.1f}")
        lines.append(
            f"| {start} | {final['step']} | {final['tokens_seen']:,} | "
            f"{_last(run_dir, 'train/loss'):.3f} | {final.get('eval/loss', float('nan')):.3f} | "
            f"{final.get('eval/perplexity', float('nan')):.1f} | {' | '.join(cells)} |"
        )
    signature = (
        next(iter(finetuned.values()))[1][cfg.eval_splits[0]].get("signature_bleu", "")
        if finetuned
        else ""
    )
    lines += [
        "",
        "Tokens: input tokens of all ranks (fine-tuning: source + target). Losses in nats per "
        "target token; perplexity = exp(valid loss).",
        f"BLEU in parentheses: difference from random/random. sacrebleu: {signature}",
    ]
    return "\n".join(lines)


def write_report(
    cfg: MainConfig, pretrained: dict, finetuned: dict, seconds: float
) -> tuple[str, Path]:
    """summary.md, summary.json and the loss-curve PNGs into OUT/report; returns the table."""
    report = Path(cfg.out_dir) / "report"
    report.mkdir(parents=True, exist_ok=True)
    table = summary_table(cfg, pretrained, finetuned)
    plots = []
    if pretrained:
        plots.append(
            plot_losses(
                pretrained,
                report / "pretrain_loss.png",
                "Pretraining: GPT (causal LM) and BERT (masked LM)",
            )
        )
    if finetuned:
        runs = {start: run_dir for start, (run_dir, _) in finetuned.items()}
        plots.append(
            plot_losses(
                runs,
                report / "finetune_loss.png",
                "Translation fine-tuning by start (encoder/decoder)",
            )
        )
    images = "\n".join(f"![{p.stem}]({p.name})" for p in plots)
    (report / "summary.md").write_text(
        f"# Main job summary\n\n{table}\n\nWall time of this invocation: "
        f"{seconds:.0f} s.\n\n{images}\n"
    )
    summary = {
        "pretraining": {name: _final(d) for name, d in pretrained.items()},
        "finetuning": {
            start: {"final": _final(d), "scores": scores}
            for start, (d, scores) in finetuned.items()
        },
        "seconds": seconds,
    }
    (report / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return table, report
