"""`python -m pipeline.inspect DATASET`: what each curation stage of a prepared dataset dropped,
per source, rule and split, the languages detected, and where the samples of dropped texts are.

Read from manifest.json alone (a local directory or a URL, as training reads a dataset), so it
answers in a second for a dataset of any size.
"""

from __future__ import annotations

import sys

from common.configure import UserError, run_main
from pipeline.format import SPLITS, read_manifest

USAGE = "usage: python -m pipeline.inspect DATASET_DIR"


def curation_table(manifest: dict) -> list[str]:
    """The dropped-text table: a row per (source, stage.rule), a column per split."""
    curation = manifest.get("curation") or {}
    rows = [
        (source, f"{stage}.{rule}", counts)
        for source, stages in curation.get("by_source", {}).items()
        for stage, rules in stages.items()
        for rule, counts in rules.items()
    ]
    if not rows:
        return ["curation: no stage dropped or changed anything (or none was enabled)"]
    width = max(len(source) for source, _, _ in rows)
    rule_width = max(len(rule) for _, rule, _ in rows)
    lines = [f"{'source':<{width}}  {'rule':<{rule_width}}" + "".join(f"{s:>9}" for s in SPLITS)]
    for source, rule, counts in rows:
        lines.append(
            f"{source:<{width}}  {rule:<{rule_width}}"
            + "".join(f"{counts.get(split, 0):>9,}" for split in SPLITS)
        )
    return lines


def report(manifest: dict, where: str) -> str:
    curation = manifest.get("curation") or {}
    lines = [f"dataset {where}", ""]
    lines += curation_table(manifest)
    notes = (
        "pii.* rules count replacements, c4.*_lines rules count removed lines, "
        "*.too_short* texts kept unjudged; every other rule counts dropped texts"
    )
    lines += ["", notes]
    for source, sides in curation.get("languages", {}).items():
        for side, codes in sides.items():
            top = sorted(codes.items(), key=lambda item: (-item[1], item[0]))
            shown = ", ".join(f"{code} {n:,}" for code, n in top[:8])
            more = f", {len(top) - 8} more" if len(top) > 8 else ""
            lines.append(f"languages of {source} ({side}): {shown}{more}")
    near = curation.get("near_dedup")
    if near:
        lines.append(
            f"near-duplicates: {near['candidate_pairs']:,} candidate pairs, "
            f"{near['verified_pairs']:,} verified, {near['removed']:,} removed; "
            f"{near['parameters']}"
        )
    deco = curation.get("decontamination")
    if deco:
        lines.append(
            "decontamination against: "
            + ", ".join(f"{origin} ({facts['texts']:,} texts)" for origin, facts in deco.items())
        )
    files = curation.get("sample_files", [])
    if files:
        lines.append(f"samples of dropped texts ({len(files)} files, JSON lines), under {where}:")
        lines += [f"  {name}" for name in files]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or argv[0] in ("-h", "--help"):
        if argv and argv[0] in ("-h", "--help"):
            print(USAGE)
            return 0
        raise UserError(USAGE)
    print(report(read_manifest(argv[0]), argv[0]))
    return 0


if __name__ == "__main__":
    run_main(main)
