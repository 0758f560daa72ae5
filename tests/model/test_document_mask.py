"""Document-aware packing (`data.document_mask`): a packed block's documents are computed as if
each were alone.

The model: with `document_ids`, GPT's logits over a packed block (a fragment of a document cut
by the previous block first, padding where a row is short) equal the logits of each document
run on its own with positions from 0 (learned, sinusoidal or rotary); BERT's likewise
(block-diagonal). FlexAttention (eager on the CPU here) gives the SDPA path's logits and
gradients, grouped key/value heads included. The data: `doc_starts` stored by
prepare become the batch's `document_ids`, checked when read; a dataset prepared without them
is refused with the mask on and read as before with it off. End to end: `launch.train` with
`data.document_mask=true` trains GPT and BERT and says which attention kernel ran.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from trainruns import TINY_SHAPE

from model import BERT, GPT, ModelConfig
from model.attention import document_attention_mask
from model.positions import positions_in_documents

V = 40  # ids 0..4 are pad, unk, <s>, </s>, <mask>
EOS = 3
VARIANTS = {
    "pre-learned": {},
    "post-sinusoidal-relu": dict(norm_position="post", positions="sinusoidal", activation="relu"),
    # Rotary positions restart at each document as learned ones do; grouped key/value heads.
    "llama": dict(positions="rope", norm="rmsnorm", activation="swiglu", n_kv_heads=2, bias=False),
}


def tiny(arch: str, **overrides) -> ModelConfig:
    base = dict(
        arch=arch,
        vocab_size=V,
        d_model=32,
        n_layers=2,
        n_heads=4,
        d_ff=64,
        max_seq_len=32,
        dropout=0.0,
    )
    return ModelConfig(**{**base, **overrides}).validate()


def packed_row(lengths: list[int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, document_ids) of one block of documents of these lengths, each ended by </s> but the
    last (cut by the block's end), the first standing for the rest of one cut by the previous block."""
    g = torch.Generator().manual_seed(seed)
    ids, docs = [], []
    for d, length in enumerate(lengths):
        doc = torch.randint(5, V, (length,), generator=g)
        if d < len(lengths) - 1:
            doc[-1] = EOS
        ids.append(doc)
        docs.append(torch.full((length,), d))
    return torch.cat(ids), torch.cat(docs)


def documents(document_ids: torch.Tensor, length: int) -> list[tuple[int, int]]:
    """(start, end) of each document among the first `length` tokens of a row."""
    ids = document_ids[:length].tolist()
    starts = [t for t in range(length) if t == 0 or ids[t] != ids[t - 1]]
    return list(zip(starts, starts[1:] + [length]))


# Two rows of 30 tokens: the first full, the second with 6 tokens of padding.
ROWS = [([5, 9, 1, 7, 8], 30), ([11, 4, 9], 24)]


def batch() -> dict[str, torch.Tensor]:
    width = max(real for _, real in ROWS)
    input_ids = torch.zeros(len(ROWS), width, dtype=torch.long)
    document_ids = torch.zeros_like(input_ids)
    attention_mask = torch.zeros_like(input_ids)
    for row, (lengths, real) in enumerate(ROWS):
        ids, docs = packed_row(lengths, seed=row)
        assert len(ids) == real
        input_ids[row, :real], document_ids[row, :real], attention_mask[row, :real] = ids, docs, 1
        document_ids[row, real:] = docs[-1]  # padding: as the collator numbers it
    return {"input_ids": input_ids, "attention_mask": attention_mask, "document_ids": document_ids}


def assert_each_document_as_if_alone(model, inputs):
    with torch.no_grad():
        packed = model(**inputs).logits  # (B, T, V)
        kernel = model.attention_kernel
        for row, (_, real) in enumerate(ROWS):
            for start, end in documents(inputs["document_ids"][row], real):
                # positions from 0
                alone = model(inputs["input_ids"][row : row + 1, start:end]).logits
                torch.testing.assert_close(
                    packed[row : row + 1, start:end], alone, rtol=1e-5, atol=1e-5
                )
    return kernel


@pytest.mark.parametrize("arch", ["gpt", "bert"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_packed_block_logits_equal_each_document_alone(arch, variant):
    torch.manual_seed(0)
    model = (GPT if arch == "gpt" else BERT)(tiny(arch, **VARIANTS[variant])).eval()
    assert assert_each_document_as_if_alone(model, batch()) == "sdpa (document mask)"


@pytest.mark.parametrize("arch", ["gpt", "bert"])
def test_without_document_ids_documents_see_each_other(arch):
    """The mask is what makes the difference: without it a later document's logits change."""
    torch.manual_seed(0)
    model = (GPT if arch == "gpt" else BERT)(tiny(arch)).eval()
    inputs = batch()
    with torch.no_grad():
        masked = model(**inputs).logits
        plain = model(inputs["input_ids"], inputs["attention_mask"]).logits
        one_document = model(
            **{**inputs, "document_ids": torch.zeros_like(inputs["document_ids"])}
        ).logits
    assert model.attention_kernel == "sdpa (document mask)"
    start, end = documents(inputs["document_ids"][0], 30)[1]
    assert not torch.allclose(masked[0, start:end], plain[0, start:end], atol=1e-3)
    # One document per row is the plain forward: the same mask and positions by another route
    # (at the real tokens; what padding positions compute is nobody's business).
    real = inputs["attention_mask"].bool()
    torch.testing.assert_close(one_document[real], plain[real], rtol=1e-5, atol=1e-5)


def test_positions_restart_at_each_document():
    document_ids = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 2], [0, 1, 1, 1, 1, 1, 2, 3, 3]])
    assert positions_in_documents(document_ids).tolist() == [
        [0, 1, 2, 0, 1, 0, 1, 2, 3],
        [0, 0, 1, 2, 3, 4, 0, 0, 1],
    ]


def test_dense_document_mask_by_hand():
    document_ids = torch.tensor([[0, 0, 1, 1]])
    key_mask = torch.tensor([[1, 1, 1, 0]])
    causal = document_attention_mask(document_ids, key_mask, causal=True)[0, 0].int().tolist()
    # the pad query sees its document
    assert causal == [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 0]]
    bidirectional = document_attention_mask(document_ids, None, causal=False)[0, 0].int().tolist()
    assert bidirectional == [[1, 1, 0, 0], [1, 1, 0, 0], [0, 0, 1, 1], [0, 0, 1, 1]]


def test_decoding_with_a_cache_takes_no_document_ids():
    from model import KVCache

    model = GPT(tiny("gpt")).eval()
    ids = torch.randint(5, V, (1, 4))
    with pytest.raises(ValueError, match="document_ids"):
        model(ids, cache=KVCache(2), document_ids=torch.zeros_like(ids))
    with pytest.raises(ValueError, match="document_ids has shape"):
        model(ids, document_ids=torch.zeros(1, 3, dtype=torch.long))


@pytest.mark.parametrize("arch", ["gpt", "bert"])
@pytest.mark.parametrize("variant", ["classic", "llama"])
def test_flex_attention_equals_sdpa_on_cpu(arch, variant):
    """The CUDA kernel's mask rule, run by FlexAttention's eager form on the CPU (forward only:
    it has no CPU backward): the logits of SDPA with the dense mask, padding included; with the
    llama variant, FlexAttention's own grouped key/value heads (`enable_gqa`) in a rotary stack."""
    torch.manual_seed(0)
    model = (GPT if arch == "gpt" else BERT)(
        tiny(arch, **(VARIANTS["llama"] if variant == "llama" else {}))
    ).eval()
    inputs = batch()
    logits = {}
    for kernel in ("sdpa", "flex_attention"):
        model.document_attention = kernel
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # FlexAttention warns that its eager form is unfused
            logits[kernel] = model(**inputs).logits
        assert model.attention_kernel == f"{kernel} (document mask)"
    real = inputs["attention_mask"].bool()
    torch.testing.assert_close(
        logits["flex_attention"][real], logits["sdpa"][real], rtol=1e-5, atol=1e-5
    )


def test_auto_kernel_is_sdpa_on_cpu_and_with_attention_dropout():
    model = GPT(tiny("gpt", dropout=0.1))
    assert model._document_kernel(torch.device("cpu")) == "sdpa"
    model.train()
    assert model._document_kernel(torch.device("cuda")) == "sdpa"  # FlexAttention has no dropout
    model.eval()
    from model.attention import FLEX_MIN_HEAD_DIM, flex_attention_available

    assert tiny("gpt").d_model // tiny("gpt").n_heads < FLEX_MIN_HEAD_DIM
    # heads too narrow for FlexAttention's kernel
    assert model._document_kernel(torch.device("cuda")) == "sdpa"
    wide = GPT(tiny("gpt", n_heads=2)).eval()  # 16 dimensions a head
    assert wide._document_kernel(torch.device("cuda")) == (
        "flex_attention" if flex_attention_available() else "sdpa"
    )
    model.document_attention = "flex_attention"
    with pytest.raises(ValueError, match="heads of 8 dimensions"):
        model._document_kernel(torch.device("cuda"))


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["gpt", "bert"])
def test_flex_attention_on_cuda(arch):
    """On CUDA the automatic kernel is compiled FlexAttention: each document as if alone, and the
    logits and gradients of SDPA with the dense mask."""
    torch.manual_seed(0)
    # 16 dimensions a head, its kernel's least
    model = (GPT if arch == "gpt" else BERT)(tiny(arch, n_heads=2)).cuda()
    inputs = {key: value.cuda() for key, value in batch().items()}
    results = {}
    for kernel in ("auto", "sdpa"):
        model.document_attention = kernel
        model.zero_grad()
        logits = model(**inputs).logits
        results[kernel] = model.attention_kernel, logits.detach()
        real = inputs["attention_mask"].bool()
        logits[real].square().mean().backward()
        results[kernel] += ([p.grad.clone() for p in model.parameters() if p.grad is not None],)
    assert results["auto"][0] == "flex_attention (document mask)"
    real = inputs["attention_mask"].bool()
    torch.testing.assert_close(
        results["auto"][1][real], results["sdpa"][1][real], rtol=1e-4, atol=1e-4
    )
    for flex_grad, sdpa_grad in zip(results["auto"][2], results["sdpa"][2], strict=True):
        torch.testing.assert_close(flex_grad, sdpa_grad, rtol=1e-3, atol=1e-5)
    model.document_attention = "auto"
    model.eval()
    assert_each_document_as_if_alone(model, inputs)


@pytest.mark.gpu
def test_flex_attention_and_compiled_blocks_after_the_trainers_tf32_setting():
    """The trainer sets TF32 before anything compiles (`launch.metrics.set_fp32_matmul`); dynamo
    and inductor read the legacy flag, which raised after a setting through the new API alone.
    After it: compiled FlexAttention (the document mask's kernel) and compiled blocks
    (`compile: true`) run forward and backward, in bf16 as the GPU configs train."""
    from launch.metrics import set_fp32_matmul
    from launch.train.setup import compile_model

    before = torch.backends.cuda.matmul.allow_tf32
    try:
        assert set_fp32_matmul(True) == (torch.cuda.get_device_capability() >= (8, 0))
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = GPT(tiny("gpt", n_heads=2)).cuda().to(torch.bfloat16).eval()
        inputs = {key: value.cuda() for key, value in batch().items()}
        model(**inputs).logits.float().square().mean().backward()
        assert model.attention_kernel == "flex_attention (document mask)"
        compile_model(model)
        model.train()
        model(
            **{k: v for k, v in inputs.items() if k != "document_ids"}
        ).logits.float().square().mean().backward()
        torch.cuda.synchronize()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


# --- the data: doc_starts in the shards -> document_ids in the batch ---------------------------


def test_collate_numbers_documents_from_doc_starts():
    from pipeline.load.collate import pack, unpack
    from pipeline.specials import sentencepiece_specials

    samples = [
        [np.array([9, 9, 3, 9, 3, 9], np.uint16), np.array([0, 3, 5], np.uint16)],
        [np.array([9, 3, 9], np.uint16), np.array([0, 2], np.uint16)],
    ]
    batch = unpack(
        "causal_lm", pack("causal_lm", samples, sentencepiece_specials(), document_mask=True)
    )
    # padding: the last document
    assert batch["document_ids"].tolist() == [[0, 0, 0, 1, 1, 2], [0, 0, 1, 1, 1, 1]]
    assert batch["document_ids"].dtype == torch.long
    assert batch["attention_mask"].tolist() == [[1] * 6, [1, 1, 1, 0, 0, 0]]


@pytest.mark.parametrize(
    "starts, problem",
    [
        ([1, 3], "0 first"),
        ([0, 3, 3], "strictly increasing"),
        ([0, 5, 2], "strictly increasing"),
        ([0, 6], "below 6"),
    ],
)
def test_bad_doc_starts_make_an_unreadable_sample(starts, problem):
    from pipeline.format import encode_array
    from pipeline.load.shards import decode_sample

    raw = {
        "input_ids": encode_array(np.array([9, 9, 3, 9, 3, 9], np.uint16)),
        "doc_starts": encode_array(np.array(starts, np.uint16)),
    }
    with pytest.raises(ValueError, match=problem.split()[0]):
        decode_sample(raw, ("input_ids", "doc_starts"), vocab_size=40)
    raw["doc_starts"] = encode_array(np.array([0, 3, 5], np.uint16))
    ids, doc_starts = decode_sample(raw, ("input_ids", "doc_starts"), vocab_size=40)
    assert doc_starts.tolist() == [0, 3, 5]


def with_doc_starts(old_dir: Path, new_dir: Path) -> None:
    """A copy of a tests/shardtools dataset (input_ids only, no `fields` in its manifest, as
    written before doc_starts) whose samples also hold doc_starts, listed in the manifest."""
    import json

    from pipeline.format import decode_array
    from pipeline.load.shards import Shard, read_shard
    from pipeline.shard_tar import write_shard
    from pipeline.specials import sentencepiece_specials

    eos = sentencepiece_specials().eos

    def doc_starts(block):  # 0, then each position after an </s> (what prepare records)
        return np.concatenate(([0], np.flatnonzero(block[:-1] == eos) + 1)).astype(block.dtype)

    manifest = json.loads((old_dir / "manifest.json").read_text())
    for record in manifest["datasets"]["packed"]["splits"]["train"]["shards"]:
        members = read_shard(
            Shard(0, str(old_dir / record["path"]), record["samples"], None),
            ("input_ids",),
            set(range(record["samples"])),
        )
        blocks = [decode_array(members[i]["input_ids"]) for i in range(record["samples"])]
        keys = [f"{Path(record['path']).stem}_{i:04d}" for i in range(record["samples"])]
        written = write_shard(
            new_dir / record["path"],
            keys,
            [{"input_ids": b, "doc_starts": doc_starts(b)} for b in blocks],
        )
        record.update({**written, "path": record["path"]})
    manifest["datasets"]["packed"]["fields"] = ["input_ids", "doc_starts"]
    (new_dir / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("task", ["causal_lm", "mlm"])
def test_loader_document_ids_follow_the_eos_and_the_flag_off_is_todays_stream(tmp_path, task):
    from common.configure import UserError
    from pipeline.load.loader import ShardLoader
    from pipeline.load.plan import LoaderPlan
    from tests.shardtools import make_dataset

    old, new = tmp_path / "old", tmp_path / "new"
    make_dataset(old, packed=[5, 7, 4], seq_len=12)
    with_doc_starts(old, new)

    def batches(data_dir, **kw):
        return list(
            ShardLoader(
                LoaderPlan(
                    str(data_dir), task, "train", micro_batch_size=2, num_workers=1, seed=3, **kw
                )
            )
        )

    before = batches(old)
    # doc_starts stored, not asked for: today's batches
    for a, b in zip(before, batches(new), strict=True):
        assert a.keys() == b.keys() and all(torch.equal(a[key], b[key]) for key in a)
    masked = batches(new, document_mask=True)
    for a, b in zip(before, masked, strict=True):
        assert set(b) == set(a) | {"document_ids"} and all(torch.equal(a[key], b[key]) for key in a)
        ids = b.get("original_ids", b["input_ids"])
        # A document starts at 0 and right after each </s> inside the block.
        expected = torch.cat(
            [torch.zeros_like(ids[:, :1]), (ids[:, :-1] == EOS).long().cumsum(1)], dim=1
        )
        assert torch.equal(b["document_ids"], expected)
    # The trainer's inputs: the document structure reaches the model, and is never dropped on the
    # way to the device as an all-ones attention mask is; without the flag there is none.
    from launch.tasks import TASKS

    inputs = TASKS[task].model_inputs(masked[0], torch.device("cpu"))
    assert "attention_mask" not in inputs and torch.equal(
        inputs["document_ids"], masked[0]["document_ids"]
    )
    assert "document_ids" not in TASKS[task].model_inputs(before[0], torch.device("cpu"))
    with pytest.raises(UserError, match="prepared without document boundaries.*prepare it again"):
        ShardLoader(LoaderPlan(str(old), task, "train", micro_batch_size=2, document_mask=True))


def test_document_mask_is_for_packed_blocks_only(tmp_path):
    from common.configure import UserError
    from pipeline.load.loader import ShardLoader
    from pipeline.load.plan import LoaderPlan
    from tests.shardtools import make_dataset

    make_dataset(tmp_path, translation=[4])
    with pytest.raises(UserError, match="document_mask applies to packed blocks"):
        ShardLoader(
            LoaderPlan(
                str(tmp_path), "translation", "train", micro_batch_size=2, document_mask=True
            )
        )


# --- end to end ---------------------------------------------------------------------------------


def test_prepared_blocks_number_their_documents_after_each_eos(tiny_dataset):
    """What pipeline.prepare writes, as the loader hands it out: a new document at 0 and right
    after each </s> of a block, in every block of an epoch."""
    from pipeline.load.loader import ShardLoader
    from pipeline.load.plan import LoaderPlan

    loader = ShardLoader(
        LoaderPlan(str(tiny_dataset), "causal_lm", "train", micro_batch_size=8, document_mask=True)
    )
    documents_seen = 0
    for batch in loader:
        ids = batch["input_ids"]
        expected = torch.cat(
            [torch.zeros_like(ids[:, :1]), (ids[:, :-1] == EOS).long().cumsum(1)], dim=1
        )
        assert torch.equal(batch["document_ids"], expected)
        documents_seen += int(batch["document_ids"][:, -1].sum()) + len(ids)
    assert documents_seen > 1.5 * len(loader) * 8  # blocks of several documents, not one each
    assert loader.stats["samples_unreadable"] == 0


@pytest.mark.parametrize("config", ["tiny_gpt.yaml", "tiny_bert.yaml"])
def test_train_with_document_mask(tiny_dataset, tmp_path, config):
    """`launch.train ... data.document_mask=true` on a dataset prepared by pipeline.prepare (with
    doc_starts): it trains, says which attention kernel ran, and its first loss differs from
    the unmasked run's (the mask reaches the model)."""
    import json
    import os
    import subprocess
    import sys

    from repo import ROOT

    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}
    tiny = [
        *TINY_SHAPE,
        "data.num_workers=0",
        "eval_every=3",
        "eval_batches=1",
        "log_every=1",
        "max_steps=3",
        "wandb.mode=disabled",
        "threads_per_rank=1",
        "deepspeed.zero_stage=0",
    ]
    # The two runs are single processes and independent: side by side, on two cores.
    jobs = {}
    for masked in (True, False):
        command = [
            sys.executable,
            "-m",
            "launch.train",
            str(ROOT / "configs" / config),
            f"data.data_dir={tiny_dataset}",
            f"run_dir={tmp_path / f'run-{masked}'}",
            *tiny,
            f"data.document_mask={str(masked).lower()}",
        ]
        jobs[masked] = subprocess.Popen(
            command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
    first_losses = {}
    try:
        for masked, job in jobs.items():
            _, stderr = job.communicate(timeout=600)
            assert job.returncode == 0, stderr[-4000:]
            assert ("attention: sdpa (document mask)" in stderr) == masked, stderr[-2000:]
            rows = [
                json.loads(line)
                for line in (tmp_path / f"run-{masked}" / "metrics.jsonl").read_text().splitlines()
            ]
            losses = [row["train/loss"] for row in rows if "train/loss" in row]
            assert len(losses) == 3 and all(math.isfinite(loss) for loss in losses)
            first_losses[masked] = losses[0]
    finally:
        for job in jobs.values():
            if job.poll() is None:
                job.kill()
                job.wait()
    assert first_losses[True] != first_losses[False]
