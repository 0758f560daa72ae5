"""The task table: labels are made once, here, from the loader's token batch; each task's FLOPs
and extra evaluation metrics; the table is closed (the trainer never branches on a task's name)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from launch.tasks import TASKS
from model import ModelConfig, ModelOutput, build_model, training_flops
from model.loss import IGNORE_INDEX
from pipeline.format import BATCH_FIELDS, DATASET_FOR_TASK
from pipeline.specials import sentencepiece_specials

SP = sentencepiece_specials()  # the project's SentencePiece layout

V = 40


def test_causal_lm_labels_are_the_next_tokens_and_ignore_the_last_position_and_padding():
    ids = torch.tensor([[7, 8, 9, 10], [11, 12, SP.pad, SP.pad]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    inputs = TASKS["causal_lm"].model_inputs({"input_ids": ids, "attention_mask": mask})
    assert inputs["labels"].tolist() == [
        [8, 9, 10, IGNORE_INDEX],
        [12, IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX],
    ]


def test_causal_lm_loss_through_the_task_is_the_next_token_loss():
    # The convention of Hugging Face's GPT-2 (labels = input_ids, shifted inside) gives the same
    # number.
    torch.manual_seed(0)
    model = build_model(
        ModelConfig(
            arch="gpt", vocab_size=V, d_model=16, n_layers=1, n_heads=2, max_seq_len=16, dropout=0.0
        )
    ).eval()
    ids = torch.randint(6, V, (2, 9))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    ids = ids.masked_fill(mask == 0, SP.pad)
    loss = model(**TASKS["causal_lm"].model_inputs({"input_ids": ids, "attention_mask": mask})).loss
    logits = model(ids, mask).logits
    hf_labels = ids.masked_fill(mask == 0, IGNORE_INDEX)
    expected = F.cross_entropy(
        logits[:, :-1].reshape(-1, V), hf_labels[:, 1:].reshape(-1), ignore_index=IGNORE_INDEX
    )
    torch.testing.assert_close(loss, expected)


def test_mlm_labels_are_the_original_tokens_at_the_masked_positions_only():
    original = torch.tensor([[7, 8, 9], [10, 11, 12]])
    selected = torch.tensor([[False, True, False], [True, False, True]])
    batch = {
        "input_ids": original.masked_fill(selected, 4),
        "attention_mask": torch.ones_like(original),
        "original_ids": original,
        "masked_positions": selected,
    }
    inputs = TASKS["mlm"].model_inputs(batch)
    assert inputs["labels"].tolist() == [[IGNORE_INDEX, 8, IGNORE_INDEX], [10, IGNORE_INDEX, 12]]
    assert torch.equal(inputs["input_ids"], batch["input_ids"])


def test_translation_inputs_are_teacher_forced():
    batch = {
        "src_ids": torch.tensor([[10, 11, 12, SP.eos], [13, SP.eos, SP.pad, SP.pad]]),
        "src_mask": torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]]),
        "tgt_ids": torch.tensor(
            [[SP.bos, 20, SP.eos, SP.pad, SP.pad], [SP.bos, 21, 22, 23, SP.eos]]
        ),
        "tgt_mask": torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]),
    }
    inputs = TASKS["translation"].model_inputs(batch)
    assert inputs["decoder_input_ids"].tolist() == [
        [SP.bos, 20, SP.pad, SP.pad],
        [SP.bos, 21, 22, 23],
    ]
    assert inputs["decoder_mask"].tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]]
    assert inputs["labels"].tolist() == [
        [20, SP.eos, IGNORE_INDEX, IGNORE_INDEX],
        [21, 22, 23, SP.eos],
    ]
    assert torch.equal(inputs["src_ids"], batch["src_ids"]) and torch.equal(
        inputs["src_mask"], batch["src_mask"]
    )
    assert TASKS["translation"].tokens(inputs) == 6 + 6


def test_mlm_flops_count_the_head_on_scored_positions_and_accuracy_on_them():
    cfg = ModelConfig(arch="bert", vocab_size=V, d_model=8, n_layers=1, n_heads=2, max_seq_len=8)
    labels = torch.full((2, 5), IGNORE_INDEX)
    labels[0, 1], labels[1, 3], labels[1, 4] = 7, 8, 9
    inputs = {
        "input_ids": torch.zeros(2, 5, dtype=torch.long),
        "attention_mask": torch.ones(2, 5),
        "labels": labels,
    }
    task = TASKS["mlm"]
    assert task.flops(cfg, inputs) == training_flops(cfg, 5, scored=1.5) * 2
    scored_logits = torch.zeros(3, V)
    scored_logits[0, 7] = scored_logits[1, 8] = scored_logits[2, 1] = 1.0  # two of three right
    sums = task.eval_sums(ModelOutput(scored_logits=scored_logits), inputs)
    assert sums == {"correct": 2.0, "scored": 3.0}
    assert task.eval_metrics(sums) == {"eval/accuracy": 2 / 3}


def test_the_table_is_closed():
    assert set(TASKS) == set(BATCH_FIELDS) == set(DATASET_FOR_TASK)
    assert {name: task.arch for name, task in TASKS.items()} == {
        "causal_lm": "gpt",
        "mlm": "bert",
        "translation": "seq2seq",
    }
    for name, task in TASKS.items():
        assert task.name == name and task.dataset == DATASET_FOR_TASK[name]
    assert [name for name, task in TASKS.items() if task.warm_startable] == ["translation"]
