"""benchmarks/fixed_seed_losses.py's comparison of two runs' metrics rows (no training here)."""

from benchmarks.fixed_seed_losses import compare, table


def rows(losses: list[float], evals: dict[int, float], seconds: float) -> list[dict]:
    """metrics.jsonl-like rows: a step's figures, an eval loss at some steps, timing and memory."""
    out = []
    for step, loss in enumerate(losses, start=1):
        row = {"step": step, "train/loss": loss, "train/lr": 1e-4 * step, "train/grad_norm": 1.5}
        row.update({"train/tokens_seen": 512 * step, "perf/tokens_per_s": seconds * step})
        row["memory/max_rss_mb"] = 300 + seconds
        if step in evals:
            row["eval/loss"] = evals[step]
        out.append(row)
    return out


LOSSES = [5.79, 5.78, 5.71, 5.66, float("nan")]
EVALS = {2: 5.6, 5: 5.4}


def test_identical_runs_pass_whatever_their_timing():
    result = compare(rows(LOSSES, EVALS, 1.0), rows(LOSSES, EVALS, 2.0))
    assert result.identical and result.first_diff is None and result.differing == []
    assert result.steps == [1, 2, 3, 4, 5] and result.evaluations == 2
    assert set(result.max_diff.values()) == {0.0}
    assert "all figures identical  yes" in table("gpt", result)


def test_a_differing_loss_is_reported_at_its_step():
    after = [*LOSSES]
    after[2] += 2e-7  # step 3
    result = compare(rows(LOSSES, EVALS, 1.0), rows(after, {2: 5.6, 5: 5.4000001}, 1.0))
    assert not result.identical and result.first_diff == 3
    assert result.differing == ["eval/loss", "train/loss"]
    assert 0 < result.max_diff["loss"] < 3e-7 and 0 < result.max_diff["eval loss"] < 2e-7
    assert result.max_diff["lr"] == result.max_diff["grad norm"] == 0.0
    assert "losses bitwise equal   no" in table("gpt", result)
    assert "first differing step   3" in table("gpt", result)


def test_missing_steps_fail_and_a_new_figure_is_only_noted():
    before = rows(LOSSES, EVALS, 1.0)
    after = rows(LOSSES[:4], {2: 5.6}, 1.0)
    for row in after:
        row["train/new_figure"] = 1.0
    result = compare(before, after)
    assert not result.identical and result.unmatched_steps == [5]
    assert result.first_diff is None and result.one_sided == ["train/new_figure"]
